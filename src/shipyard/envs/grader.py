"""Grade a session's final workspace against a task's hidden tests, so that the graded code cannot forge its result.

Contract: :func:`grade` never runs anything in the session's sandbox. It splits every grading
across two fresh :class:`~shipyard.envs.sandbox.BwrapSandbox` instances that share nothing but
two pipes:

- the *solution sandbox* holds the final files minus everything that could steer a test run
  (:func:`agent_controlled`: ``conftest.py`` anywhere, ini/config files,
  ``sitecustomize.py``/``usercustomize.py``, ``*.pth``, a top-level ``__init__.py``, the test
  files the harness and grader write, anything under ``test_hidden/``, ``pytest/`` or
  ``_pytest/``) and runs an *oracle* (:func:`_oracle_main`): for every request it gets, it
  imports the solution in a child process forked fresh for each test and answers with the value
  a function returned, the exception it raised or the fact that it died, as plain data
  (:func:`_encode`: None, bool, int, float, complex, str, bytes, bytearray, list, tuple, dict,
  set, frozenset, nested; subclasses and numpy scalars become their base type);
- the *test sandbox* holds only the hidden tests and runs our *runner* (:func:`_runner_main`,
  a small test runner, not pytest: no plugins, conftest or ini files exist for it to read).
  It imports ``test_hidden.py``; the workspace's modules (``solution`` and every top-level
  module or package among the files, when no installed module has that name) are proxies whose
  functions send their arguments to the oracle and return its answer decoded
  (:func:`_decode`, strict and bounded). Each expected test then runs in a fresh oracle child;
  its outcome is written by the runner to ``/grader/report.jsonl``, a host directory made fresh
  for this grading that only the test sandbox mounts.

So no agent code ever runs where the verdict is computed: writing the report, patching pytest or
``builtins``, exiting early, ``atexit`` hooks, always-equal objects (they cannot cross the pipe)
and reading the hidden tests (not in the solution sandbox) all leave the verdict alone; the
oracle can only answer wrong. (A runner in the process that imported the solution cannot keep
anything from it: fds, nonces and the runner's own code are all reachable through ``gc``,
``/proc/self`` or monkeypatching, hence the split.) A solution-side exit, crash or hang fails the current test
through :class:`_BridgeFailure`, a ``BaseException`` that test code catching ``Exception``
cannot swallow; a later test gets a new child. Solution exceptions are re-raised as the builtin
exception of the same name (so ``pytest.raises(ValueError)`` works) or :class:`_RemoteError`.
Arguments the solution mutates in place (list, dict, set, bytearray) are written back.

Files matching ``task.protected`` are then put back exactly as ``task.files`` has them
(:func:`restore_protected`: edits undone, deletions restored, additions dropped).

The reward is ``passed / expected`` where ``expected`` is the set of top-level ``test*``
functions of the hidden tests (found with :mod:`ast`); a test passes when every case of it
(``pytest.mark.parametrize`` is expanded) is reported passed; unreported, failed, errored or
skipped counts as failed. ``details["tests"]`` maps each expected test to its outcome
(``passed``/``failed``/``error``/``skipped``/``missing``) and duration; ``details`` also holds
``returncode`` (the runner's), ``duration_s``, ``dropped_files``, ``log_tail`` (runner output,
then the solution's stderr) and, when something went wrong as a whole, ``reason``
(``timeout: ...``, ``collection error: ...``, ``crash: ...``). Each call has
``max(MIN_CALL_S, cfg.timeout_s / (tests + 1))`` seconds; the whole run ``cfg.timeout_s``
(tests reported before a timeout keep their credit).

The runner supports plain ``assert`` tests, ``async def`` tests, ``pytest.raises``/``approx``
(pytest is importable), ``pytest.mark.parametrize`` and ``skip``/``skipif(True)`` marks.

Limits: entry points must take and return plain data (objects, callbacks and generators cannot
cross; classes defined in the solution cannot be used as exception types or instantiated into
usable objects); fixtures are not provided (a test asking for one is an ``error``); assertion
messages are not rewritten as pytest would (the log shows less detail); a workspace module that
shadows an installed module of the same name is not proxied (the installed one is imported);
module-level state does not survive from one test to the next (fresh child per test). All 60
generated families' and all 164 HumanEval references pass. Grading costs two sandbox starts,
two Python starts and a fork plus solution import per test: about 0.2 s here (2 loaded cores),
against about 0.45 s for the pytest run it replaces.

Example::

    res = grade(task, {"solution.py": task.reference}, SandboxConfig())
    assert res.reward == 1.0 and res.passed == res.total
"""

