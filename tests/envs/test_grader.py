"""grade(): partial credit, per-test processes, timeouts, crashes, the data bridge, and files the agent must not control.

Each attack is paired with a positive control showing it does work against a naive pytest run,
so a passing test means the grader defeated it rather than the attack being broken. The corpus
of known hacks is in test_hacks.py.
"""

from __future__ import annotations

import pytest

from shipyard.config.schema import SandboxConfig
from shipyard.envs.grading.grader import (
    agent_controlled,
    expected_tests,
    grade,
    workspace_modules,
)
from shipyard.envs.grading.programs.wire import _decode, _encode
from shipyard.envs.sandbox import BwrapSandbox, sandbox_available
from shipyard.envs.types import Task

pytestmark = pytest.mark.skipif(sandbox_available() is not None, reason=str(sandbox_available()))

CFG = SandboxConfig(timeout_s=20)
HIDDEN = (
    "from solution import square\n\n\n"
    "def test_one():\n    assert square(1) == 1\n\n\n"
    "def test_two():\n    assert square(2) == 4\n\n\n"
    "def test_three():\n    assert square(3) == 9\n\n\n"
    "def test_neg():\n    assert square(-2) == 4\n"
)
TASK = Task(id="t-square", prompt="square", entry_point="square", hidden_tests=HIDDEN)
WRONG = "def square(x):\n    return None\n"
FORCE_PASS_CONFTEST = (
    "import pytest\n\n\n"
    "@pytest.hookimpl(hookwrapper=True)\n"
    "def pytest_runtest_makereport(item, call):\n"
    "    outcome = yield\n"
    "    rep = outcome.get_result()\n"
    "    rep.outcome = 'passed'\n"
)


def test_correct_partial_and_wrong() -> None:
    res = grade(TASK, {"solution.py": "def square(x):\n    return x * x\n"}, CFG)
    assert (res.reward, res.passed, res.total) == (1.0, 4, 4)
    assert set(res.details["tests"]) == {"test_one", "test_two", "test_three", "test_neg"}
    assert all(v["outcome"] == "passed" and v["time_s"] >= 0 for v in res.details["tests"].values())
    res = grade(TASK, {"solution.py": "def square(x):\n    return x if x < 2 else x * x\n"}, CFG)
    assert (res.reward, res.passed) == (0.75, 3)
    assert res.details["tests"]["test_neg"]["outcome"] == "failed"
    assert grade(TASK, {"solution.py": WRONG}, CFG).reward == 0.0
    assert grade(TASK, {}, CFG).details["reason"].startswith("collection error: ImportError")


def test_solution_skips_and_exits_fail_only_their_test() -> None:
    # pytest.skip raised by the solution is just an exception to the runner: a failed test
    skip = "import pytest\n\n\ndef square(x):\n    if x == 3:\n        pytest.skip('no')\n    return x * x\n"
    res = grade(TASK, {"solution.py": skip}, CFG)
    assert res.passed == 3 and res.details["tests"]["test_three"]["outcome"] == "failed"
    # an exit kills that test's process only; the next test gets a fresh one
    crash = "import os\n\n\ndef square(x):\n    if x == 3:\n        os._exit(0)\n    return x * x\n"
    res = grade(TASK, {"solution.py": crash}, CFG)
    assert (res.reward, res.passed) == (0.75, 3) and "reason" not in res.details
    assert res.details["tests"]["test_three"]["outcome"] == "failed"
    assert "died" in res.details["log_tail"]


def test_timeout_gives_zero_with_reason() -> None:
    res = grade(
        TASK, {"solution.py": "def square(x):\n    while True:\n        pass\n"}, SandboxConfig(timeout_s=2)
    )
    assert res.reward == 0.0 and res.details["reason"].startswith("timeout")


