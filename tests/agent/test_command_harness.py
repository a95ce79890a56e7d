"""Command harnesses: a program in the session's sandbox reaching the model only through its
session endpoint, graded in a fresh sandbox afterwards; and harnesses that misbehave (each ends
with reward 0 and its reason, nothing leaks, the next session runs)."""

from __future__ import annotations

import dataclasses
import json
import socket
from pathlib import Path
from typing import Any

import pytest
from tests.conftest import DONE, harness_spec, live_children

from shipyard.agent.endpoint import SessionEndpoint
from shipyard.agent.harness.command import CommandHarness, harness_reward
from shipyard.agent.play import play
from shipyard.agent.session import SessionSpec
from shipyard.config.schema import HarnessConfig, SamplingConfig, SandboxConfig
from shipyard.envs.types import Task
from shipyard.inference.client import HttpInferenceClient
from shipyard.inference.serving.server import InferenceServer

HARNESSES = str(Path(__file__).parent / "harnesses")
TASK = Task(
    id="t-one",
    prompt="Write `one()` returning 1.",
    entry_point="one",
    hidden_tests="from solution import one\n\ndef test_one():\n    assert one() == 1\n",
)
SOLUTION = "def one():\n    return 1\n"


@pytest.fixture(scope="module")
def server(taught_server: InferenceServer) -> InferenceServer:
    return taught_server


def _spec(server: InferenceServer, tok: Any, mode: str, **harness: Any) -> SessionSpec:
    env = {"MODE": mode, **harness.pop("env", {})}
    cfg = HarnessConfig(
        type="command",
        command="python /shipyard/harness/agent.py",
        files=HARNESSES,
        env=env,
        honor_sampling=True,
        **{"timeout_s": 60, **harness},
    )
    return harness_spec(server.url, tok, cfg)


def test_a_harness_plays_through_its_endpoint_and_is_graded(
    server: InferenceServer, taught_model: Any
) -> None:
    before = live_children()
    segs = play(_spec(server, taught_model[1], "agent", env={"SOLUTION": SOLUTION}), TASK, "g", 0)
    [seg] = segs
    assert seg.finish == "done" and seg.error is None and seg.reward == 1.0, seg.grade
    assert seg.reward_info == {"passed": 1, "total": 1} and "+    return 1" in seg.changes
    assert seg.metrics["calls"] == 2 and seg.metrics["retokenized_calls"] == 0
    assert seg.metrics["tool_calls"] == 1 and seg.metrics["tool_call_parse_frac"] == 1.0
    assistant = [t for t in seg.turns if t["role"] == "assistant"]
    assert assistant[0]["tool_calls"] == [{"name": "read_file", "arguments": '{"path": "a.py"}'}]
    assert assistant[1]["text"] == DONE
    assert sum(seg.loss_mask) == sum(t["end"] - t["start"] for t in assistant)
    assert live_children() <= before, "the sandbox, the relay and the harness are gone"


def test_a_wrong_workspace_gets_its_grade(server: InferenceServer, taught_model: Any) -> None:
    [seg] = play(
        _spec(server, taught_model[1], "agent", env={"SOLUTION": "def one():\n    return 2\n"}), TASK, "g", 1
    )
    assert seg.finish == "done" and seg.reward == 0.0 and seg.reward_info == {"passed": 0, "total": 1}


@pytest.mark.parametrize(
    ("command", "harness", "finish", "reason"),
    [
        ("exit 3", {}, "harness_error", "exited with 3"),
        ("sleep 100", {"timeout_s": 2}, "timeout", "harness.timeout_s"),
        ("true", {}, "no_calls", "never called the model"),
    ],
)
def test_a_harness_that_crashes_hangs_or_does_nothing(
    server: InferenceServer,
    taught_model: Any,
    command: str,
    harness: dict[str, Any],
    finish: str,
    reason: str,
) -> None:
    before = live_children()
    spec = _spec(server, taught_model[1], "agent", **harness)
    cfg = spec.harness.cfg.model_copy(update={"command": command})
    spec = dataclasses.replace(spec, harness=CommandHarness(cfg, SandboxConfig(), 1024))
    [seg] = play(spec, TASK, "g", 0)
    assert seg.finish == finish and seg.reward == 0.0 and reason in seg.reward_info["reason"], seg.reward_info
    assert sum(seg.loss_mask) == 0 and (seg.error is not None) == (finish == "harness_error")
    assert live_children() <= before


