"""Router replay end to end: a bf16 MoE sampler records routes in a multi-turn session, they travel
through the store, and the fp32 trainer's step replays them (zero disagreement, the router learns).

Shape legend: B = sequences, T = positions.
"""

from __future__ import annotations

import copy
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from shipyard.agent.session import ChatFrame, SessionSpec, run_session
from shipyard.agent.spec import SandboxWorkbench
from shipyard.agent.types import Trajectory
from shipyard.config.schema import AgentConfig, ModelConfig, SamplingConfig, SandboxConfig, TrainerConfig
from shipyard.envs.types import Task
from shipyard.inference.client import LocalInferenceClient
from shipyard.inference.engine.engine import EmbeddedEngine
from shipyard.inference.types import GenerateRequest, GenerateResult, SamplingParams
from shipyard.models.loading import load_model
from shipyard.models.router_replay import RouterSeam, moe_routers
from shipyard.models.routes import decode_routes
from shipyard.rollout.types import RolloutBatch
from shipyard.store import LocalStore
from shipyard.trainer.loop import _named
from shipyard.trainer.step import make_optimizer, train_step

TASK = Task(
    id="t-add",
    prompt="Write a Python function `add(a, b)` that returns a + b.",
    entry_point="add",
    visible_tests="from solution import add\n\ndef test_one():\n    assert add(1, 2) == 3\n",
    hidden_tests="from solution import add\n\ndef test_a():\n    assert add(2, 2) == 4\n",
)


@pytest.fixture(scope="module")
def policy() -> tuple[Any, Any]:
    """A tiny Qwen3-MoE with lively random weights, so routing depends on the numerics."""
    model, tok = load_model(ModelConfig(source="tiny", tiny="moe", seed=2))
    gen = torch.Generator().manual_seed(9)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.15, generator=gen)
    return model, tok


def _sampled(policy: tuple[Any, Any], n: int = 6) -> list[Trajectory]:
    """Single-turn trajectories sampled by a bf16 copy of the policy, batched (left padding)."""
    model, tok = policy
    engine = EmbeddedEngine(copy.deepcopy(model).to(torch.bfloat16), tok, max_batch=n)
    gen = torch.Generator().manual_seed(4)
    prompts = [
        torch.randint(3, 3000, (int(k),), generator=gen).tolist()
        for k in torch.randint(4, 20, (n,), generator=gen)
    ]
    params = [SamplingParams(max_tokens=24, seed=i) for i in range(n)]
    results = engine.generate([GenerateRequest(p, q) for p, q in zip(prompts, params, strict=True)])
    trajs = []
    for i, (p, res) in enumerate(zip(prompts, results, strict=True)):
        ids = p + res.token_ids
        mask = [0] * len(p) + [1] * len(res.token_ids)
        lps = [0.0] * len(p) + res.logprobs
        versions = [-1] * len(p) + res.versions
        trajs.append(Trajectory("t", f"g{i // 2}", i, ids, mask, lps, versions, len(p), routes=res.routes))
    return trajs


def _step(model: Any, trajs: list[Trajectory], replay: bool) -> dict[str, float]:
    cfg = TrainerConfig(router_replay=replay, micro_batch=3, lr=1e-2)
    seam = RouterSeam(model)
    try:
        adv = [1.0 if i % 2 else -1.0 for i in range(len(trajs))]
        return train_step(model, make_optimizer(model, cfg), trajs, adv, cfg, pad_id=0, seam=seam)
    finally:
        seam.remove()


def test_replayed_step_has_zero_disagreement_and_trains_the_router(policy: tuple[Any, Any]) -> None:
    trajs = _sampled(policy)
    free = _step(copy.deepcopy(policy[0]), trajs, replay=False)
    model = copy.deepcopy(policy[0])
    routers_before = [r.weight.detach().clone() for _, r in moe_routers(model)]
    replayed = _step(model, trajs, replay=True)
    assert free["route_disagree"] > 0  # bf16 sampler vs fp32 trainer: some experts flip
    assert free["route_disagree"] == free["route_own_disagree"]
    assert replayed["route_disagree"] == 0.0 and replayed["route_token_disagree"] == 0.0
    assert replayed["route_own_disagree"] > 0  # what replay overrode (later layers see replayed inputs)
    for layer in (0, 1):
        assert replayed[f"route_disagree/layer_{layer}"] == 0.0
        assert 0.0 <= free[f"route_disagree/layer_{layer}"] <= 1.0
    for (_, router), before in zip(moe_routers(model), routers_before, strict=True):
        assert not torch.equal(router.weight.detach(), before)  # the router still gets a gradient
    named = _named(replayed)
    assert named["mismatch/route_disagree/layer_1"] == 0.0 and "mismatch/route_own_disagree" in named
    assert "mismatch/k3" in named and "train/loss" in named


def test_routes_round_trip_through_the_store(policy: tuple[Any, Any], tmp_path: Path) -> None:
    trajs = _sampled(policy, n=3)
    store = LocalStore(tmp_path)
    batch = RolloutBatch(batch_id="w0/00000000", worker_id="w0", created_at=time.time(), trajectories=trajs)
    store.put(batch.key(), batch.to_bytes())
    back = RolloutBatch.from_bytes(store.get(batch.key())).trajectories
    for a, b in zip(trajs, back, strict=True):
        assert a == b and a.routes is not None and b.routes is not None
        assert (decode_routes(a.routes) == decode_routes(b.routes)).all()
        assert b.routes["n"] == len(b.token_ids) - 1 and b.routes["dtype"] == "uint8"


class _Recording(LocalInferenceClient):
    """The real local client, keeping every request and result the session exchanged."""

    def __init__(self, engine: EmbeddedEngine) -> None:
        super().__init__(engine)
        self.calls: list[tuple[GenerateRequest, GenerateResult]] = []

    def generate(self, requests: list[GenerateRequest]) -> list[GenerateResult]:
        results = super().generate(requests)
        self.calls += list(zip(requests, results, strict=True))
        return results


def test_multi_turn_session_routes_every_forwarded_token(policy: tuple[Any, Any]) -> None:
    model, tok = policy
    client = _Recording(EmbeddedEngine(copy.deepcopy(model).to(torch.bfloat16), tok, max_batch=4))
    sb = SandboxConfig(timeout_s=10)
    spec = SessionSpec(
        client=client,
        frame=ChatFrame(tok),
        agent=AgentConfig(max_turns=3, max_session_tokens=600),
        sampling=SamplingConfig(max_tokens=16),
        bench=SandboxWorkbench(sb),
    )
    [traj] = run_session(spec, TASK, "g", 0)
    assert traj.error is None and traj.num_turns == 3 and len(client.calls) == 3
    assert traj.routes is not None and traj.routes["n"] == len(traj.token_ids) - 1  # all but the last token
    previous = None
    for request, result in client.calls:
        assert request.prompt_routes == previous  # each turn sends the context's routes so far
        assert result.routes is not None
        assert result.routes["n"] == len(request.prompt_ids) + len(result.token_ids) - 1
        if previous is not None:  # the engine replayed them: a token keeps its first forward's experts
            n = previous["n"]
            assert (decode_routes(result.routes)[:n] == decode_routes(previous)).all()
        previous = result.routes
    assert traj.routes == previous
