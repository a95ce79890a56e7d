"""Tests of :mod:`shipyard.envs.tasks.repo`: squashed repositories, issues, diff-based grading.

Contract checked: squashing leaves one commit, one ref, no reflog, tag, pack or dangling object,
and not the object of the fixed code that the history held; a task's repository is rebuilt
byte-identically (same commit hash) and shows one commit inside a sandbox; :func:`make_patch`
round-trips additions, edits, deletions and files without a final newline; every reference fix
earns 1.0 and doing nothing 0.0; editing protected tests or adding a conftest changes nothing; a
change that breaks a ``test_keep_*`` test earns 0; a partial fix earns its exact fraction.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator

import pytest

from shipyard.config.schema import SandboxConfig
from shipyard.envs.sandbox import BwrapSandbox
from shipyard.envs.tasks.repo import (
    TEMPLATES,
    RepoCache,
    apply_patch_locally,
    grade_repo,
    make_patch,
    materialize,
    repo_tasks,
    squash_repository,
)
from shipyard.envs.types import Task

CFG = SandboxConfig(timeout_s=30)
N_DEFECTS = sum(len(t.defects) for t in TEMPLATES.values())


@pytest.fixture(scope="module")
def tasks() -> list[Task]:
    return repo_tasks(N_DEFECTS, seed=0)


@pytest.fixture(scope="module")
def cache() -> Iterator[RepoCache]:
    with RepoCache() as c:
        yield c


def _git(repo: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["git", "-C", repo, *args], capture_output=True, text=True)


def _blob_hash(text: str) -> str:
    return subprocess.run(
        ["git", "hash-object", "--stdin"], input=text, capture_output=True, text=True, check=True
    ).stdout.strip()


def _assert_single_commit(repo: str, absent: str) -> None:
    assert _git(repo, "log", "--all", "--oneline").stdout.count("\n") == 1
    assert _git(repo, "for-each-ref", "--format=%(refname)").stdout.split() == ["refs/heads/main"]
    fsck = _git(repo, "fsck", "--unreachable", "--dangling", "--no-reflogs", "--full")
    assert fsck.returncode == 0 and fsck.stdout == "", fsck.stdout
    assert _git(repo, "cat-file", "-e", absent).returncode != 0  # the fixed code is not in the repository
    assert not os.path.exists(os.path.join(repo, ".git", "logs"))
    assert not os.path.exists(os.path.join(repo, ".git", "packed-refs"))
    assert "packs: 0" in _git(repo, "count-objects", "-v").stdout


def test_squash_drops_history_refs_and_the_solution(tmp_path: object) -> None:
    root = str(tmp_path)
    src, dest = os.path.join(root, "src"), os.path.join(root, "dest")
    os.mkdir(src)
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t"}
    env["GIT_COMMITTER_EMAIL"] = "t@t"
    solution = "def f():\n    return 42  # the fix\n"

    def git(*args: str) -> None:
        subprocess.run(["git", "-C", src, *args], check=True, capture_output=True, env=env)

    with open(os.path.join(src, "mod.py"), "w") as f:
        f.write(solution)
    git("init", "-q", "-b", "main")
    git("add", "-A")
    git("commit", "-q", "-m", "fixed")
    git("tag", "v1")
    git("branch", "keep-fix")
    with open(os.path.join(src, "mod.py"), "w") as f:
        f.write("def f():\n    return 41\n")
    git("commit", "-q", "-am", "regress")
    git("gc", "-q")  # history now lives in a pack
    assert _git(src, "cat-file", "-e", _blob_hash(solution)).returncode == 0
    squash_repository(src, dest)
    _assert_single_commit(dest, _blob_hash(solution))
    with open(os.path.join(dest, "mod.py")) as f:
        assert f.read() == "def f():\n    return 41\n"


def test_task_repositories_are_reproducible_one_commit_snapshots(tasks: list[Task], tmp_path: object) -> None:
    task = tasks[0]
    fixed = apply_patch_locally(task.files, task.reference)
    changed = next(p for p in fixed if fixed[p] != task.files.get(p))
    a, b = os.path.join(str(tmp_path), "a"), os.path.join(str(tmp_path), "b")
    assert materialize(task.files, a) == materialize(task.files, b)
    _assert_single_commit(a, _blob_hash(fixed[changed]))
    with BwrapSandbox(None, CFG, base=a) as sb:
        log = sb.exec("git log --all --oneline && git show HEAD~1")
        assert log.stdout.count("\n") == 1 and log.returncode != 0
        assert sb.exec("python -m pytest -q -p no:cacheprovider tests").returncode == 0  # visible tests run


def test_generation_is_deterministic_and_every_defect_comes_first(tasks: list[Task]) -> None:
    again = repo_tasks(2, seed=0)
    assert [t.to_json() for t in again] == [t.to_json() for t in tasks[:2]]
    keys = {(t.id.split("-")[1], t.id.split("-")[2]) for t in tasks}
    assert len(keys) == N_DEFECTS
    for t in tasks:
        assert t.kind == "repo" and "tests/*" in t.protected and t.reference.startswith("diff --git")
        assert any(p.startswith("tests/") for p in t.files) and "README.md" in t.files
        assert Task.from_json(t.to_json()) == t
    with pytest.raises(ValueError, match="n=999"):
        repo_tasks(999, seed=0)


def test_make_patch_round_trips() -> None:
    before = {"a.py": "x = 1\n", "b.py": "gone\n", "c.txt": "no newline", "keep.py": "same\n"}
    after = {"a.py": "x = 2\n", "c.txt": "still none", "new/d.py": "d = 4\n", "keep.py": "same\n"}
    patch = make_patch(before, after)
    assert apply_patch_locally(before, patch) == after
    assert "keep.py" not in patch
    protected = make_patch(before, {**after, "tests/test_x.py": "hack\n"}, ["tests/*"])
    assert "tests/test_x.py" not in protected


def test_references_pass_and_doing_nothing_earns_nothing(tasks: list[Task], cache: RepoCache) -> None:
    for task in tasks:
        good = grade_repo(task, apply_patch_locally(task.files, task.reference), CFG, cache)
        assert (good.reward, good.passed, good.total) == (1.0, good.total, good.total), (
            task.id,
            good.details,
        )
        nothing = grade_repo(task, dict(task.files), CFG, cache)
        assert nothing.reward == 0.0, (task.id, nothing.details.get("tests"))


def test_protected_files_are_restored_and_breakage_is_zero(tasks: list[Task], cache: RepoCache) -> None:
    task = next(t for t in tasks if "-negative_format-" in t.id)
    pkg = task.entry_point.split("/")[0]
    test_file = next(p for p in task.files if p.startswith("tests/"))
    tampered = {
        **task.files,
        test_file: "def test_nothing():\n    pass\n",
        "conftest.py": "import pytest\n",
        "tests/conftest.py": "raise SystemExit(0)\n",
    }
    res = grade_repo(task, tampered, CFG, cache)
    assert res.reward == 0.0 and "tests/" not in "".join(res.details.get("dropped_files", []))
    fixed = apply_patch_locally(task.files, task.reference)
    also_tampered = {**fixed, test_file: "", "conftest.py": "import pytest\n"}
    assert grade_repo(task, also_tampered, CFG, cache).reward == 1.0
    broken_balance = fixed[f"{pkg}/accounts.py"].replace('+ entry["cents"]', '- entry["cents"]')
    breaks = grade_repo(task, {**fixed, f"{pkg}/accounts.py": broken_balance}, CFG, cache)
    assert breaks.reward == 0.0 and "test_keep_balance" in breaks.details["reason"]


def test_partial_fix_earns_its_fraction(tasks: list[Task], cache: RepoCache) -> None:
    task = next(t for t in tasks if "-negative_format-" in t.id)
    money = task.entry_point
    # handles -5 (small negatives) but not -1234: one of the two issue tests
    partial = task.files[money].replace(
        "    whole, frac = divmod(cents, 100)\n",
        "    if -100 < cents < 0:\n        return f'-0.{-cents:02d}'\n    whole, frac = divmod(cents, 100)\n",
    )
    res = grade_repo(task, {**task.files, money: partial}, CFG, cache)
    assert (res.reward, res.passed, res.total) == (0.5, 1, 2)
    outcomes = {k: v["outcome"] for k, v in res.details["tests"].items()}
    assert outcomes["test_issue_small_negative"] == "passed" and outcomes["test_issue_negative"] == "failed"
