"""Load user task files (the documented format, docs/tasks.md) into validated :class:`Task` records.

Contract: :func:`load_task_file` reads one file: ``.toml`` (an array of ``[[task]]`` tables),
``.json`` (a list of task objects, or ``{"task": [...]}``) or ``.jsonl`` (one task object per
line). Every task is checked before any is returned, and the first problem raises a
``ValueError`` naming the file, the task (by id, or by position when it has none) and the field,
with how to fix it: unknown fields, wrong types, a missing ``id``/``prompt``, duplicate ids, an
unknown ``kind`` or service, hidden tests that are not Python or hold no ``test_*`` function,
db tasks without ``setup.postgres`` or ``hidden_checks``, check names that are not identifiers.

Fields are those of :class:`~shipyard.envs.types.Task` plus ``repo`` (repo tasks): a path,
relative to the task file, of a local git repository whose HEAD snapshot becomes the task's
files (history, other refs and untracked files are not carried: see
:func:`shipyard.envs.tasks.repo.squash_repository`). Repo tasks get
:data:`shipyard.envs.tasks.repo.PROTECTED` when they list no ``protected`` patterns; db tasks get
``services = ["postgres"]`` when they list none. :func:`extra_training_tasks` builds the tasks a
run adds to its training set from ``tasks.num_db``, ``tasks.num_repo`` and ``tasks.files``;
:func:`check_references` grades every task's ``reference`` with the production graders
(``python -m shipyard.envs.tasks.files FILE...`` prints them and exits 1 if one earns less than 1).

Example::

    tasks = load_task_file("my_tasks.toml")      # [Task(id='fizz', kind='function', ...), ...]
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
import tomllib
from dataclasses import fields
from pathlib import Path
from typing import Any

from shipyard.config.schema import TASK_KINDS, SandboxConfig, TasksConfig
from shipyard.envs.services.base import SERVICE_NAMES
from shipyard.envs.tasks.kinds import task_kind
from shipyard.envs.types import Task

_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,99}$")
_STR, _MAP, _LIST, _INT = "a string", "a table of strings (name -> text)", "a list of strings", "an integer"
_TYPES: dict[str, str] = {
    "id": _STR,
    "prompt": _STR,
    "entry_point": _STR,
    "files": _MAP,
    "visible_tests": _STR,
    "hidden_tests": _STR,
    "difficulty": _INT,
    "source": _STR,
    "reference": _STR,
    "kind": _STR,
    "services": _LIST,
    "setup": _MAP,
    "hidden_checks": _MAP,
    "protected": _LIST,
    "family": _STR,
    "repo": _STR,
}
"""Every field a task may have, with its type as the error messages name it."""
assert set(_TYPES) == {f.name for f in fields(Task)} | {"repo"}


def _records(path: Path) -> list[Any]:
    text = path.read_text(encoding="utf-8")
    try:
        if path.suffix == ".toml":
            data: Any = tomllib.loads(text)
        elif path.suffix == ".jsonl":
            data = [json.loads(line) for line in text.splitlines() if line.strip()]
        elif path.suffix == ".json":
            data = json.loads(text)
        else:
            raise ValueError(f"{path}: unknown task file type {path.suffix!r}; use .toml, .json or .jsonl")
    except (tomllib.TOMLDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: not valid {path.suffix[1:].upper()}: {exc}") from None
    if isinstance(data, dict):
        if set(data) - {"task"}:
            raise ValueError(
                f"{path}: top level must hold only `task` (an array of tasks), found {sorted(data)}"
            )
        data = data.get("task", [])
    if not isinstance(data, list) or not data:
        raise ValueError(f"{path}: no tasks found; write one or more [[task]] tables (see docs/tasks.md)")
    return data


def _check_type(where: str, name: str, value: Any) -> None:
    kind = _TYPES[name]
    ok = {
        _STR: isinstance(value, str),
        _INT: isinstance(value, int) and not isinstance(value, bool),
        _LIST: isinstance(value, list) and all(isinstance(v, str) for v in value),
        _MAP: isinstance(value, dict)
        and all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()),
    }[kind]
    if not ok:
        raise ValueError(f"{where}: field `{name}` must be {kind}, got {type(value).__name__}")


def _repo_files(where: str, base: Path, repo: str) -> dict[str, str]:
    from shipyard.envs.tasks.repo import repo_text_files, squash_repository

    src = (base / repo).resolve()
    if not (src / ".git").exists():
        raise ValueError(f"{where}: field `repo` = {repo!r} ({src}) is not a git repository (no .git)")
    work = tempfile.mkdtemp(prefix="shipyard-task-repo-")
    try:
        squash_repository(str(src), os.path.join(work, "repo"))
        return repo_text_files(os.path.join(work, "repo"))
    except RuntimeError as exc:
        raise ValueError(f"{where}: field `repo`: {exc}") from None
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _check_kind(where: str, task: Task) -> None:
    if task.kind not in TASK_KINDS:
        raise ValueError(f"{where}: field `kind` = {task.kind!r} must be one of {list(TASK_KINDS)}")
    for name in task.services:
        if name not in SERVICE_NAMES:
            raise ValueError(
                f"{where}: field `services` names unknown service {name!r}; known: {list(SERVICE_NAMES)}"
            )
    task_kind(task.kind).check(task, where)


def _task(path: Path, index: int, raw: Any) -> Task:
    where = f"{path}: task #{index + 1}"
    if not isinstance(raw, dict):
        raise ValueError(f"{where}: must be a table of fields, got {type(raw).__name__}")
    if isinstance(raw.get("id"), str):
        where = f"{path}: task {raw['id']!r}"
    unknown = sorted(set(raw) - set(_TYPES))
    if unknown:
        raise ValueError(f"{where}: unknown fields {unknown}; known fields are {sorted(_TYPES)}")
    for name, value in raw.items():
        _check_type(where, name, value)
    for name in ("id", "prompt"):
        if not str(raw.get(name, "")).strip():
            raise ValueError(f"{where}: field `{name}` is required and must not be empty")
    if not _ID.match(raw["id"]):
        raise ValueError(f"{where}: field `id` must be 1-100 of letters, digits, '_', '.', '-'")
    fields_ = {k: v for k, v in raw.items() if k != "repo"}
    fields_.setdefault("kind", "function")
    fields_.setdefault("source", f"file:{path.name}")
    fields_.setdefault("entry_point", "")
    if "repo" in raw:
        if fields_["kind"] != "repo":
            raise ValueError(f'{where}: field `repo` is only for kind = "repo" tasks')
        fields_["files"] = {**_repo_files(where, path.parent, raw["repo"]), **fields_.get("files", {})}
    if fields_["kind"] == "repo" and "protected" not in raw:
        from shipyard.envs.tasks.repo import PROTECTED

        fields_["protected"] = list(PROTECTED)
    if fields_["kind"] == "db" and "services" not in raw:
        fields_["services"] = ["postgres"]
    task = Task(**fields_)
    _check_kind(where, task)
    return task


def load_task_file(path: str | os.PathLike[str]) -> list[Task]:
    """Every task of one task file, validated (see the module docstring)."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(
            f"task file {str(p)!r} does not exist (tasks.files entries are paths to .toml/.json/.jsonl)"
        )
    tasks = [_task(p, i, raw) for i, raw in enumerate(_records(p))]
    seen: set[str] = set()
    for t in tasks:
        if t.id in seen:
            raise ValueError(f"{p}: task id {t.id!r} appears more than once; ids must be unique")
        seen.add(t.id)
    return tasks