def test_malicious_conftest_is_ignored() -> None:
    files = {"solution.py": WRONG, "conftest.py": FORCE_PASS_CONFTEST, "sub/conftest.py": FORCE_PASS_CONFTEST}
    # positive control: the conftest does force passes in a naive pytest run
    with BwrapSandbox({**files, "test_hidden.py": HIDDEN}, CFG) as sb:
        naive = sb.exec("python -m pytest -q -p no:cacheprovider test_hidden.py")
    assert "4 passed" in naive.stdout, naive.stdout
    res = grade(TASK, files, CFG)
    assert res.reward == 0.0 and res.passed == 0
    assert res.details["dropped_files"] == ["conftest.py", "sub/conftest.py"]


def test_agent_written_test_hidden_and_config_are_ignored() -> None:
    fake = "def test_one():\n    pass\n\n\ndef test_two():\n    pass\n\n\ndef test_three():\n    pass\n\n\ndef test_neg():\n    pass\n"
    files = {
        "solution.py": WRONG,
        "test_hidden.py": fake,
        "pytest.ini": "[pytest]\naddopts = -p no:junitxml\n",
        "pyproject.toml": "[tool.pytest.ini_options]\npython_functions = 'nothing'\n",
        "sitecustomize.py": "raise SystemExit(0)\n",
    }
    res = grade(TASK, files, CFG)
    assert res.reward == 0.0 and res.total == 4
    assert set(res.details["dropped_files"]) == {
        "test_hidden.py",
        "pytest.ini",
        "pyproject.toml",
        "sitecustomize.py",
    }


def test_shadowing_pytest_module_is_not_run() -> None:
    forge = (
        "import os\nos.makedirs('/grader', exist_ok=True)\n"
        "open('/grader/report.xml', 'w').write('<testsuites><testsuite>' + ''.join("
        'f\'<testcase classname="test_hidden" name="{n}" time="0"/>\' for n in '
        "['test_one', 'test_two', 'test_three', 'test_neg']) + '</testsuite></testsuites>')\n"
    )
    # positive control: plain `python -m pytest` in the workspace would run this file
    with BwrapSandbox({"pytest.py": "print('shadowed')\n"}, CFG) as sb:
        assert "shadowed" in sb.exec("python -m pytest --version").stdout
    res = grade(TASK, {"solution.py": WRONG, "pytest.py": forge}, CFG)
    assert res.reward == 0.0


def test_agent_controlled_paths() -> None:
    for path in (
        "conftest.py",
        "a/b/conftest.py",
        "pytest.ini",
        "tox.ini",
        "setup.cfg",
        "x.pth",
        "__init__.py",
    ):
        assert agent_controlled(path), path
    for path in ("test_hidden.py", "test_hidden/__init__.py", "_pytest/x.py", "usercustomize.py"):
        assert agent_controlled(path), path
    for path in ("solution.py", "pkg/__init__.py", "notes.txt", "test_mine.py"):
        assert not agent_controlled(path), path


def test_expected_tests_and_bad_tasks() -> None:
    assert expected_tests(HIDDEN) == ["test_one", "test_two", "test_three", "test_neg"]
    src = "def helper():\n    pass\n\n\nclass TestX:\n    def test_in_class(self):\n        pass\n\n\nasync def test_a():\n    pass\n"
    assert expected_tests(src) == ["test_a"]
    with pytest.raises(ValueError, match="no top-level test_"):
        grade(Task(id="x", prompt="", entry_point="f", hidden_tests="x = 1\n"), {}, CFG)
    with pytest.raises(ValueError, match="not valid Python"):
        grade(Task(id="x", prompt="", entry_point="f", hidden_tests="def test_(:\n"), {}, CFG)


def _task(hidden: str) -> Task:
    return Task(id="t-x", prompt="", entry_point="f", hidden_tests=hidden)


