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
