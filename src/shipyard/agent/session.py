"""One multi-turn agent session: policy turns, tool results, token-exact segments, a reward.

Contract: :func:`run_session` plays ``task`` in a fresh sandbox until the policy submits, a
written solution passes the visible tests (``end_on_pass``), the turn limit or the context
window (``agent.max_session_tokens``) is hit. The context is kept as token ids only: the prompt
is rendered once by the chat template, sampled ids are appended exactly as returned by the
server (with their logprobs and versions), and each tool result is rendered into the chat
template's turn delimiters and tokenized once, masked out of the loss. Model output is never
re-tokenized. MoE routes travel the same way: each turn's request carries the context's
routes so far (replayed by the engine), and the segment keeps its latest result's routes
(``Trajectory.routes``). The final files are graded in a fresh sandbox by ``spec.bench.grade``. Any exception is
recorded in ``Trajectory.error`` (on every segment), with a zero loss mask and zero reward, and
does not propagate: a crashed rollout never stops a run.

Self-summarization (``agent.summarize_at_tokens`` / ``summarize_at_frac``, off by default): when
a tool result would bring the context to the threshold (or earlier, when after one more turn a
full summary would no longer fit the window, see :meth:`_Session.feed_back`), the summary instruction
is appended to it in the same user turn and the policy's summary is sampled like any turn (``loss_mask = 1``);
that ends the segment, and the session goes on in a fresh context built from the task, the
summary's text and the state the harness keeps (:mod:`shipyard.agent.summarize`), tokenized once
as environment tokens. With ``agent.summary.mode = "truncate"`` (the baseline) the same trigger
drops the context instead: no summary is sampled, the next segment holds the task and the kept
state only (its predecessor ends with ``finish = "truncated"``). Each segment is token-exact on
its own. :func:`run_session` returns the
segments (one when summarization is off or never triggered); every segment carries the
session's reward. Seeds are per sampled turn of the session, so with summarization off a session
samples exactly as before segments existed.

Limits: the turn delimiters are derived from the tokenizer's chat template (see
:class:`ChatFrame`); templates that rewrite earlier turns (e.g. stripping reasoning) would make
the token record differ from a fresh render, which is the point: the record is what was seen.
Summary turns are sampled without the stop strings of ``sampling.stop`` (a summary is prose).
"""

from __future__ import annotations

import difflib
import hashlib
import json
import time
import traceback
from contextlib import closing
from dataclasses import dataclass, field
from typing import Any, Protocol

from shipyard.agent.actions import Action, check_write_path, parse_action
from shipyard.agent.summarize import SummaryStats, carried_state, resume_message
from shipyard.agent.types import Trajectory
from shipyard.config.schema import AgentConfig, SamplingConfig
from shipyard.envs.tasks.functions import SYSTEM_PROMPT, VISIBLE_TESTS_FILE
from shipyard.envs.tasks.kinds import clip_output, task_kind
from shipyard.envs.types import RewardResult, Sandbox, Task
from shipyard.inference.types import GenerateRequest, GenerateResult, InferenceClient, SamplingParams


class ChatFrame:
    """Token framing of a chat template: the first prompt and the text between turns."""

    def __init__(self, tokenizer: Any) -> None:
        self.tok = tokenizer
        self.eos_text: str = tokenizer.eos_token
        self.eos_id: int = tokenizer.eos_token_id
        probe = [{"role": "user", "content": "A"}, {"role": "assistant", "content": "B"}]
        rendered = tokenizer.apply_chat_template(probe, tokenize=False)
        marker = "B" + self.eos_text
        assert marker in rendered, "chat template must end an assistant turn with the EOS token"
        self._after_assistant = rendered.index(marker) + len(marker)
        self._probe = probe

    def prompt_ids(self, user_text: str, system: str = SYSTEM_PROMPT) -> list[int]:
        msgs = [{"role": "system", "content": system}, {"role": "user", "content": user_text}]
        text = self.tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        return self.tok(text, add_special_tokens=False).input_ids

    def tool_turn_ids(self, feedback: str, closed_by_eos: bool) -> list[int]:
        """Tokens after an assistant turn: (EOS if the turn was cut), the user turn, the next header."""
        msgs = [*self._probe, {"role": "user", "content": feedback}]
        full = self.tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        text = full[self._after_assistant :]
        if not closed_by_eos:
            text = self.eos_text + text
        return self.tok(text, add_special_tokens=False).input_ids


