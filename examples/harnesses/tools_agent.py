"""A coding agent of the kind a team writes: the ``openai`` client with three function tools.

It is a harness Shipyard trains unmodified (docs/harnesses.md): started once per session inside
the session's sandbox, it reads its task from ``SHIPYARD_TASK`` and calls the model at
``OPENAI_BASE_URL`` with ``OPENAI_API_KEY`` (the session's endpoint), running the tools it asks
for on the workspace (the working directory) until the model answers without a call, or
``MAX_TURNS`` turns have passed. Nothing in it knows about Shipyard but those variables.

Tools: ``read_file(path)``, ``write_file(path, content)``, ``run_command(command)`` (``sh -c`` in
the workspace, 20 s, output cut to 2,000 characters).
"""

import json
import os
import pathlib
import subprocess

import openai

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "Read a text file of the workspace.",
            "parameters": {
                "type": "object",
                "properties": {"path": {"type": "string"}},
                "required": ["path"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "write_file",
            "description": "Write a text file of the workspace (the whole content).",
            "parameters": {
                "type": "object",
                "properties": {"path": {"type": "string"}, "content": {"type": "string"}},
                "required": ["path", "content"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "run_command",
            "description": "Run a shell command in the workspace, e.g. the tests.",
            "parameters": {
                "type": "object",
                "properties": {"command": {"type": "string"}},
                "required": ["command"],
            },
        },
    },
]
SYSTEM = "You are a coding agent. Use the tools to read, write and test files, then answer briefly."


def run_tool(name: str, args: dict) -> str:
    if name == "read_file":
        path = pathlib.Path(args["path"])
        return path.read_text()[:4000] if path.is_file() else f"error: no file {args['path']}"
    if name == "write_file":
        pathlib.Path(args["path"]).write_text(args["content"])
        return f"wrote {len(args['content'])} characters to {args['path']}"
    if name == "run_command":
        try:
            out = subprocess.run(args["command"], shell=True, capture_output=True, text=True, timeout=20)
        except subprocess.TimeoutExpired:
            return "error: the command took more than 20 s"
        return f"exit {out.returncode}\n{(out.stdout + out.stderr)[-2000:]}"
    return f"error: no tool named {name}"


def main() -> None:
    client = openai.OpenAI(max_retries=0)
    model = os.environ.get("SHIPYARD_MODEL", "policy")
    messages = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": os.environ["SHIPYARD_TASK"]},
    ]
    for _ in range(int(os.environ.get("MAX_TURNS", "6"))):
        try:
            out = client.chat.completions.create(model=model, messages=messages, tools=TOOLS)
        except openai.BadRequestError as e:  # the session's limits: stop
            print(f"stopped: {e.body}")
            return
        msg = out.choices[0].message
        messages.append(msg.model_dump(exclude_none=True))
        if not msg.tool_calls:
            return
        for call in msg.tool_calls:
            try:
                result = run_tool(call.function.name, json.loads(call.function.arguments))
            except (ValueError, KeyError, TypeError, OSError) as e:
                result = f"error: {type(e).__name__}: {e}"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})


if __name__ == "__main__":
    main()
