"""Which tasks a run trains on, which it tunes on and which it only reports: the one place the splits are drawn.

Contract, for generated function tasks (``tasks.set = "functions"``): the generator's first
``tasks.num_generated`` tasks (``tasks.seed``) up to ``tasks.max_difficulty`` are split, per
difficulty and seeded (:func:`~shipyard.envs.tasks.functions.split_tasks`), in two steps:

- ``tasks.heldout_frac`` of them are **validation**, the split to tune on: the "held-out" split of
  every run before the test split existed (less the unseen families' tasks, when some are held
  out), so every configuration tuned so far was tuned on it;
- ``tasks.test_frac`` of the rest are **test**, the split that is only reported: tasks no
  configuration was chosen on (``test_frac = 0``: none);
- the rest are **training**;
- **unseen families**: ``tasks.unseen_families`` families (:func:`unseen_families`) are never
  trained on. Their tasks are left out of all three splits and form their own suite
  (:func:`unseen_family_tasks`): for ``eval.split = "validation"`` theirs in validation, for
  ``"test"`` all their others (none of which training or validation holds).

The generator never repeats a task (family, name, parameters, summary), so the splits share no
task; tasks of one family differ by names, constants and inputs, so validation and test measure
renamed instances of trained families and the unseen-families suite measures families never
trained. :func:`task_splits` gives (training, validation); :func:`heldout_tasks` gives ``n``
held-out tasks of a kind (function: of ``eval.split``; db, repo) that training never sees; :func:`unseen_family_tasks`
the unseen-families suite.
Deterministic in the config (seeds), so the trainer's workers, the train driver's before/after
evaluation and ``shipyard eval`` draw the same tasks in every process. The ``long`` set has
training and validation only.
"""

from __future__ import annotations

import copy
import functools
import random
from dataclasses import dataclass

from shipyard.config.schema import TASK_KINDS, ShipyardConfig
from shipyard.envs.types import Task


def task_splits(cfg: ShipyardConfig) -> tuple[list[Task], list[Task]]:
    """(training, validation) tasks of the set ``tasks.set`` (module doc)."""
    splits = _splits(cfg)
    return splits.train, splits.validation


@dataclass
class _Splits:
    """The tasks of ``tasks.set`` by split (module doc); unseen families' tasks only in the last two."""

    train: list[Task]
    validation: list[Task]
    test: list[Task]
    unseen_validation: list[Task]
    """Unseen families' tasks that the validation split drew."""
    unseen_other: list[Task]
    """Every other task of the unseen families (the unseen-families suite's test split)."""


def _splits(cfg: ShipyardConfig) -> _Splits:
    from shipyard.envs.tasks.functions import generated_tasks, split_tasks

    t = cfg.tasks
    if t.set == "long":
        from shipyard.envs.tasks.long import long_tasks

        tasks = long_tasks(
            t.num_generated,
            t.seed,
            t.long_modules,
            t.long_filler_lines,
            local_constants=t.long_local_constants,
            rules=None if t.long_rules is None else tuple(t.long_rules),
        )
    else:
        tasks = [x for x in generated_tasks(t.num_generated, t.seed) if x.difficulty <= t.max_difficulty]
    rest, validation = split_tasks(tasks, t.heldout_frac, t.seed)
    train, test = split_tasks(rest, t.test_frac, t.seed) if t.test_frac > 0 else (rest, [])
    unseen = unseen_families(cfg)
    seen = [[x for x in split if x.family not in unseen] for split in (train, validation, test)]
    return _Splits(
        *seen,
        unseen_validation=[x for x in validation if x.family in unseen],
        unseen_other=[x for x in rest if x.family in unseen],
    )


def unseen_families(cfg: ShipyardConfig) -> frozenset[str]:
    """The ``tasks.unseen_families`` family keys training never sees: per difficulty (1 up to
    ``tasks.max_difficulty``) the families are shuffled by ``tasks.seed``, then taken a difficulty
    at a time in turn (1, 2, .., 1, 2, ..), so every difficulty gives up about as many."""
    t = cfg.tasks
    if t.unseen_families == 0:
        return frozenset()
    from shipyard.envs.tasks.function_families import FAMILIES

    rng = random.Random(f"unseen-families-{t.seed}")
    levels = [sorted(f.key for f in FAMILIES if f.difficulty == d) for d in range(1, t.max_difficulty + 1)]
    if t.unseen_families >= sum(map(len, levels)):
        raise ValueError(
            f"tasks.unseen_families={t.unseen_families} leaves no family to train on: difficulties up to "
            f"tasks.max_difficulty={t.max_difficulty} have {sum(map(len, levels))} families; lower it"
        )
    for keys in levels:
        rng.shuffle(keys)
    order = [keys[i] for i in range(max(map(len, levels))) for keys in levels if i < len(keys)]
    return frozenset(order[: t.unseen_families])


