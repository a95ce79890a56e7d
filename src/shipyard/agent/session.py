"""One multi-turn agent session: policy turns, tool results, a token-exact trajectory, a reward.

Contract: :func:`run_session` plays ``task`` in a fresh sandbox until the policy submits, a
written solution passes the visible tests (``end_on_pass``), the turn limit or the session token
budget is hit. The context is kept as token ids only: the prompt is rendered once by the chat
template, sampled ids are appended exactly as returned by the server (with their logprobs and
versions), and each tool result is rendered into the chat template's turn delimiters and
tokenized once, masked out of the loss. Model output is never re-tokenized. The final files are
graded in a fresh sandbox by ``grader``. Any exception is recorded in ``Trajectory.error``, with
a zero loss mask and zero reward, and does not propagate: a crashed rollout never stops a run.

Limits: the turn delimiters are derived from the tokenizer's chat template (see
:class:`ChatFrame`); templates that rewrite earlier turns (e.g. stripping reasoning) would make
the token record differ from a fresh render, which is the point: the record is what was seen.
"""

from __future__ import annotations

import hashlib
import traceback
from collections.abc import Callable
from contextlib import closing
from dataclasses import dataclass, field
from typing import Any

from shipyard.agent.actions import REMINDER, SYSTEM_PROMPT, clip_output, parse_action
from shipyard.agent.types import Trajectory
from shipyard.config.schema import AgentConfig, SamplingConfig
from shipyard.envs.types import RewardResult, Sandbox, Task
from shipyard.inference.types import GenerateRequest, InferenceClient, SamplingParams

VISIBLE_TESTS_FILE = "test_visible.py"
RUN_VISIBLE = f"python -m pytest -q -x --no-header -p no:cacheprovider {VISIBLE_TESTS_FILE}"


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

    def __post_init__(self) -> None:
        n = len(self.ids)
        self.mask, self.logprobs, self.versions = [0] * n, [0.0] * n, [-1] * n

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


def workspace_files(task: Task) -> dict[str, str]:
    files = dict(task.files)
    if task.visible_tests:
        files[VISIBLE_TESTS_FILE] = task.visible_tests
    return files


def first_message(task: Task) -> str:
    return f"{task.prompt}\n\nReply with the complete solution.py in a ```python block."


@dataclass
class SessionSpec:
    """Everything a session needs besides the task: policy, harness limits, sandbox, grader."""

    client: InferenceClient
    frame: ChatFrame
    agent: AgentConfig
    sampling: SamplingConfig
    sandbox_factory: Callable[[dict[str, str]], Sandbox]
    grader: Callable[[Task, dict[str, str]], RewardResult]
    seed: int = 0


def run_session(spec: SessionSpec, task: Task, group_id: str, sample_idx: int) -> Trajectory:
    rec = _Record(spec.frame.prompt_ids(first_message(task)))
    traj = Trajectory(task.id, group_id, sample_idx, [], [], [], [], prompt_len=len(rec.ids))
    try:
        with closing(spec.sandbox_factory(workspace_files(task))) as sb:
            traj.finish = _play(spec, task, sb, rec, traj, group_id, sample_idx)
            result = spec.grader(task, sb.files())
        traj.reward = result.reward
        traj.reward_info = {"passed": result.passed, "total": result.total}
        if "reason" in result.details:
            traj.reward_info["reason"] = result.details["reason"]
    except Exception as e:  # a crashed rollout is recorded, never propagated
        traj.error = f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=4)}"
        traj.reward, traj.finish = 0.0, "error"
        rec.mask = [0] * len(rec.ids)
    traj.token_ids, traj.loss_mask, traj.logprobs, traj.versions = (
        rec.ids,
        rec.mask,
        rec.logprobs,
        rec.versions,
    )
    return traj


def _play(
    spec: SessionSpec, task: Task, sb: Sandbox, rec: _Record, traj: Trajectory, gid: str, idx: int
) -> str:
    cfg = spec.agent
    for turn in range(cfg.max_turns):
        budget = cfg.max_session_tokens - len(rec.ids)
        if budget <= 0:
            return "budget"
        params = SamplingParams(
            temperature=spec.sampling.temperature,
            top_p=spec.sampling.top_p,
            max_tokens=min(spec.sampling.max_tokens, budget),
            stop=list(spec.sampling.stop),
            seed=session_seed(gid, idx, turn, spec.seed),
        )
        [res] = spec.client.generate([GenerateRequest(prompt_ids=list(rec.ids), params=params)])
        rec.add_sampled(res.token_ids, res.logprobs, res.versions)
        traj.num_turns = turn + 1
        text = spec.frame.tok.decode(res.token_ids, skip_special_tokens=True)
        feedback, done = _act(spec, task, sb, text)
        if done:
            return done
        if turn + 1 < cfg.max_turns:
            rec.add_env(spec.frame.tool_turn_ids(feedback, closed_by_eos=res.finish_reason == "eos"))
    return "max_turns"


def _act(spec: SessionSpec, task: Task, sb: Sandbox, text: str) -> tuple[str, str]:
    """Carry out the action in ``text``; returns (feedback, finish reason or '')."""
    action = parse_action(text)
    limit = spec.agent.max_tool_output_chars
    if action.kind == "submit":
        return "", "submit"
    if action.kind == "none":
        return REMINDER, ""
    if action.kind == "run":
        res = sb.exec(action.content)
        status = "timed out" if res.timed_out else f"exit code {res.returncode}"
        return clip_output(f"$ {action.content}\n{res.stdout}{res.stderr}\n[{status}]", limit), ""
    sb.write("solution.py", action.content)
    if not task.visible_tests:
        return "solution.py written.", "written" if spec.agent.end_on_pass else ""
    res = sb.exec(RUN_VISIBLE)
    if res.returncode == 0 and not res.timed_out:
        return "solution.py written. Visible tests passed.", "passed" if spec.agent.end_on_pass else ""
    out = clip_output(res.stdout + res.stderr, limit)
    return f"solution.py written. Visible tests failed:\n{out}", ""
