"""Shared by every test directory: a tiny model taught fixed replies (tool calls) and a server of
it, the session spec a command harness test plays with, and waiting on a condition."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from shipyard.config.schema import ModelConfig
from shipyard.inference.serving.tools import tool_template
from shipyard.models.loading import load_model

TOOLS = json.loads((Path(__file__).parent / "agent/harnesses/tools.json").read_text())
"""The tool the taught model calls (the test harness in tests/agent/harnesses reads the same file)."""

CALL = '<tool_call>\n{"name": "read_file", "arguments": {"path": "a.py"}}\n</tool_call>'
"""What the taught model answers to a user turn (a Hermes tool call)."""

DONE = "All done."
"""What the taught model answers after a tool response."""


def teach(model: Any, tok: Any, examples: list[tuple[list[int], list[int]]], steps: int = 100) -> Any:
    """Train ``model`` (fp32, in place) until it answers each ``(prompt_ids, reply_ids)`` greedily;
    returns it in eval mode."""
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(steps):
        opt.zero_grad()
        for prompt, reply in examples:
            ids = torch.tensor([prompt + reply])
            labels = ids.clone()
            labels[0, : len(prompt)] = -100
            model(input_ids=ids, labels=labels).loss.backward()
        opt.step()
    model.eval()
    return model


def tool_examples(tok: Any) -> list[tuple[list[int], list[int]]]:
    """The taught replies: a user turn gets :data:`CALL`, a tool response gets :data:`DONE`."""
    template = tool_template(tok).template
    user = [{"role": "user", "content": "Look at a.py"}]
    call = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"type": "function", "function": {"name": "read_file", "arguments": {"path": "a.py"}}}
        ],
    }
    after = [*user, call, {"role": "tool", "content": "print(1)", "tool_call_id": "x"}]

    def ids(messages: list[dict[str, Any]]) -> list[int]:
        return list(
            tok.apply_chat_template(
                messages,
                tools=TOOLS,
                chat_template=template,
                add_generation_prompt=True,
                tokenize=True,
                return_dict=True,
            )["input_ids"]
        )

    def reply(text: str) -> list[int]:
        return tok(text, add_special_tokens=False).input_ids + [tok.eos_token_id]

    return [(ids(user), reply(CALL)), (ids(after), reply(DONE))]


@pytest.fixture(scope="session")
def taught_model() -> tuple[Any, Any]:
    """The tiny dense model taught :func:`tool_examples` (greedy replies: a tool call, then "All done.")."""
    model, tok = load_model(ModelConfig(source="tiny", tiny="dense", seed=7))
    return teach(model, tok, tool_examples(tok)), tok


@pytest.fixture(scope="module")
def taught_server(taught_model: tuple[Any, Any]) -> Iterator[Any]:
    """An embedded inference server of :func:`taught_model` on loopback."""
    from shipyard.inference.engine.engine import EmbeddedEngine
    from shipyard.inference.serving.server import InferenceServer

    with InferenceServer(EmbeddedEngine(*taught_model, max_batch=4)) as srv:
        yield srv


def harness_spec(url: str, tok: Any, cfg: Any) -> Any:
    """A session spec playing the command harness ``cfg`` (a ``HarnessConfig``) against the server
    at ``url``: near-greedy sampling, 40 tokens a call, sandboxed grading."""
    from shipyard.agent.harness.command import CommandHarness
    from shipyard.agent.session import ChatFrame, SessionSpec
    from shipyard.agent.spec import SandboxWorkbench
    from shipyard.config.schema import AgentConfig, SamplingConfig, SandboxConfig
    from shipyard.inference.client import HttpInferenceClient

    return SessionSpec(
        client=HttpInferenceClient(url, timeout_s=60),
        frame=ChatFrame(tok),
        agent=AgentConfig(max_session_tokens=1024),
        sampling=SamplingConfig(temperature=0.05, max_tokens=40),
        bench=SandboxWorkbench(SandboxConfig(timeout_s=20)),
        harness=CommandHarness(cfg, SandboxConfig(), 1024),
    )


def live_children() -> set[int]:
    """Pids of this process's descendants (a session must leave none behind)."""
    import psutil

    return {p.pid for p in psutil.Process().children(recursive=True)}


def until(condition: Callable[[], bool], timeout_s: float) -> bool:
    """Wait until ``condition()`` holds (for counters that have no event to wait on); whether it did
    within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True