from __future__ import annotations

import ast
import base64
import builtins
import contextlib
import fnmatch
import functools
import importlib
import importlib.util
import inspect
import json
import os
import select
import shlex
import shutil
import signal
import stat
import sys
import tempfile
import textwrap
import time
import traceback
from collections.abc import Callable
from typing import Any

from shipyard.config.schema import SandboxConfig
from shipyard.envs.sandbox import BwrapSandbox
from shipyard.envs.types import RewardResult, Task

HIDDEN_FILE = "test_hidden.py"
"""Name the hidden tests get in the test sandbox."""
REPORT_DIR = "/grader"
"""Test-sandbox path of the fresh per-grading directory that receives the runner's report."""
MAX_REPORT_BYTES = 2 * 1024 * 1024
"""A report larger than this is rejected (reward 0)."""
LOG_TAIL_CHARS = 2000
"""Characters of the runner's (and then the solution's) output kept in ``details["log_tail"]``."""
MIN_CALL_S = 2.0
"""Least time one call into the solution may take before it fails its test."""
MAX_MESSAGE_BYTES = 8 * 1024 * 1024
"""Largest single answer the runner accepts from the oracle."""
MAX_DEPTH = 200
"""Deepest nesting of a value sent between the two sandboxes."""

_BLOCKED_NAMES = frozenset(
    {
        "conftest.py",
        "pytest.ini",
        ".pytest.ini",
        "tox.ini",
        "setup.cfg",
        "pyproject.toml",
        "sitecustomize.py",
        "usercustomize.py",
        HIDDEN_FILE,
        "test_visible.py",
    }
)
_HIDDEN_MODULE = HIDDEN_FILE.removesuffix(".py")
_OUTCOMES = ("passed", "failed", "error", "skipped", "missing")


def agent_controlled(path: str) -> bool:
    """True for workspace files the grader drops before grading (they could steer a test run)."""
    parts = [p for p in path.replace("\\", "/").split("/") if p not in ("", ".")]
    if not parts:
        return True
    if parts == ["__init__.py"] or parts[0] in (_HIDDEN_MODULE, "_pytest", "pytest"):
        return True  # would make the workspace a package or shadow the hidden tests / pytest
    return parts[-1] in _BLOCKED_NAMES or parts[-1].endswith(".pth")


def restore_protected(task: Task, files: dict[str, str]) -> dict[str, str]:
    """``files`` with every path matching ``task.protected`` (globs, ``*`` crosses ``/``) exactly as in
    ``task.files``: edited ones restored, deleted ones put back, new ones dropped."""
    if not task.protected:
        return files
    hit = functools.partial(_matches_any, task.protected)
    out = {p: c for p, c in files.items() if not hit(p)}
    out.update({p: c for p, c in task.files.items() if hit(p) and not agent_controlled(p)})
    return out


def _matches_any(patterns: list[str], path: str) -> bool:
    return any(fnmatch.fnmatch(path, pat) for pat in patterns)


def expected_tests(hidden_tests: str) -> list[str]:
    """Names of the top-level ``test*`` functions of a hidden-test module, in source order."""
    try:
        tree = ast.parse(hidden_tests)
    except SyntaxError as exc:
        raise ValueError(f"task.hidden_tests is not valid Python ({exc}); fix the task's test code") from exc
    names = [
        node.name
        for node in tree.body
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name.startswith("test")
    ]
    return list(dict.fromkeys(names))


def workspace_modules(files: dict[str, str]) -> list[str]:
    """Top-level modules the files provide (``x.py``, ``pkg/...``) plus ``solution``, sorted."""
    names = {"solution"}
    for path in files:
        parts = [p for p in path.replace("\\", "/").split("/") if p not in ("", ".")]
        if len(parts) == 1 and parts[0].endswith(".py"):
            names.add(parts[0].removesuffix(".py"))
        elif len(parts) > 1:
            names.add(parts[0])
    return sorted(n for n in names if n.isidentifier())


