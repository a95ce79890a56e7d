"""A region as one unit (`shipyard region`): its processes' command lines resolve to the region's
relay, servers and workers, a process that fails is restarted and one that finishes stays down, and
bad region settings are refused naming the field. The whole region under a network partition is
`benchmarks/fleet_regions.py` (it needs root for network namespaces)."""

from __future__ import annotations

import sys
import tomllib
from pathlib import Path

import pytest

from shipyard.cli import main
from shipyard.config import ConfigError, load_config
from shipyard.fleet.region import Region, Supervised

ROOT = Path(__file__).resolve().parents[2]
REGIONS = 'fleet.regions=[{name="us",mirror_root="/m/us"},{name="eu",mirror_root="/m/eu",servers=2,workers_per_server=2,port=9000}]'


def _resolved(argv: list[str], capsys: pytest.CaptureFixture[str]) -> dict:
    """The config a child command line resolves to (the real CLI, `--dry-run`)."""
    assert argv[1:3] == ["-m", "shipyard.cli"]
    assert main([*argv[3:], "--dry-run"]) == 0
    return tomllib.loads(capsys.readouterr().out)


def test_a_region_runs_its_relay_servers_and_workers(capsys: pytest.CaptureFixture[str]) -> None:
    overrides = [REGIONS, "rollout.num_workers=5", "trainer.groups_per_step=5", "fleet.region=eu"]
    cfg = load_config(ROOT / "configs/tiny.toml", overrides)
    region = Region(cfg, str(ROOT / "configs/tiny.toml"), overrides)
    relay = _resolved(region.relay.argv, capsys)
    assert relay["relay"]["mirror"]["root"] == "/m/eu" and relay["relay"]["region"] == "eu"
    assert relay["store"]["root"] == cfg.store.root  # from the origin
    servers = [_resolved(s.argv, capsys) for s in region.servers]
    assert [(s["store"]["type"], s["store"]["root"], s["inference"]["port"]) for s in servers] == [
        ("local", "/m/eu", 9000),
        ("local", "/m/eu", 9001),
    ]
    assert all(s["fleet"]["region"] == "eu" for s in servers)
    workers = [w.argv for w in region.workers]
    assert [w[w.index("--worker-id") + 1] for w in workers] == ["eu-w0", "eu-w1", "eu-w2", "eu-w3"]
    assert [w[w.index("--server") + 1] for w in workers] == [
        "http://127.0.0.1:9000",
        "http://127.0.0.1:9000",
        "http://127.0.0.1:9001",
        "http://127.0.0.1:9001",
    ]
    worker = _resolved(workers[0], capsys)
    assert worker["fleet"]["region"] == "eu" and worker["store"]["root"] == cfg.store.root


def test_bad_regions_are_refused_naming_the_setting() -> None:
    with pytest.raises(ConfigError, match="rollout.num_workers=1 but fleet.regions run 5 workers"):
        load_config(ROOT / "configs/tiny.toml", [REGIONS])
    with pytest.raises(ConfigError, match="region names must be unique"):
        load_config(
            ROOT / "configs/tiny.toml",
            [
                'fleet.regions=[{name="us",mirror_root="/a"},{name="us",mirror_root="/b"}]',
                "rollout.num_workers=2",
            ],
        )
    cfg = load_config(
        ROOT / "configs/tiny.toml",
        [REGIONS, "rollout.num_workers=5", "trainer.groups_per_step=5", "fleet.region=ap"],
    )
    with pytest.raises(ValueError, match=r"fleet.region='ap' is not in fleet.regions \(\['us', 'eu'\]\)"):
        Region(cfg, "configs/tiny.toml", [])


