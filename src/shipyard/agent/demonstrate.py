"""Demonstrations for a warm start: a scripted expert plays tasks through the real harness.

Purpose: RL needs a policy that sometimes succeeds. SmolLM2-135M never solves a long task at
base (0/16 at 2 and 4 modules: it does not read, or reads and never writes), so every session's
reward is 0 and RL has no signal. A short supervised warm start on demonstrations of the harness's
own protocol fixes that, as production pipelines do before RL.

Contract: :class:`LongTaskExpert` is an :class:`~shipyard.inference.types.InferenceClient` for one
long task (``shipyard.envs.tasks.long``). Each turn it reads the context it is given (the token
ids the harness built, decoded) and answers as a careful agent would: a ``cat`` of the first module
whose rule is not in its context yet; when every rule is, the complete ``solution.py``
(:func:`~shipyard.envs.tasks.long.solution_from_rules`); when asked for a summary (the harness's
summary instruction is in the context), how many modules it has read, one line per rule known so
far, as code with its constant's import (:meth:`~shipyard.envs.tasks.long.ReadRule.note`), and its
next step. The summary is written so that a 135M policy continues by copying: the import and the
code line go into ``solution.py`` as they are, and the count and next step say when to write it
(an earlier format without them taught a policy to write after two of four modules and to guess
imports from the order of the notes). So a demonstration is a real session: the same
prompts, tool outputs, summaries and segments (:func:`~shipyard.agent.play.play`,
real sandboxes, graded by the hidden tests), only the sampled tokens are the expert's.
:class:`FunctionToolExpert` does the same for function tasks played by a command harness
(mini-swe-agent, the Agents SDK, a verifiers environment): the harness runs unmodified against its
session endpoint, and the expert answers its calls with the task's reference solution in the
harness's own protocol (Hermes tool calls, or mini-swe-agent's fenced bash block in its text mode),
so the demonstrations teach that protocol.
:func:`demonstrations` plays a task list and keeps the sessions that passed.

Limits: long tasks with the built-in harness, function tasks (with a reference) with a command
harness; it never guesses, so
demonstrations show reading and summarizing, not recovering from mistakes; turn texts longer
than a request's ``max_tokens`` are cut as the engine would (that session then fails and is
dropped). Logprobs are 0 and versions -1: demonstrations are for supervised training, not for RL.
"""

from __future__ import annotations

import abc
import dataclasses
import itertools
import json
import re
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from shipyard.agent.play import play
from shipyard.agent.session import SessionSpec
from shipyard.agent.types import Trajectory
from shipyard.envs.tasks.long import ReadRule, read_rule, solution_from_rules
from shipyard.envs.types import Task
from shipyard.inference.types import GenerateRequest, GenerateResult

SUMMARY_LEAD = "Rules read so far"
SUBMIT = "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"
"""mini-swe-agent's submission line: a command whose output starts with it ends the session."""


class _Expert(abc.ABC):
    """What every scripted expert is as an :class:`~shipyard.inference.types.InferenceClient`: version
    -1, always ready, each request answered by ``_turn`` (the subclass's policy)."""

    def version(self) -> int:
        return -1

    def stats(self) -> dict[str, Any]:
        return {}

    def wait_ready(self, timeout_s: float = 60.0) -> int:
        return -1

    def close(self) -> None:
        """Nothing to release: the expert holds no connection."""
        return None

    def generate(self, requests: list[GenerateRequest]) -> list[GenerateResult]:
        return [self._turn(r) for r in requests]

    async def agenerate(self, requests: list[GenerateRequest], http: Any = None) -> list[GenerateResult]:
        return self.generate(requests)

    @abc.abstractmethod
    def _turn(self, request: GenerateRequest) -> GenerateResult:
        """The expert's answer to one request (its policy)."""


class LongTaskExpert(_Expert):
    """A scripted policy for one long task (module doc)."""

    def __init__(self, task: Task, tokenizer: Any, summary_instruction: str) -> None:
        if task.source != "long":
            raise ValueError(f"task {task.id} is a {task.source!r} task; the expert plays long tasks only")
        self.task, self.tok, self.instruction = task, tokenizer, summary_instruction
        modules = sorted(n for n in task.files if n.startswith("part_") and n.endswith(".py"))
        self.rules: list[ReadRule] = []
        for name in modules:
            rule = read_rule(task.files[name])
            if rule is None:
                raise ValueError(f"task {task.id}: {name} states no rule the expert can read")
            self.rules.append(rule)

    def reply(self, context: str) -> tuple[str, bool]:
        """(text, is a summary) of the expert's next turn given the context text."""
        known = [r for r in self.rules if r.note() in context or r.statement() in context]
        missing = [r for r in self.rules if r not in known]
        if self.instruction in context:
            lead = f"{SUMMARY_LEAD} ({len(known)} of {len(self.rules)} modules), as code:"
            step = f"read {missing[0].module}.py" if missing else "write solution.py"
            return "\n".join([lead, *(r.note() for r in known), f"Next: {step}"]), True
        if missing:
            return f"```bash\ncat {missing[0].module}.py\n```\n", False
        return f"```python\n{solution_from_rules(self.task.entry_point, self.rules)}```\n", False

    def _turn(self, request: GenerateRequest) -> GenerateResult:
        text, summary = self.reply(self.tok.decode(request.prompt_ids, skip_special_tokens=False))
        ids = self.tok(text, add_special_tokens=False).input_ids
        finish = "eos" if summary else "stop"  # actions end at the stop string, as sampled turns do
        if summary:
            ids.append(self.tok.eos_token_id)
        if len(ids) > request.params.max_tokens:
            ids, finish = ids[: request.params.max_tokens], "length"
        return GenerateResult(ids, [0.0] * len(ids), [-1] * len(ids), finish)


