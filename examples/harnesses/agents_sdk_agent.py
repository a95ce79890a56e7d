"""A coding agent built on the OpenAI Agents SDK (``openai-agents``), with three function tools.

The kind of harness a team writes with the SDK, trained by Shipyard unmodified
(docs/harnesses.md, ``configs/agents_sdk.toml``): it reads its task from ``SHIPYARD_TASK`` and
runs one ``Agent`` with ``Runner.run_sync`` against the model at ``OPENAI_BASE_URL`` with
``OPENAI_API_KEY``, through the Chat Completions API, until the model answers without a tool
call or ``MAX_TURNS`` turns have passed. Nothing in it knows about Shipyard but those variables.

Tools: ``read_file(path)``, ``write_file(path, content)``, ``run_command(command)`` (``sh -c`` in
the workspace, 20 s, output cut to 2,000 characters). Tracing is off: the sandbox has no network
but its own endpoint, and the SDK's exporter would post to api.openai.com.
"""

import os
import pathlib
import subprocess

from agents import (
    Agent,
    MaxTurnsExceeded,
    ModelSettings,
    Runner,
    function_tool,
    set_default_openai_api,
    set_tracing_disabled,
)

INSTRUCTIONS = "You are a coding agent. Use the tools to read, write and test files, then answer briefly."


@function_tool
def read_file(path: str) -> str:
    """Read a text file of the workspace."""
    p = pathlib.Path(path)
    return p.read_text()[:4000] if p.is_file() else f"error: no file {path}"


@function_tool
def write_file(path: str, content: str) -> str:
    """Write a text file of the workspace (the whole content)."""
    pathlib.Path(path).write_text(content)
    return f"wrote {len(content)} characters to {path}"


@function_tool
def run_command(command: str) -> str:
    """Run a shell command in the workspace, e.g. the tests."""
    try:
        out = subprocess.run(command, shell=True, capture_output=True, text=True, timeout=20)
    except subprocess.TimeoutExpired:
        return "error: the command took more than 20 s"
    return f"exit {out.returncode}\n{(out.stdout + out.stderr)[-2000:]}"


def main() -> None:
    set_tracing_disabled(True)
    set_default_openai_api("chat_completions")
    agent = Agent(
        name="coder",
        instructions=INSTRUCTIONS,
        model=os.environ.get("SHIPYARD_MODEL", "policy"),
        tools=[read_file, write_file, run_command],
        model_settings=ModelSettings(parallel_tool_calls=False),
    )
    try:
        result = Runner.run_sync(
            agent, os.environ["SHIPYARD_TASK"], max_turns=int(os.environ.get("MAX_TURNS", "6"))
        )
        print(result.final_output)
    except MaxTurnsExceeded as e:
        print(f"stopped: {e}")


if __name__ == "__main__":
    main()
