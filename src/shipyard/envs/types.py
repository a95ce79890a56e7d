"""Records and interfaces of environments: tasks, sandboxes, grading results.

Contract: a :class:`Task` is self-contained data (JSON-serialisable): the instruction shown to
the policy, the starting workspace files, tests the agent may run (``visible_tests``) and tests
only the grader runs (``hidden_tests``, never written into the agent's sandbox). A
:class:`Sandbox` is one isolated, persistent workspace per session; grading always happens in a
fresh sandbox built from the session's final files with the tests written by the grader.

``Task.reference`` holds a known-correct solution (the full ``solution.py``) for tests and
sanity checks; it is never shown to the policy. :meth:`Task.from_json` accepts records written
before a field existed (missing fields take their defaults) and rejects unknown fields.

Example::

    task = generated_tasks(n=10, seed=0)[0]
    with BwrapSandbox(files=task.files, cfg=SandboxConfig()) as sb:
        sb.write("solution.py", code)
        res = sb.exec("python -m pytest -q test_visible.py", timeout_s=10)
        final_files = sb.files()
    reward = grade(task, final_files, SandboxConfig())   # RewardResult(reward=0.75, passed=3, total=4)
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Protocol, runtime_checkable


@dataclass
class Task:
    id: str
    prompt: str
    entry_point: str
    files: dict[str, str] = field(default_factory=dict)
    visible_tests: str = ""
    hidden_tests: str = ""
    difficulty: int = 1
    source: str = "generated"
    reference: str = ""
    kind: str = "function"
    """One of :data:`shipyard.config.schema.TASK_KINDS`. ``function``: ``solution.py`` against ``hidden_tests``; ``repo``: a repository squashed to one
    commit, graded from the session's diff (:mod:`shipyard.envs.tasks.repo`); ``db``: a migration
    graded by ``hidden_checks`` against a real database (:mod:`shipyard.envs.tasks.db`)."""
    services: list[str] = field(default_factory=list)
    """Services the task needs (e.g. ``["postgres"]``), one lease per rollout (:mod:`shipyard.envs.services`)."""
    setup: dict[str, str] = field(default_factory=dict)
    """Per service, what its template is built from (``postgres``: SQL run once into the task's template)."""
    hidden_checks: dict[str, str] = field(default_factory=dict)
    """``db`` tasks: check name -> SQL returning one boolean, run by the grader outside the sandbox."""
    protected: list[str] = field(default_factory=list)
    """Glob patterns of files restored from ``files`` before grading (tests, conftest, configuration)."""
    family: str = ""
    """The family a generated function task is an instance of (``Family.key`` of
    :mod:`shipyard.envs.tasks.function_families`: tasks of one family differ by names, constants and
    inputs); "" for other tasks, unless a task file sets it (free text, for your own bookkeeping)."""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @staticmethod
    def from_json(d: dict[str, Any]) -> Task:
        known = {f.name for f in fields(Task)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"Task record has unknown fields {unknown}; known fields are {sorted(known)}")
        return Task(**d)


@dataclass
class ExecResult:
    returncode: int
    stdout: str
    stderr: str
    timed_out: bool
    duration_s: float


@dataclass
class WorkspaceDiff:
    """How a sandbox's workspace differs from its base (text files, relative paths, sorted)."""

    added: dict[str, str] = field(default_factory=dict)
    modified: dict[str, str] = field(default_factory=dict)
    """New content of files changed since the base."""
    deleted: list[str] = field(default_factory=list)

    def paths(self) -> list[str]:
        """Every changed path, sorted."""
        return sorted([*self.added, *self.modified, *self.deleted])

    def is_empty(self) -> bool:
        return not (self.added or self.modified or self.deleted)


@dataclass
class RewardResult:
    reward: float
    passed: int
    total: int
    details: dict[str, Any] = field(default_factory=dict)


@runtime_checkable
class Sandbox(Protocol):
    def exec(
        self,
        cmd: str,
        timeout_s: float | None = None,
        stdin: str | None = None,
        *,
        env: Mapping[str, str] | None = None,
    ) -> ExecResult:
        """Run a shell command in the workspace; the whole process tree is killed on timeout."""

    def write(self, path: str, content: str) -> None:
        """Write a UTF-8 file (relative to the workspace), creating parent directories."""

    def read(self, path: str) -> str:
        """Read a UTF-8 file (relative to the workspace)."""

    def files(self) -> dict[str, str]:
        """The workspace's text files (relative path -> content)."""

    def seed(self, files: Mapping[str, str]) -> None:
        """Write starting files that count as part of the base (``diff`` does not report them)."""

    def diff(self) -> WorkspaceDiff:
        """Text files added, modified and deleted since the sandbox's base."""

    def fork(self) -> Sandbox:
        """A new independent sandbox whose workspace starts as a copy of this one's."""

    def close(self) -> None:
        """Kill everything still running and release the workspace (idempotent)."""
