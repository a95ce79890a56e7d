"""Runs for the viewer's tests, made by the tests: a real tiny training run, plus real expert
sessions (tool calls, summaries, a diff, a passing grade) written into the same run's store."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from shipyard.agent.demonstrate import LongTaskExpert, demonstrations
from shipyard.agent.spec import session_spec
from shipyard.config import load_config
from shipyard.config.schema import StoreConfig
from shipyard.envs.tasks.long import long_tasks
from shipyard.models.loading import load_model
from shipyard.orchestrate.train import train
from shipyard.rollout.types import RolloutBatch
from shipyard.store.run import open_run

ROOT = Path(__file__).resolve().parents[2]


def overrides(tmp: Path, *extra: str) -> list[str]:
    return [
        f'run.output_dir="{tmp}"',
        f'store.root="{tmp / "store"}"',
        f'run.results_dir="{tmp / "results"}"',
        *extra,
    ]


def add_expert_sessions(tmp: Path, name: str, n: int = 2) -> list[str]:
    """Play ``n`` long tasks with the scripted expert through the real harness and write them as the
    batch ``expert/00000000`` of run ``name``; returns their session ids."""
    cfg = load_config(ROOT / "configs/long_horizon.toml", ["model.source=tiny", "sandbox.timeout_s=60"])
    _, tok = load_model(cfg.model)
    tasks = long_tasks(n, seed=2, modules=4, filler_lines=2)
    spec = session_spec(cfg, LongTaskExpert(tasks[0], tok, cfg.agent.summary.instruction), tok)
    sessions = demonstrations(spec, tasks)
    store = open_run(StoreConfig(root=str(tmp / "store")), name)
    trajs = [t for segs in sessions for t in segs]
    batch = RolloutBatch(
        "expert/00000000", "expert", time.time(), trajs, run=name, run_id=store.identity.run_id
    )
    store.put(batch.key(), batch.to_bytes())
    return [segs[0].session_id for segs in sessions]


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[str]]:
    """(run directory, expert session ids) of a finished 3-step tiny run."""
    tmp = tmp_path_factory.mktemp("view")
    train(load_config(ROOT / "configs/tiny.toml", overrides(tmp)))
    return tmp / "tiny", add_expert_sessions(tmp, "tiny")