def grade(task: Task, files: dict[str, str], cfg: SandboxConfig) -> RewardResult:
    """Run ``task.hidden_tests`` against ``files`` in two fresh sandboxes; see the module contract."""
    expected = expected_tests(task.hidden_tests)
    if not expected:
        raise ValueError(f"task {task.id!r} has no top-level test_* functions in hidden_tests; add some")
    workspace = restore_protected(task, {p: c for p, c in files.items() if not agent_controlled(p)})
    dropped = sorted(set(files) - set(workspace))
    report_dir = tempfile.mkdtemp(prefix=f"shipyard-grade-{os.getpid()}-")
    try:
        res, solution_log = _run_split(task, workspace, expected, cfg, report_dir)
        details: dict[str, Any] = {
            "returncode": res.returncode,
            "duration_s": round(res.duration_s, 3),
            "dropped_files": dropped,
            "log_tail": _tail(res.stdout + res.stderr, solution_log),
        }
        lines, problem = _read_report(os.path.join(report_dir, "report.jsonl"))
    finally:
        shutil.rmtree(report_dir, ignore_errors=True)
    outcomes, collect_error = _outcomes(lines, expected)
    details["tests"] = outcomes
    if res.timed_out:
        details["reason"] = f"timeout: the hidden tests ran longer than {cfg.timeout_s} s"
    elif collect_error is not None:
        details["reason"] = f"collection error: {collect_error}"
    elif problem:
        details["reason"] = f"crash: {problem} (runner exit code {res.returncode})"
    passed = sum(1 for o in outcomes.values() if o["outcome"] == "passed")
    return RewardResult(reward=passed / len(expected), passed=passed, total=len(expected), details=details)


def _tail(runner_log: str, solution_log: str) -> str:
    half = LOG_TAIL_CHARS // 2
    if not solution_log:
        return runner_log[-LOG_TAIL_CHARS:]
    return runner_log[-half:] + "\n[solution stderr]\n" + solution_log[-half:]


def _run_split(
    task: Task, workspace: dict[str, str], expected: list[str], cfg: SandboxConfig, report_dir: str
) -> tuple[Any, str]:
    """Start the oracle over ``workspace`` and run the runner over the hidden tests against it."""
    req_r, req_w = os.pipe()
    resp_r, resp_w = os.pipe()
    open_fds = {req_r, req_w, resp_r, resp_w}

    def close(*fds: int) -> None:
        for fd in fds:
            if fd in open_fds:
                open_fds.discard(fd)
                os.close(fd)

    runner_cfg = {
        "req_fd": req_w,
        "resp_fd": resp_r,
        "call_s": max(MIN_CALL_S, cfg.timeout_s / (len(expected) + 1)),
        "modules": workspace_modules(workspace),
        "expected": expected,
        "tests": f"/workspace/{HIDDEN_FILE}",
        "report": f"{REPORT_DIR}/report.jsonl",
    }
    runner = f"python -I -c {shlex.quote(_script('runner'))} {shlex.quote(json.dumps(runner_cfg))}"
    try:
        with (
            tempfile.TemporaryFile() as log,
            BwrapSandbox(workspace, cfg, persistent=False) as solution_box,
            BwrapSandbox(
                {HIDDEN_FILE: task.hidden_tests}, cfg, binds={report_dir: REPORT_DIR}, persistent=False
            ) as test_box,
        ):
            oracle = f"python -I -c {shlex.quote(_script('oracle'))}"
            solution_box.spawn(oracle, stdin=req_r, stdout=resp_w, stderr=log)
            close(req_r, resp_w)
            res = test_box.exec(runner, timeout_s=cfg.timeout_s, pass_fds=(req_w, resp_r))
            close(req_w, resp_r)
            solution_box.close()
            log.seek(max(0, os.fstat(log.fileno()).st_size - LOG_TAIL_CHARS))
            solution_log = log.read().decode("utf-8", errors="replace")
    finally:
        close(*list(open_fds))
    return res, solution_log


