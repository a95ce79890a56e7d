"""Stalls on the Ray placement (issue 40): a rollout worker actor frozen whole (SIGSTOP, so its own
watchdog is frozen too) is named silent by the driver from the records in the store, killed and
restarted by Ray, and the run trains every step; the frozen process is gone afterwards."""

from __future__ import annotations

import json
import os
import signal
import threading
from pathlib import Path

import pytest
from tests.conftest import until

from shipyard.config import load_config
from shipyard.metrics.logger import read_metrics
from shipyard.orchestrate.train import train

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


def _state(pid: int) -> str | None:
    """The process's state letter (``T`` stopped, ``Z`` zombie), or None when it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


@pytest.mark.timeout(900)
def test_a_frozen_ray_worker_is_named_and_restarted(tmp_path: Path) -> None:
    cfg = load_config(
        ROOT / "configs/tiny.toml",
        [
            "run.placement=ray",
            "trainer.steps=10",
            f'run.output_dir="{tmp_path}"',
            f'store.root="{tmp_path / "store"}"',
            "run.watchdog.report_s=1",
            "run.watchdog.silent_s=8",
            "run.watchdog.check_s=1",
        ],
    )
    record = tmp_path / "store" / cfg.run.name / "health" / "worker-w0.json"
    metrics = tmp_path / cfg.run.name / "metrics.jsonl"
    frozen: list[int] = []

    def freeze_the_worker() -> None:  # once it reported and the trainer took a step
        if until(lambda: record.exists() and metrics.exists() and '"train"' in metrics.read_text(), 600):
            frozen.append(json.loads(record.read_text())["pid"])
            os.kill(frozen[0], signal.SIGSTOP)

    threading.Thread(target=freeze_the_worker, daemon=True).start()
    summary = train(cfg)
    assert frozen, "the worker never reported to the store"
    assert summary["trainer"]["final_version"] == 10
    steps = [r["step"] for r in read_metrics(metrics) if r.get("kind") == "train"]
    assert steps == list(range(1, 11))
    health = [json.loads(x) for x in (tmp_path / cfg.run.name / "health.jsonl").read_text().splitlines()]
    [stall] = [h for h in health if h["kind"] == "stall"]
    assert (stall["component"], stall["reason"], stall["action"]) == ("worker w0", "silent", "restarting it")
    assert stall["pid"] == frozen[0] and stall["age_s"] >= 8
    assert json.loads(record.read_text())["pid"] != frozen[0]  # a new incarnation reported
    assert _state(frozen[0]) in (None, "Z")  # the frozen process was killed, not left stopped


@pytest.mark.timeout(900)
def test_a_frozen_ray_trainer_stops_the_run_naming_it(tmp_path: Path) -> None:
    """A trainer cannot be restarted under the driver (its ranks are one group): the driver names it
    silent and the run stops with a StallError (``shipyard train`` exits 3; rerun, it resumes)."""
    from shipyard.metrics.health import StallError

    cfg = load_config(
        ROOT / "configs/tiny.toml",
        [
            "run.placement=ray",
            "trainer.steps=200",
            f'run.output_dir="{tmp_path}"',
            f'store.root="{tmp_path / "store"}"',
            "run.watchdog.report_s=1",
            "run.watchdog.silent_s=8",
            "run.watchdog.check_s=1",
        ],
    )
    record = tmp_path / "store" / cfg.run.name / "health" / "trainer.json"
    frozen: list[int] = []

    def freeze_the_trainer() -> None:
        if until(lambda: record.exists() and json.loads(record.read_text())["phase"] != "starting", 600):
            frozen.append(json.loads(record.read_text())["pid"])
            os.kill(frozen[0], signal.SIGSTOP)

    threading.Thread(target=freeze_the_trainer, daemon=True).start()
    with pytest.raises(StallError, match=r"trainer \(pid \d+ on .*\) has not reported for .* s"):
        train(cfg)
    assert frozen
    health = [json.loads(x) for x in (tmp_path / cfg.run.name / "health.jsonl").read_text().splitlines()]
    [stall] = [h for h in health if h["kind"] == "stall"]
    assert (stall["component"], stall["reason"], stall["action"]) == ("trainer", "silent", "stopping the run")
    assert _state(frozen[0]) in (None, "Z")  # the placement's stop killed it


@pytest.mark.timeout(1500)
def test_a_ray_worker_cut_off_from_its_server_is_named_and_recovers(tmp_path: Path) -> None:
    """The chaos suite's partition on Ray: the server actor listens on a chosen port, the worker
    reaches it through a fault proxy (`rollout.server_urls`) that drops every byte for 60 s. The
    worker is named within its deadline, the run trains again after the path heals, and nothing is
    lost, trained twice or left behind (the driver stopped with SIGTERM cleans its actors up)."""
    from tests.chaos.conftest import load_chaos

    chaos = load_chaos()
    figures = chaos.run_chaos(
        tmp_path, rounds=0, steps=0, seed=2, stall_rounds=1, stall_kinds=("partition",), placement="ray"
    )
    (stall,) = figures["stall_log"]
    assert figures["silent_hangs"] == 0, stall
    assert stall["detect_s"] is not None and any(n.startswith("worker") for n in stall["named"]), stall
    assert figures["steps_trained"] > 0
    for key in chaos.INVARIANTS:
        assert figures[key] == 0, (key, figures)
