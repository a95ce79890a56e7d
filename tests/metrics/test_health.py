"""The progress board and its watchdog: a phase without progress past its deadline is a stall, named
once with its phase and its threads' stacks; idle phases and ticking components never are."""

from __future__ import annotations

import json
import threading
from pathlib import Path

from tests.conftest import until

from shipyard.metrics.health import Health, Watchdog


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
