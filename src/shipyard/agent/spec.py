"""The session spec a run plays with: its inference client, chat frame, limits, sandboxes and grader.

Contract: :func:`session_spec` builds the :class:`~shipyard.agent.session.SessionSpec` every
session of a run uses (training, evaluation, demonstrations) from the config: sandboxes of
``sandbox.type`` (:func:`shipyard.envs.sandbox.make_sandbox`) and the hidden-test grader, both
limited by ``sandbox``, played by the harness ``harness.type`` names (:mod:`shipyard.agent.harness`); an :class:`~shipyard.envs.environment.Environment` swaps in its own per
task kind when a session is played through it (:func:`shipyard.agent.play.play`).
"""

from __future__ import annotations

from typing import Any

from shipyard.agent.session import ChatFrame, SessionSpec
from shipyard.config.schema import SandboxConfig, ShipyardConfig
from shipyard.envs.types import RewardResult, Sandbox, Task
from shipyard.inference.types import InferenceClient


class SandboxWorkbench:
    """The run's workbench: sandboxes of ``sandbox.type`` and the two-sandbox hidden-test grader,
    both limited by ``cfg``."""

    def __init__(self, cfg: SandboxConfig) -> None:
        self.cfg = cfg

    def sandbox(self, files: dict[str, str]) -> Sandbox:
        """A sandbox of the backend ``sandbox.type`` names, holding ``files``."""
        from shipyard.envs.sandbox import make_sandbox

        return make_sandbox(self.cfg, files)

    def grade(self, task: Task, files: dict[str, str]) -> RewardResult:
        """The hidden tests of ``task`` graded on ``files`` in a fresh sandbox."""
        from shipyard.envs.grading.grader import grade

        return grade(task, files, self.cfg)


def session_spec(cfg: ShipyardConfig, client: InferenceClient, tokenizer: Any) -> SessionSpec:
    """The spec of every session of the run ``cfg`` describes, sampling from ``client``."""
    from shipyard.agent.harness import make_harness

    return SessionSpec(
        client=client,
        frame=ChatFrame(tokenizer),
        agent=cfg.agent,
        sampling=cfg.sampling,
        bench=SandboxWorkbench(cfg.sandbox),
        seed=cfg.run.seed,
        harness=make_harness(cfg),
    )
