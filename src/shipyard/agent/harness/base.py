"""The harness interface: what plays one session of a task and returns its trajectories.

Contract: a :class:`Harness` plays ``task`` once with the session spec's policy (``spec.client``),
limits and workbench (``spec.bench``: the session's sandboxes and grader, an environment's hooks
when played through one) and returns the session's token-exact segments with the session's
reward on each; a failure of any kind comes back as trajectories with reward 0 and the reason
(``finish``, ``reward_info["reason"]``, ``error`` for a crash), never as an exception.
:func:`shipyard.agent.harness.make_harness` builds the one ``harness.type`` names;
:func:`shipyard.agent.play.play` is the one path every session takes to it.
"""

from __future__ import annotations

from typing import Protocol

from shipyard.agent.session import SessionSpec
from shipyard.agent.types import Trajectory
from shipyard.envs.types import Task


class Harness(Protocol):
    def run(self, spec: SessionSpec, task: Task, group_id: str, sample_idx: int) -> list[Trajectory]:
        """Play one session of ``task`` (module doc)."""
