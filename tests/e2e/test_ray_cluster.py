"""Given a Ray address, the same config joins that cluster: a token-authenticated head node this
test starts on loopback (127.0.0.2: Ray rewrites 127.0.0.1 to the outward interface), and in the
second test a worker node beside it (127.0.0.3) so a two-rank trainer is placed one rank per node.
The runs are `shipyard train` in processes of their own: Ray keeps a process's auth token for its
lifetime, so joining the token cluster in-process would break every later local `ray.init`."""

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
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


@contextmanager
def _cluster(tmp_path: Path, workers: int) -> Iterator[tuple[str, dict[str, str], Path]]:
    """A token-authenticated head on 127.0.0.2 and ``workers`` worker nodes on 127.0.0.3, ...: each
    node a ``ray start --block`` process of its own, 2 CPUs each; (address, auth env, temp dir)."""
    port = _free_port()
    ray_tmp = Path(tempfile.mkdtemp(prefix="ray", dir="/tmp"))  # short: Ray's socket paths cap at 107 bytes
    auth = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}
    common = ["--block", "--num-cpus=2", f"--temp-dir={ray_tmp}", "--disable-usage-stats"]
    nodes = [
        subprocess.Popen(
            [
                RAY,
                "start",
                "--head",
                f"--port={port}",
                f"--node-ip-address={HOST}",
                "--include-dashboard=false",
                *common,
            ],
            env={**os.environ, **auth},
            start_new_session=True,
            stdout=(tmp_path / "head.log").open("wb"),
            stderr=subprocess.STDOUT,
        )
    ]
    try:
        _wait_listening(port, deadline_s=120, log=tmp_path / "head.log")
        for i in range(workers):
            nodes.append(
                subprocess.Popen(
                    [RAY, "start", f"--address={HOST}:{port}", f"--node-ip-address=127.0.0.{3 + i}", *common],
                    env={**os.environ, **auth},
                    start_new_session=True,
                    stdout=(tmp_path / f"worker{i}.log").open("wb"),
                    stderr=subprocess.STDOUT,
                )
            )
        yield f"{HOST}:{port}", auth, ray_tmp
    finally:
        for node in reversed(nodes):
            os.killpg(node.pid, signal.SIGTERM)
            node.wait(timeout=60)
        shutil.rmtree(ray_tmp, ignore_errors=True)


def _shipyard_train(
    tmp_path: Path, address: str, auth: dict[str, str], *overrides: str
) -> subprocess.CompletedProcess:
    shipyard = str(Path(sys.executable).with_name("shipyard"))
    args = [
        "run.placement=ray",
        f'run.ray_address="{address}"',
        f'run.output_dir="{tmp_path}"',
        f'store.root="{tmp_path / "store"}"',
        *overrides,
    ]
    return subprocess.run(
        [shipyard, "train", str(ROOT / "configs/tiny.toml"), *args],
        env={**os.environ, **auth},
        capture_output=True,
        text=True,
        timeout=900,
    )


def _wait_nodes(address: str, auth: dict[str, str], count: int, deadline_s: float = 120) -> None:
    probe = "import ray; ray.init(address='%s', _node_ip_address='%s'); print(len([n for n in ray.nodes() if n['Alive']]))"
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        out = subprocess.run(
            [sys.executable, "-c", probe % (address, HOST)],
            env={**os.environ, **auth},
            capture_output=True,
            text=True,
        )
        if out.stdout.strip().endswith(str(count)):
            return
        time.sleep(2)
    raise AssertionError(f"the cluster at {address} did not reach {count} nodes within {deadline_s}s")


@pytest.mark.slow
def test_two_rank_trainer_spans_two_nodes(tmp_path: Path) -> None:
    with _cluster(tmp_path, workers=1) as (address, auth, _):
        _wait_nodes(address, auth, 2)
        run = _shipyard_train(
            tmp_path,
            address,
            auth,
            "trainer.steps=3",
            "trainer.world_size=2",
            'trainer.placement_strategy="STRICT_SPREAD"',
        )
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
        summary = json.loads((tmp_path / "tiny/summary.json").read_text())
        assert summary["trainer"]["world_size"] == 2 and summary["trainer"]["final_version"] == 3
        assert len(set(summary["trainer"]["nodes"])) == 2  # one rank on each node
        assert latest_version(LocalStore(tmp_path / "store" / "tiny")) == 3
        too_big = _shipyard_train(tmp_path / "big", address, auth, "trainer.world_size=8")
        assert too_big.returncode != 0
        assert "trainer.world_size=8 needs 8 CPU" in too_big.stdout + too_big.stderr
