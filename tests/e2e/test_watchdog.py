"""A run never hangs silently (issue 40): a rollout worker whose session never returns is named by
the watchdog with its phase, its thread's stack is written to the run's logs, and the run stops with
an error naming it, well before the trainer's own wait would time out."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from shipyard.config import load_config
from shipyard.metrics.health import StallError
from shipyard.metrics.logger import read_metrics
from shipyard.orchestrate.train import train

ROOT = Path(__file__).resolve().parents[2]


def _tiny(tmp_path: Path, *over: str) -> Any:
    """configs/tiny.toml on the local placement, everything under ``tmp_path``, no before/after eval."""
    return load_config(
        ROOT / "configs/tiny.toml",
        [
            f'run.output_dir="{tmp_path}"',
            f'store.root="{tmp_path / "store"}"',
            f'run.results_dir="{tmp_path / "results"}"',
            "run.eval_before_after=false",
            *over,
        ],
    )


def test_a_hung_session_is_named_and_the_run_stops(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    release = threading.Event()

    def session_that_never_returns(*args: object, **kwargs: object) -> list:
        release.wait(300)  # the hang: a harness that neither answers nor exits
        return []

    monkeypatch.setattr("shipyard.rollout.worker.play", session_that_never_returns)
    cfg = _tiny(tmp_path, "run.watchdog.deadlines.worker=3", "run.watchdog.check_s=0.5")
    t0 = time.monotonic()
    try:
        with pytest.raises(StallError, match=r"worker w0 made no progress in phase 'sessions'"):
            train(cfg)
    finally:
        release.set()  # the session's pool thread ends (this process could not exit before it)
    assert time.monotonic() - t0 < 120
    records = [json.loads(line) for line in (tmp_path / "tiny/health.jsonl").read_text().splitlines()]
    [stall] = [r for r in records if r["kind"] == "stall"]
    assert (stall["component"], stall["phase"], stall["deadline_s"]) == ("worker w0", "sessions", 3.0)
    assert stall["age_s"] > 3.0
    stacks = Path(stall["stacks"]).read_text()
    mine = stacks.split("<- the stalled component's")[1].split("--- thread")[0]
    assert "session_that_never_returns" in stacks and "run" in mine  # the worker thread's own stack


def test_a_trainer_given_no_trainable_samples_is_a_stall(tmp_path: Path) -> None:
    """A server that stops adopting new versions (here it polls the store once an hour, with no
    feed): the workers wait at the version gate (idle, as they should) and the trainer receives no
    trainable samples. The trainer is named, stuck in `wait_rollouts` past its deadline, long before
    `trainer.wait_timeout_s` would end its wait."""
    cfg = _tiny(
        tmp_path,
        "trainer.steps=20",
        "trainer.max_off_policy_steps=1",
        "trainer.wait_timeout_s=600",
        "inference.poll_s=3600",
        "run.watchdog.deadlines.trainer=8",
        "run.watchdog.check_s=0.5",
    )
    t0 = time.monotonic()
    with pytest.raises(StallError, match=r"trainer made no progress in phase 'wait_rollouts'"):
        train(cfg)
    assert time.monotonic() - t0 < 300
    records = [json.loads(line) for line in (tmp_path / "tiny/health.jsonl").read_text().splitlines()]
    [stall] = [r for r in records if r["kind"] == "stall"]
    assert (stall["component"], stall["phase"], stall["deadline_s"]) == ("trainer", "wait_rollouts", 8.0)
    workers = [c for c in records[-1]["components"] if c["component"].startswith("worker")]
    assert workers and all(c["phase"] == "waiting" for c in workers)  # at the gate, not stalled
    trained = [r["step"] for r in read_metrics(tmp_path / "tiny/metrics.jsonl") if r.get("kind") == "train"]
    assert 1 <= len(trained) <= 3  # (version 0 serves steps up to the staleness bound, then nothing)


def test_a_standalone_worker_with_a_hung_harness_exits_for_its_supervisor(tmp_path: Path) -> None:
    """`shipyard worker` whose harness hangs (a command that never exits, well within its own
    timeout) names the stall and exits with status 3 at once, so its supervisor restarts it."""
    import subprocess
    import sys

    from shipyard.inference.backends.embedded import EmbeddedNode
    from shipyard.store import LocalStore
    from shipyard.store.run import stamp_new_run

    over = [
        f'run.output_dir="{tmp_path}"',
        f'store.root="{tmp_path / "store"}"',
        "harness.command='sleep 600'",
        "harness.timeout_s=900",
        "run.watchdog.deadlines.worker=3",
        "run.watchdog.check_s=0.5",
        "run.watchdog.report_s=0.5",
        "run.watchdog.silent_s=2",
    ]
    cfg = load_config(ROOT / "configs/tiny_harness.toml", over)
    store = stamp_new_run(LocalStore(tmp_path / "store"), cfg.run.name)
    node = EmbeddedNode(cfg, store)
    try:
        cmd = [sys.executable, "-m", "shipyard.cli", "worker", str(ROOT / "configs/tiny_harness.toml"), *over]
        out = subprocess.run(
            [*cmd, "--server", node.url, "--worker-id", "w0"], capture_output=True, text=True, timeout=180
        )
    finally:
        node.stop()
    assert out.returncode == 3, out.stderr[-2000:]
    assert "worker w0 made no progress in phase 'sessions'" in out.stderr
    where = tmp_path / cfg.run.name / "workers" / "w0"
    [stall] = [json.loads(x) for x in (where / "health.jsonl").read_text().splitlines() if '"stall"' in x]
    assert stall["component"] == "worker w0" and Path(stall["stacks"]).is_file()
    # it reported to the store while it ran: `shipyard health`, watching from outside, finds it
    # silent in the phase it was stuck in and exits 3 (the probe a supervisor runs)
    record = json.loads(store.get("health/worker-w0.json"))
    assert (record["component"], record["phase"]) == ("worker w0", "sessions") and record["reports"] >= 1
    probe = subprocess.run(
        [
            sys.executable,
            "-m",
            "shipyard.cli",
            "health",
            str(ROOT / "configs/tiny_harness.toml"),
            *over,
            "--for",
            "4",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert probe.returncode == 3, probe.stdout[-2000:] + probe.stderr[-2000:]
    assert "STALL (silent): worker w0" in probe.stdout and "last in phase 'sessions'" in probe.stdout