@dataclass
class _Record:
    ids: list[int]
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    routes: dict[str, Any] | None = None
    """MoE routes of the context's forwarded prefix (the latest turn's result covers all earlier ones)."""
    turns: list[dict[str, Any]] = field(default_factory=list)
    """``Trajectory.turns``: each turn's role, token span and text."""

    def __post_init__(self) -> None:
        n = len(self.ids)
        self.mask, self.logprobs, self.versions = [0] * n, [0.0] * n, [-1] * n

    def turn(self, role: str, start: int, text: str, **extra: Any) -> None:
        """Record the turn that covers ``ids[start:]`` (just appended)."""
        self.turns.append({"role": role, "start": start, "end": len(self.ids), "text": text, **extra})

    def add_env(self, ids: list[int]) -> None:
        self.ids += ids
        self.mask += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)
        self.versions += [-1] * len(ids)

    def add_sampled(self, ids: list[int], logprobs: list[float], versions: list[int]) -> None:
        self.ids += ids
        self.mask += [1] * len(ids)
        self.logprobs += logprobs
        self.versions += versions


def session_seed(group_id: str, sample_idx: int, turn: int, base: int) -> int:
    h = hashlib.blake2b(f"{base}/{group_id}/{sample_idx}/{turn}".encode(), digest_size=4).digest()
    return int.from_bytes(h, "little")


def grade_record(result: RewardResult) -> tuple[dict[str, Any], dict[str, Any]]:
    """A grading as a trajectory records it: ``reward_info`` (passed, total, the grader's reason
    where it gives one) and ``grade`` (its report, made JSON-safe)."""
    info: dict[str, Any] = {"passed": result.passed, "total": result.total}
    if "reason" in result.details:
        info["reason"] = result.details["reason"]
    return info, json.loads(json.dumps(result.details, default=str))


def workspace_files(task: Task) -> dict[str, str]:
    files = dict(task.files)
    if task.visible_tests:
        files[VISIBLE_TESTS_FILE] = task.visible_tests
    return files


def first_message(task: Task) -> str:
    """The first user message: the task and, by its kind, which file(s) to write and how to check
    them (:meth:`shipyard.envs.tasks.kinds.TaskKind.first_message`)."""
    return task_kind(task.kind).first_message(task)


class Workbench(Protocol):
    """The session's sandbox and grader: :class:`shipyard.agent.spec.SandboxWorkbench` (the run's
    sandboxes, hidden-test grading) or an environment's :class:`~shipyard.envs.environment.SessionHooks`
    (per task kind, reward components, anti-cheat)."""

    def sandbox(self, files: dict[str, str]) -> Sandbox: ...

    def grade(self, task: Task, files: dict[str, str]) -> RewardResult: ...


@dataclass
class SessionSpec:
    """Everything a session needs besides the task: policy, harness limits, sandbox, grader."""

    client: InferenceClient
    frame: ChatFrame
    agent: AgentConfig
    sampling: SamplingConfig
    bench: Workbench
    """Where the session works and is judged: its sandbox and its grader."""
    seed: int = 0
    harness: Any = None
    """The :class:`~shipyard.agent.harness.base.Harness` that plays the session (None: the built-in
    one, :func:`run_session`)."""


def run_session(spec: SessionSpec, task: Task, group_id: str, sample_idx: int) -> list[Trajectory]:
    """Play ``task`` once; returns the session's segments in order (see the module doc)."""
    run = _Session(spec, task, group_id, sample_idx)
    try:
        with closing(spec.bench.sandbox(workspace_files(task))) as sb:
            finish = _play(run, sb)
            final = sb.files()
            result = spec.bench.grade(task, final)
        run.graded(finish, result, files_diff(workspace_files(task), final))
    except Exception as e:  # a crashed rollout is recorded, never propagated
        run.crashed(f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=4)}")
    return run.trajectories()


def replay_session(
    agent: AgentConfig, bench: Workbench, task: Task, segments: list[Trajectory]
) -> RewardResult:
    """Play a recorded session again without a model: its sampled turns' actions, in order, in a
    fresh sandbox of ``bench``, then grade the files they left (what a verifier re-grades)."""
    sampled = [t for seg in segments for t in seg.turns if t["role"] == "assistant"]
    with closing(bench.sandbox(workspace_files(task))) as sb:
        for turn in sampled:
            _, done = _act(agent, task, sb, parse_action(turn["text"], task.kind))
            if done:
                break
        return bench.grade(task, sb.files())


def _play(run: _Session, sb: Sandbox) -> str:
    """Action turns until the session ends; returns its finish reason."""
    spec = run.spec
    for turn in range(spec.agent.max_turns):
        res = run.sample(spec.sampling.max_tokens, spec.sampling.stop)
        if res is None:
            return "budget"
        run.traj.num_turns += 1
        text = spec.frame.tok.decode(res.token_ids, skip_special_tokens=True)
        action = parse_action(text, run.task.kind)
        run.rec.turns[-1].update(action=action.kind, **_action_fields(action))
        feedback, done = _act(spec.agent, run.task, sb, action)
        if done:
            return done
        if turn + 1 < spec.agent.max_turns and not run.feed_back(sb, feedback, res.finish_reason == "eos"):
            return "budget"
    return "max_turns"


