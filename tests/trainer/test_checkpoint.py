"""Resumable checkpoints: bit-exact resume of model and AdamW state, tied embeddings, atomicity
(incomplete and temporary directories), pruning to the newest ``keep``.

Shape legend: T = positions.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from shipyard.agent.types import Trajectory
from shipyard.config.schema import TrainerConfig
from shipyard.models.loading import build_tiny
from shipyard.trainer.checkpoint import load_latest_checkpoint, save_checkpoint
from shipyard.trainer.step import make_optimizer, train_step

VOCAB = 49152
PAD_ID = 2
CFG = TrainerConfig(lr=1e-3, weight_decay=0.01, micro_batch=2)


def _batch(seed: int) -> tuple[list[Trajectory], list[float]]:
    """Two 14-token trajectories (4 prompt tokens), μ a fixed -3 per sampled token, advantages ±1."""
    gen = torch.Generator().manual_seed(seed)
    trajs = []
    for i in range(2):
        ids_T = torch.randint(3, VOCAB, (14,), generator=gen)
        mask = [0] * 4 + [1] * 10
        logprobs = [-3.0 * m for m in mask]
        trajs.append(Trajectory("t", "g", i, ids_T.tolist(), mask, logprobs, [0] * 14, prompt_len=4))
    return trajs, [1.0, -1.0]


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, seeds: range) -> None:
    for seed in seeds:
        trajs, adv = _batch(seed)
        train_step(model, opt, trajs, adv, CFG, PAD_ID)


def test_resume_is_bit_exact(tmp_path: Path) -> None:
    model = build_tiny("dense", VOCAB, seed=0)
    opt = make_optimizer(model, CFG)
    _train(model, opt, range(0, 2))
    state = {"consumed": ["rollouts/w0/00000000.json.gz"], "seed": 7}
    path = save_checkpoint(tmp_path, 2, model, opt, state)
    assert path == tmp_path / "step-000002" and (path / "meta.json").is_file()
    _train(model, opt, range(2, 4))

    fresh = build_tiny("dense", VOCAB, seed=1)
    fresh_opt = make_optimizer(fresh, CFG)
    loaded = load_latest_checkpoint(tmp_path, fresh, fresh_opt)
    assert loaded == {**state, "step": 2}
    assert fresh.lm_head.weight is fresh.model.embed_tokens.weight  # still tied after loading
    _train(fresh, fresh_opt, range(2, 4))
    for (name, p), q in zip(model.named_parameters(), fresh.parameters(), strict=True):
        assert torch.equal(p, q), name
    assert fresh_opt.state_dict()["state"].keys() == opt.state_dict()["state"].keys()


def test_keep_prunes_and_incomplete_dirs_are_ignored(tmp_path: Path) -> None:
    model = build_tiny("dense", VOCAB, seed=0)
    opt = make_optimizer(model, CFG)
    for step in range(1, 5):
        save_checkpoint(tmp_path, step, model, opt, {"n": step})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000003", "step-000004"]
    (tmp_path / "step-000009").mkdir()  # a crash mid-write by some other writer: no meta.json
    (tmp_path / "step-000009" / "model.safetensors").write_bytes(b"partial")
    (tmp_path / ".tmp-step-000010-x").mkdir()  # our own crashed temp dir
    assert load_latest_checkpoint(tmp_path, model, opt) == {"n": 4, "step": 4}
    save_checkpoint(tmp_path, 4, model, opt, {"n": 44})  # same step again replaces it
    assert not (tmp_path / ".tmp-step-000010-x").exists()
    meta = json.loads((tmp_path / "step-000004" / "meta.json").read_text())
    assert meta["state"] == {"n": 44} and meta["step"] == 4
    assert load_latest_checkpoint(tmp_path, model, opt) == {"n": 44, "step": 4}


def test_missing_root_and_bad_state(tmp_path: Path) -> None:
    model = build_tiny("dense", VOCAB, seed=0)
    opt = make_optimizer(model, CFG)
    assert load_latest_checkpoint(tmp_path / "nothing", model, opt) is None
    with pytest.raises(ValueError):
        save_checkpoint(tmp_path, 1, model, opt, {"bad": object()})
    with pytest.raises(ValueError):
        save_checkpoint(tmp_path, 1, model, opt, {"step": 2})
    assert list(tmp_path.iterdir()) == []


def test_resume_relogs_a_step_killed_between_checkpoint_and_log(tmp_path: Path) -> None:
    """The checkpoint carries its step's records; a resume writes them when the kill came first."""
    from shipyard.metrics.logger import MetricsLogger, read_metrics
    from shipyard.store import LocalStore
    from shipyard.trainer.loop import _relog_checkpointed_step
    from shipyard.weights.snapshot import WeightPublisher, read_manifest

    store = LocalStore(tmp_path / "store")
    pub = WeightPublisher(store)
    pub.publish(0, {"w": torch.zeros(4)})
    pub.publish(1, {"w": torch.ones(4)})
    state = {"step": 1, "log": {"train": {"kind": "train", "reward/mean": 0.5}, "groups": ["g1"]}}
    logger = MetricsLogger(tmp_path / "run", tensorboard=False)
    _relog_checkpointed_step(logger, state, store)
    _relog_checkpointed_step(logger, state, store)  # already there: written once
    recs = read_metrics(logger.path)
    assert [(r["step"], r["kind"]) for r in recs] == [(1, "train"), (1, "consumed")]
    assert recs[0]["reward/mean"] == 0.5 and recs[1]["groups"] == ["g1"]
    assert recs[1]["digest"] == read_manifest(store, 1).state_digest
