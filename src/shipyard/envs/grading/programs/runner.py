"""The runner: runs the hidden tests in the test sandbox against proxies of the solution (stdlib only).

Contract: imports ``test_hidden.py``; the workspace's modules are proxies whose functions send
their arguments to the oracle and return its decoded answer (``wire.py``); every expected test runs
in a fresh oracle child and its outcome is written to ``/grader/report.jsonl``. Shipped into the
sandbox as source after ``wire.py`` and run with ``python -I -c``
(:func:`shipyard.envs.grading.grader.program_source`); its entry point is :func:`_runner_main`.
"""

from __future__ import annotations

import builtins
import importlib
import importlib.util
import inspect
import json
import os
import select
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

from shipyard.envs.grading.programs.wire import (  # outside the sandbox only: there wire.py comes first
    MAX_MESSAGE_BYTES,
    _decode,
    _encode,
)


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
