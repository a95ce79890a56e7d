"""The same tiny run placed as Ray actors (trainer, inference server, rollout worker) on a local Ray."""

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tests.conftest import until

from shipyard.config import load_config
from shipyard.metrics.logger import read_metrics
from shipyard.orchestrate.train import train
from shipyard.store import LocalStore
from shipyard.weights.snapshot import latest_version

ROOT = Path(__file__).resolve().parents[2]


def test_ray_placement_runs_the_loop(tmp_path: Path) -> None:
    cfg = load_config(
        ROOT / "configs/tiny.toml",
        [
            "run.placement=ray",
            "trainer.steps=2",
            f'run.output_dir="{tmp_path}"',
            f'store.root="{tmp_path / "store"}"',
        ],
    )
    summary = train(cfg)
    assert summary["trainer"]["final_version"] == 2
    assert latest_version(LocalStore(tmp_path / "store" / "tiny")) == 2
    steps = [r["step"] for r in read_metrics(tmp_path / "tiny/metrics.jsonl") if r.get("kind") == "train"]
    assert steps == [1, 2]


def test_actors_get_absolute_local_paths_and_s3_roots_unchanged() -> None:
    """A local store's root becomes absolute for actors in other directories; an S3 root is
    `bucket/prefix` and stays as given (it was once resolved into a local path, so a Ray run on S3
    could not open its run)."""
    from shipyard.orchestrate.ray_placement import for_actors

    local = for_actors(load_config(ROOT / "configs/tiny.toml", ['store.root="runs/store"']))
    assert local.store.root == str(Path("runs/store").resolve())
    s3 = for_actors(
        load_config(
            ROOT / "configs/tiny.toml",
            ["store.type=s3", 'store.root="bucket/runs"', 'store.endpoint_url="http://127.0.0.1:9"'],
        )
    )
    assert s3.store.root == "bucket/runs" and Path(s3.model.cache_dir).is_absolute()


def test_the_driver_names_a_silent_trainer_but_not_an_earlier_drivers_record(tmp_path: Path) -> None:
    """A rerun driver finds its previous actors' records in the store (frozen forever): it never names
    those; a record of its own actor that stops changing is named silent and stops the run."""
    import json

    from tests.conftest import until

    from shipyard.metrics.health import StallError, health_key
    from shipyard.orchestrate.ray_placement import ActorWatch
    from shipyard.store.run import stamp_new_run

    cfg = load_config(
        ROOT / "configs/tiny.toml",
        [f'store.root="{tmp_path / "store"}"', "run.watchdog.report_s=0.05", "run.watchdog.silent_s=0.5"],
    )
    store = stamp_new_run(LocalStore(tmp_path / "store"), cfg.run.name)

    def report(pid: int, reports: int) -> None:
        record = {
            "component": "trainer",
            "phase": "publish",
            "seq": 3,
            "reports": reports,
            "pid": pid,
            "deadline_s": 900.0,
        }
        store.put(health_key("trainer"), json.dumps(record).encode())

    report(pid=111, reports=40)  # the previous driver's trainer, frozen when it stopped
    earlier = ActorWatch(cfg, tmp_path, ray=None)
    earlier.start()
    try:
        assert not until(lambda: earlier.stall is not None, 1.5)  # three times silent_s: not named
    finally:
        earlier.stop()
    watch = ActorWatch(cfg, tmp_path, ray=None)  # a new driver, before it starts its actors
    report(pid=222, reports=1)  # its trainer reports once before the watch starts, then freezes
    watch.start()
    try:
        assert until(lambda: watch.stall is not None, 10)
    finally:
        watch.stop()
    assert isinstance(watch.stall, StallError) and "trainer (pid 222" in str(watch.stall)
    [named] = watch.named
    assert (named["pid"], named["reason"], named["action"]) == (222, "silent", "stopping the run")


