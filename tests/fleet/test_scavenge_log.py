"""The scavenging benchmark's round log: a run cut short goes on from its next round with every window
it had, a log of another design is refused, and a line cut by a crash is run again."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    spec = importlib.util.spec_from_file_location(
        "fleet_scavenge_bench", ROOT / "benchmarks" / "fleet_scavenge.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up while being defined
    spec.loader.exec_module(module)
    return module


def _window(bench: ModuleType, k: int) -> object:
    served = [bench.Served(sent=30.0 * k + i, latency_s=1.0 + 0.1 * i, tokens=24) for i in range(3)]
    return bench.Window(
        served=served,
        start_s=30.0 * k,
        wall_s=31.5,
        rl_tokens=100 + k,
        busy_s=12.0,
        preemptions=k,
        yields_s=[0.2],
        capacity=90.0,
        rl_sessions=4,
        rl_sessions_crashed=1,
    )


def test_a_resumed_run_has_every_round_the_first_part_logged(bench: ModuleType, tmp_path: Path) -> None:
    path, design = tmp_path / "rounds.jsonl", {"trace": {"seed": 0}, "arms": ["production_only", "tiers_k0"]}
    log = bench.RoundLog(path, design, resume=False)
    for k in range(3):
        log.append({"production_only": _window(bench, k), "tiers_k0": _window(bench, k + 10)})
    again = bench.RoundLog(path, design, resume=True)
    assert again.rounds == log.rounds and len(again.rounds) == 3  # dataclasses compare field by field
    assert again.rounds[2]["tiers_k0"].served[1].latency_s == pytest.approx(1.1)
    assert bench.RoundLog(path, design, resume=False).rounds == []  # without --resume: start over


def test_a_log_of_another_design_is_refused_and_a_cut_line_runs_again(
    bench: ModuleType, tmp_path: Path
) -> None:
    path, design = tmp_path / "rounds.jsonl", {"trace": {"seed": 0}, "window_s": 60.0}
    log = bench.RoundLog(path, design, resume=False)
    log.append({"production_only": _window(bench, 0)})
    log.append({"production_only": _window(bench, 1)})
    with pytest.raises(ValueError, match="window_s"):
        bench.RoundLog(path, {**design, "window_s": 30.0}, resume=True)
    path.write_text(path.read_text()[:-40])  # the last round's line cut mid-write
    assert len(bench.RoundLog(path, design, resume=True).rounds) == 1
