"""Tests of :mod:`shipyard.envs.tasks.files`: the documented task format and its loader.

Contract checked: the example file of docs/tasks.md loads, and its references earn 1.0 from
the production graders (function and db); a repo task made from a local git repository gets
that repository's HEAD snapshot (not its history or untracked files) and default protected
patterns, and is graded from the diff; every malformed file is rejected with a ValueError that
names the file, the task and the field; a run's extra training tasks come from
``tasks.num_db``, ``tasks.num_repo`` and ``tasks.files``.
"""

from __future__ import annotations

import subprocess
from dataclasses import replace
from pathlib import Path

import pytest

from shipyard.config.schema import SandboxConfig, TasksConfig
from shipyard.envs.grading.grader import grade
from shipyard.envs.services.pool import ServicePool
from shipyard.envs.services.postgres import postgres_available
from shipyard.envs.tasks.db import MIGRATION_FILE, grade_db
from shipyard.envs.tasks.files import check_references, extra_training_tasks, load_task_file, main
from shipyard.envs.tasks.repo import PROTECTED, RepoCache, grade_repo, make_patch

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "docs/examples/tasks.toml"
CFG = SandboxConfig(timeout_s=30)


def test_example_file_loads_and_its_function_reference_passes() -> None:
    fn, db = load_task_file(EXAMPLE)
    assert (fn.id, fn.kind, fn.source) == ("example-clamp", "function", "file:tasks.toml")
    assert (db.kind, db.services, sorted(db.hidden_checks)) == (
        "db",
        ["postgres"],
        ["constraint_added", "lowered"],
    )
    assert grade(fn, {"solution.py": fn.reference}, CFG).reward == 1.0
    identity = grade(fn, {"solution.py": "def clamp(x, lo, hi):\n    return x\n"}, CFG)
    assert (identity.passed, identity.total) == (1, 3)  # only test_inside


@pytest.mark.skipif(postgres_available() is not None, reason=str(postgres_available()))
def test_example_db_task_is_graded_against_postgres(capsys: pytest.CaptureFixture[str]) -> None:
    db = load_task_file(EXAMPLE)[1]
    with ServicePool() as pool:
        assert grade_db(db, {MIGRATION_FILE: "SELECT 1;"}, pool, CFG).reward == 0.0
    assert main([str(EXAMPLE)]) == 0  # every reference earns 1.0 under the production graders
    out = capsys.readouterr().out
    assert "example-clamp (function): reference reward 1.000" in out
    assert "example-email-lowercase (db): reference reward 1.000" in out


def _git(repo: Path, *args: str) -> None:
    env = {
        "GIT_AUTHOR_NAME": "t",
        "GIT_AUTHOR_EMAIL": "t@t",
        "GIT_COMMITTER_NAME": "t",
        "GIT_COMMITTER_EMAIL": "t@t",
    }
    subprocess.run(
        ["git", "-C", str(repo), *args], check=True, capture_output=True, env={"PATH": "/usr/bin:/bin", **env}
    )


def test_repo_task_from_a_local_repository(tmp_path: Path) -> None:
    repo = tmp_path / "calc"
    (repo / "calc").mkdir(parents=True)
    (repo / "tests").mkdir()
    (repo / "calc/__init__.py").write_text("")
    (repo / "calc/ops.py").write_text("def double(x):\n    return 2 * x\n")
    (repo / "tests/test_ops.py").write_text(
        "from calc.ops import double\n\n\ndef test_d():\n    assert double(1) == 2\n"
    )
    _git(repo, "init", "-q", "-b", "main")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "-m", "good")
    (repo / "calc/ops.py").write_text("def double(x):\n    return x + x + 1\n")
    _git(repo, "commit", "-q", "-am", "regression")
    (repo / "scratch.txt").write_text("untracked")
    (tmp_path / "t.toml").write_text(
        '[[task]]\nid = "calc-double"\nkind = "repo"\nrepo = "calc"\n'
        'prompt = "double(3) returns 7, it should return 6."\n'
        'hidden_tests = """\nfrom calc.ops import double\n\n\ndef test_issue():\n    assert double(3) == 6\n"""\n'
    )
    [task] = load_task_file(tmp_path / "t.toml")
    assert task.protected == PROTECTED and "scratch.txt" not in task.files
    assert task.files["calc/ops.py"] == "def double(x):\n    return x + x + 1\n"
    with RepoCache() as cache:
        fixed = {**task.files, "calc/ops.py": "def double(x):\n    return 2 * x\n"}
        assert grade_repo(task, fixed, CFG, cache).reward == 1.0
        assert grade_repo(task, dict(task.files), CFG, cache).reward == 0.0
    assert check_references([task]) == {}  # no reference: skipped
    fix = replace(task, reference=make_patch(task.files, fixed))
    unrelated = replace(
        task, id="calc-notes", reference=make_patch(task.files, {**task.files, "NOTES.md": "x\n"})
    )
    assert check_references([fix, unrelated]) == {"calc-double": 1.0, "calc-notes": 0.0}


