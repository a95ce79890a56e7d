"""Verified rollouts against real sessions: honest nodes pass, each kind of cheat is caught and quarantined."""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from shipyard.agent.session import ChatFrame, SessionSpec, replay_session, run_session
from shipyard.agent.spec import SandboxWorkbench
from shipyard.agent.types import Trajectory
from shipyard.config.schema import AgentConfig, ModelConfig, SamplingConfig, SandboxConfig, VerifyConfig
from shipyard.envs.types import Task
from shipyard.fleet.verify import QUARANTINE_PREFIX, RolloutVerifier, VersionModels
from shipyard.inference.client import LocalInferenceClient
from shipyard.inference.engine.engine import EmbeddedEngine
from shipyard.models.loading import load_model
from shipyard.rollout.types import RolloutBatch
from shipyard.store.local import LocalStore
from shipyard.trainer.feed import RolloutFeed
from shipyard.weights.publisher import WeightPublisher, named_params
from shipyard.weights.versions import read_manifest

TASK = Task(
    id="t-add",
    prompt="Write a Python function `add(a, b)` that returns a + b.",
    entry_point="add",
    visible_tests="from solution import add\n\ndef test_one():\n    assert add(1, 2) == 3\n",
    hidden_tests="from solution import add\n\ndef test_a():\n    assert add(2, 2) == 4\n",
)
AGENT = AgentConfig(max_turns=1, max_session_tokens=400)
BENCH = SandboxWorkbench(SandboxConfig(timeout_s=10))
SOLVED = "```python\ndef add(a, b):\n    return a + b\n```"


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    model, tok = load_model(ModelConfig(source="tiny", tiny="dense"))
    store = LocalStore(str(tmp_path_factory.mktemp("store")))
    WeightPublisher(store).publish(0, named_params(model))
    return {"model": model, "tok": tok, "store": store, "digest": read_manifest(store, 0).state_digest}


def sessions(world: dict[str, Any], model: Any, gid: str, n: int = 2) -> list[Trajectory]:
    spec = SessionSpec(
        client=LocalInferenceClient(EmbeddedEngine(model, world["tok"], max_batch=4)),
        frame=ChatFrame(world["tok"]),
        agent=AGENT,
        sampling=SamplingConfig(max_tokens=16, temperature=1.0),
        bench=BENCH,
    )
    return [seg for i in range(n) for seg in run_session(spec, TASK, gid, i)]


def batch(
    world: dict[str, Any], node: str, seq: int, trajs: list[Trajectory], digest: str | None = None
) -> RolloutBatch:
    return RolloutBatch(
        f"{node}/{seq:08d}", node, 0.0, trajs, run_id="r", claims={"0": digest or world["digest"]}
    )


def verifier(world: dict[str, Any], **cfg: Any) -> RolloutVerifier:
    def make() -> Any:
        return copy.deepcopy(world["model"])

    vc = VerifyConfig(
        enabled=True, trusted=["trusted"], rollout_frac=1.0, regrade_frac=1.0, calibration_sessions=2, **cfg
    )
    return RolloutVerifier(
        vc,
        world["store"],
        VersionModels(world["store"], make),
        {TASK.id: TASK},
        lambda task, segs: replay_session(AGENT, BENCH, task, segs).reward,
        temperature=1.0,
    )


def test_honest_nodes_pass_and_calibrate_the_tolerance(world: dict[str, Any]) -> None:
    v = verifier(world)
    assert v.admit(batch(world, "trusted", 0, sessions(world, world["model"], "trusted/0/0")))
    assert len(v.stats.honest_mismatch) == 2 and max(v.stats.honest_mismatch) < 1e-4  # same fp32 weights
    assert v.tolerance == pytest.approx(0.1)  # the floor: 3 x the honest mismatch is smaller
    assert v.admit(batch(world, "n1", 0, sessions(world, world["model"], "n1/0/0")))
    assert v.stats.sessions_checked == 4 and v.stats.sessions_regraded == 2 and not v.evidence


