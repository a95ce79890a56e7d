"""Long-horizon tasks: deterministic, too long for a small context, graded by the real grader."""

from __future__ import annotations

import ast

import pytest

from shipyard.config.schema import ModelConfig, SandboxConfig
from shipyard.envs.grading.grader import grade
from shipyard.envs.tasks.long import long_tasks
from shipyard.models.loading import load_tokenizer


def test_long_tasks_are_deterministic_and_well_formed() -> None:
    tasks = long_tasks(6, seed=3)
    assert [t.to_json() for t in tasks] == [t.to_json() for t in long_tasks(6, seed=3)]
    assert tasks != long_tasks(6, seed=4)
    for i, t in enumerate(tasks):
        assert (
            t.id == f"long-{i:05d}"
            and t.source == "long"
            and sorted(t.files) == [f"part_{j:02d}.py" for j in range(12)]
        )
        for src in [*t.files.values(), t.reference, t.visible_tests, t.hidden_tests]:
            ast.parse(src)
        assert t.visible_tests.count("def test_example_") == 2 and t.hidden_tests.count("def test_case_") >= 7
        assert f"`{t.entry_point}(x)`" in t.prompt and "part_00.py" in t.prompt
        for j, src in enumerate(t.files.values()):  # each rule names a constant defined in another module
            rule = src.split("Rule: ", 1)[1].split("\n", 1)[0]
            name, home = rule.split("`")[1], rule.split(" defined in ")[1].split(".py")[0]
            assert home != f"part_{j:02d}" and f"\n{name} = " in t.files[f"{home}.py"]
    with pytest.raises(ValueError, match="modules"):
        long_tasks(1, seed=0, modules=1)
    with pytest.raises(ValueError, match="n=0"):
        long_tasks(0, seed=0)


def test_workspace_does_not_fit_a_small_context() -> None:
    tok = load_tokenizer(ModelConfig(source="tiny"))
    for t in long_tasks(3, seed=0):
        assert sum(len(tok(src).input_ids) for src in t.files.values()) > 2000


def test_reference_passes_hidden_tests_and_modules_are_importable_when_graded() -> None:
    [task] = long_tasks(1, seed=7, modules=4)
    cfg = SandboxConfig(timeout_s=20)
    importing = task.reference + "\nimport part_00  # the workspace modules are there when graded\n"
    ok = grade(task, {**task.files, "solution.py": importing}, cfg)
    assert ok.reward == 1.0 and ok.passed == ok.total >= 7
    wrong = grade(task, {**task.files, "solution.py": f"def {task.entry_point}(x):\n    return x\n"}, cfg)
    assert wrong.reward < 1.0


def test_easier_variants_keep_the_shape_and_the_default_is_unchanged() -> None:
    default = long_tasks(3, seed=0, modules=3, filler_lines=2)
    assert default == long_tasks(3, seed=0, modules=3, filler_lines=2, local_constants=False, rules=None)
    easy = long_tasks(6, seed=0, modules=3, filler_lines=2, local_constants=True, rules=("add", "sub", "mul"))
    for t in easy:
        assert "defined in the same module" in t.prompt
        for j in range(3):
            src = t.files[f"part_{j:02d}.py"]
            assert "defined in this module" in src.split('"""')[1]
        ops = [line.strip() for line in t.reference.splitlines() if line.strip().startswith("x = ")]
        assert len(ops) == 3 and all(op.split()[3] in "+-*" for op in ops)
        files = {**t.files, "solution.py": t.reference}
        assert grade(t, files, SandboxConfig(timeout_s=30)).reward == 1.0
    with pytest.raises(ValueError, match="tasks.long_rules"):
        long_tasks(1, seed=0, rules=("pow",))
