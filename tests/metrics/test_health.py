"""The progress board and its watchdog: a phase without progress past its deadline is a stall, named
once with its phase and its threads' stacks; idle phases and ticking components never are."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

from tests.conftest import until

from shipyard.metrics.health import Health, Monitor, Watchdog, watch


def test_a_frozen_phase_is_named_once_with_its_stack(tmp_path: Path) -> None:
    health = Health(deadline_s=60, deadlines={"trainer": 0.3})
    stalls: list[dict] = []
    dog = Watchdog(health, tmp_path, stalls.append, check_s=0.05, snapshot_s=0.1, say=lambda _: None).start()
    frozen = threading.Event()

    def trainer_step() -> None:
        beat = health.beat("trainer")
        beat.enter("forward_backward")
        frozen.wait(10)  # a backward pass that never returns

    def busy_server() -> None:
        beat = health.beat("server 0")
        beat.enter("decode")
        while not frozen.is_set():
            beat.tick()
            frozen.wait(0.01)

    threads = [threading.Thread(target=f) for f in (trainer_step, busy_server)]
    health.beat("worker w0").enter("waiting")  # idle: never a stall, however long
    for t in threads:
        t.start()
    try:
        assert until(lambda: bool(stalls), 10)
        snapshots = (tmp_path / "health.jsonl").read_text().count('"snapshot"')
        # more checks after the stall (three more snapshots): still one report for it
        assert until(lambda: (tmp_path / "health.jsonl").read_text().count('"snapshot"') >= snapshots + 3, 10)
    finally:
        frozen.set()
        for t in threads:
            t.join()
        dog.stop()
    [stall] = stalls
    assert (stall["component"], stall["phase"], stall["deadline_s"]) == ("trainer", "forward_backward", 0.3)
    assert "trainer_step" in Path(stall["stacks"]).read_text()
    lines = [json.loads(x) for x in (tmp_path / "health.jsonl").read_text().splitlines()]
    assert [x["component"] for x in lines if x["kind"] == "stall"] == ["trainer"]
    snap = next(x for x in lines if x["kind"] == "snapshot")
    assert {c["component"] for c in snap["components"]} <= {"trainer", "server 0", "worker w0"}
    beat = health.beat("trainer")
    beat.tick()  # progress again: no longer stalled
    assert health.stalled() == []


def _record(component: str, reports: int, seq: int, phase: str = "sessions", **kw: object) -> dict:
    return {
        "component": component,
        "phase": phase,
        "reports": reports,
        "seq": seq,
        "deadline_s": 30.0,
        "pid": 100,
        "written_at": 1e9,
        **kw,
    }


def test_the_monitor_names_a_silent_component_once_on_its_own_clock() -> None:
    """Reports that stop changing name the component silent after ``silent_s`` of the monitor's own
    clock; the reporter's wall clock jumping an hour either way changes nothing; a restart (new pid)
    is a new incarnation, alive again."""
    monitor = Monitor(silent_s=20)
    t = 1000.0
    for i, jump in enumerate([0, 3600, -3600, 0, 0]):  # reports every 5 s, its wall clock jumping
        monitor.observe([_record("worker w0", i, i, written_at=1e9 + jump)], now=t + 5 * i)
        assert monitor.check(now=t + 5 * i) == []
    last = t + 20
    for dt in (5, 15, 20):  # the same report seen again and again: not yet past 20 s
        monitor.observe([_record("worker w0", 4, 4)], now=last + dt)
        assert monitor.check(now=last + dt) == []
    monitor.observe([_record("worker w0", 4, 4)], now=last + 20.5)
    (stall,) = monitor.check(now=last + 20.5)
    assert (stall["component"], stall["reason"], stall["phase"], stall["age_s"]) == (
        "worker w0",
        "silent",
        "sessions",
        20.5,
    )
    assert monitor.check(now=last + 60) == []  # named once
    assert [s["reason"] for s in monitor.stalled(now=last + 60)] == ["silent"]
    monitor.observe([_record("worker w0", 1, 1, pid=101)], now=last + 61)  # restarted: alive
    assert monitor.stalled(now=last + 62) == []


def test_the_monitor_names_a_stuck_phase_but_never_an_idle_one() -> None:
    monitor = Monitor(silent_s=20)
    for i in range(10):  # alive (reports change) for 45 s; progress only once
        monitor.observe(
            [_record("trainer", i, 7, phase="publish"), _record("server 8000", i, 3, phase="idle")],
            now=5.0 * i,
        )
    (stall,) = monitor.check(now=45.0)
    assert (stall["component"], stall["reason"], stall["phase"]) == ("trainer", "stuck", "publish")
    assert stall["age_s"] == 45.0 and stall["deadline_s"] == 30.0
    monitor.observe([_record("trainer", 11, 8, phase="publish")], now=50.0)  # it moved: no longer stuck
    assert monitor.stalled(now=50.0) == []
    monitor.observe([_record("trainer", 12, 9, phase="done")], now=51.0)  # it finished and stopped reporting
    assert [s["component"] for s in monitor.stalled(now=500.0)] == ["server 8000"]  # it went silent


def test_a_process_reports_its_components_to_the_store(tmp_path: Path) -> None:
    """`watch` publishes the component's record every report_s (health/<component>.json); a store
    that fails is said once and retried; the published reports feed a monitor."""
    from shipyard.config.schema import WatchdogConfig
    from shipyard.store import LocalStore

    store = LocalStore(tmp_path / "store")
    failing = threading.Event()
    failing.set()
    refused: list[str] = []

    def publish(key: str, data: bytes) -> None:
        if failing.is_set():
            refused.append(key)
            raise OSError("No space left on device")
        store.put(key, data)

    settings = WatchdogConfig(report_s=0.05, silent_s=1.0, check_s=0.05)
    with watch(settings, tmp_path / "run", "worker w0", publish=publish) as beat:
        beat.enter("sessions")
        assert until(lambda: len(refused) >= 3, 10)  # three rounds refused, each retried
        assert store.list("health/") == []
        failing.clear()
        assert until(lambda: store.list("health/") == ["health/worker-w0.json"], 10)
        beat.tick()
        first = json.loads(store.get("health/worker-w0.json"))
        assert until(lambda: json.loads(store.get("health/worker-w0.json"))["reports"] > first["reports"], 10)
    record = json.loads(store.get("health/worker-w0.json"))
    assert record["phase"] == "sessions" and record["seq"] == 2 and record["pid"] == os.getpid()
    monitor = Monitor(silent_s=settings.silent_s)
    monitor.observe([record], now=0.0)
    monitor.observe([json.loads(store.get("health/worker-w0.json"))], now=2.0)  # it stopped reporting
    assert [s["reason"] for s in monitor.check(now=2.0)] == ["silent"]
