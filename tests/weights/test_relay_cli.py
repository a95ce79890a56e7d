"""`shipyard relay CONFIG`: mirrors the origin store into the configured regional store."""

import threading
from pathlib import Path

import torch

from shipyard.cli import main
from shipyard.config import load_config
from shipyard.store import LocalStore
from shipyard.store.run import stamp_new_run
from shipyard.weights.publisher import WeightPublisher
from shipyard.weights.relay import run_relay
from shipyard.weights.versions import latest_version, load_version

ROOT = Path(__file__).resolve().parents[2]


def test_relay_command_mirrors_the_origin(tmp_path: Path, capsys) -> None:
    overrides = [
        f'store.root="{tmp_path / "origin"}"',
        f'relay.mirror.root="{tmp_path / "eu"}"',
        "relay.poll_s=0.05",
    ]
    assert main(["relay", str(ROOT / "configs/tiny.toml"), *overrides, "--dry-run"]) == 0
    assert "[relay.mirror]" in capsys.readouterr().out
    cfg = load_config(ROOT / "configs/tiny.toml", [*overrides, "relay.region=eu"])
    pub = WeightPublisher(stamp_new_run(LocalStore(tmp_path / "origin"), "tiny"), snapshot_every=2)
    states = [{"w": torch.full((64, 64), float(v)).bfloat16()} for v in range(4)]
    for v, s in enumerate(states):
        pub.publish(v, s)
    relay = run_relay(cfg, max_s=0.5)
    mirror = LocalStore(tmp_path / "eu" / "tiny")
    assert latest_version(mirror) == 3 and relay.name == "relay-eu"
    assert torch.equal(load_version(mirror, 3)["w"], states[3]["w"])
    assert "version 3 mirrored" in capsys.readouterr().out


def test_relay_command_follows_the_origin_feed_and_serves_its_region(tmp_path: Path, until) -> None:
    """`relay.feed_url` + `relay.feed_port`: versions arrive by push (polls are a minute apart)
    and are pushed on to the region's followers."""
    from shipyard.weights.feed import FeedFollower, VersionFeed

    origin_feed = VersionFeed().start()
    region = VersionFeed()  # only to find a free port for the relay's feed
    port = region.port
    region.close()
    cfg = load_config(
        ROOT / "configs/tiny.toml",
        [
            f'store.root="{tmp_path / "origin"}"',
            f'relay.mirror.root="{tmp_path / "eu"}"',
            "relay.poll_s=60",
            f'relay.feed_url="{origin_feed.url}"',
            f"relay.feed_port={port}",
        ],
    )
    pub = WeightPublisher(stamp_new_run(LocalStore(tmp_path / "origin"), "tiny"), feed=origin_feed)
    states = [{"w": torch.full((64, 64), float(v)).bfloat16()} for v in range(3)]
    pub.publish(0, states[0])
    mirror = LocalStore(tmp_path / "eu" / "tiny")
    got: list[int] = []
    stop = threading.Event()
    out: list = []
    runner = threading.Thread(target=lambda: out.append(run_relay(cfg, stop=stop)))
    runner.start()
    follower = FeedFollower(
        f"http://127.0.0.1:{port}", after=lambda: None, on_push=lambda p: got.append(p.version)
    )
    try:
        assert until(lambda: latest_version(mirror) == 0, 60), "the relay's first sync"
        pub.publish(1, states[1])  # polls are a minute apart: only the origin's push brings it
        assert until(lambda: latest_version(mirror) == 1, 60)
        follower.start()
        assert until(lambda: follower.healthy, 60)
        pub.publish(2, states[2])
        assert until(lambda: 2 in got, 60), "the region's feed pushed what the relay mirrored"
    finally:
        follower.stop()
        stop.set()
        runner.join(timeout=60)
        origin_feed.close()
    [relay] = out
    assert relay.version == 2 and latest_version(mirror) == 2
    assert torch.equal(relay.state["w"], states[2]["w"])
