"""The persistent command session of a bubblewrap sandbox: the host ends of the command server's pipes.

Contract: :class:`_Session` sends one command at a time to the server running inside the sandbox
(:data:`shipyard.envs.sandbox.bwrap._SERVER`), reads its output and status with the deadline of
the command, and reports a protocol error, a timeout or a dead server; ``alive()`` says whether it
can take another command.
"""

from __future__ import annotations

import contextlib
import math
import os
import selectors
import subprocess
import threading
import time

from shipyard.envs.sandbox.process import OUTPUT_CAP, _Capture, _drain, _kill_group

_STATUS_CAP = 256


class _Session:
    """A running command server (:data:`_SERVER`) and the host ends of its pipes."""

    def __init__(self, proc: subprocess.Popen[bytes], cmd_w: int, out_r: int, err_r: int, st_r: int) -> None:
        self.proc, self.cmd_w, self.out_r, self.err_r, self.st_r = proc, cmd_w, out_r, err_r, st_r
        for fd in (cmd_w, out_r, err_r, st_r):
            os.set_blocking(fd, False)
        self.seq = 0
        self.owner = threading.current_thread()
        """The thread that started the session: bwrap's ``--die-with-parent`` ends it with that thread."""
        self.answered = False
        """Whether the server has answered a command (so, for ``base``, the overlay is mounted)."""

    def alive(self) -> bool:
        """Running, and not about to die with the thread that started it."""
        return self.proc.poll() is None and self.owner.is_alive()

    def kill(self, graceful: bool = False) -> None:
        """End the session; ``graceful``: close its command pipe and let it exit (so every process
        is reaped by its parent and its CPU time is accounted to us), killing it after 1 s."""
        if graceful and self.alive():
            os.close(self.cmd_w)
            self.cmd_w = -1
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=1.0)
        _kill_group(self.proc)
        self.proc.wait()
        for fd in (self.cmd_w, self.out_r, self.err_r, self.st_r):
            if fd >= 0:
                os.close(fd)
        self.cmd_w = self.out_r = self.err_r = self.st_r = -1

    def run(self, cmd: bytes, timeout: float) -> tuple[int | None, str, str, str]:
        """(exit status or None, stdout, stderr, problem): problem is '' or 'timeout'/'died'/'protocol'."""
        deadline = time.monotonic() + timeout
        _drain(self.out_r, None)  # bytes a killed background job wrote after the last status
        _drain(self.err_r, None)
        self.seq += 1
        lines = cmd.count(b"\n") + 1
        pending = memoryview(f"{self.seq} {lines} {math.ceil(timeout) + 1}\n".encode() + cmd + b"\n")
        caps = {self.out_r: _Capture(OUTPUT_CAP), self.err_r: _Capture(OUTPUT_CAP)}
        status = bytearray()
        sel = selectors.DefaultSelector()
        for fd in (self.out_r, self.err_r, self.st_r):
            sel.register(fd, selectors.EVENT_READ)
        sel.register(self.cmd_w, selectors.EVENT_WRITE)
        problem = ""
        try:
            while b"\n" not in status and not problem:
                left = deadline - time.monotonic()
                if left <= 0:
                    problem = "timeout"
                    break
                for key, _ in sel.select(timeout=min(left, 1.0)):
                    if key.fd == self.cmd_w:
                        pending = self._feed(pending)
                        if not pending:
                            sel.unregister(self.cmd_w)
                    elif not self._read_into(key.fd, caps.get(key.fd), status):
                        problem = "died"
                if len(status) > _STATUS_CAP:
                    problem = "protocol"
        finally:
            sel.close()
        for fd, cap in caps.items():
            _drain(fd, cap)
        out, err = caps[self.out_r].text(), caps[self.err_r].text()
        problem = problem or self._check(bytes(status))
        self.answered = self.answered or not problem
        return self._status(bytes(status), problem), out, err, problem

    def _feed(self, pending: memoryview) -> memoryview:
        try:
            return pending[os.write(self.cmd_w, pending[:65536]) :]
        except BlockingIOError:
            return pending
        except BrokenPipeError:
            return pending[:0]

    def _read_into(self, fd: int, cap: _Capture | None, status: bytearray) -> bool:
        """Read what ``fd`` has into its capture (or the status buffer); False on EOF."""
        try:
            chunk = os.read(fd, 65536)
        except BlockingIOError:
            return True
        if not chunk:
            return False
        if cap is not None:
            cap.add(chunk)
        else:
            status += chunk
        return True

    def _status(self, status: bytes, problem: str) -> int | None:
        parts = status.split(b"\n", 1)[0].split()
        if problem or len(parts) != 2 or not parts[1].isdigit():
            return None
        return int(parts[1])

    def _check(self, status: bytes) -> str:
        parts = status.split(b"\n", 1)[0].split()
        ok = len(parts) == 2 and parts[0] == str(self.seq).encode() and parts[1].isdigit()
        return "" if ok and status.endswith(b"\n") and status.count(b"\n") == 1 else "protocol"
