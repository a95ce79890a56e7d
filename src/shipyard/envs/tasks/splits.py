"""Which tasks a run trains on and which it holds out: the one place the splits are drawn.

Contract: :func:`task_splits` gives the (training, held-out) function or long tasks of
``tasks.set``; :func:`heldout_tasks` gives ``n`` held-out tasks of a kind (function, db, repo)
that training never sees. Deterministic in the config (seeds), so the trainer's workers, the train
driver's before/after evaluation and ``shipyard eval`` draw the same tasks in every process.
"""

from __future__ import annotations

import copy
import functools

from shipyard.config.schema import TASK_KINDS, ShipyardConfig
from shipyard.envs.types import Task


def task_splits(cfg: ShipyardConfig) -> tuple[list[Task], list[Task]]:
    """(training, held-out) tasks of the set ``tasks.set`` (functions: up to ``tasks.max_difficulty``)."""
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
    return split_tasks(tasks, t.heldout_frac, t.seed)


def heldout_tasks(cfg: ShipyardConfig, kind: str, n: int) -> list[Task]:
    """``n`` held-out tasks of ``kind`` from the generators the run trains on, none of them trained on.

    - ``function``: the first ``n`` of :func:`task_splits`' held-out tasks (``tasks.set``), never
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
        held = task_splits(cfg)[1]
        if len(held) < n:
            raise ValueError(
                f"eval.heldout_n={n} but the held-out split has {len(held)} tasks (tasks.num_generated="
                f"{t.num_generated}, tasks.heldout_frac={t.heldout_frac}, tasks.max_difficulty={t.max_difficulty}): "
                "lower eval.heldout_n or raise tasks.num_generated"
            )
        return held[:n]
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
