"""A real multi-node Ray cluster on this machine's loopback: one head and N worker nodes, each a
``ray start --block`` process of its own, token-authenticated.

Contract: :func:`loopback_cluster` starts the head on 127.0.0.2 (Ray rewrites 127.0.0.1 to the
outward interface) and worker node ``i`` on 127.0.0.(3+i), each with ``cpus`` CPUs, waits until
all of them are alive, yields a :class:`LoopbackCluster` (its ``address`` for ``run.ray_address``
and the ``env`` a driver needs: the auth token), and on exit stops every node (its whole process
session) and removes Ray's temporary directory. For the tests and benchmarks of multi-node
placement, and to try a multi-node config on one box before a real cluster.
Limits: every node shares this machine's CPUs and file system; Linux only (the 127/8 loopback).
"""

from __future__ import annotations

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
from dataclasses import dataclass
from pathlib import Path

HEAD_HOST = "127.0.0.2"


@dataclass(frozen=True)
class LoopbackCluster:
    address: str
    """``host:port`` of the head (``run.ray_address``)."""
    env: dict[str, str]
    """Environment a driver joining the cluster needs (``RAY_AUTH_MODE``, ``RAY_AUTH_TOKEN``)."""
    temp_dir: Path
    """Ray's temporary directory (session logs: ``session_*/logs``)."""


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _wait_listening(host: str, port: int, deadline_s: float, log: Path) -> None:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        with socket.socket() as s:
            if s.connect_ex((host, port)) == 0:
                return
        time.sleep(0.5)
    tail = log.read_text(errors="replace")[-3000:]
    raise TimeoutError(f"the ray head did not listen on {host}:{port} within {deadline_s}s:\n{tail}")


def alive_nodes(address: str, env: dict[str, str]) -> int:
    """How many nodes of the cluster at ``address`` are alive (asked from a fresh process: Ray keeps
    a process's cluster and token for its lifetime)."""
    host = address.rsplit(":", 1)[0]
    probe = (
        f"import ray; ray.init(address={address!r}, _node_ip_address={host!r}, log_to_driver=False); "
        "print(sum(n['Alive'] for n in ray.nodes()))"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], env={**os.environ, **env}, capture_output=True, text=True, timeout=120
    )
    lines = out.stdout.strip().splitlines()
    return int(lines[-1]) if lines and lines[-1].isdigit() else 0


@contextmanager
def loopback_cluster(
    workers: int, log_dir: Path, cpus: int = 2, deadline_s: float = 180
) -> Iterator[LoopbackCluster]:
    """A head and ``workers`` worker nodes (module doc); logs in ``log_dir``."""
    ray = str(Path(sys.executable).with_name("ray"))
    port = _free_port(HEAD_HOST)
    temp_dir = Path(tempfile.mkdtemp(prefix="ray", dir="/tmp"))  # short: Ray's socket paths cap at 107 bytes
    env = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}
    common = ["--block", f"--num-cpus={cpus}", f"--temp-dir={temp_dir}", "--disable-usage-stats"]
    log_dir.mkdir(parents=True, exist_ok=True)
    nodes: list[subprocess.Popen] = []

    def start(name: str, args: list[str]) -> None:
        nodes.append(
            subprocess.Popen(
                [ray, "start", *args, *common],
                env={**os.environ, **env},
                start_new_session=True,  # the node and all it starts live in a session of their own
                stdout=(log_dir / f"{name}.log").open("wb"),
                stderr=subprocess.STDOUT,
            )
        )

    try:
        start(
            "head",
            ["--head", f"--port={port}", f"--node-ip-address={HEAD_HOST}", "--include-dashboard=false"],
        )
        _wait_listening(HEAD_HOST, port, deadline_s, log_dir / "head.log")
        address = f"{HEAD_HOST}:{port}"
        for i in range(workers):
            start(f"worker{i}", [f"--address={address}", f"--node-ip-address=127.0.0.{3 + i}"])
        end = time.monotonic() + deadline_s
        while alive_nodes(address, env) < 1 + workers:
            if time.monotonic() > end:
                raise TimeoutError(
                    f"the cluster at {address} did not reach {1 + workers} nodes in {deadline_s}s"
                )
            time.sleep(2)
        yield LoopbackCluster(address, env, temp_dir)
    finally:
        for node in reversed(nodes):
            os.killpg(node.pid, signal.SIGTERM)
            node.wait(timeout=60)
        shutil.rmtree(temp_dir, ignore_errors=True)