class _Session:
    """One session across its segments: a token record per context, counters, the outcome."""

    def __init__(self, spec: SessionSpec, task: Task, group_id: str, sample_idx: int) -> None:
        self.spec, self.task, self.gid, self.idx = spec, task, group_id, sample_idx
        self.segments: list[tuple[_Record, Trajectory]] = []
        self.sampled_turns = 0
        self.stats = SummaryStats()
        self.finish, self.reward, self.error = "", 0.0, None
        self.reward_info: dict[str, Any] = {}
        self.changes, self.grade = "", {}
        self._mark = time.perf_counter()
        self._timed: dict[str, Any] | None = None
        """The latest sampled turn, until the time after it (its ``env_s``) is known."""
        self._open(first_message(task))

    @property
    def rec(self) -> _Record:
        return self.segments[-1][0]

    @property
    def traj(self) -> Trajectory:
        return self.segments[-1][1]

    def _open(self, message: str) -> None:
        """Start a segment (a fresh context) from the user ``message`` under the kind's system prompt."""
        system = task_kind(self.task.kind).system_prompt()
        prompt_ids = self.spec.frame.prompt_ids(message, system)
        traj = Trajectory(
            self.task.id,
            self.gid,
            self.idx,
            [],
            [],
            [],
            [],
            prompt_len=len(prompt_ids),
            session_id=f"{self.gid}/{self.idx}",
            segment_idx=len(self.segments),
            num_segments=len(self.segments) + 1,
        )
        rec = _Record(prompt_ids)
        rec.turn("prompt", 0, message, system=system)
        self.segments.append((rec, traj))

    def sample(self, max_tokens: int, stop: list[str], role: str = "assistant") -> GenerateResult | None:
        """Sample one turn onto the current context; None when the window has no room left."""
        budget = self.spec.agent.max_session_tokens - len(self.rec.ids)
        if budget <= 0:
            return None
        cfg = self.spec.sampling
        params = SamplingParams(
            temperature=cfg.temperature,
            top_p=cfg.top_p,
            max_tokens=min(max_tokens, budget),
            stop=list(stop),
            seed=session_seed(self.gid, self.idx, self.sampled_turns, self.spec.seed),
        )
        request = GenerateRequest(prompt_ids=list(self.rec.ids), params=params, prompt_routes=self.rec.routes)
        t0 = self._close_env()
        [res] = self.spec.client.generate([request])
        start = len(self.rec.ids)
        self.rec.add_sampled(res.token_ids, res.logprobs, res.versions)
        text = self.spec.frame.tok.decode(res.token_ids, skip_special_tokens=True)
        self._mark = time.perf_counter()
        self.rec.turn(role, start, text, gen_s=round(self._mark - t0, 4), cached=res.cached_tokens)
        self._timed = self.rec.turns[-1]
        self.rec.routes = res.routes
        self.sampled_turns += 1
        return res

    def _close_env(self) -> float:
        """Time since the last generation returned, on the turn it follows (``env_s``: its action,
        tool output, grading) or, before the first, on the opening prompt (``setup_s``: sandbox)."""
        now = time.perf_counter()
        if self._timed is not None:
            self._timed["env_s"] = round(now - self._mark, 4)
        elif self.segments and "setup_s" not in self.segments[0][0].turns[0]:
            self.segments[0][0].turns[0]["setup_s"] = round(now - self._mark, 4)
        self._timed, self._mark = None, now
        return now

    def feed_back(self, sb: Sandbox, feedback: str, closed_by_eos: bool) -> bool:
        """Append a tool result, or summarize into a new segment (module doc); False: no room left.

        A summary is requested when the tool result would bring the context to the threshold, or
        earlier when, after one more turn (``sampling.max_tokens``), a request of this size and a
        full summary (``agent.summary.max_tokens``) would no longer fit the window.
        """
        agent = self.spec.agent
        ids = self.spec.frame.tool_turn_ids(feedback, closed_by_eos)
        at, cfg = agent.summarize_threshold(), agent.summary
        if at and len(self.stats.summarized) < cfg.max_summaries:
            request = self.spec.frame.tool_turn_ids(f"{feedback}\n\n{cfg.instruction}", closed_by_eos)
            after = len(self.rec.ids) + len(ids)
            later = after + self.spec.sampling.max_tokens + len(request) + cfg.max_tokens
            if after >= at or later > agent.max_session_tokens:
                if cfg.mode == "truncate":
                    return self._truncate(sb, feedback)
                return self._summarize(sb, request, feedback)
        start = len(self.rec.ids)
        self.rec.add_env(ids)
        self.rec.turn("tool", start, feedback)
        return True

    def _summarize(self, sb: Sandbox, request: list[int], feedback: str) -> bool:
        """Append the summary ``request``, sample the summary, open the next segment; False: no room."""
        cfg = self.spec.agent.summary
        summarized = len(self.rec.ids)
        self.rec.add_env(request)
        self.rec.turn("tool", summarized, f"{feedback}\n\n{cfg.instruction}")
        res = self.sample(cfg.max_tokens, [], role="summary")
        if res is None:
            return False
        self.traj.finish, self.traj.summary_tokens = "summary", len(res.token_ids)
        self.stats.add(summarized, len(res.token_ids))
        state = carried_state(sb, feedback, cfg, self.task.kind)
        self._open(resume_message(first_message(self.task), self.rec.turns[-1]["text"], state))
        return True

    def _truncate(self, sb: Sandbox, feedback: str) -> bool:
        """Baseline to summarizing: drop the context, open the next from the task and the kept state."""
        self.traj.finish = "truncated"
        self.stats.add(len(self.rec.ids), 0)
        state = carried_state(sb, feedback, self.spec.agent.summary, self.task.kind)
        self._open(resume_message(first_message(self.task), None, state))
        return True

    def graded(self, finish: str, result: RewardResult, changes: str = "") -> None:
        self.finish, self.reward, self.changes = finish, result.reward, changes
        self.reward_info, self.grade = grade_record(result)

    def crashed(self, error: str) -> None:
        self.error, self.reward, self.finish = error, 0.0, "error"

    def trajectories(self) -> list[Trajectory]:
        """The segments with their token records and the session's outcome on each."""
        self._close_env()
        total = sum(len(rec.ids) for rec, _ in self.segments)
        on = bool(self.spec.agent.summarize_threshold())
        metrics = self.stats.metrics(self.finish, total) if on else {}
        out = []
        for k, (rec, traj) in enumerate(self.segments):
            if self.error is not None:
                rec.mask = [0] * len(rec.ids)
                traj.finish, traj.summary_tokens = "error", 0
            elif k == len(self.segments) - 1:
                traj.finish = self.finish
            traj.token_ids, traj.loss_mask, traj.logprobs, traj.versions = (
                rec.ids,
                rec.mask,
                rec.logprobs,
                rec.versions,
            )
            traj.num_segments = len(self.segments)
            traj.routes = rec.routes
            traj.reward, traj.reward_info, traj.error = self.reward, dict(self.reward_info), self.error
            traj.metrics = dict(metrics)
            traj.turns = rec.turns
            if k == len(self.segments) - 1:
                traj.changes, traj.grade = self.changes, self.grade
            out.append(traj)
        return out