def test_each_test_runs_in_a_fresh_solution_process() -> None:
    # the first call in a process answers right, later ones wrong: only separate processes pass all
    stateful = (
        "calls = []\n\n\ndef square(x):\n    calls.append(x)\n    return x * x if len(calls) == 1 else None\n"
    )
    with BwrapSandbox({"solution.py": stateful, "test_hidden.py": HIDDEN}, CFG) as sb:  # positive control
        assert "3 failed" in sb.exec("python -m pytest -q -p no:cacheprovider test_hidden.py").stdout
    assert grade(TASK, {"solution.py": stateful}, CFG).reward == 1.0


def test_exceptions_cross_and_exits_cannot_be_swallowed() -> None:
    hidden = (
        "import pytest\nfrom solution import f\n\n\n"
        "def test_raises():\n    with pytest.raises(ValueError, match='neg'):\n        f(-1)\n\n\n"
        "def test_swallow():\n    try:\n        f(-2)\n    except Exception:\n        return\n    assert False\n\n\n"
        "def test_value():\n    assert f(2) == 2\n"
    )
    honest = "def f(x):\n    if x < 0:\n        raise ValueError('neg')\n    return x\n"
    res = grade(_task(hidden), {"solution.py": honest}, CFG)
    assert res.reward == 1.0, res.details
    exits = "import os\n\n\ndef f(x):\n    if x < 0:\n        os._exit(1)\n    return x\n"
    res = grade(_task(hidden), {"solution.py": exits}, CFG)
    assert res.passed == 1 and res.details["tests"]["test_swallow"]["outcome"] == "failed"


def test_in_place_changes_come_back_and_non_data_fails() -> None:
    hidden = (
        "from solution import f\n\n\n"
        "def test_sorted():\n    xs = [3, 1, 2]\n    assert f(xs) is None and xs == [1, 2, 3]\n\n\n"
        "def test_dict():\n    d = {'b': 1}\n    f(d)\n    assert d == {'b': 1, 'new': 1}\n"
    )
    honest = "def f(x):\n    if isinstance(x, list):\n        x.sort()\n    else:\n        x['new'] = 1\n"
    assert grade(_task(hidden), {"solution.py": honest}, CFG).reward == 1.0
    gen = "def f(x):\n    return (v for v in x)\n"
    res = grade(
        _task("from solution import f\n\n\ndef test_a():\n    assert list(f([1])) == [1]\n"),
        {"solution.py": gen},
        CFG,
    )
    assert res.reward == 0.0 and "not plain data" in res.details["log_tail"]


def test_parametrize_fixtures_star_import_and_packages() -> None:
    hidden = (
        "import pytest\nfrom solution import *\nfrom pkg.util import double\n\n\n"
        "@pytest.mark.parametrize('x, want', [(1, 2), (2, 4), pytest.param(5, 10)])\n"
        "def test_param(x, want):\n    assert f(x) == want == double(x)\n\n\n"
        "def test_const():\n    assert LIMIT == (1, 'a')\n\n\n"
        "def test_fixture(tmp_path):\n    assert tmp_path\n"
    )
    files = {
        "solution.py": "LIMIT = (1, 'a')\n\n\ndef f(x):\n    return 2 * x\n",
        "pkg/__init__.py": "",
        "pkg/util.py": "def double(x):\n    return x + x\n",
    }
    res = grade(_task(hidden), files, CFG)
    tests = res.details["tests"]
    assert tests["test_param"]["outcome"] == "passed" and tests["test_const"]["outcome"] == "passed"
    assert tests["test_fixture"]["outcome"] == "error" and res.passed == 2
    assert workspace_modules(files) == ["pkg", "solution"]
    assert workspace_modules({"a/b.py": "", "x.py": "", "notes.txt": "", "bad-name.py": ""}) == [
        "a",
        "solution",
        "x",
    ]


def test_one_endless_call_costs_one_test() -> None:
    loops = "def square(x):\n    while x == 3:\n        pass\n    return x * x\n"
    res = grade(TASK, {"solution.py": loops}, SandboxConfig(timeout_s=8))
    assert (res.passed, res.details["tests"]["test_three"]["outcome"]) == (3, "failed"), res.details
    assert "timeout" in res.details["log_tail"] and "reason" not in res.details


