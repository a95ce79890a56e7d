"""Host side of a sandboxed process: bounded output capture, pumping stdin/stdout/stderr to a deadline,
killing a process group, draining pipes.

Contract: :class:`_Capture` keeps the head and tail of a stream within ``OUTPUT_CAP`` bytes; :func:`_pump`
feeds stdin and reads both streams until the process ends or ``deadline`` passes (then reports a
timeout); :func:`_kill_group` SIGKILLs a process's whole group. Used by :mod:`.bwrap` and :mod:`.session`.
"""

from __future__ import annotations

import contextlib
import os
import selectors
import signal
import subprocess
import time

OUTPUT_CAP = 64 * 1024
"""Bytes of stdout (and separately stderr) kept per exec: the first and last halves."""


class _Capture:
    """Keeps the first and last ``cap // 2`` bytes of a stream and counts what was cut between."""

    def __init__(self, cap: int) -> None:
        self.head_cap = cap // 2
        self.tail_cap = cap - self.head_cap
        self.head = bytearray()
        self.tail = bytearray()
        self.total = 0

    def add(self, data: bytes) -> None:
        self.total += len(data)
        room = self.head_cap - len(self.head)
        if room > 0:
            self.head += data[:room]
            data = data[room:]
        if data:
            self.tail += data
            if len(self.tail) > 2 * self.tail_cap:
                del self.tail[: len(self.tail) - self.tail_cap]

    def text(self) -> str:
        tail = bytes(self.tail[-self.tail_cap :]) if self.tail_cap else b""
        cut = self.total - len(self.head) - len(tail)
        mid = f"\n[... {cut} bytes truncated ...]\n".encode() if cut > 0 else b""
        return (bytes(self.head) + mid + tail).decode("utf-8", errors="replace")


def _pump(proc: subprocess.Popen[bytes], stdin: bytes | None, deadline: float) -> tuple[str, str, bool]:
    """Feed stdin, drain stdout/stderr (capped) until both close or the deadline passes."""
    assert proc.stdout is not None and proc.stderr is not None
    caps = {proc.stdout.fileno(): _Capture(OUTPUT_CAP), proc.stderr.fileno(): _Capture(OUTPUT_CAP)}
    sel = selectors.DefaultSelector()
    for f in (proc.stdout, proc.stderr):
        os.set_blocking(f.fileno(), False)
        sel.register(f.fileno(), selectors.EVENT_READ)
    pending = memoryview(stdin or b"")
    if proc.stdin is not None:
        os.set_blocking(proc.stdin.fileno(), False)
        if pending:
            sel.register(proc.stdin.fileno(), selectors.EVENT_WRITE)
        else:
            proc.stdin.close()
    timed_out = False
    reading = 2
    while reading:
        left = deadline - time.monotonic()
        if left <= 0 and not timed_out:
            timed_out = True
            _kill_group(proc)
            deadline = time.monotonic() + 5.0  # the pid namespace is gone; drain what is buffered
            continue
        if left <= 0:
            break
        for key, _ in sel.select(timeout=min(left, 1.0)):
            fd = key.fd
            if fd in caps:
                chunk = os.read(fd, 65536)
                if chunk:
                    caps[fd].add(chunk)
                else:
                    sel.unregister(fd)
                    reading -= 1
            else:
                assert proc.stdin is not None
                try:
                    pending = pending[os.write(fd, pending[:65536]) :]
                except BrokenPipeError:
                    pending = pending[:0]
                if not pending:
                    sel.unregister(fd)
                    proc.stdin.close()
    sel.close()
    out, err = caps[proc.stdout.fileno()].text(), caps[proc.stderr.fileno()].text()
    return out, err, timed_out


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)


def _drain(fd: int, sink: _Capture | None) -> None:
    """Read a non-blocking fd until it is empty (EOF or EAGAIN), into ``sink`` or nowhere."""
    while True:
        try:
            chunk = os.read(fd, 65536)
        except BlockingIOError:
            return
        except OSError:
            return
        if not chunk:
            return
        if sink is not None:
            sink.add(chunk)
