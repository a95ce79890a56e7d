"""A harness a team could write, used by the command-harness tests: the ``openai`` client with one
function tool, run inside the session's sandbox. ``MODE`` picks a behaviour (good or bad)."""

import json
import os
import pathlib
import socket
import sys

import openai

TOOLS = json.loads((pathlib.Path(__file__).parent / "tools.json").read_text())
MODE = os.environ.get("MODE", "agent")
client = openai.OpenAI(max_retries=0)  # OPENAI_BASE_URL and OPENAI_API_KEY come from the session
model = os.environ["SHIPYARD_MODEL"]


def agent() -> None:
    """Call the model with the tool until it answers without calls, then write the solution."""
    messages = [{"role": "user", "content": "Look at a.py"}]
    for _ in range(4):
        out = client.chat.completions.create(model=model, messages=messages, tools=TOOLS, max_tokens=40)
        msg = out.choices[0].message
        messages.append(msg.model_dump(exclude_none=True))
        if not msg.tool_calls:
            break
        for call in msg.tool_calls:
            path = pathlib.Path(json.loads(call.function.arguments)["path"])
            text = path.read_text() if path.is_file() else f"no such file: {path}"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": text})
    pathlib.Path("solution.py").write_text(os.environ.get("SOLUTION", ""))


def flood() -> None:
    """Call far past the session's limits; report how the endpoint answered."""
    codes = []
    for _ in range(20):
        try:
            client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=8
            )
            codes.append(200)
        except openai.BadRequestError as e:
            codes.append(e.body["code"])
    print(json.dumps(codes))


def bad_history() -> None:
    """Send back a history whose tool call is malformed JSON and names an unknown tool."""
    messages = [
        {"role": "user", "content": "Look at a.py"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "no_such_tool", "arguments": "{bad"}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "x"},
    ]
    out = client.chat.completions.create(model=model, messages=messages, tools=TOOLS, max_tokens=8)
    print(out.choices[0].finish_reason)


def escape() -> None:
    """Try to reach another endpoint: a loopback port of the host and a host socket path."""
    results = {}
    for name, target in (
        ("tcp", ("127.0.0.1", int(os.environ["OTHER_PORT"]))),
        ("unix", os.environ["OTHER_SOCK"]),
    ):
        family = socket.AF_UNIX if name == "unix" else socket.AF_INET
        s = socket.socket(family, socket.SOCK_STREAM)
        s.settimeout(2)
        try:
            s.connect(target)
            results[name] = "connected"
        except OSError as e:
            results[name] = type(e).__name__
    print(json.dumps(results))
    client.models.list()  # its own endpoint answers


{"agent": agent, "flood": flood, "bad_history": bad_history, "escape": escape}[MODE]()
sys.exit(0)