def files_diff(before: dict[str, str], after: dict[str, str]) -> str:
    """Unified diff (``a/`` -> ``b/``) of the files that differ between ``before`` and ``after``."""
    out: list[str] = []
    for path in sorted(set(before) | set(after)):
        old, new = before.get(path), after.get(path)
        if old == new:
            continue
        out += difflib.unified_diff(
            (old or "").splitlines(keepends=True),
            (new or "").splitlines(keepends=True),
            "/dev/null" if old is None else f"a/{path}",
            "/dev/null" if new is None else f"b/{path}",
        )
        if out and not out[-1].endswith("\n"):
            out[-1] += "\n"
    return "".join(out)


def _action_fields(action: Action) -> dict[str, str]:
    """What the viewer shows of an action besides its kind: the command run or the path written."""
    if action.kind == "run":
        return {"command": action.content}
    if action.kind == "write":
        return {"path": action.path}
    return {}


def _act(agent: AgentConfig, task: Task, sb: Sandbox, action: Action) -> tuple[str, str]:
    """Carry out ``action``; returns (feedback, finish reason or '')."""
    limit = agent.max_tool_output_chars
    if action.kind == "submit":
        return "", "submit"
    if action.kind == "none":
        return task_kind(task.kind).reminder(), ""
    if action.kind == "run":
        res = sb.exec(action.content)
        status = "timed out" if res.timed_out else f"exit code {res.returncode}"
        return clip_output(f"$ {action.content}\n{res.stdout}{res.stderr}\n[{status}]", limit), ""
    return _write(agent, task, sb, action)


def _write(agent: AgentConfig, task: Task, sb: Sandbox, action: Action) -> tuple[str, str]:
    """Write ``action.path`` (unless the path is refused), then the kind's check: visible tests
    (function tasks), a rolled-back trial of the migration (db tasks), nothing (repo tasks)."""
    problem = check_write_path(action.path, task.protected)
    if problem:
        return problem, ""
    try:
        sb.write(action.path, action.content)
    except ValueError as e:  # e.g. a path through a symlink: refused by the sandbox
        return f"Cannot write {action.path}: {e}", ""
    return task_kind(task.kind).after_write(
        task, sb, action.path, agent.max_tool_output_chars, agent.end_on_pass
    )