def test_a_flood_and_a_token_budget_are_refused(server: InferenceServer, taught_model: Any) -> None:
    segs = play(_spec(server, taught_model[1], "flood", max_calls=3), TASK, "g", 0)
    log = segs[-1].grade["harness"]
    codes = json.loads(log["stdout"])
    assert codes[:3] == [200, 200, 200] and set(codes[3:]) == {"session_limit"}
    # the same one-message prompt each time: three calls, none extending another, three segments
    assert len(segs) == 3 and segs[0].metrics["calls"] == 3 and log["refused_calls"] == {"session_limit": 17}
    segs = play(_spec(server, taught_model[1], "flood", max_sampled_tokens=12), TASK, "g", 0)
    assert (
        sum(sum(s.loss_mask) for s in segs) <= 12 and "session_limit" in segs[-1].grade["harness"]["stdout"]
    )


def test_a_malformed_history_is_counted_not_a_500(server: InferenceServer, taught_model: Any) -> None:
    [seg] = play(_spec(server, taught_model[1], "bad_history"), TASK, "g", 0)
    assert seg.grade["harness"]["returncode"] == 0 and seg.grade["harness"]["stdout"].strip() in (
        "stop",
        "length",
        "tool_calls",
    )
    assert seg.metrics["retokenized_calls"] == 1 and seg.metrics["calls"] == 1


def test_a_harness_reaches_only_its_own_endpoint(
    server: InferenceServer, taught_model: Any, tmp_path: Path
) -> None:
    tok = taught_model[1]
    other = SessionEndpoint(
        HttpInferenceClient(server.url), tok, HarnessConfig(), SamplingConfig(), max_context=512
    )
    sock = str(tmp_path / "other.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(sock)
    listener.listen(1)
    with other:
        port = int(other.url.rsplit(":", 1)[1].split("/")[0])
        env = {"OTHER_PORT": str(port), "OTHER_SOCK": sock}
        [seg] = play(_spec(server, tok, "escape", env=env), TASK, "g", 0)
    listener.close()
    assert seg.grade["harness"]["returncode"] == 0, seg.grade
    assert json.loads(seg.grade["harness"]["stdout"]) == {
        "tcp": "ConnectionRefusedError",
        "unix": "FileNotFoundError",
    }
    assert other.calls == [] and other.refused == {}


def test_a_harness_reward_file_is_read_and_checked(tmp_path: Path) -> None:
    path = tmp_path / "reward.json"
    assert harness_reward(str(path)).details["reason"] == "the harness wrote no reward.json"
    for bad in ('{"reward": 1.5}', '{"reward": true}', "[1]", '{"reward": 0.5, "metrics": 3}', "{"):
        path.write_text(bad)
        r = harness_reward(str(path))
        assert r.reward == 0.0 and "malformed" in r.details["reason"], bad
    path.write_text('{"reward": 0.5, "metrics": {"passed": 3.0, "total": 6}}')
    r = harness_reward(str(path))
    assert (r.reward, r.passed, r.total) == (0.5, 3, 6) and r.details["source"] == "harness"
    path.write_text('{"reward": 1.0, "metrics": {"passed": "all"}}')
    assert (harness_reward(str(path)).passed, harness_reward(str(path)).total) == (1, 1)


def test_a_harness_venv_must_be_a_virtualenv(tmp_path: Path) -> None:
    cfg = HarnessConfig(type="command", command="true", venv=str(tmp_path))
    with pytest.raises(ValueError, match="harness.venv"):
        CommandHarness(cfg, SandboxConfig(), 1024)