def cheats(world: dict[str, Any]) -> dict[str, RolloutBatch]:
    honest = sessions(world, world["model"], "c/0/0")
    fabricated = [dataclasses.replace(t, logprobs=[-0.01 if m else 0.0 for m in t.loss_mask]) for t in honest]
    wrong = copy.deepcopy(world["model"])
    with torch.no_grad():
        for p in wrong.parameters():
            p.add_(0.2 * torch.randn_like(p))
    inflated = [dataclasses.replace(t, reward=1.0) for t in sessions(world, world["model"], "i/0/0")]
    return {
        "fabricated_logprobs": batch(world, "fab", 0, fabricated),
        "wrong_weights": batch(world, "wrong", 0, sessions(world, wrong, "w/0/0")),
        "inflated_rewards": batch(world, "inflate", 0, inflated),
        "bad_digest": batch(world, "digest", 0, sessions(world, world["model"], "d/0/0"), digest="0" * 64),
        "honest_source": batch(world, "trusted", 1, honest),
    }


def test_every_cheat_is_caught_with_evidence_and_the_node_stays_out(world: dict[str, Any]) -> None:
    v = verifier(world)
    got = cheats(world)
    assert v.admit(got.pop("honest_source"))
    # a replay: a trusted node's sessions resubmitted under new ids, logprobs untouched
    honest = [dataclasses.replace(t, group_id="r/9/0") for t in v_source(world, v)]
    expect = {
        "fab": "logprobs",
        "wrong": "logprobs",
        "inflate": "rewards",
        "digest": "digest",
        "replay": "replay",
    }
    for b in got.values():
        assert not v.admit(b)
    assert not v.admit(batch(world, "replay", 0, honest))
    assert {node: ev.check for node, ev in v.evidence.items()} == expect
    ev = json.loads(world["store"].get(f"{QUARANTINE_PREFIX}inflate.json"))
    assert ev["check"] == "rewards" and ev["detail"]["claimed"] == 1.0 and ev["detail"]["regraded"] == 0.0
    assert json.loads(world["store"].get(f"{QUARANTINE_PREFIX}fab.json"))["detail"]["mean_abs_dlogprob"] > 0.1
    # a quarantined node's next batch is refused even if it is honest now
    assert not v.admit(batch(world, "wrong", 1, sessions(world, world["model"], "w/1/0")))
    assert v.stats.refused_batches == 6


def v_source(world: dict[str, Any], v: RolloutVerifier) -> list[Trajectory]:
    """A trusted node's batch, admitted (so the verifier has seen it), to be replayed."""
    trajs = sessions(world, world["model"], "src/0/0")
    assert v.admit(batch(world, "trusted", 7, trajs))
    return trajs


def test_solved_sessions_regrade_to_their_reward(world: dict[str, Any]) -> None:
    [t] = [seg for seg in sessions(world, world["model"], "s/0/0", n=1)]
    t.turns[1]["text"] = SOLVED  # the action a solving session took
    assert replay_session(AGENT, BENCH, TASK, [t]).reward == 1.0


def test_feed_drops_queued_groups_of_a_node_quarantined_later(world: dict[str, Any], tmp_path: Path) -> None:
    v = verifier(world)
    store = LocalStore(str(tmp_path))
    ok = batch(world, "n2", 0, sessions(world, world["model"], "n2/0/0"))
    store.put(ok.key(), ok.to_bytes())
    feed = RolloutFeed(store, "r", gate=v)
    assert feed.poll() and len(feed._queue) == 1  # admitted, queued
    bad = batch(world, "n2", 1, sessions(world, world["model"], "n2/1/0"), digest="0" * 64)
    store.put(bad.key(), bad.to_bytes())
    other = batch(world, "n3", 0, sessions(world, world["model"], "n3/0/0"))
    store.put(other.key(), other.to_bytes())
    assert feed.poll() and v.quarantined("n2")  # n2's next batch fails its digest
    taken = feed.take(1, current_version=0, max_off_policy_steps=2, timeout_s=5)
    assert taken.refused == 1 and taken.dropped_quarantined == 2  # n2's queued group: 2 sessions
    assert [g[0].group_id for g in taken.groups] == ["n3/0/0"]
