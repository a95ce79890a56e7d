"""Faults that stall a component without killing it, for the chaos suite (``benchmarks/chaos.py``).

Contract:

- :class:`FaultProxy`: a TCP proxy on loopback between a client and a server. ``pass`` forwards;
  ``partition`` forwards nothing either way (new connections are accepted and then hear nothing,
  what a client sees when packets are dropped), and on :meth:`heal` the connections it held are
  closed, as their TCP timers would have; ``slow`` answers every request ``delay_s`` late (the
  first bytes a client sends after the server spoke, or on a new connection, wait ``delay_s``).
- :class:`TmpfsHolder`: a private mount namespace (``unshare -m``) holding a tmpfs of ``size_mb`` on
  a directory, kept by a ``sleep`` process so that a server run inside it (:attr:`prefix`, an
  ``nsenter`` command) can be killed and restarted on the same data; :meth:`fill` writes a file
  until ``leave_mb`` is free (the disk is full for the server), :meth:`free` removes it.
- :class:`ClockShift`: a small preloaded library (``benchmarks/clockshift.c``) that adds the seconds
  in a file to the process's wall clock (``CLOCK_REALTIME``; the monotonic clock is untouched, as
  with a real NTP step), so :meth:`ClockShift.jump` steps that process's clock while it runs.
- :func:`freeze` / :func:`thaw`: SIGSTOP / SIGCONT to a process group.

Limits: loopback TCP only; the tmpfs holder needs ``unshare`` and ``nsenter`` and the right to make
a mount namespace (root); the clock shift needs ``cc``; each raises ``RuntimeError`` saying what is
missing. Statically linked programs (``weed``) ignore the clock shift.
"""

from __future__ import annotations

import contextlib
import os
import selectors
import shutil
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path


class FaultProxy:
    """A loopback TCP proxy to ``target_port`` that can partition or slow the path (module doc)."""

    def __init__(self, target_port: int, delay_s: float = 2.0) -> None:
        self.target_port, self.delay_s = target_port, delay_s
        self.mode = "pass"
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = int(self._listener.getsockname()[1])
        self._held: list[socket.socket] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        threading.Thread(target=self._accept, name=f"fault-proxy-{self.port}", daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def partition(self) -> None:
        self.mode = "partition"

    def slow(self) -> None:
        self.mode = "slow"

    def heal(self) -> None:
        """Back to ``pass``; connections held by a partition are closed."""
        self.mode = "pass"
        with self._lock:
            held, self._held = self._held, []
        for s in held:
            with contextlib.suppress(OSError):
                s.close()

    def close(self) -> None:
        self._stop.set()
        self.heal()
        self._listener.close()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        if self.mode == "partition":
            with self._lock:
                self._held.append(client)
            return
        try:
            upstream = socket.create_connection(("127.0.0.1", self.target_port), timeout=10)
        except OSError:
            client.close()
            return
        upstream.settimeout(None)
        self._pump(client, upstream)

    def _pump(self, client: socket.socket, upstream: socket.socket) -> None:
        sel = selectors.DefaultSelector()
        sel.register(client, selectors.EVENT_READ, upstream)
        sel.register(upstream, selectors.EVENT_READ, client)
        new_request = True
        try:
            while not self._stop.is_set():
                if self.mode == "partition":  # held silent until healed
                    with self._lock:
                        self._held += [client, upstream]
                    return
                for key, _ in sel.select(timeout=0.2):
                    src: socket.socket = key.fileobj  # type: ignore[assignment]
                    data = src.recv(1 << 16)
                    if not data:
                        raise ConnectionResetError
                    if src is client and new_request and self.mode == "slow":
                        time.sleep(self.delay_s)
                    new_request = src is upstream
                    key.data.sendall(data)
        except OSError:
            pass
        finally:
            sel.close()
            if self.mode != "partition":
                for s in (client, upstream):
                    with contextlib.suppress(OSError):
                        s.close()


class TmpfsHolder:
    """A tmpfs on ``path`` in a private mount namespace (module doc)."""

    def __init__(self, path: Path, size_mb: int) -> None:
        self.path = path
        path.mkdir(parents=True, exist_ok=True)
        for tool in ("unshare", "nsenter"):
            if shutil.which(tool) is None:
                raise RuntimeError(f"the full-disk fault needs `{tool}` (util-linux)")
        script = f"mount -t tmpfs -o size={size_mb}m tmpfs '{path}' && echo mounted && exec sleep infinity"
        self.proc = subprocess.Popen(
            ["unshare", "-m", "--propagation", "private", "sh", "-c", script],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
        assert self.proc.stdout is not None
        if self.proc.stdout.readline().strip() != b"mounted":
            err = self.proc.stderr.read().decode() if self.proc.stderr else ""
            self.proc.kill()
            raise RuntimeError(f"the full-disk fault cannot mount a tmpfs in a mount namespace here: {err}")

    @property
    def prefix(self) -> list[str]:
        """The command prefix that runs a program inside the namespace (seeing the tmpfs)."""
        return ["nsenter", "-t", str(self.proc.pid), "-m", "--"]

    @property
    def inside(self) -> Path:
        """``path`` as this process reaches the tmpfs (through the holder's root)."""
        return Path(f"/proc/{self.proc.pid}/root") / self.path.relative_to("/")

    def free_mb(self) -> int:
        return shutil.disk_usage(self.inside).free >> 20

    def fill(self, leave_mb: int) -> None:
        """Write ``<path>/filler`` until ``leave_mb`` MiB are free."""
        chunk = b"\0" * (1 << 20)
        with open(self.inside / "filler", "ab", buffering=0) as f, contextlib.suppress(OSError):  # ENOSPC
            for _ in range(max(0, self.free_mb() - leave_mb)):
                f.write(chunk)

    def free(self) -> None:
        (self.inside / "filler").unlink(missing_ok=True)

    def close(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)


class ClockShift:
    """A process's wall clock, shifted from the host's by the seconds in :attr:`file` (module doc):
    ``benchmarks/clockshift.c``, compiled with ``cc`` into ``where``, preloaded through :attr:`env`."""

    def __init__(self, where: Path, name: str) -> None:
        lib = where / "clockshift.so"
        if not lib.exists():
            if shutil.which("cc") is None:
                raise RuntimeError("the clock-jump fault compiles benchmarks/clockshift.c: install gcc")
            src = Path(__file__).with_name("clockshift.c")
            subprocess.run(
                ["cc", "-shared", "-fPIC", "-O2", "-o", str(lib), str(src), "-ldl"], check=True, timeout=60
            )
        self.file, self.offset_s = where / f"clock-{name}", 0
        self.file.write_text("0\n")
        self.env = {"LD_PRELOAD": str(lib), "CLOCKSHIFT_FILE": str(self.file)}

    def jump(self, seconds: int) -> None:
        """Step the clock by ``seconds`` (negative: back) from where it is."""
        self.offset_s += seconds
        tmp = self.file.with_suffix(".tmp")
        tmp.write_text(f"{self.offset_s}\n")
        tmp.replace(self.file)


@dataclass
class Frozen:
    """A frozen component: its ``pid``, whether its supervisor ``replaced`` it, and how to ``thaw`` it."""

    pid: int
    replaced: Callable[[], bool]
    thaw: Callable[[], None]


def freeze(pid: int) -> None:
    """SIGSTOP the process group of ``pid`` (every process of the component stops)."""
    os.killpg(pid, signal.SIGSTOP)


def thaw(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGCONT)