def extra_training_tasks(cfg: TasksConfig) -> list[Task]:
    """Generated db and repo tasks (``tasks.num_db``, ``tasks.num_repo``) and the tasks of ``tasks.files``."""
    from shipyard.envs.tasks.db import db_tasks
    from shipyard.envs.tasks.repo import repo_tasks

    out = db_tasks(cfg.num_db, cfg.seed) + repo_tasks(cfg.num_repo, cfg.seed)
    for path in cfg.files:
        out += load_task_file(path)
    check_unique_ids(out, "tasks.files")
    return out


def check_unique_ids(tasks: list[Task], field: str) -> None:
    """ValueError naming ``field`` when a task id appears twice among ``tasks`` (from several files)."""
    ids = [t.id for t in tasks]
    dup = sorted({i for i in ids if ids.count(i) > 1})
    if dup:
        raise ValueError(f"{field}: task ids {dup} appear in more than one file; ids must be unique")


def check_references(tasks: list[Task], cfg: SandboxConfig | None = None) -> dict[str, float]:
    """Task id -> reward of its ``reference`` under the production graders (tasks without one are skipped).

    A reference is ``solution.py`` for function tasks, the fixing diff for repo tasks and
    ``migration.sql`` for db tasks; every one should earn 1.0.
    """
    from shipyard.envs.services.pool import ServicePool
    from shipyard.envs.tasks.grade import hidden_tests_reward
    from shipyard.envs.tasks.kinds import GradingContext
    from shipyard.envs.tasks.repo import RepoCache

    cfg = cfg if cfg is not None else SandboxConfig()
    out: dict[str, float] = {}
    with ServicePool() as pool, RepoCache() as repos:
        ctx = GradingContext(cfg, pool, repos)
        for task in tasks:
            if not task.reference:
                continue
            files = task_kind(task.kind).reference_files(task)
            out[task.id] = hidden_tests_reward(task, files, ctx).reward
    return out


def main(argv: list[str] | None = None) -> int:
    """``python -m shipyard.envs.tasks.files FILE...``: validate task files and grade their references."""
    import argparse

    ap = argparse.ArgumentParser(description="Validate task files and grade their reference solutions.")
    ap.add_argument("files", nargs="+", help=".toml / .json / .jsonl task files (docs/tasks.md)")
    args = ap.parse_args(argv)
    failed = 0
    for path in args.files:
        tasks = load_task_file(path)
        rewards = check_references(tasks)
        for task in tasks:
            reward = rewards.get(task.id)
            shown = "no reference" if reward is None else f"reference reward {reward:.3f}"
            print(f"{path}: {task.id} ({task.kind}): {shown}")
            failed += reward is not None and reward < 1.0
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
