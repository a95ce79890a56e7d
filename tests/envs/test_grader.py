"""grade(): partial credit, unreported tests, timeouts, crashes, and files the agent must not control.

Each attack is paired with a positive control showing it does work against a naive pytest run,
so a passing test means the grader defeated it rather than the attack being broken.
"""

from __future__ import annotations

import pytest

from shipyard.config.schema import SandboxConfig
from shipyard.envs.grader import agent_controlled, expected_tests, grade
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
    assert grade(TASK, {}, CFG).details["reason"].startswith("pytest exit code")


def test_unreported_and_skipped_tests_count_as_failed() -> None:
    skip = "import pytest\n\n\ndef square(x):\n    if x == 3:\n        pytest.skip('no')\n    return x * x\n"
    res = grade(TASK, {"solution.py": skip}, CFG)
    assert res.passed == 3 and res.details["tests"]["test_three"]["outcome"] == "skipped"
    crash = "import os\n\n\ndef square(x):\n    if x == 3:\n        os._exit(0)\n    return x * x\n"
    res = grade(TASK, {"solution.py": crash}, CFG)
    assert res.reward == 0.0 and res.details["reason"].startswith("crash")


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
