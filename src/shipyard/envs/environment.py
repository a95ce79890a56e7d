"""One pool's environment: sandboxes, services and rewards for every task kind, with anti-cheat.

Contract: an :class:`Environment` belongs to one pool (a rollout worker) and owns what tasks
share there: the :class:`~shipyard.envs.services.base.ServicePool` (PostgreSQL starts on the
first db task), the :class:`~shipyard.envs.tasks.repo.RepoCache` (one squashed repository per
repo task) and the LLM judge when a judge component has weight. :meth:`Environment.session`
gives one session its :class:`SessionHooks`, the session's workbench (``sandbox`` and ``grade``,
what :class:`shipyard.agent.session.SessionSpec` takes as ``bench``):

- ``sandbox(files)`` builds the session's sandbox by task kind: ``function`` tasks use
  the factory the caller passes (the run's default), ``repo`` tasks a copy-on-write sandbox over
  the task's squashed repository, ``db`` tasks a sandbox bound to a fresh database lease (its
  own clone of the task's template, released when the hooks close). Every sandbox is wrapped in
  a :class:`RecordingSandbox`, which keeps the commands the session ran.
- ``grade(task, files)`` computes the reward components (``tests`` by task kind, see
  :mod:`shipyard.envs.tasks.grade`; ``judge/<aspect>`` and ``judge`` when weighted), their
  weighted composite (:func:`shipyard.envs.grading.rewards.composite`, the session's reward) and
  the anti-cheat flags (:func:`shipyard.envs.grading.anticheat.detect` over the final files, the
  recorded commands and the starting files; on repo tasks ``git_history`` is not flagged: the
  history is squashed, so ``git diff``/``git log`` are ordinary tools there).
- :meth:`SessionHooks.annotate` writes ``reward_components``, ``flags`` and
  ``reward_info["source"]`` onto the session's trajectories.

:func:`shipyard.agent.play.play` does all of that for one session (the one path the rollout
worker, ``shipyard eval`` and demonstrations take); this package never imports the agent.

Example::

    with Environment.from_config(cfg) as env, env.session(task, factory, grader) as hooks:
        sandbox = hooks.sandbox(task.files)   # what a session's harness uses
        result = hooks.grade(task, final_files)
    hooks.annotate(trajectories)
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Mapping
from types import TracebackType
from typing import Any

from shipyard.config.schema import (
    AntiCheatConfig,
    RewardsConfig,
    SandboxConfig,
    ServicesConfig,
    ShipyardConfig,
)
from shipyard.envs.grading.anticheat import detect
from shipyard.envs.grading.judge import RubricJudge
from shipyard.envs.grading.rewards import composite, needed
from shipyard.envs.services.base import ServiceLease, lease_binds, lease_files
from shipyard.envs.services.pool import ServicePool
from shipyard.envs.tasks.grade import hidden_tests_reward
from shipyard.envs.tasks.kinds import GradingContext, task_kind
from shipyard.envs.tasks.repo import RepoCache, make_patch
from shipyard.envs.types import ExecResult, RewardResult, Sandbox, Task

SandboxFactory = Callable[[dict[str, str]], Sandbox]
Grader = Callable[[Task, dict[str, str]], RewardResult]


class RecordingSandbox:
    """A sandbox that keeps every command run through it (for the anti-cheat detectors); every other
    method is the wrapped sandbox's."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.commands: list[str] = []

    def exec(
        self, cmd: str, timeout_s: float | None = None, stdin: str | None = None, **kw: Any
    ) -> ExecResult:
        self.commands.append(cmd)
        return self.inner.exec(cmd, timeout_s, stdin, **kw)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)  # read, write, files, diff, seed, fork, close: the inner sandbox's