def _read_report(path: str) -> tuple[list[dict[str, Any]], str]:
    """The runner's report lines (a regular file, not a link, bounded size) or why there are none."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return [], "the test runner wrote no report (it died or could not start)"
    except OSError as exc:
        return [], f"report unreadable: {exc}"
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            return [], "report is not a regular file"
        data = f.read(MAX_REPORT_BYTES + 1)
    if len(data) > MAX_REPORT_BYTES:
        return [], f"report larger than {MAX_REPORT_BYTES} bytes"
    lines = []
    for raw in data.splitlines():
        with contextlib.suppress(ValueError):
            item = json.loads(raw)
            if isinstance(item, dict):
                lines.append(item)
    return lines, ""


def _outcomes(
    lines: list[dict[str, Any]], expected: list[str]
) -> tuple[dict[str, dict[str, Any]], str | None]:
    """Per expected test: ``passed`` only if every reported case of it passed; and any collection error."""
    out: dict[str, dict[str, Any]] = {name: {"outcome": "missing", "time_s": 0.0} for name in expected}
    collect_error = None
    for line in lines:
        if "collect_error" in line:
            collect_error = str(line["collect_error"])[:500]
            continue
        prev = out.get(str(line.get("test")))
        outcome = line.get("outcome")
        if prev is None or outcome not in _OUTCOMES:
            continue
        if prev["outcome"] in ("missing", "passed"):
            prev["outcome"] = outcome
        seconds = line.get("time_s")
        prev["time_s"] = round(prev["time_s"] + (seconds if isinstance(seconds, float) else 0.0), 4)
    return out, collect_error


# ------------------------------------------------------------------------------------------------
# Code that runs inside the sandboxes. Stdlib only, no reference to anything above this line but
# the constants passed in by _script(): it is shipped as source (inspect.getsource) and run with
# ``python -I -c``. The oracle runs in the solution sandbox, the runner in the test sandbox.
# ------------------------------------------------------------------------------------------------


def _encode(value: object, depth: int = 0) -> object:
    """Plain data -> JSON-ready tagged form; TypeError for anything that is not plain data."""
    if depth > MAX_DEPTH:
        raise ValueError(f"value nested deeper than {MAX_DEPTH} levels")
    if value is None or type(value) in (bool, int, float, str):
        return value
    if type(value).__module__ == "numpy" and hasattr(value, "item") and not hasattr(value, "__len__"):
        return _encode(value.item(), depth + 1)  # numpy scalar
    for container, tag in ((list, "l"), (tuple, "t"), (set, "s"), (frozenset, "z")):
        if isinstance(value, container):
            return {tag: [_encode(v, depth + 1) for v in container.__iter__(value)]}
    if isinstance(value, dict):
        return {"d": [[_encode(k, depth + 1), _encode(v, depth + 1)] for k, v in dict.items(value)]}
    if isinstance(value, bytes | bytearray):
        tag = "a" if isinstance(value, bytearray) else "b"
        return {tag: base64.b64encode(bytes(value)).decode()}
    if isinstance(value, complex):
        return {"c": [complex(value).real, complex(value).imag]}
    for scalar in (int, float, str):  # subclasses (IntEnum, namedtuple fields, ...) become the base type
        if isinstance(value, scalar):
            plain = scalar(value)
            if type(plain) is scalar:
                return plain
    raise TypeError(f"a {type(value).__name__} is not plain data (None, numbers, str, bytes, containers)")


def _decode(obj: object, depth: int = 0) -> object:
    """Inverse of :func:`_encode`, strict: anything malformed raises ValueError or TypeError."""
    if depth > MAX_DEPTH:
        raise ValueError(f"value nested deeper than {MAX_DEPTH} levels")
    if obj is None or type(obj) in (bool, int, float, str):
        return obj
    if type(obj) is not dict or len(obj) != 1:
        raise ValueError("malformed value")
    ((tag, body),) = obj.items()
    kinds: dict[str, Callable[[list[object]], object]] = {"l": list, "t": tuple, "s": set, "z": frozenset}
    if tag in kinds and type(body) is list:
        return kinds[tag]([_decode(v, depth + 1) for v in body])
    if tag == "d" and type(body) is list:
        if not all(type(p) is list and len(p) == 2 for p in body):
            raise ValueError("malformed dict")
        return {_decode(k, depth + 1): _decode(v, depth + 1) for k, v in body}
    if tag in ("b", "a") and type(body) is str:
        data = base64.b64decode(body.encode(), validate=True)
        return bytearray(data) if tag == "a" else data
    if tag == "c" and type(body) is list and len(body) == 2 and all(type(x) in (int, float) for x in body):
        return complex(body[0], body[1])
    raise ValueError(f"malformed value (tag {tag!r})")


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


class _BridgeFailure(BaseException):
    """The solution process died, hung, or answered nonsense: fails the test, past ``except Exception``."""


class _RemoteError(Exception):
    """An exception of the solution that is not a builtin exception type."""


class _Bridge:
    """Runner side of the pipe pair: one request at a time, each with a deadline."""

    def __init__(self, wfd: int, rfd: int, call_s: float) -> None:
        self.wfd, self.rfd, self.call_s = wfd, rfd, call_s
        self.next_id = 0
        self.buf = bytearray()

    def begin(self, test: str) -> None:
        self.send({"op": "begin", "test": test}, time.monotonic() + self.call_s)

    def send(self, msg: dict[str, Any], deadline: float) -> None:
        view = memoryview(json.dumps(msg).encode() + b"\n")
        while view:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([], [self.wfd], [], left)[1]:
                raise _BridgeFailure(f"the solution process took no request for {self.call_s:.1f} s")
            try:
                view = view[os.write(self.wfd, view[:65536]) :]
            except OSError as exc:
                raise _BridgeFailure(f"the solution process is gone ({exc})") from None

    def request(self, msg: dict[str, Any]) -> dict[str, Any]:
        self.next_id += 1
        msg["id"] = self.next_id
        deadline = time.monotonic() + self.call_s
        self.send(msg, deadline)
        while True:
            line = self.line(deadline)
            try:
                answer = json.loads(line)
            except (ValueError, RecursionError):
                raise _BridgeFailure("the solution process sent a garbled answer") from None
            if type(answer) is dict and answer.get("id") == msg["id"]:
                return answer

    def line(self, deadline: float) -> bytes:
        while b"\n" not in self.buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.rfd], [], [], left)[0]:
                raise _BridgeFailure(f"the solution took longer than {self.call_s:.1f} s (timeout)")
            data = os.read(self.rfd, 1 << 20)
            if not data:
                raise _BridgeFailure("the solution process is gone (it exited or was killed)")
            self.buf += data
            if len(self.buf) > MAX_MESSAGE_BYTES:
                raise _BridgeFailure(f"the solution's answer is larger than {MAX_MESSAGE_BYTES} bytes")
        line, _, rest = bytes(self.buf).partition(b"\n")
        self.buf = bytearray(rest)
        return line

    def result(self, answer: dict[str, Any]) -> object:
        """The value in ``answer``, or raise what it says was raised."""
        if "value" in answer:
            try:
                return _decode(answer["value"])
            except (ValueError, TypeError, RecursionError) as exc:
                raise _BridgeFailure(f"the solution's answer is not plain data ({exc})") from None
        if answer.get("died"):
            raise _BridgeFailure("the solution process died during the call (it exited or was killed)")
        raised = answer.get("raise")
        if not (type(raised) is list and len(raised) == 2 and all(type(x) is str for x in raised)):
            raise _BridgeFailure("the solution process sent a malformed answer")
        name, message = raised
        cls = getattr(builtins, name, None)
        if isinstance(cls, type) and issubclass(cls, Exception):
            try:
                exc = cls(message)
            except Exception:
                exc = _RemoteError(f"{name}: {message}")
            raise exc
        if isinstance(cls, type) and issubclass(cls, BaseException):
            raise _BridgeFailure(f"the solution raised {name}: {message}")
        raise _RemoteError(f"{name}: {message}")


def _write_back(args: list[Any], kwargs: dict[str, Any], answer: dict[str, Any]) -> None:
    """Copy in-place changes the solution made to list/dict/set/bytearray arguments."""
    try:
        new_args, new_kwargs = _decode(answer.get("args")), _decode(answer.get("kwargs"))
    except (ValueError, TypeError, RecursionError):
        return
    if not (type(new_args) is list and type(new_kwargs) is dict and len(new_args) == len(args)):
        return
    pairs = list(zip(args, new_args, strict=True))
    pairs += [(kwargs[k], new_kwargs[k]) for k in kwargs if k in new_kwargs]
    for old, new in pairs:
        if type(old) is not type(new) or old == new:
            continue
        if type(old) in (list, bytearray):
            old[:] = new
        elif type(old) in (dict, set):
            old.clear()
            old.update(new)


class _RemoteFunction:
    """A function of the solution: calls go to the oracle, arguments and results as plain data."""

    def __init__(self, bridge: _Bridge, module: str, name: str) -> None:
        self._bridge, self._module = bridge, module
        self.__name__ = self.__qualname__ = name

    def __repr__(self) -> str:
        return f"<solution function {self._module}.{self.__name__}>"

    def __call__(self, *args: Any, **kwargs: Any) -> object:
        try:
            payload = {"args": _encode(list(args)), "kwargs": _encode(kwargs)}
        except (TypeError, ValueError) as exc:
            raise _BridgeFailure(f"cannot send the arguments to the solution: {exc}") from None
        msg = {"op": "call", "mod": self._module, "name": self.__name__, **payload}
        answer = self._bridge.request(msg)
        value = self._bridge.result(answer)
        _write_back(list(args), kwargs, answer)
        return value


def _proxy_attr(bridge: _Bridge, module: str, attr: str) -> object:
    """``module.attr`` of a proxied module: a remote function or a plain value."""
    if attr == "__all__":
        names = bridge.request({"op": "names", "mod": module}).get("names")
        if type(names) is not list or not all(type(n) is str and n.isidentifier() for n in names):
            raise ImportError(f"cannot list the names of {module}")
        return names
    if attr.startswith("__"):
        raise AttributeError(attr)
    answer = bridge.request({"op": "attr", "mod": module, "name": attr})
    if answer.get("callable") is True:
        return _RemoteFunction(bridge, module, attr)
    raised = answer.get("raise")
    if type(raised) is list and raised and raised[0] == "AttributeError":
        raise AttributeError(f"module {module!r} has no attribute {attr!r}")
    if raised is not None:
        raise ImportError(f"{module}.{attr}: {raised}")
    return bridge.result(answer)


class _ProxyFinder:
    """Meta-path finder (last in line) that turns the workspace's module names into proxies."""

    def __init__(self, bridge: _Bridge, modules: frozenset[str]) -> None:
        self.bridge, self.modules = bridge, modules

    def find_spec(self, fullname: str, path: object = None, target: object = None) -> Any:
        if fullname.split(".")[0] not in self.modules:
            return None
        return importlib.util.spec_from_loader(fullname, self, is_package=True)

    def create_module(self, spec: Any) -> None:
        return None

    def exec_module(self, module: Any) -> None:
        name, bridge = module.__name__, self.bridge
        module.__path__ = []
        module.__getattr__ = lambda attr: _proxy_attr(bridge, name, attr)


