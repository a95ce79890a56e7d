"""Play one session: the one path training, evaluation and demonstrations take.

Contract: :func:`play` runs the spec's harness (``spec.harness``, :mod:`shipyard.agent.harness`;
None: the built-in one, :func:`~shipyard.agent.session.run_session`) for one session of ``task``. Given an :class:`~shipyard.envs.environment.Environment`, the session goes through that
environment's hooks: its sandbox comes from the environment by task kind (function tasks from
``sandbox_factory``, e.g. a worker's pre-warmed pool, else the spec's own; repo tasks over the
squashed repository; db tasks with a fresh database lease), it is graded by the environment's
reward components, and the returned trajectories carry ``reward_components`` and anti-cheat
``flags``. Without one, the spec's workbench (sandboxes and grader) serves the session as it is. A
session that crashes comes back as a trajectory with its error (see ``run_session``).

Example::

    with Environment.from_config(cfg) as env:
        trajs = play(session_spec(cfg, client, tokenizer), task, "g0", 0, env)
"""

from __future__ import annotations

import dataclasses

from shipyard.agent.harness.builtin import BuiltinHarness
from shipyard.agent.session import SessionSpec
from shipyard.agent.types import Trajectory
from shipyard.envs.environment import Environment, SandboxFactory
from shipyard.envs.types import Task


def play(
    spec: SessionSpec,
    task: Task,
    group_id: str,
    sample_idx: int,
    env: Environment | None = None,
    sandbox_factory: SandboxFactory | None = None,
) -> list[Trajectory]:
    """The trajectories (one per context segment) of one session of ``task`` (module doc)."""
    harness = spec.harness if spec.harness is not None else BuiltinHarness()
    if env is None:
        return harness.run(spec, task, group_id, sample_idx)
    with env.session(task, sandbox_factory or spec.bench.sandbox, spec.bench.grade) as hooks:
        hooked = dataclasses.replace(spec, bench=hooks)
        trajs = harness.run(hooked, task, group_id, sample_idx)
    hooks.annotate(trajs)
    return trajs
