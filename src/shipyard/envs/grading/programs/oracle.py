"""The oracle: runs in the solution sandbox and answers calls with what the solution did (stdlib only).

Contract: reads requests from the runner over a pipe; for each test it forks a fresh child that
imports the solution and answers each call with the value returned, the exception raised or the
fact that the child died, as plain data (``wire.py``). Untrusted code runs only in the children.
Shipped into the sandbox as source after ``wire.py`` and run with ``python -I -c``
(:func:`shipyard.envs.grading.grader.program_source`); its entry point is :func:`_oracle_main`.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import inspect
import json
import os
import select
import signal
import sys
from typing import Any

from shipyard.envs.grading.programs.wire import (  # outside the sandbox only: there wire.py comes first
    MAX_MESSAGE_BYTES,
    _decode,
    _encode,
)


def _oracle_handle(req: dict[str, Any]) -> dict[str, Any]:
    """Answer one request in the solution's child process (untrusted territory from here on)."""
    rid = req.get("id")
    try:
        module = importlib.import_module(req["mod"])
        if req["op"] == "names":
            return {"id": rid, "names": _public_names(module)}
        value = getattr(module, req["name"])
        if req["op"] == "attr":
            return {"id": rid, "callable": True} if callable(value) else {"id": rid, "value": _encode(value)}
        args = _decode(req["args"])
        kwargs = _decode(req["kwargs"])
        assert isinstance(args, list) and isinstance(kwargs, dict)
        result = value(*args, **kwargs)
        return {"id": rid, "value": _encode(result), "args": _encode(args), "kwargs": _encode(kwargs)}
    except BaseException as exc:  # the solution's exception (or exit) is the answer
        try:
            message = str(exc)[:2000]
        except BaseException:
            message = "<unprintable>"
        return {"id": rid, "raise": [type(exc).__name__, message]}


def _public_names(module: Any) -> list[str]:
    """What ``from module import *`` would bind that can cross: its own callables and plain data."""
    names = getattr(module, "__all__", None)
    if not isinstance(names, list | tuple):
        names = [n for n in vars(module) if not n.startswith("_")]
    out = []
    for name in names:
        value = getattr(module, str(name), None)
        if callable(value) and getattr(value, "__module__", None) == module.__name__:
            out.append(str(name))
        elif not callable(value) and not inspect.ismodule(value):
            with contextlib.suppress(Exception):
                _encode(value)
                out.append(str(name))
    return out


def _oracle_child(rfd: int, wfd: int) -> None:
    """Serve requests from ``rfd`` until EOF; the workspace is importable from here on."""
    sys.path.insert(0, "/workspace")
    buf = b""
    while True:
        data = os.read(rfd, 65536)
        if not data:
            os._exit(0)
        buf += data
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            try:
                answer = json.dumps(_oracle_handle(json.loads(line))).encode() + b"\n"
            except BaseException as exc:
                answer = (
                    json.dumps({"id": None, "raise": [type(exc).__name__, "unanswerable"]}).encode() + b"\n"
                )
            view = memoryview(answer)
            while view:
                view = view[os.write(wfd, view) :]


class _Oracle:
    """Parent process of the solution sandbox: forwards requests to a child forked per test."""

    def __init__(self, pin: int, pout: int) -> None:
        self.pin, self.pout = pin, pout
        self.inbuf = bytearray()
        self.outbuf = bytearray()
        self.child: list[Any] | None = None  # [pid, to_child_fd, from_child_fd, to_child_buffer, from_buffer]
        self.outstanding: object = None

    def fork(self) -> None:
        r1, w1 = os.pipe()
        r2, w2 = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.setpgid(0, 0)
            for fd in (self.pin, self.pout, w1, r2):
                os.close(fd)
            _oracle_child(r1, w2)
            os._exit(0)
        os.close(r1)
        os.close(w2)
        os.set_blocking(w1, False)
        with contextlib.suppress(OSError):
            os.setpgid(pid, pid)
        self.child = [pid, w1, r2, bytearray(), bytearray()]

    def drop(self) -> None:
        if self.child is not None:
            pid, w1, r2 = self.child[:3]
            with contextlib.suppress(OSError):
                os.killpg(pid, signal.SIGKILL)
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)
            os.close(w1)
            os.close(r2)
            self.child = None

    def request(self, line: bytes) -> None:
        try:
            msg = json.loads(line)
        except ValueError:
            return
        if not isinstance(msg, dict):
            return
        if msg.get("op") == "begin":
            self.drop()
            self.outstanding = None
            return
        if self.child is None:
            self.fork()
        assert self.child is not None
        self.outstanding = msg.get("id")
        self.child[3] += line + b"\n"

    def child_output(self) -> None:
        """Forward the child's complete answer lines; on EOF reap it and report the pending call."""
        assert self.child is not None
        data = os.read(self.child[2], 65536)
        if not data:
            pid, w1, r2 = self.child[:3]
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)
            os.close(w1)
            os.close(r2)
            self.child = None
            if self.outstanding is not None:
                self.outbuf += json.dumps({"id": self.outstanding, "died": True}).encode() + b"\n"
                self.outstanding = None
            return
        self.child[4] += data
        if b"\n" in self.child[4]:
            head, _, rest = bytes(self.child[4]).rpartition(b"\n")
            self.outbuf += head + b"\n"
            self.child[4] = bytearray(rest)
            self.outstanding = None
        if len(self.child[4]) > MAX_MESSAGE_BYTES or len(self.outbuf) > 4 * MAX_MESSAGE_BYTES:
            self.drop()

    def step(self) -> bool:
        """One round of the event loop; False once the runner has gone (stdin closed)."""
        rd = [self.pin] + ([self.child[2]] if self.child else [])
        wr = ([self.child[1]] if self.child and self.child[3] else []) + ([self.pout] if self.outbuf else [])
        readable, writable, _ = select.select(rd, wr, [])
        if self.pout in writable:
            del self.outbuf[: os.write(self.pout, self.outbuf[:65536])]
        if self.child and self.child[1] in writable:
            with contextlib.suppress(BlockingIOError, BrokenPipeError):
                del self.child[3][: os.write(self.child[1], self.child[3][:65536])]
        if self.child and self.child[2] in readable:
            self.child_output()
        if self.pin in readable:
            data = os.read(self.pin, 65536)
            if not data:
                return False
            self.inbuf += data
            while b"\n" in self.inbuf:
                line, _, rest = bytes(self.inbuf).partition(b"\n")
                self.inbuf = bytearray(rest)
                self.request(line)
        return True


def _oracle_main() -> None:
    """Solution-sandbox entry: fd 0 brings the runner's requests, fd 1 takes the answers."""
    sys.set_int_max_str_digits(0)
    sys.dont_write_bytecode = True  # ``-I`` ignores PYTHONDONTWRITEBYTECODE
    pin, pout = os.dup(0), os.dup(1)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(2, 1)  # whatever the solution prints goes to stderr, never into the answers
    os.set_blocking(pout, False)
    oracle = _Oracle(pin, pout)
    try:
        while oracle.step():
            pass
    finally:
        oracle.drop()