def _cases(fn: Callable[..., Any]) -> list[tuple[str, dict[str, Any], str]]:
    """(case id, keyword arguments, skip reason) per case: ``parametrize`` marks expanded."""
    combos: list[tuple[str, dict[str, Any]]] = [("", {})]
    skip = ""
    for mark in getattr(fn, "pytestmark", []):
        name, args, kw = getattr(mark, "name", ""), getattr(mark, "args", ()), getattr(mark, "kwargs", {})
        if name == "skip" or (name == "skipif" and args and args[0] is True):
            skip = str(kw.get("reason", args[0] if name == "skip" and args else "skip mark"))
        if name != "parametrize":
            continue
        names = [s.strip() for s in args[0].split(",")] if isinstance(args[0], str) else list(args[0])
        grown = []
        for cid, kwargs in combos:
            for i, raw in enumerate(args[1]):
                is_param = type(raw).__name__ == "ParameterSet"
                values = tuple(raw.values) if is_param else tuple(raw) if len(names) > 1 else (raw,)
                grown.append((f"{cid}[{i}]", {**kwargs, **dict(zip(names, values, strict=True))}))
        combos = grown
    return [(cid, kwargs, skip) for cid, kwargs in combos]


def _call_test(fn: Callable[..., Any], kwargs: dict[str, Any]) -> tuple[str, str]:
    """(outcome, message) of one test case."""
    missing = [
        p.name
        for p in inspect.signature(fn).parameters.values()
        if p.name not in kwargs and p.default is inspect.Parameter.empty
    ]
    if missing:
        return "error", f"fixtures are not available in the grader's runner: {missing}"
    try:
        result = fn(**kwargs)
        if inspect.iscoroutine(result):
            import asyncio

            asyncio.run(result)
        return "passed", ""
    except AssertionError as exc:
        return "failed", f"AssertionError: {exc}"[:1000]
    except BaseException as exc:  # the test's own error, or _BridgeFailure
        kind = type(exc).__name__
        if kind == "Skipped":
            return "skipped", str(exc)[:1000]
        return "failed", f"{kind}: {exc}"[:1000]


