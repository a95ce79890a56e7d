"""The ``tests`` reward component: each task kind's hidden tests, run where the policy cannot reach.

Contract: :func:`hidden_tests_reward` asks the task's kind (:func:`shipyard.envs.tasks.kinds.task_kind`):

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

from shipyard.envs.tasks.kinds import GradingContext, task_kind
from shipyard.envs.types import RewardResult, Task


def hidden_tests_reward(task: Task, files: dict[str, str], ctx: GradingContext) -> RewardResult:
    """The hidden-test result of ``files`` for ``task``: its kind's ``grade`` (module docstring)."""
    return task_kind(task.kind).grade(task, files, ctx)
