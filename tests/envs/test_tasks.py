"""Generated tasks and HumanEval tasks: determinism, shape, and that references really pass.

Every generated reference is checked in-process against its hidden and visible tests (fast, all
600 tasks); one task per family (60) is also graded end to end through ``grade`` in sandboxes,
two at a time. HumanEval: all 164 load; a few canonical solutions pass and an empty body fails.
"""

from __future__ import annotations

import ast
import collections
import importlib.metadata
import pathlib
import re
import sys
import types
from concurrent.futures import ThreadPoolExecutor

import pytest

from shipyard.config.schema import TASK_KINDS, SandboxConfig
from shipyard.envs.grading.grader import expected_tests, grade
from shipyard.envs.sandbox import sandbox_available
from shipyard.envs.sandbox.bwrap import BwrapSandbox
from shipyard.envs.tasks.functions import FAMILIES, RUN_VISIBLE, FunctionKind, generated_tasks, split_tasks
from shipyard.envs.tasks.humaneval import humaneval_tasks
from shipyard.envs.tasks.kinds import task_kind
from shipyard.envs.types import Task

needs_sandbox = pytest.mark.skipif(sandbox_available() is not None, reason=str(sandbox_available()))
CFG = SandboxConfig(timeout_s=20)


@pytest.fixture(scope="module")
def tasks() -> list[Task]:
    return generated_tasks(600, seed=1234)


def _run_in_process(task: Task, solution: str, test_source: str) -> tuple[int, int]:
    """(passed, total) of ``test_source``'s test functions against ``solution`` (trusted code only)."""
    mod = types.ModuleType("solution")
    exec(compile(solution, "solution.py", "exec"), mod.__dict__)
    old = sys.modules.get("solution")
    sys.modules["solution"] = mod
    try:
        scope: dict[str, object] = {}
        exec(compile(test_source, "tests.py", "exec"), scope)
        names = expected_tests(test_source)
        passed = 0
        for name in names:
            try:
                scope[name]()  # type: ignore[operator]
                passed += 1
            except Exception:
                pass
        return passed, len(names)
    finally:
        if old is None:
            sys.modules.pop("solution", None)
        else:
            sys.modules["solution"] = old


def test_families_cover_all_difficulties() -> None:
    assert len(FAMILIES) >= 40
    assert len({f.key for f in FAMILIES}) == len(FAMILIES)
    assert collections.Counter(f.difficulty for f in FAMILIES) == {1: 12, 2: 12, 3: 12, 4: 12, 5: 12}


def test_deterministic_by_seed() -> None:
    a = [t.to_json() for t in generated_tasks(120, seed=7)]
    assert a == [t.to_json() for t in generated_tasks(120, seed=7)]
    assert a != [t.to_json() for t in generated_tasks(120, seed=8)]
    with pytest.raises(ValueError, match="n=0"):
        generated_tasks(0, seed=1)


def test_task_shape(tasks: list[Task]) -> None:
    assert [t.id for t in tasks] == [f"gen-{i:05d}" for i in range(600)]
    assert len({t.prompt for t in tasks}) == 600  # all distinct
    assert collections.Counter(t.difficulty for t in tasks) == {d: 120 for d in range(1, 6)}
    # the first len(FAMILIES) tasks are one per family
    assert collections.Counter(t.difficulty for t in tasks[: len(FAMILIES)]) == {d: 12 for d in range(1, 6)}
    for t in tasks:
        assert t.source == "generated" and t.files == {} and t.reference
        assert re.match(rf"Write a Python function `{t.entry_point}\(.*\)` that .+\. For example, ", t.prompt)
        assert f"from solution import {t.entry_point}\n" in t.visible_tests
        assert f"from solution import {t.entry_point}\n" in t.hidden_tests
        assert 1 <= len(expected_tests(t.visible_tests)) <= 2
        assert 4 <= len(expected_tests(t.hidden_tests)) <= 8
        assert not set(expected_tests(t.visible_tests)) & set(expected_tests(t.hidden_tests))
        ast.parse(t.reference)
        assert Task.from_json(t.to_json()) == t


def test_every_reference_passes_in_process(tasks: list[Task]) -> None:
    for t in tasks:
        for tests in (t.hidden_tests, t.visible_tests):
            passed, total = _run_in_process(t, t.reference, tests)
            assert passed == total, f"{t.id}: reference fails its tests\n{t.reference}\n{tests}"


def test_wrong_solutions_fail_in_process(tasks: list[Task]) -> None:
    for t in tasks:
        params = re.match(rf"Write a Python function `{t.entry_point}\((.*?)\)`", t.prompt)
        assert params is not None
        wrong = f"def {t.entry_point}({params.group(1)}):\n    return None\n"
        passed, total = _run_in_process(t, wrong, t.hidden_tests)
        assert passed < total, t.id


@needs_sandbox
def test_references_pass_through_grade(tasks: list[Task]) -> None:
    sample = tasks[: len(FAMILIES)]  # one task of every family, every difficulty

    def check(t: Task) -> tuple[str, float, str]:
        both = Task(
            id=t.id,
            prompt=t.prompt,
            entry_point=t.entry_point,
            hidden_tests=t.hidden_tests + "\n" + t.visible_tests,
        )
        res = grade(both, {"solution.py": t.reference}, CFG)
        assert res.total == len(expected_tests(t.hidden_tests)) + len(expected_tests(t.visible_tests))
        return t.id, res.reward, str(res.details.get("log_tail", ""))

    with ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(check, sample))
    failures = [r for r in results if r[1] != 1.0]
    assert not failures, failures