def test_forged_reports_never_reach_the_verdict() -> None:
    # the old grader's known hole: code in solution.py rewriting the report at import and exit
    forge = (
        "import atexit, json, os\n\n\n"
        "def _forge():\n"
        "    try:\n"
        "        os.makedirs('/grader', exist_ok=True)\n"
        "        with open('/grader/report.jsonl', 'w') as f:\n"
        "            for n in ['test_one', 'test_two', 'test_three', 'test_neg']:\n"
        "                f.write(json.dumps({'test': n, 'outcome': 'passed', 'time_s': 0.0}) + '\\n')\n"
        "    except OSError:\n"
        "        pass\n\n\n"
        "_forge()\natexit.register(_forge)\n\n\n"
        "def square(x):\n    _forge()\n    return None\n"
    )
    res = grade(TASK, {"solution.py": forge}, CFG)
    assert res.reward == 0.0 and all(t["outcome"] == "failed" for t in res.details["tests"].values())


def test_encoding_is_strict_and_round_trips() -> None:
    values = [None, True, 0, -7, 2**100, 1.5, float("inf"), "x", b"\x00\xff", bytearray(b"ab"), 1 + 2j]
    values += [[1, [2, (3,)]], (1, "a"), {1, 2}, frozenset({"z"}), {(1, 2): [3], "k": {"n": None}}]
    for v in values:
        back = _decode(_encode(v))
        assert back == v and type(back) is type(v), v

    class AlwaysEqual:
        def __eq__(self, other: object) -> bool:
            return True

    with pytest.raises(TypeError, match="not plain data"):
        _encode(AlwaysEqual())
    with pytest.raises(TypeError):
        _encode([print])
    assert type(_encode(True)) is bool and _decode(_encode(type("S", (str,), {})("s"))) == "s"
    for bad in ({"l": 1}, {"x": []}, {"l": [], "t": []}, [1], {"d": [[1]]}, {"c": ["a", 1]}):
        with pytest.raises((ValueError, TypeError)):
            _decode(bad)
    deep: object = 1
    for _ in range(300):
        deep = [deep]
    with pytest.raises(ValueError, match="deeper"):
        _encode(deep)


def test_protected_files_are_restored_before_grading() -> None:
    task = Task(
        id="prot",
        prompt="",
        entry_point="f",
        files={"data/table.py": "TABLE = {1: 'one'}\n", "helper.py": "X = 1\n"},
        hidden_tests="from solution import f\n\n\ndef test_lookup():\n    assert f(1) == 'one'\n",
        protected=["data/*"],
    )
    solution = "from data.table import TABLE\n\n\ndef f(k):\n    return TABLE[k]\n"
    honest = grade(task, {**task.files, "solution.py": solution}, CFG)
    assert honest.reward == 1.0
    edited = {**task.files, "data/table.py": "TABLE = {1: 'uno'}\n", "data/extra.py": "Y = 2\n"}
    assert grade(task, {**edited, "solution.py": solution}, CFG).reward == 1.0  # the edit is undone
    deleted = {"helper.py": "X = 1\n", "solution.py": solution}
    assert grade(task, deleted, CFG).reward == 1.0  # the deleted protected file is put back
    cheat = (
        "from data.table import TABLE\n\n\ndef f(k):\n    return 'one' if 'uno' in TABLE.values() else 'x'\n"
    )
    assert grade(task, {**edited, "solution.py": cheat}, CFG).reward == 0.0


@pytest.mark.parametrize("kind", ["oracle", "runner"])
def test_in_sandbox_programs_are_shipped_as_standalone_source(kind: str) -> None:
    from shipyard.envs.grading.grader import program_source

    source = program_source(kind)
    compile(source, f"<{kind}>", "exec")  # one program: wire.py, then the program file, then its entry
    assert "import shipyard" not in source and "from shipyard" not in source
    assert source.rstrip().endswith(f"_{kind}_main()") and source.count("def _encode(") == 1