def test_servers_listen_where_configured_and_workers_reach_them_through_server_urls() -> None:
    """`inference.port` fixes server i's port at port + i; `rollout.server_urls` (a gateway or a
    proxy in front of the servers) replaces the servers' own addresses for the workers, in turn."""
    from shipyard.orchestrate.components import server_port, worker_url

    cfg = load_config(ROOT / "configs/tiny.toml", ["inference.port=8300"])
    assert [server_port(cfg, i) for i in range(3)] == [8300, 8301, 8302]
    assert server_port(load_config(ROOT / "configs/tiny.toml"), 2) == 0  # free ones
    own = ["http://127.0.0.1:8300", "http://127.0.0.1:8301"]
    assert [worker_url(cfg, i, own) for i in range(3)] == [own[0], own[1], own[0]]
    routed = load_config(ROOT / "configs/tiny.toml", ['rollout.server_urls=["http://gw:9000"]'])
    assert [worker_url(routed, i, own) for i in range(3)] == ["http://gw:9000"] * 3


def test_a_ray_driver_keeps_its_sigterm_handler() -> None:
    """`ray.init` installs a SIGTERM handler that ends the driver at once, so a `shipyard train`
    stopped by its supervisor left its actors running; `init_ray` keeps the driver's own handler
    (here, `shipyard train`'s: SIGTERM raises KeyboardInterrupt, and the placement stops)."""
    import subprocess
    import sys

    code = f"""
import os, signal, time
import ray
from shipyard.config import load_config
from shipyard.orchestrate.ray_placement import init_ray
signal.signal(signal.SIGTERM, signal.default_int_handler)
init_ray(load_config({str(ROOT / "configs/tiny.toml")!r}, ["run.placement=ray"]))
try:
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(10)
except KeyboardInterrupt:
    print("stopped cleanly")
finally:
    ray.shutdown()
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert "stopped cleanly" in out.stdout, out.stdout + out.stderr[-2000:]


@contextlib.contextmanager
def _bare_placement(tmp_path: Path) -> Iterator[Any]:
    """A claimed run's RayPlacement on a local Ray with no actors yet (a test gives it its workers);
    stopped after, its workers dropped first (the test's own actors)."""
    from shipyard.orchestrate.ray_placement import RayPlacement
    from shipyard.store.run import claim_run

    cfg = load_config(
        ROOT / "configs/tiny.toml",
        ["run.placement=ray", f'run.output_dir="{tmp_path}"', f'store.root="{tmp_path / "store"}"'],
    )
    claim_run(cfg.store, cfg.run.name, tmp_path / cfg.run.name)
    placement = RayPlacement(cfg, tmp_path / cfg.run.name)
    try:
        yield placement
    finally:
        placement.workers, placement._runs = [], []
        placement.stop()


def _health(placement: Any) -> list[dict[str, Any]]:
    return [json.loads(x) for x in (placement.run_dir / "health.jsonl").read_text().splitlines()]


def test_a_ray_worker_run_that_raises_is_rerun_and_one_that_keeps_failing_ends_the_run(
    tmp_path: Path,
) -> None:
    """The driver's `rerun_failed_workers`, on a real local Ray: a run that raised is recorded in
    `health.jsonl` and started again on the same actor after its backoff (the second run returns);
    a run that fails `MAX_RUN_FAILURES` times in the window ends the run naming the worker."""

    import pytest
    import ray

    from shipyard.orchestrate import ray_placement

    class Flaky:  # a worker actor's `run`: fails `fails` times (counted in a file), then returns 7
        def __init__(self, marker: str, fails: int) -> None:
            self.marker, self.fails = Path(marker), fails

        def run(self) -> int:
            n = int(self.marker.read_text()) if self.marker.exists() else 0
            self.marker.write_text(str(n + 1))
            if n < self.fails:
                raise ConnectionError(f"server unreachable (run {n + 1})")
            return 7

    with _bare_placement(tmp_path) as placement:
        actor = ray.remote(num_cpus=0)(Flaky)
        placement.workers = [
            actor.remote(str(tmp_path / "once"), 1),
            actor.remote(str(tmp_path / "always"), 99),
        ]
        placement._runs = [w.run.remote().future() for w in placement.workers]
        with pytest.raises(RuntimeError, match=r"worker w1's run failed 5 times within 600 s; last: .*run 5"):
            assert not until(lambda: placement.rerun_failed_workers() is not None, 120)
        assert placement._ended == {0} and placement._runs[0].result() == 7
        assert (tmp_path / "once").read_text() == "2" and (tmp_path / "always").read_text() == "5"
        health = _health(placement)
        crashes = [(h["component"], h["action"]) for h in health if h["kind"] == "crash"]
        assert crashes.count(("worker w0", "running it again in 1 s")) == 1
        assert [a for c, a in crashes if c == "worker w1"] == [
            f"running it again in {s} s" for s in (1, 2, 4, 8)
        ]
        assert ray_placement.MAX_RUN_FAILURES == 5


def test_a_ray_worker_whose_actor_died_gets_a_new_actor_that_runs(tmp_path: Path) -> None:
    """The driver, not Ray, restarts a worker whose process died (Ray's restart once left a
    worker's `run` never retried): the dead actor's run fails, a `crash` is recorded and a new actor
    of the worker's class is started with the worker's arguments; its run returns."""
    import os
    import signal

    import ray

    class Worker:  # a worker actor: its first incarnation runs until killed, the next returns 7
        def __init__(self, cfg: object, worker_id: str, url: str, run_dir: str) -> None:
            self.marker = Path(run_dir) / f"{worker_id}-{url}"

        def run(self) -> int:
            if self.marker.exists():
                return 7
            self.marker.write_text(str(os.getpid()))
            signal.pause()  # until the test kills this process
            return 0

    with _bare_placement(tmp_path) as placement:
        placement._worker_cls = ray.remote(num_cpus=0, max_restarts=0, max_task_retries=0)(Worker)
        placement._worker_urls = ["u0"]
        placement.workers = [None]
        placement._runs = [placement._start_worker(0)]
        first = placement.workers[0]
        marker = placement.run_dir / "w0-u0"
        assert until(lambda: marker.exists() and marker.read_text() != "", 180)
        os.kill(int(marker.read_text()), signal.SIGKILL)
        assert until(lambda: (placement.rerun_failed_workers(), 0 in placement._ended)[1], 120)
        assert (
            placement.workers[0] is not first and placement.watch.actors["worker w0"] is placement.workers[0]
        )
        assert placement._runs[0].result() == 7
        health = _health(placement)
        [crash] = [h for h in health if h["kind"] == "crash"]
        assert (crash["component"], crash["action"]) == ("worker w0", "starting a new actor in 1 s")
        assert placement._failures == {}  # a death is not a failed run: it has its own count


def test_a_ray_worker_whose_actors_keep_dying_ends_the_run(tmp_path: Path, monkeypatch) -> None:
    """An actor that cannot start (its constructor raises) is not replaced forever: with the backoff
    doubling, the MAX_ACTOR_DEATHS-th death in the window ends the run naming the worker."""

    import pytest
    import ray

    from shipyard.orchestrate import ray_placement

    class Broken:
        def __init__(self, cfg: object, worker_id: str, url: str, run_dir: str) -> None:
            raise ImportError("no module named 'their_harness'")

        def run(self) -> int:
            return 0

    monkeypatch.setattr(ray_placement, "DEAD_WORKER_RESTART_S", 0.05)
    monkeypatch.setattr(ray_placement, "MAX_ACTOR_DEATHS", 3)
    with _bare_placement(tmp_path) as placement:
        placement._worker_cls = ray.remote(num_cpus=0, max_restarts=0, max_task_retries=0)(Broken)
        placement._worker_urls = ["u0"]
        placement.workers = [None]
        placement._runs = [placement._start_worker(0)]
        with pytest.raises(
            RuntimeError, match=r"worker w0's actor died 3 times within 600 s; last: .*their_harness"
        ):
            assert not until(lambda: placement.rerun_failed_workers() is not None, 120)
        health = _health(placement)
        actions = [h["action"] for h in health if h["kind"] == "crash"]
        assert actions == ["starting a new actor in 0.05 s", "starting a new actor in 0.1 s"]