@needs_sandbox
def test_wrong_solution_scores_below_one(tasks: list[Task]) -> None:
    for t in (tasks[0], tasks[1]):
        res = grade(t, {"solution.py": f"def {t.entry_point}(*args):\n    return None\n"}, CFG)
        assert res.reward < 1.0 and res.passed < res.total


@needs_sandbox
def test_visible_run_is_plain_pytest_without_third_party_plugins(tasks: list[Task]) -> None:
    """After a write the agent reads pytest's own report (a failure names the test and the values
    compared), and pytest loads none of the plugins installed beside the sandbox's Python."""
    task = tasks[0]
    name = task.entry_point
    wrong = f"def {name}(*args, **kwargs):\n    return 12345\n"
    plugins = {ep.value.split(":")[0] for ep in importlib.metadata.entry_points(group="pytest11")}
    assert "pytest_timeout" in plugins  # a dev dependency (pyproject.toml), so the probe can fail
    probe = f"import sys\n\ndef test_no_plugins():\n    assert not {plugins!r} & set(sys.modules)\n"
    kind = FunctionKind()
    with BwrapSandbox({"solution.py": wrong, "test_visible.py": task.visible_tests}) as sb:
        text, outcome = kind.after_write(task, sb, "solution.py", 2000, end_on_pass=True)
        assert outcome == ""
        assert "Visible tests failed" in text
        assert re.search(
            r"FAILED test_visible.py::test_example_1 - (AssertionError: )?assert 12345 == ", text
        ), text
        sb.write("solution.py", task.reference)
        assert kind.after_write(task, sb, "solution.py", 2000, end_on_pass=True)[1] == "passed"
        sb.write("test_visible.py", probe)
        assert sb.exec(RUN_VISIBLE).returncode == 0
        assert sb.exec(RUN_VISIBLE.replace("PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 ", "")).returncode == 1


def test_split_is_disjoint_deterministic_and_stratified(tasks: list[Task]) -> None:
    train, held = split_tasks(tasks, 0.25, seed=3)
    assert {t.id for t in train}.isdisjoint({t.id for t in held})
    assert len(train) + len(held) == len(tasks)
    assert len(held) == 150
    assert collections.Counter(t.difficulty for t in held) == {d: 30 for d in range(1, 6)}
    again = split_tasks(tasks, 0.25, seed=3)
    assert [t.id for t in again[1]] == [t.id for t in held]
    assert [t.id for t in split_tasks(tasks, 0.25, seed=4)[1]] != [t.id for t in held]
    for bad in (0.0, 1.0, -0.1):
        with pytest.raises(ValueError, match="heldout_frac"):
            split_tasks(tasks, bad, seed=3)


def test_task_from_json_rejects_unknown_fields() -> None:
    record = generated_tasks(1, seed=0)[0].to_json()
    old = {k: v for k, v in record.items() if k != "reference"}
    assert Task.from_json(old).reference == ""
    with pytest.raises(ValueError, match="unknown fields"):
        Task.from_json({**record, "bogus": 1})


def test_humaneval_loads_all() -> None:
    tasks = humaneval_tasks()
    assert len(tasks) == 164
    assert [t.id for t in tasks[:3]] == ["HumanEval/0", "HumanEval/1", "HumanEval/2"]
    for t in tasks:
        assert t.source == "humaneval" and t.visible_tests == "" and t.files == {}
        assert expected_tests(t.hidden_tests) == ["test_check"]
        problem = t.prompt.split("```python\n")[1].split("```")[0]
        assert f"def {t.entry_point}" in problem and t.reference.startswith(problem)
    assert len(humaneval_tasks(5)) == 5 and humaneval_tasks(0) == []
    with pytest.raises(ValueError, match="n=165"):
        humaneval_tasks(165)


@needs_sandbox
def test_humaneval_canonical_passes_and_empty_body_fails() -> None:
    tasks = humaneval_tasks()
    for t in (tasks[0], tasks[32], tasks[162]):  # 32 needs the prompt's helper; 162 imports hashlib
        res = grade(t, {"solution.py": t.reference}, CFG)
        assert res.reward == 1.0, res.details
    stub = tasks[0].prompt.split("```python\n")[1].split("```")[0] + "    pass\n"
    res = grade(tasks[0], {"solution.py": stub}, CFG)
    assert res.reward == 0.0 and res.details["tests"]["test_check"]["outcome"] == "failed"


def test_the_task_kinds_are_listed_once() -> None:
    """Every kind of TASK_KINDS has its kind object under its own name; no other module spells out
    the list again (a tuple, list or set literal holding every kind, besides ``TaskKindName``'s)."""
    assert set(TASK_KINDS) == {"function", "db", "repo"}
    assert [task_kind(k).name for k in TASK_KINDS] == list(TASK_KINDS)
    with pytest.raises(ValueError, match="known kinds are"):
        task_kind("notebook")
    src = pathlib.Path(__file__).resolve().parents[2] / "src" / "shipyard"
    again = []
    for path in src.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Tuple | ast.List | ast.Set) and len(node.elts) == len(TASK_KINDS):
                values = {e.value for e in node.elts if isinstance(e, ast.Constant)}
                if values == set(TASK_KINDS):
                    again.append(f"{path.relative_to(src)}:{node.lineno}")
    assert len(again) == 1 and again[0].startswith("config/schema.py:"), (
        f"the task kinds are listed in {again}; list them once (shipyard.config.schema.TaskKindName) "
        "and use shipyard.config.schema.TASK_KINDS"
    )
