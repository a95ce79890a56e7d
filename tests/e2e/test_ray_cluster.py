"""Given a Ray address, the same config joins that cluster (a head node this test starts on loopback)."""

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from shipyard.config import load_config
from shipyard.orchestrate.train import train
from shipyard.store import LocalStore
from shipyard.weights.snapshot import latest_version

ROOT = Path(__file__).resolve().parents[2]
RAY = str(Path(sys.executable).with_name("ray"))


@pytest.mark.slow
def test_run_joins_an_existing_ray_cluster(tmp_path: Path) -> None:
    port = 46379
    head = subprocess.Popen(
        [
            RAY,
            "start",
            "--head",
            "--block",
            f"--port={port}",
            "--node-ip-address=127.0.0.1",
            "--num-cpus=4",
            "--include-dashboard=false",
            f"--temp-dir={tmp_path / 'ray'}",
            "--disable-usage-stats",
        ],
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        cfg = load_config(
            ROOT / "configs/tiny.toml",
            [
                "run.placement=ray",
                f'run.ray_address="127.0.0.1:{port}"',
                "trainer.steps=1",
                f'run.output_dir="{tmp_path}"',
                f'store.root="{tmp_path / "store"}"',
            ],
        )
        assert train(cfg)["trainer"]["final_version"] == 1
        assert latest_version(LocalStore(tmp_path / "store")) == 1
    finally:  # the head and everything it started live in the session this test created
        os.killpg(head.pid, signal.SIGTERM)
        head.wait(timeout=60)
