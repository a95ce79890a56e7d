"""Grade a session's final workspace against a task's hidden tests, so that the graded code cannot forge its result.

Contract: :func:`grade` never runs anything in the session's sandbox. It splits every grading
across two fresh :class:`~shipyard.envs.sandbox.BwrapSandbox` instances that share nothing but
two pipes:

- the *solution sandbox* holds the final files minus everything that could steer a test run
  (:func:`agent_controlled`: ``conftest.py`` anywhere, ini/config files,
  ``sitecustomize.py``/``usercustomize.py``, ``*.pth``, a top-level ``__init__.py``, the test
  files the harness and grader write, anything under ``test_hidden/``, ``pytest/`` or
  ``_pytest/``) and runs an *oracle* (``programs/oracle.py``): for every request it gets, it
  imports the solution in a child process forked fresh for each test and answers with the value
  a function returned, the exception it raised or the fact that it died, as plain data
  (``programs/wire.py``: None, bool, int, float, complex, str, bytes, bytearray, list, tuple, dict,
  set, frozenset, nested; subclasses and numpy scalars become their base type);
- the *test sandbox* holds only the hidden tests and runs our *runner* (``programs/runner.py``,
  a small test runner, not pytest: no plugins, conftest or ini files exist for it to read).
  It imports ``test_hidden.py``; the workspace's modules (``solution`` and every top-level
  module or package among the files, when no installed module has that name) are proxies whose
  functions send their arguments to the oracle and return its answer decoded
  (strict and bounded). Each expected test then runs in a fresh oracle child;
  its outcome is written by the runner to ``/grader/report.jsonl``, a host directory made fresh
  for this grading that only the test sandbox mounts.

So no agent code ever runs where the verdict is computed: writing the report, patching pytest or
``builtins``, exiting early, ``atexit`` hooks, always-equal objects (they cannot cross the pipe)
and reading the hidden tests (not in the solution sandbox) all leave the verdict alone; the
oracle can only answer wrong. (A runner in the process that imported the solution cannot keep
anything from it: fds, nonces and the runner's own code are all reachable through ``gc``,
``/proc/self`` or monkeypatching, hence the split.) A solution-side exit, crash or hang fails the current test
through the runner's ``_BridgeFailure``, a ``BaseException`` that test code catching ``Exception``
cannot swallow; a later test gets a new child. Solution exceptions are re-raised as the builtin
exception of the same name (so ``pytest.raises(ValueError)`` works) or the runner's ``_RemoteError``.
The programs are real files of ``programs/`` (stdlib only), shipped as source (:func:`program_source`).
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
import contextlib
import fnmatch
import functools
import json
import os
import shlex
import shutil
import stat
import tempfile
from pathlib import Path
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
    runner = f"python -I -c {shlex.quote(program_source('runner'))} {shlex.quote(json.dumps(runner_cfg))}"
    try:
        with (
            tempfile.TemporaryFile() as log,
            BwrapSandbox(workspace, cfg, persistent=False) as solution_box,
            BwrapSandbox(
                {HIDDEN_FILE: task.hidden_tests}, cfg, binds={report_dir: REPORT_DIR}, persistent=False
            ) as test_box,
        ):
            oracle = f"python -I -c {shlex.quote(program_source('oracle'))}"
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


PROGRAMS = Path(__file__).resolve().parent / "programs"
"""Where the in-sandbox programs live (``wire.py``, ``oracle.py``, ``runner.py``)."""
_ENTRY = {"oracle": "_oracle_main", "runner": "_runner_main"}


def _without_shipyard_imports(text: str) -> str:
    """``text`` minus its ``from shipyard... import`` statements (in the sandbox the names they bring
    are defined by the program source that comes first)."""
    lines = text.splitlines()
    for node in reversed(ast.parse(text).body):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("shipyard."):
            assert node.end_lineno is not None
            del lines[node.lineno - 1 : node.end_lineno]
    return "\n".join(lines)


@functools.lru_cache(maxsize=2)
def program_source(kind: str) -> str:
    """Source of the ``oracle`` or ``runner`` program as the sandbox runs it (``python -I -c``):
    ``wire.py`` (with the limits), then the program's own file, then a call to its entry point."""
    parts = [_without_shipyard_imports((PROGRAMS / f"{name}.py").read_text()) for name in ("wire", kind)]
    body = "\n\n".join(parts).replace("from __future__ import annotations\n", "")
    return f"from __future__ import annotations\n{body}\n\n{_ENTRY[kind]}()\n"
