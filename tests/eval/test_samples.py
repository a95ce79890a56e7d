"""k samples per evaluated task (`eval.samples_per_task`).

Checked with the tiny model and its real engine: every task is played k times with k different
seeds (sample i of a task draws its own), a task's `passed` and `rewards` are the means over its
samples, the sessions counted by `on_done` are tasks x k, and one sample keeps 0/1 outcomes.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from shipyard.agent.spec import session_spec
from shipyard.config.load import load_config
from shipyard.envs.tasks.splits import task_splits
from shipyard.eval.evaluate import evaluate
from shipyard.inference.client import LocalInferenceClient
from shipyard.inference.engine.engine import EmbeddedEngine
from shipyard.inference.types import GenerateRequest, GenerateResult
from shipyard.models.loading import load_model

ROOT = Path(__file__).resolve().parents[2]


class _Recording(LocalInferenceClient):
    """The real local client, keeping every request it sampled."""

    def __init__(self, engine: EmbeddedEngine) -> None:
        super().__init__(engine)
        self.requests: list[GenerateRequest] = []

    def generate(self, requests: list[GenerateRequest]) -> list[GenerateResult]:
        self.requests += requests
        return super().generate(requests)


@pytest.fixture(scope="module")
def setup():
    cfg = load_config(ROOT / "configs" / "tiny.toml", ["eval.samples_per_task=3", "agent.max_turns=1"])
    model, tok = load_model(cfg.model)
    client = _Recording(EmbeddedEngine(model, tok, max_batch=8))
    return cfg, client, session_spec(cfg, client, tok), task_splits(cfg)[1][:4]


def test_each_task_is_sampled_k_times_with_its_own_seeds(setup) -> None:
    cfg, client, spec, tasks = setup
    done: list[int] = []
    res = evaluate(spec, tasks, 1.0, 4, lambda: done.append(1), samples=cfg.eval.samples_per_task)
    assert res.samples == 3 and res.n == 4 and len(done) == 12 and len(client.requests) == 12
    assert res.task_ids == [t.id for t in tasks]
    seeds = [r.params.seed for r in client.requests]
    assert len(set(seeds)) == 12  # 4 tasks x 3 samples, no two sessions share a draw
    for p, r in zip(res.passed, res.rewards, strict=True):
        assert round(p * 3) == pytest.approx(p * 3) and 0.0 <= p <= 1.0  # a mean of three 0/1 outcomes
        assert 0.0 <= r <= 1.0
    assert res.pass_rate == pytest.approx(sum(res.passed) / 4)
    assert [sum(s) / 3 for s in res.sample_passed] == pytest.approx(res.passed)


def test_one_sample_keeps_zero_one_outcomes(setup) -> None:
    _, client, spec, tasks = setup
    client.requests.clear()
    res = evaluate(spec, tasks, 1.0, 4)
    assert res.samples == 1 and len(client.requests) == 4 and set(res.passed) <= {0.0, 1.0}


def test_samples_per_task_is_validated() -> None:
    with pytest.raises(ValueError, match="samples_per_task"):
        load_config(ROOT / "configs" / "tiny.toml", ["eval.samples_per_task=0"])