BAD: list[tuple[str, str]] = [
    (
        '[[task]]\nid = "a"\nprompt = "p"\nentry_point = "f"\nhidden = "x"\n',
        r"task 'a': unknown fields \['hidden'\]",
    ),
    (
        '[[task]]\nid = "a"\nprompt = "p"\ndifficulty = "hard"\n',
        "task 'a': field `difficulty` must be an integer",
    ),
    ('[[task]]\nid = "a"\nentry_point = "f"\n', "task 'a': field `prompt` is required"),
    ('[[task]]\nprompt = "p"\n', r"task #1: field `id` is required"),
    ('[[task]]\nid = "a b"\nprompt = "p"\n', "field `id` must be"),
    (
        '[[task]]\nid = "a"\nprompt = "p"\nkind = "video"\nhidden_tests = "def test_a(): pass"\n',
        "field `kind`",
    ),
    (
        '[[task]]\nid = "a"\nprompt = "p"\nentry_point = "f"\nhidden_tests = "def test_a(:"\n',
        "field `hidden_tests`",
    ),
    ('[[task]]\nid = "a"\nprompt = "p"\nentry_point = "f"\nhidden_tests = "x = 1"\n', "no top-level test_"),
    ('[[task]]\nid = "a"\nprompt = "p"\nhidden_tests = "def test_a(): pass"\n', "needs `entry_point`"),
    ('[[task]]\nid = "a"\nprompt = "p"\nkind = "db"\n', r"needs `setup\.postgres`"),
    ('[[task]]\nid = "a"\nprompt = "p"\nkind = "db"\nsetup.postgres = "SELECT 1"\n', "needs `hidden_checks`"),
    (
        '[[task]]\nid = "a"\nprompt = "p"\nkind = "db"\nsetup.postgres = "SELECT 1"\nhidden_checks = {"a b" = "x"}\n',
        "must be identifiers",
    ),
    ('[[task]]\nid = "a"\nprompt = "p"\nservices = ["redis"]\n', "unknown service 'redis'"),
    (
        '[[task]]\nid = "a"\nprompt = "p"\nkind = "repo"\nrepo = "nowhere"\nhidden_tests = "def test_a(): pass"\n',
        "not a git",
    ),
    ('[[task]]\nid = "a"\nprompt = "p"\nrepo = "x"\n', "only for kind"),
    (
        '[[task]]\nid = "a"\nprompt = "p"\nentry_point = "f"\nhidden_tests = "def test_a(): pass"\n' * 2,
        "more than once",
    ),
    ("[[task]\n", "not valid TOML"),
    ("title = 1\n", "top level must hold only `task`"),
]


@pytest.mark.parametrize(("text", "error"), BAD)
def test_malformed_files_name_the_file_task_and_field(tmp_path: Path, text: str, error: str) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ValueError, match=error) as info:
        load_task_file(path)
    assert str(path) in str(info.value)


def test_json_lines_and_missing_files(tmp_path: Path) -> None:
    line = '{"id": "j", "prompt": "p", "entry_point": "f", "hidden_tests": "def test_a():\\n    pass\\n"}\n'
    (tmp_path / "t.jsonl").write_text(line)
    assert [t.id for t in load_task_file(tmp_path / "t.jsonl")] == ["j"]
    with pytest.raises(ValueError, match="does not exist"):
        load_task_file(tmp_path / "missing.toml")
    (tmp_path / "t.yaml").write_text("x")
    with pytest.raises(ValueError, match="unknown task file type"):
        load_task_file(tmp_path / "t.yaml")


def test_extra_training_tasks_from_the_config() -> None:
    tasks = extra_training_tasks(TasksConfig(num_db=2, num_repo=1, files=[str(EXAMPLE)]))
    assert [t.kind for t in tasks] == ["db", "db", "repo", "function", "db"]
    assert extra_training_tasks(TasksConfig()) == []
    with pytest.raises(ValueError, match="more than one file"):
        extra_training_tasks(TasksConfig(files=[str(EXAMPLE), str(EXAMPLE)]))
