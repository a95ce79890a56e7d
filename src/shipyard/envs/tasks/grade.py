"""The ``tests`` reward component: each task kind's hidden tests, run where the policy cannot reach.

Contract: :func:`hidden_tests_reward` switches on ``Task.kind``:

- ``function``: the two-sandbox hidden-test grader (:func:`shipyard.envs.grading.grader.grade`, or the
  grader a caller passes in): passed / expected tests;
- ``repo``: the session's diff applied to a fresh copy of the squashed repository, then the
  same grader, gated on the ``test_keep_*`` tests (:func:`shipyard.envs.tasks.repo.grade_repo`);
- ``db``: ``migration.sql`` applied to a fresh database clone, then the hidden SQL checks
  (:func:`shipyard.envs.tasks.db.grade_db`).

Example::

    res = hidden_tests_reward(task, files, GradingContext(cfg.sandbox, pool, repos))
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from shipyard.config.schema import SandboxConfig
from shipyard.envs.services.pool import ServicePool
from shipyard.envs.tasks.repo import RepoCache
from shipyard.envs.types import RewardResult, Task

TASK_KINDS = ("function", "repo", "db")
"""Every value ``Task.kind`` may take."""


@dataclass
class GradingContext:
    """What grading needs besides the task and files: limits, the pool's services and repositories."""

    sandbox: SandboxConfig
    services: ServicePool
    repos: RepoCache
    function_grader: Callable[[Task, dict[str, str]], RewardResult] | None = None
    """Grader of ``function`` tasks (None: :func:`shipyard.envs.grading.grader.grade` with ``sandbox``)."""


def hidden_tests_reward(task: Task, files: dict[str, str], ctx: GradingContext) -> RewardResult:
    """The hidden-test result of ``files`` for ``task`` (see the module docstring)."""
    if task.kind == "function":
        if ctx.function_grader is not None:
            return ctx.function_grader(task, files)
        from shipyard.envs.grading.grader import grade

        return grade(task, files, ctx.sandbox)
    if task.kind == "repo":
        from shipyard.envs.tasks.repo import grade_repo

        return grade_repo(task, files, ctx.sandbox, ctx.repos)
    if task.kind == "db":
        from shipyard.envs.tasks.db import grade_db

        return grade_db(task, files, ctx.services, ctx.sandbox)
    raise ValueError(f"task {task.id!r} has kind {task.kind!r}; known kinds are {list(TASK_KINDS)}")
