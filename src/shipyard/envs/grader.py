"""Grade a session's final workspace against a task's hidden tests, in a fresh sandbox.

Contract: :func:`grade` never runs anything in the session's sandbox. It builds a new
:class:`~shipyard.envs.sandbox.BwrapSandbox` from the final files minus everything that could
steer pytest (:func:`agent_controlled`: ``conftest.py`` anywhere, ini/config files,
``sitecustomize.py``/``usercustomize.py``, ``*.pth``, a top-level ``__init__.py``, the test
files the harness and grader write, and anything under ``test_hidden/``, ``pytest/`` or
``_pytest/``), writes the hidden tests as ``test_hidden.py`` and runs::

    python -P -m pytest -q -p no:cacheprovider --noconftest -c /dev/null --rootdir /workspace
        --junitxml /grader/report.xml test_hidden.py

with plugin autoloading disabled (``-P`` keeps a workspace ``pytest.py`` from shadowing pytest
at start-up; the test module's directory is still put on ``sys.path`` so ``solution`` imports).
The JUnit report goes to ``/grader``, a host directory made
fresh for this grading and bind-mounted into the sandbox, so no file planted by the agent during
its session can pose as the report. The reward is ``passed / expected`` where ``expected`` is the
set of top-level ``test_*`` functions of the hidden tests (found with :mod:`ast`); a test that
the report does not mention, or mentions as failed, errored or skipped, counts as failed.
A timeout, a crash without a report or an unreadable report gives reward 0 with the reason in
``details["reason"]``. ``details["tests"]`` maps each expected test to its outcome
(``passed``/``failed``/``error``/``skipped``/``missing``) and duration; ``details`` also holds
``returncode``, ``duration_s``, ``dropped_files`` and ``log_tail`` (pytest's last output). One
grading costs about 0.45 s (sandbox start plus Python and pytest start-up).

Limits (a later issue hardens this): the agent's ``solution.py`` is imported into the pytest
process, so code in it runs with the same rights as pytest and could rewrite the report (e.g.
an ``atexit`` hook writing ``/grader/report.xml``) or patch pytest itself. The sandbox stops it
from touching the host, but not from forging its own reward. A hidden-test run is limited as a
whole by ``cfg.timeout_s`` (one endless test gives 0 for all); tests are matched by function name
only (parametrised cases ``name[...]`` all have to pass).

Example::

    res = grade(task, {"solution.py": task.reference}, SandboxConfig())
    assert res.reward == 1.0 and res.passed == res.total
"""

from __future__ import annotations

import ast
import os
import shutil
import stat
import tempfile
import xml.etree.ElementTree as ET
from typing import Any

from shipyard.config.schema import SandboxConfig
from shipyard.envs.sandbox import BwrapSandbox
from shipyard.envs.types import RewardResult, Task

HIDDEN_FILE = "test_hidden.py"
"""Name the hidden tests get in the grading workspace."""
REPORT_DIR = "/grader"
"""Sandbox path of the fresh per-grading directory that receives the JUnit report."""
MAX_REPORT_BYTES = 2 * 1024 * 1024
"""A report larger than this is rejected (reward 0)."""
LOG_TAIL_CHARS = 2000
"""Characters of pytest's output kept in ``details["log_tail"]``."""

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
_PYTEST_CMD = (
    "PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 python -P -m pytest -q -p no:cacheprovider --noconftest "
    f"-c /dev/null --rootdir /workspace --junitxml {REPORT_DIR}/report.xml {HIDDEN_FILE}"
)


def agent_controlled(path: str) -> bool:
    """True for workspace files the grader drops before grading (they could steer pytest)."""
    parts = [p for p in path.replace("\\", "/").split("/") if p not in ("", ".")]
    if not parts:
        return True
    if parts == ["__init__.py"] or parts[0] in (_HIDDEN_MODULE, "_pytest", "pytest"):
        return True  # would make the workspace a package or shadow the hidden tests / pytest
    return parts[-1] in _BLOCKED_NAMES or parts[-1].endswith(".pth")


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