def test_a_failing_process_is_restarted_and_a_finished_one_stays_down(tmp_path: Path) -> None:
    count = tmp_path / "starts"
    script = f"p='{count}'; n=len(open(p).read()) if __import__('os').path.exists(p) else 0; open(p,'a').write('x'); raise SystemExit(3 if n < 2 else 0)"
    proc = Supervised("flaky", [sys.executable, "-c", script], tmp_path / "flaky.log", restart_s=0.0)
    proc.start()
    for _ in range(3):  # each start: wait for its exit, then let the supervisor act on it
        assert proc.proc is not None and not proc.done
        proc.proc.wait(timeout=60)
        proc.supervise()
    assert proc.done
    assert proc.restarts == 2 and count.read_text() == "xxx"  # two failures restarted, then it finished
    proc.supervise()
    assert proc.restarts == 2  # and it stays down


def test_a_server_or_relay_is_restarted_however_it_exits(tmp_path: Path) -> None:
    proc = Supervised(
        "server", [sys.executable, "-c", "pass"], tmp_path / "s.log", restart_s=0.0, finishes=False
    )
    proc.start()
    for _ in range(2):  # exit 0, restarted; again
        assert proc.proc is not None
        proc.proc.wait(timeout=60)
        proc.supervise()
    assert proc.restarts == 2 and not proc.done
    proc.stop()


CHILD = """
import sys, time
from pathlib import Path
from shipyard.config.schema import WatchdogConfig
from shipyard.metrics.health import watch
from shipyard.store import LocalStore
store = LocalStore(sys.argv[1])
with watch(WatchdogConfig(report_s=0.2, silent_s=1), Path(sys.argv[2]), "worker eu-w0", store.put) as beat:
    beat.enter("sessions")
    while True:
        beat.tick()
        time.sleep(0.05)
"""


def test_a_frozen_process_is_named_silent_killed_and_restarted(tmp_path: Path) -> None:
    """Issue 40: a region's process frozen whole (SIGSTOP: its own watchdog is frozen too) stops
    reporting to the store; the region names it silent from outside, kills it, and restarts it."""
    import json
    import os
    import signal

    from tests.conftest import until

    from shipyard.store import LocalStore
    from shipyard.store.run import stamp_new_run

    overrides = [
        REGIONS,
        "rollout.num_workers=5",
        "trainer.groups_per_step=5",
        "fleet.region=eu",
        f'store.root="{tmp_path / "store"}"',
        "run.watchdog.report_s=0.2",
        "run.watchdog.silent_s=1",
    ]
    cfg = load_config(ROOT / "configs/tiny.toml", overrides)
    run = stamp_new_run(LocalStore(tmp_path / "store"), cfg.run.name)
    region = Region(cfg, str(ROOT / "configs/tiny.toml"), overrides, log_dir=tmp_path / "logs")
    worker = region.workers[0]
    worker.argv = [sys.executable, "-c", CHILD, str(tmp_path / "store" / cfg.run.name), str(tmp_path / "w")]
    worker.restart_s = 0.0
    worker.start()
    try:
        key = "health/worker-eu-w0.json"
        assert until(lambda: key in run.list("health/") and b"sessions" in run.get(key), 60)
        first = worker.proc.pid

        def reports() -> int:
            region._checked = 0.0
            region.check_health()
            return int(json.loads(run.get(key))["reports"])

        start = reports()  # twice silent_s of reports (every 0.2 s), alive and ticking: never named
        assert until(lambda: reports() >= start + 10, 30)
        assert region.named == []
        os.kill(first, signal.SIGSTOP)
        assert until(
            lambda: (setattr(region, "_checked", 0.0), region.check_health(), region.named)[2] != [], 30
        )
        [stall] = region.named
        assert (stall["component"], stall["reason"], stall["phase"]) == ("worker eu-w0", "silent", "sessions")
        assert stall["action"] == "killed, to be restarted" and worker.proc.returncode == -9
        worker.supervise()  # restart_s = 0: started again at once
        assert worker.restarts == 1 and worker.proc.pid != first
        assert until(lambda: f'"pid": {worker.proc.pid}' in run.get("health/worker-eu-w0.json").decode(), 60)
    finally:
        worker.kill()
