"""The chaos suite's stalls, one test per kind (`benchmarks/stalls.py`): a live run of separate processes
whose component is frozen (resumed after 60 s, or never), whose worker is cut off from its server,
whose store answers 2 s late or has a full disk, or whose component's clock jumps an hour. Each stall
that stops a component is named within its deadline (no silent hang), the run recovers and goes on,
and nothing is lost, trained twice or left behind. About 3-4 minutes each; not in `.ci/run`."""

from __future__ import annotations

import shutil
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
    pytest.mark.skipif(shutil.which("cc") is None, reason="the clock shift is compiled with cc"),
]


@pytest.mark.timeout(1200)
@pytest.mark.parametrize(
    "kind", ["freeze_resumed", "freeze", "partition", "slow_store", "full_disk", "clock_jump"]
)
def test_a_stall_is_named_and_the_run_recovers(kind: str, tmp_path: Path) -> None:
    chaos = load_chaos()
    figures = chaos.run_chaos(tmp_path, rounds=0, steps=0, seed=2, stall_rounds=1, stall_kinds=(kind,))
    (stall,) = figures["stall_log"]
    assert figures["stalls"] == {kind: 1}
    assert figures["silent_hangs"] == 0, stall
    if kind in ("freeze_resumed", "freeze", "partition", "full_disk"):
        # named within the kind's deadline plus silent_s plus the slack of the definition
        assert stall["detect_s"] is not None and stall["named"], stall
    if kind == "freeze":  # never resumed: the supervisor, told by the monitor, restarted it
        assert figures["restarts"][stall["target"]] >= 1, figures["restarts"]
    assert stall["recover_s"] < 600, stall
    assert figures["steps_trained"] > 0
    for key in chaos.INVARIANTS:
        assert figures[key] == 0, (key, figures)