def grade(task: Task, files: dict[str, str], cfg: SandboxConfig) -> RewardResult:
    """Run ``task.hidden_tests`` against ``files`` in a fresh sandbox; see the module contract."""
    expected = expected_tests(task.hidden_tests)
    if not expected:
        raise ValueError(f"task {task.id!r} has no top-level test_* functions in hidden_tests; add some")
    workspace = {p: c for p, c in files.items() if not agent_controlled(p)}
    dropped = sorted(set(files) - set(workspace))
    workspace[HIDDEN_FILE] = task.hidden_tests
    report_dir = tempfile.mkdtemp(prefix="shipyard-grade-")
    try:
        with BwrapSandbox(workspace, cfg, binds={report_dir: REPORT_DIR}) as sb:
            res = sb.exec(_PYTEST_CMD, timeout_s=cfg.timeout_s)
        details: dict[str, Any] = {
            "returncode": res.returncode,
            "duration_s": round(res.duration_s, 3),
            "dropped_files": dropped,
            "log_tail": (res.stdout + res.stderr)[-LOG_TAIL_CHARS:],
        }
        if res.timed_out:
            return _zero(expected, details, f"timeout: pytest ran longer than {cfg.timeout_s} s")
        report, problem = _read_report(os.path.join(report_dir, "report.xml"))
        if report is None:
            return _zero(expected, details, problem)
        outcomes = _outcomes(report, expected)
    finally:
        shutil.rmtree(report_dir, ignore_errors=True)
    passed = sum(1 for o in outcomes.values() if o["outcome"] == "passed")
    details["tests"] = outcomes
    if res.returncode not in (0, 1):
        details["reason"] = f"pytest exit code {res.returncode}: collection or usage error (see log_tail)"
    return RewardResult(reward=passed / len(expected), passed=passed, total=len(expected), details=details)


def _zero(expected: list[str], details: dict[str, Any], reason: str) -> RewardResult:
    details["reason"] = reason
    details["tests"] = {name: {"outcome": "missing", "time_s": 0.0} for name in expected}
    return RewardResult(reward=0.0, passed=0, total=len(expected), details=details)


def _read_report(path: str) -> tuple[ET.Element | None, str]:
    """Parse the JUnit report (a regular file, not a link, bounded size) or say why not."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return None, "crash: pytest wrote no report (it died or could not start)"
    except OSError as exc:
        return None, f"report unreadable: {exc}"
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            return None, "report is not a regular file"
        data = f.read(MAX_REPORT_BYTES + 1)
    if len(data) > MAX_REPORT_BYTES:
        return None, f"report larger than {MAX_REPORT_BYTES} bytes"
    try:
        return ET.fromstring(data), ""
    except ET.ParseError as exc:
        return None, f"report is not valid XML: {exc}"


def _outcomes(report: ET.Element, expected: list[str]) -> dict[str, dict[str, Any]]:
    """Per expected test: ``passed`` only if every reported case of it passed, else why not."""
    out: dict[str, dict[str, Any]] = {name: {"outcome": "missing", "time_s": 0.0} for name in expected}
    for case in report.iter("testcase"):
        if case.get("classname") != _HIDDEN_MODULE:
            continue
        name = (case.get("name") or "").split("[", 1)[0]
        if name not in out:
            continue
        outcome = "passed"
        for tag in ("failure", "error", "skipped"):
            if case.find(tag) is not None:
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
                break
        try:
            seconds = float(case.get("time") or 0.0)
        except ValueError:
            seconds = 0.0
        prev = out[name]
        if prev["outcome"] in ("missing", "passed"):
            prev["outcome"] = outcome
        prev["time_s"] = round(prev["time_s"] + seconds, 4)
    return out