class Environment:
    """Services, repositories and rewards of one pool; see the module docstring."""

    def __init__(
        self,
        sandbox: SandboxConfig | None = None,
        services: ServicesConfig | None = None,
        rewards: RewardsConfig | None = None,
        anticheat: AntiCheatConfig | None = None,
    ) -> None:
        self.sandbox = sandbox if sandbox is not None else SandboxConfig()
        self.rewards = rewards if rewards is not None else RewardsConfig()
        self.anticheat = anticheat if anticheat is not None else AntiCheatConfig()
        self.services = ServicePool(services)
        self.repos = RepoCache()
        self.judge = RubricJudge(self.rewards.judge) if "judge" in needed(self.rewards.weights) else None

    @staticmethod
    def from_config(cfg: ShipyardConfig) -> Environment:
        return Environment(cfg.sandbox, cfg.services, cfg.rewards, cfg.anticheat)

    def __enter__(self) -> Environment:
        return self

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    @contextlib.contextmanager
    def session(
        self, task: Task, sandbox_factory: SandboxFactory | None = None, grader: Grader | None = None
    ) -> Iterator[SessionHooks]:
        """Hooks for one session of ``task``; leases taken by its sandbox are released on exit."""
        hooks = SessionHooks(self, task, sandbox_factory, grader)
        try:
            yield hooks
        finally:
            hooks.close()

    def close(self) -> None:
        """Stop the services and remove the repositories (a later session starts them again)."""
        self.services.close()
        self.repos.close()


class SessionHooks:
    """One session's sandbox factory and grader, and what they recorded (see the module docstring)."""

    def __init__(
        self, env: Environment, task: Task, factory: SandboxFactory | None, grader: Grader | None
    ) -> None:
        self.env, self.task = env, task
        self._factory, self._grader = factory, grader
        self._leases = contextlib.ExitStack()
        self._lock = threading.Lock()
        self.sandboxes: list[RecordingSandbox] = []
        self.original: dict[str, str] = {}
        self.components: dict[str, float] = {}
        self.flags: list[str] = []
        self.result: RewardResult | None = None

    @property
    def commands(self) -> list[str]:
        return [cmd for sb in self.sandboxes for cmd in sb.commands]

    def sandbox(self, files: dict[str, str]) -> Any:
        """The session's sandbox for ``task``'s kind, starting from ``files`` (a :class:`RecordingSandbox`)."""
        from shipyard.envs.sandbox import make_sandbox

        task, cfg = self.task, self.env.sandbox
        leases = self._lease() if task.services else {}
        files, binds = {**files, **lease_files(leases)}, lease_binds(leases)
        base = task_kind(task.kind).workspace_base(task, self.env.repos)
        if base is not None:  # copy-on-write over the task's tree: only files that differ are written
            extra = {p: t for p, t in files.items() if task.files.get(p) != t}
            inner: Any = make_sandbox(cfg, extra, base=base, binds=binds)
        elif leases:
            inner = make_sandbox(cfg, files, binds=binds)
        elif self._factory is not None:
            inner = self._factory(files)
        else:
            inner = make_sandbox(cfg, files)
        with self._lock:
            self.original = dict(files)
            self.sandboxes.append(RecordingSandbox(inner))
            return self.sandboxes[-1]

    def _lease(self) -> Mapping[str, ServiceLease]:
        with self._lock:
            return self._leases.enter_context(self.env.services.leases(self.task))

    def grade(self, task: Task, files: dict[str, str]) -> RewardResult:
        """Reward components, their composite and the anti-cheat flags of ``files``."""
        env = self.env
        ctx = GradingContext(env.sandbox, env.services, env.repos, self._grader)
        tests = hidden_tests_reward(task, files, ctx)
        components = {"tests": tests.reward}
        details = dict(tests.details)
        if env.judge is not None:
            verdict = env.judge.score(task.prompt, make_patch(self.original, files))
            components.update(verdict.components())
            details["judge"] = {"error": verdict.error, "raw": verdict.raw[-500:]}
        if env.anticheat.detect:
            flags = detect(files, self.commands, original=self.original)
            ignored = task_kind(task.kind).ignored_flags()
            self.flags = [f for f in flags if f not in ignored]
            details["flags"] = self.flags
        self.components = components
        details["components"] = components
        reward = composite(env.rewards.weights, components)
        self.result = RewardResult(reward, tests.passed, tests.total, details)
        return self.result

    def annotate(self, trajectories: list[Any]) -> None:
        """Record components, flags and the task's source on each of the session's trajectories."""
        for traj in trajectories:
            traj.reward_components = dict(self.components)
            traj.flags = list(self.flags)
            traj.reward_info["source"] = self.task.source

    def close(self) -> None:
        self._leases.close()