def _run_test(bridge: _Bridge, report: Any, module: Any, name: str) -> None:
    fn = getattr(module, name, None)
    if not callable(fn):
        report.write(json.dumps({"test": name, "outcome": "missing", "time_s": 0.0}) + "\n")
        return
    try:
        cases = _cases(fn)
    except Exception as exc:
        cases = []
        report.write(
            json.dumps({"test": name, "outcome": "error", "time_s": 0.0, "message": repr(exc)}) + "\n"
        )
    for cid, kwargs, skip in cases:
        start = time.perf_counter()
        if skip:
            outcome, message = "skipped", skip
        else:
            bridge.begin(name)
            outcome, message = _call_test(fn, kwargs)
        line = {
            "test": name,
            "case": cid,
            "outcome": outcome,
            "time_s": round(time.perf_counter() - start, 4),
        }
        report.write(json.dumps({**line, "message": message}) + "\n")
        print(f"{name}{cid}: {outcome}" + (f": {message}" if message else ""), flush=True)


def _runner_main() -> None:
    """Test-sandbox entry: argv[1] is the JSON configuration written by :func:`_run_split`."""
    cfg = json.loads(sys.argv[1])
    sys.set_int_max_str_digits(0)
    sys.dont_write_bytecode = True
    bridge = _Bridge(cfg["req_fd"], cfg["resp_fd"], cfg["call_s"])
    sys.meta_path.append(_ProxyFinder(bridge, frozenset(cfg["modules"])))
    with open(cfg["report"], "w", buffering=1) as report:
        try:
            bridge.begin("<collect>")
            spec = importlib.util.spec_from_file_location("test_hidden", cfg["tests"])
            assert spec is not None and spec.loader is not None
            module = importlib.util.module_from_spec(spec)
            sys.modules["test_hidden"] = module
            spec.loader.exec_module(module)
        except BaseException as exc:
            report.write(json.dumps({"collect_error": f"{type(exc).__name__}: {exc}"[:1000]}) + "\n")
            traceback.print_exc()
            sys.exit(2)
        for name in cfg["expected"]:
            _run_test(bridge, report, module, name)


