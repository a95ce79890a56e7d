"""Third-party harnesses, unmodified, with their shipped configs (configs/mini_swe.toml,
configs/agents_sdk.toml, configs/verifiers_env.toml; mini-swe-agent also in its tool-calling mode,
mini.yaml): a few sessions each on the taught tiny model, through the session endpoint, confined to
the session's sandbox.

The harnesses' virtualenvs come from `make harnesses` (.venv-harness/); without them these tests
skip, unless SHIPYARD_REQUIRE_HARNESSES=1 (CI) makes a missing one a failure.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import pytest
from tests.conftest import harness_spec, live_children

from shipyard.agent.demonstrate import demonstrations
from shipyard.agent.play import play
from shipyard.agent.session import SessionSpec
from shipyard.config import load_config
from shipyard.config.schema import SamplingConfig
from shipyard.envs.tasks.functions import generated_tasks
from shipyard.inference.serving.server import InferenceServer

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = {
    "mini_swe": "mini_swe.toml",  # its text action mode, examples/harnesses/mini_swe_agent/mini_text.yaml
    "mini_swe_tools": "mini_swe.toml",  # its tool-calling mode (the bash tool), mini.yaml
    "agents_sdk": "agents_sdk.toml",
    "verifiers": "verifiers_env.toml",
}
TASK = generated_tasks(20, seed=1234)[3]


@pytest.fixture(scope="module")
def server(taught_server: InferenceServer) -> InferenceServer:
    return taught_server


def _spec(server: InferenceServer, tok: Any, name: str) -> SessionSpec:
    cwd = os.getcwd()
    os.chdir(ROOT)  # the shipped configs' paths are relative to the repository
    try:
        cfg = load_config(str(ROOT / "configs" / CONFIGS[name]))
    finally:
        os.chdir(cwd)
    harness = cfg.harness
    if name == "mini_swe_tools":
        harness = harness.model_copy(
            update={"command": harness.command.replace("mini_text.yaml", "mini.yaml")}
        )
    if not os.path.isdir(harness.venv):
        if os.environ.get("SHIPYARD_REQUIRE_HARNESSES") == "1":
            pytest.fail(f"{harness.venv} is missing: `make harnesses` builds it")
        pytest.skip(f"{harness.venv} is missing: `make harnesses` builds it")
    return harness_spec(server.url, tok, harness.model_copy(update={"timeout_s": 90.0}))


@pytest.mark.parametrize("name", list(CONFIGS))
def test_a_third_party_harness_plays_sessions_token_exact(
    server: InferenceServer, taught_model: Any, name: str
) -> None:
    before = live_children()
    spec = _spec(server, taught_model[1], name)
    for idx in range(2):
        segs = play(spec, TASK, "g", idx)
        log = segs[-1].grade["harness"]
        assert segs[-1].finish == "done", (segs[-1].reward_info, log)
        if name == "verifiers":  # the environment's rubric is the reward: the hidden tests it ran
            grade = segs[-1].grade
            assert grade["source"] == "harness" and segs[-1].reward_info["total"] == 6, grade
        m = segs[0].metrics
        assert m["calls"] >= 1 and m["retokenized_calls"] == 0, (m, log)
        assert m["tool_call_parse_frac"] == 1.0 or m["tool_calls"] == 0, m
        for seg in segs:
            sampled = [i for i, k in enumerate(seg.loss_mask) if k]
            assert sampled and all(seg.versions[i] >= 0 for i in sampled)
            assert all(seg.logprobs[i] <= 0.0 for i in sampled)
    assert live_children() <= before, "the sandbox, the relay and the harness are gone"


@pytest.mark.parametrize("name", [n for n in CONFIGS if n != "mini_swe_tools"])  # the shipped ones
def test_a_scripted_expert_passes_through_each_harness(
    server: InferenceServer, taught_model: Any, name: str
) -> None:
    """The warm start's demonstrations: the harness unmodified, the expert answering its calls
    in the harness's own protocol, the grader (or the environment's rubric) scoring 1."""
    spec = _spec(server, taught_model[1], name)
    spec = dataclasses.replace(spec, sampling=SamplingConfig(max_tokens=160))  # the heredoc's length
    [session] = demonstrations(spec, [TASK], concurrency=1)
    calls = [t for seg in session for t in seg.turns if t["role"] == "assistant"]
    m = session[0].metrics
    assert session[-1].reward == 1.0 and m["retokenized_calls"] == 0, (session[-1].reward_info, m)
    if name == "mini_swe":  # one fenced bash block writes the file and submits
        assert len(calls) == 1 and calls[0]["text"].startswith("```bash\ncat > solution.py"), calls
        assert m["tool_calls"] == 0, m
    elif name != "verifiers":  # a one-shot environment has no tools: the solution comes as text
        assert m["tool_calls"] >= 1 and m["tool_call_parse_frac"] == 1.0, m
        assert calls[0]["tool_calls"][0]["name"] in ("bash", "write_file"), calls[0]
    assert sum(sum(s.loss_mask) for s in session) == sum(t["end"] - t["start"] for t in calls)
