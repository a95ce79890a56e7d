"""Task kinds behind one interface: what the harness tells the policy, what a write triggers, what a
summary carries, how a task file's task is checked and how a session is graded.

Contract: :func:`task_kind` switches on ``Task.kind`` and returns the kind's object
(:class:`~shipyard.envs.tasks.functions.FunctionKind`, :class:`~shipyard.envs.tasks.repo.RepoKind`,
:class:`~shipyard.envs.tasks.db.DbKind`), each in the module that generates tasks of that kind; no
other code branches on the kind. A kind implements :class:`TaskKind`:

- ``system_prompt()`` / ``reminder()``: the system message of its sessions, and the line a turn
  without an action gets;
- ``default_files()``: language -> the file an unnamed block of that language writes;
  ``asks_for_path()``: whether an unnamed code block is a write the policy must name (repo);
- ``first_message(task)``: the first user message;
- ``after_write(task, sb, path, limit, end_on_pass)``: what the session is told after a write and
  whether the session may end (``"passed"``, ``"written"`` or ``""``);
- ``work_state(sb, chars)``: the state a summary carries into the next context;
- ``check(task, where)``: a task file's task of this kind is complete (ValueError naming the field);
- ``reference_files(task)``: the final files of a session that wrote ``task.reference``;
- ``workspace_base(task, repos)``: a host directory the session's sandbox forks copy-on-write
  (repo tasks: the squashed repository), else None; ``ignored_flags()``: anti-cheat flags that are
  ordinary tools on this kind (repo: ``git_history``, the history is squashed);
- ``grade(task, files, ctx)``: the ``tests`` reward of the session's final files.

Example::

    kind = task_kind(task.kind)
    prompt = frame.prompt_ids(kind.first_message(task), kind.system_prompt())
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from shipyard.config.schema import TASK_KINDS, SandboxConfig
from shipyard.envs.types import RewardResult, Sandbox, Task

if TYPE_CHECKING:
    from shipyard.envs.services.pool import ServicePool
    from shipyard.envs.tasks.repo import RepoCache


@dataclass
class GradingContext:
    """What grading needs besides the task and files: limits, the pool's services and repositories."""

    sandbox: SandboxConfig
    services: ServicePool
    repos: RepoCache
    function_grader: Callable[[Task, dict[str, str]], RewardResult] | None = None
    """Grader of ``function`` tasks (None: :func:`shipyard.envs.grading.grader.grade` with ``sandbox``)."""


class TaskKind(Protocol):
    name: str

    def system_prompt(self) -> str: ...

    def reminder(self) -> str: ...

    def default_files(self) -> dict[str, str]: ...

    def asks_for_path(self) -> bool: ...

    def first_message(self, task: Task) -> str: ...

    def after_write(
        self, task: Task, sb: Sandbox, path: str, limit: int, end_on_pass: bool
    ) -> tuple[str, str]: ...

    def work_state(self, sb: Sandbox, chars: int) -> str: ...

    def check(self, task: Task, where: str) -> None: ...

    def reference_files(self, task: Task) -> dict[str, str]: ...

    def workspace_base(self, task: Task, repos: RepoCache) -> str | None: ...

    def ignored_flags(self) -> frozenset[str]: ...

    def grade(self, task: Task, files: dict[str, str], ctx: GradingContext) -> RewardResult: ...


@functools.cache
def task_kind(kind: str) -> TaskKind:
    """The object of task kind ``kind`` (one of :data:`TASK_KINDS`); ValueError naming the field."""
    if kind == "function":
        from shipyard.envs.tasks.functions import FunctionKind

        return FunctionKind()
    if kind == "repo":
        from shipyard.envs.tasks.repo import RepoKind

        return RepoKind()
    if kind == "db":
        from shipyard.envs.tasks.db import DbKind

        return DbKind()
    raise ValueError(f"task kind {kind!r} is unknown (field `kind`); known kinds are {list(TASK_KINDS)}")


def clip_output(text: str, limit: int) -> str:
    """Keep the head and tail of long tool output, marking what was cut."""
    if len(text) <= limit:
        return text
    head = limit // 3
    tail = limit - head
    return f"{text[:head]}\n... [{len(text) - limit} characters cut] ...\n{text[-tail:]}"


def check_hidden_tests(task: Task, where: str) -> None:
    """``task.hidden_tests`` holds at least one top-level ``test_*`` function (ValueError naming the field)."""
    from shipyard.envs.grading.grader import expected_tests

    if not task.hidden_tests.strip():
        raise ValueError(f"{where}: a {task.kind} task needs `hidden_tests` (Python with test_* functions)")
    try:
        names = expected_tests(task.hidden_tests)
    except ValueError as exc:
        raise ValueError(f"{where}: field `hidden_tests`: {exc}") from None
    if not names:
        raise ValueError(f"{where}: field `hidden_tests` has no top-level test_* function")


def file_state(sb: Sandbox, path: str, lang: str, chars: int) -> str:
    """The current contents of the kind's work file ``path`` for a summary (clipped to ``chars``)."""
    try:
        text = sb.read(path)
    except OSError:
        text = ""
    if not text:
        return f"{path} has not been written yet."
    return f"Current {path}:\n```{lang}\n{clip_output(text, chars)}\n```"


FILES_SYSTEM_PROMPT = (
    "You are a coding agent in a Linux sandbox. Act by replying with exactly one of:\n"
    "- a fenced block whose first line names the language and the file, e.g. ```python src/app.py, "
    "holding the complete new contents of that file (relative to the current directory),\n"
    "- a ```bash block with one shell command to run,\n"
    "- SUBMIT on its own line when you are done."
)
"""The system prompt of db and repo tasks, where the policy writes files by name."""
FILES_REMINDER = (
    "No action found. Reply with a fenced block naming the file it writes (e.g. ```python src/app.py), "
    "a ```bash block with one command, or SUBMIT."
)
"""The reminder of db and repo tasks."""
