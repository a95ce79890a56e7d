"""The chaos suite: a live run whose every kind of component is SIGKILLed in turn finishes its steps,
loses no version, trains no group twice and leaves nothing behind (`benchmarks/chaos.py`, one round)."""

from __future__ import annotations

from pathlib import Path

import pytest
from tests.chaos.conftest import load_chaos

from shipyard.envs.sandbox import sandbox_available
from shipyard.envs.services.postgres import postgres_available

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(sandbox_available() is not None, reason=str(sandbox_available())),
    pytest.mark.skipif(postgres_available() is not None, reason=str(postgres_available())),
]


@pytest.mark.timeout(1800)
def test_every_component_killed_once_and_the_run_finishes_clean(tmp_path: Path) -> None:
    chaos = load_chaos()
    figures = chaos.run_chaos(tmp_path, rounds=1, steps=60, seed=1)
    assert figures["kills"] >= 6 and len(figures["kinds"]) >= 6, figures["kill_log"]
    assert figures["steps_trained"] == 60
    for key in chaos.INVARIANTS:
        assert figures[key] == 0, (key, figures)
    assert all(s < 600 for s in figures["max_recovery_s"].values())
