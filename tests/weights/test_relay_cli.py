"""`shipyard relay CONFIG`: mirrors the origin store into the configured regional store."""

from pathlib import Path

import torch

from shipyard.cli import main
from shipyard.config import load_config
from shipyard.store import LocalStore
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
    pub = WeightPublisher(LocalStore(tmp_path / "origin"), snapshot_every=2)
    states = [{"w": torch.full((64, 64), float(v)).bfloat16()} for v in range(4)]
    for v, s in enumerate(states):
        pub.publish(v, s)
    relay = run_relay(cfg, max_s=0.5)
    mirror = LocalStore(tmp_path / "eu")
    assert latest_version(mirror) == 3 and relay.name == "relay-eu"
    assert torch.equal(load_version(mirror, 3)["w"], states[3]["w"])
    assert "version 3 mirrored" in capsys.readouterr().out