class FunctionToolExpert(_Expert):
    """A scripted policy for one function task played by a command harness with tools (module
    doc): through its session endpoint it answers as a direct agent would, in the Hermes format
    the endpoint parses. With a ``bash`` tool (mini-swe-agent): a heredoc writing the task's
    reference ``solution.py``, then ``echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT``; with a
    ``write_file`` tool (the Agents SDK, the ``openai`` client agent): that file, then a short
    answer; without tools, in mini-swe-agent's text mode (its submission line is in the prompt): one
    fenced bash block with that heredoc followed by the submission echo; without tools otherwise (a
    one-shot environment): the solution in a python block. Its step is read from the context: after
    a tool response it finishes."""

    def __init__(self, task: Task, tokenizer: Any) -> None:
        if task.kind != "function" or not task.reference:
            raise ValueError(f"task {task.id}: the expert plays function tasks with a reference solution")
        self.task, self.tok = task, tokenizer

    def reply(self, context: str) -> str:
        """The expert's next reply given the context text."""
        block = re.search(r"<tools>\n(.*?)\n</tools>", context, re.S)  # the schemas, one per line
        tools = set(re.findall(r'"name": "(\w+)"', block.group(1))) if block else set()
        done = "<tool_response>" in context
        ref = self.task.reference
        if "bash" in tools:
            command = f"echo {SUBMIT}" if done else f"cat > solution.py <<'EOF'\n{ref}EOF"
            return _hermes_call("bash", {"command": command})
        if "write_file" in tools:
            return (
                "I wrote solution.py."
                if done
                else _hermes_call("write_file", {"path": "solution.py", "content": ref})
            )
        if SUBMIT in context:  # mini-swe-agent's text mode: one fenced bash block writes and submits
            return f"```bash\ncat > solution.py <<'EOF'\n{ref}EOF\necho {SUBMIT}\n```"
        return f"```python\n{ref}```"

    def _turn(self, request: GenerateRequest) -> GenerateResult:
        text = self.reply(self.tok.decode(request.prompt_ids, skip_special_tokens=False))
        ids = [*self.tok(text, add_special_tokens=False).input_ids, self.tok.eos_token_id]
        finish = "eos"
        if len(ids) > request.params.max_tokens:
            ids, finish = ids[: request.params.max_tokens], "length"
        return GenerateResult(ids, [0.0] * len(ids), [-1] * len(ids), finish)


def _hermes_call(name: str, arguments: dict[str, Any]) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def expert_for(task: Task, tokenizer: Any, summary_instruction: str) -> LongTaskExpert | FunctionToolExpert:
    """The scripted expert of ``task``: long tasks read their rules, function tasks played by a
    command harness write the reference through its tools."""
    if task.source == "long":
        return LongTaskExpert(task, tokenizer, summary_instruction)
    return FunctionToolExpert(task, tokenizer)


def demonstrations(
    spec: SessionSpec,
    tasks: list[Task],
    concurrency: int = 4,
    on_session: Callable[[int], None] | None = None,
) -> list[list[Trajectory]]:
    """The expert's sessions (segments each) on ``tasks`` through ``spec``'s harness, sandboxes
    and grader (``spec.client`` is replaced by each task's expert, :func:`expert_for`); only
    sessions that passed every hidden test (reward 1, no error) are returned. ``on_session(n)`` is
    called as the ``n``-th session ends (progress)."""
    done = itertools.count(1)

    def one(task: Task) -> list[Trajectory]:
        session = play(
            dataclasses.replace(
                spec, client=expert_for(task, spec.frame.tok, spec.agent.summary.instruction)
            ),
            task,
            f"demo/{task.id}",
            0,
        )
        if on_session is not None:
            on_session(next(done))
        return session

    with ThreadPoolExecutor(concurrency, thread_name_prefix="demo") as pool:
        sessions = list(pool.map(one, tasks))
    return [s for s in sessions if s[-1].error is None and s[-1].reward >= 1.0]
