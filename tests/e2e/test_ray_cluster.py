"""Given a Ray address, the same config joins that cluster: a token-authenticated head node this
test starts on loopback (127.0.0.2: Ray rewrites 127.0.0.1 to the outward interface). The run is
`shipyard train` in a process of its own: Ray keeps a process's auth token for its lifetime, so
joining the token cluster in-process would break every later local `ray.init` of the session."""

import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from shipyard.store import LocalStore
from shipyard.weights.snapshot import latest_version

ROOT = Path(__file__).resolve().parents[2]
RAY = str(Path(sys.executable).with_name("ray"))
HOST = "127.0.0.2"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def _wait_listening(port: int, deadline_s: float, log: Path) -> None:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        with socket.socket() as s:
            if s.connect_ex((HOST, port)) == 0:
                return
        time.sleep(0.5)
    tail = log.read_text(errors="replace")[-3000:]
    raise AssertionError(f"ray head did not listen on {HOST}:{port} within {deadline_s}s:\n{tail}")


@pytest.mark.slow
def test_run_joins_an_existing_ray_cluster(tmp_path: Path) -> None:
    port = _free_port()
    ray_tmp = Path(tempfile.mkdtemp(prefix="ray", dir="/tmp"))  # short: Ray's socket paths cap at 107 bytes
    head_log = tmp_path / "head.log"
    auth = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}
    head = subprocess.Popen(
        [RAY, "start", "--head", "--block", f"--port={port}", f"--node-ip-address={HOST}", "--num-cpus=4"]
        + ["--include-dashboard=false", f"--temp-dir={ray_tmp}", "--disable-usage-stats"],
        env={**os.environ, **auth},
        start_new_session=True,  # the head and all it starts live in this test's own session
        stdout=head_log.open("wb"),
        stderr=subprocess.STDOUT,
    )
    try:
        _wait_listening(port, deadline_s=120, log=head_log)
        overrides = [
            "run.placement=ray",
            f'run.ray_address="{HOST}:{port}"',
            "trainer.steps=2",
            f'run.output_dir="{tmp_path}"',
            f'store.root="{tmp_path / "store"}"',
        ]
        shipyard = str(Path(sys.executable).with_name("shipyard"))
        run = subprocess.run(
            [shipyard, "train", str(ROOT / "configs/tiny.toml"), *overrides],
            env={**os.environ, **auth},
            capture_output=True,
            text=True,
            timeout=900,
        )
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
        assert latest_version(LocalStore(tmp_path / "store" / "tiny")) == 2
        # The actors ran in the head's session, not in a Ray instance this process started.
        sessions = list(ray_tmp.glob("session_*/logs/worker-*.out"))
        assert sessions, "no actor logs under the head's temp dir: the run did not use the given cluster"
    finally:
        os.killpg(head.pid, signal.SIGTERM)
        head.wait(timeout=60)
        shutil.rmtree(ray_tmp, ignore_errors=True)