def unseen_family_tasks(cfg: ShipyardConfig, n: int) -> list[Task]:
    """``n`` tasks of the unseen families (:func:`unseen_families`) for ``eval.split`` (module doc)."""
    assert cfg.tasks.unseen_families, "the config's validator requires unseen families for this suite"
    splits = _splits(cfg)
    tasks = splits.unseen_other if cfg.eval.split == "test" else splits.unseen_validation
    return _first(cfg, tasks, n, "eval.unseen_n", "of the unseen families", "tasks.unseen_families")


def _first(cfg: ShipyardConfig, tasks: list[Task], n: int, field: str, which: str, knob: str) -> list[Task]:
    """The first ``n`` of ``tasks`` (a split of generated tasks), or a ValueError naming the fields."""
    t = cfg.tasks
    if len(tasks) < n:
        raise ValueError(
            f"{field}={n} but the {cfg.eval.split} split has {len(tasks)} tasks {which} (tasks.num_generated="
            f"{t.num_generated}, tasks.heldout_frac={t.heldout_frac}, tasks.test_frac={t.test_frac}, "
            f"tasks.max_difficulty={t.max_difficulty}, tasks.unseen_families={t.unseen_families}): "
            f"lower {field}, or raise tasks.num_generated or {knob}"
        )
    return tasks[:n]


def heldout_tasks(cfg: ShipyardConfig, kind: str, n: int) -> list[Task]:
    """``n`` held-out tasks of ``kind`` from the generators the run trains on, none of them trained on.

    - ``function``: the first ``n`` tasks of ``eval.split`` (module doc: validation, the held-out
      share of :func:`task_splits`, or test), unseen families left out, never
      fewer (a ValueError names the fields);
    - ``db``: ``db_tasks(tasks.num_db + n, tasks.seed)[tasks.num_db:]``: the rollout worker trains on
      the first ``tasks.num_db`` tasks, and task ``k`` of the generator does not depend on ``n``, so
      these are other instances (own rows, names and checks) of the same migration families;
    - ``repo``: tasks whose (template, defect) pair is not among the ``tasks.num_repo`` trained
      tasks. Tasks of one pair differ only by the package name (the fix is the same), so a held-out
      repo task is a defect training never saw; there are 8 pairs, so ``tasks.num_repo`` must leave
      some unseen (at most 7 when every trained task has its own pair).

    Raises ValueError when the generator cannot give ``n`` such tasks, naming the fields to change.
    """
    t = cfg.tasks
    if kind == "function":
        splits = _splits(cfg)
        held = splits.test if cfg.eval.split == "test" else splits.validation
        knob = "tasks.test_frac" if cfg.eval.split == "test" else "tasks.heldout_frac"
        return _first(cfg, held, n, "eval.heldout_n", "of the trained families", knob)
    if kind == "db":
        from shipyard.envs.tasks.db import db_tasks

        return db_tasks(t.num_db + n, t.seed)[t.num_db :]
    if kind == "repo":
        every = [copy.deepcopy(x) for x in _every_repo_task(t.seed)]
        seen = {_repo_pair(x) for x in every[: t.num_repo]}
        held = [x for x in every[t.num_repo :] if _repo_pair(x) not in seen][:n]
        if len(held) < n:
            pairs = len({_repo_pair(x) for x in every})
            raise ValueError(
                f"eval.repo_n={n} held-out repo tasks asked for, but tasks.num_repo={t.num_repo} trains on "
                f"{len(seen)} of the {pairs} defects, leaving {len(held)} untrained tasks; lower "
                "tasks.num_repo or eval.repo_n"
            )
        return held
    raise ValueError(f"held-out kind {kind!r} is unknown; use one of {list(TASK_KINDS)}")


@functools.lru_cache(maxsize=2)
def _every_repo_task(seed: int) -> tuple[Task, ...]:
    """Every task the repo generator makes for ``seed``, in its order (built once per seed: each
    task builds and squashes a git history; callers get copies)."""
    from shipyard.envs.tasks.repo import TEMPLATES, repo_tasks

    return tuple(repo_tasks(sum(len(t.defects) * len(t.names) for t in TEMPLATES.values()), seed))


def _repo_pair(task: Task) -> str:
    """``repo-<template>-<defect>`` of a generated repo task id (``...-<index>`` dropped)."""
    return task.id.rsplit("-", 1)[0]