_SHARED: tuple[Any, ...] = (_encode, _decode)
_PARTS: dict[str, tuple[Any, ...]] = {
    "oracle": (*_SHARED, _oracle_handle, _public_names, _oracle_child, _Oracle, _oracle_main),
    "runner": (
        *_SHARED,
        _BridgeFailure,
        _RemoteError,
        _Bridge,
        _write_back,
        _RemoteFunction,
        _proxy_attr,
        _ProxyFinder,
        _cases,
        _call_test,
        _run_test,
        _runner_main,
    ),
}
_HEADER = (
    "from __future__ import annotations\n"
    "import base64, builtins, contextlib, importlib, importlib.util, inspect, json, os, select, signal, sys, "
    "time, traceback\nfrom typing import Any\nfrom collections.abc import Callable\n"
)


@functools.lru_cache(maxsize=2)
def _script(kind: str) -> str:
    """Source of the ``oracle`` or ``runner`` program: the functions above, then a call to the entry."""
    parts = _PARTS[kind]
    consts = f"MAX_DEPTH = {MAX_DEPTH}\nMAX_MESSAGE_BYTES = {MAX_MESSAGE_BYTES}\n"
    body = "\n\n".join(textwrap.dedent(inspect.getsource(p)) for p in parts)
    return f"{_HEADER}{consts}\n\n{body}\n\n{parts[-1].__name__}()\n"
