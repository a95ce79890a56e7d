"""The built-in harness: Shipyard's markdown-action agent (:mod:`shipyard.agent.session`).

Contract: :class:`BuiltinHarness` plays a session with :func:`~shipyard.agent.session.run_session`
(actions parsed from the policy's text, tool results fed back as tokens, self-summarization);
it is ``harness.type = "builtin"``, the default, and its recorded formats are unchanged.
"""

from __future__ import annotations

from shipyard.agent.session import SessionSpec, run_session
from shipyard.agent.types import Trajectory
from shipyard.envs.types import Task


class BuiltinHarness:
    def run(self, spec: SessionSpec, task: Task, group_id: str, sample_idx: int) -> list[Trajectory]:
        return run_session(spec, task, group_id, sample_idx)
