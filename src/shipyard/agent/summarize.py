"""Self-summarization: the text that opens a new context, and the metrics of a summarizing session.

Contract: when a session's context reaches ``agent.summarize_threshold()`` tokens, the harness
(:mod:`shipyard.agent.session`) appends ``agent.summary.instruction`` to the tool result in the
same user turn and samples the policy's summary like any turn (its tokens are the policy's, with
``loss_mask = 1``, and end the segment). The next segment starts from a fresh context, rendered
by the chat template once and masked out of the loss: the system prompt and one user message
made by :func:`resume_message`: the task's first message, :data:`SUMMARY_HEADER` with the
summary's text (decoded from the sampled ids; it is re-used as text only, so the new context is
environment tokens), then the state the harness keeps (:func:`carried_state`: the current
``solution.py`` (by task kind: ``migration.sql``, or the changed files of a repo task) and/or
the last tool output, per ``agent.summary.keep``).

Metrics (:class:`SummaryStats`, written to every segment's ``Trajectory.metrics`` when
summarization is on): ``summaries`` per session; ``summarized_tokens`` (context tokens that the
summaries replaced: each summarized segment's length before the summary request) and
``summary_tokens`` (sampled summary tokens), summed over the session; ``compression`` =
``summarized_tokens / summary_tokens`` (0 without a summary); ``session_tokens`` (all segments'
tokens); ``hit_budget_unfinished`` = 1 when the session reached its context budget (summarized
at least once, or ran out of window) and ended without the policy finishing (a passing write, a
write on a task without visible tests, or SUBMIT). :func:`rollout_summary_metrics` aggregates
them over the sessions of a trainer step. With ``agent.summary.mode = "truncate"`` each context
restart counts as a summary of 0 tokens (``summaries`` = restarts, ``compression`` = 0).

Limits: the state items are clipped to ``agent.summary.state_chars`` characters each (head and
tail kept); nothing checks that a summary is faithful: what makes summaries useful is training
them (``agent.summary.segment_advantage``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shipyard.agent.types import Trajectory, group_sessions
from shipyard.config.schema import SummaryConfig
from shipyard.envs.tasks.kinds import clip_output, task_kind
from shipyard.envs.types import Sandbox

SUMMARY_HEADER = "Summary of your work so far:"
FINISHED = frozenset({"passed", "written", "submit"})
"""Finish reasons where the policy ended the session itself (not a limit)."""


def _clip(text: str, limit: int) -> str:
    """``text`` cut to about ``limit`` characters (head and tail kept, plus a cut marker); '' for 0."""
    return clip_output(text, limit) if limit else ""


def carried_state(sb: Sandbox, last_output: str, cfg: SummaryConfig, kind: str = "function") -> str:
    """The state the harness keeps across a summary (``cfg.keep``), as prompt text ('' if none).

    The ``solution`` item is the task kind's work (its ``work_state``): ``solution.py`` (function and
    long tasks), ``migration.sql`` (db tasks), or every file the session changed (repo tasks, from
    the sandbox's diff against its base); each clipped to ``cfg.state_chars``.
    """
    parts: list[str] = []
    if cfg.state_chars == 0:
        return ""
    if "solution" in cfg.keep:
        parts.append(task_kind(kind).work_state(sb, cfg.state_chars))
    if "last_output" in cfg.keep and last_output:
        parts.append(f"Last tool output:\n{_clip(last_output, cfg.state_chars)}")
    return "\n\n".join(p for p in parts if p)


def resume_message(first_message: str, summary: str | None, state: str) -> str:
    """The first user message of a segment after a summary: task, summary, kept state.

    ``summary=None`` (``agent.summary.mode = "truncate"``): task and kept state only.
    """
    text = first_message if summary is None else f"{first_message}\n\n{SUMMARY_HEADER}\n{summary.strip()}"
    return f"{text}\n\n{state}" if state else text


@dataclass
class SummaryStats:
    """Per-session counters of summarization (see the module doc for the metric definitions)."""

    summarized: list[int] = field(default_factory=list)
    """Per summary: context tokens of the segment before the summary request."""
    summary_tokens: list[int] = field(default_factory=list)
    """Per summary: sampled tokens of the summary turn."""

    def add(self, summarized: int, summary_tokens: int) -> None:
        self.summarized.append(summarized)
        self.summary_tokens.append(summary_tokens)

    def metrics(self, finish: str, session_tokens: int) -> dict[str, float]:
        """The session's summary metrics, given its finish reason and its tokens over all segments."""
        n, made = len(self.summarized), sum(self.summary_tokens)
        hit_budget = n > 0 or finish == "budget"
        return {
            "summaries": float(n),
            "summarized_tokens": float(sum(self.summarized)),
            "summary_tokens": float(made),
            "compression": sum(self.summarized) / made if made else 0.0,
            "session_tokens": float(session_tokens),
            "hit_budget_unfinished": float(hit_budget and finish not in FINISHED),
        }


def rollout_summary_metrics(trajs: list[Trajectory]) -> dict[str, float]:
    """Step-level summary metrics over the sessions in ``trajs`` ({} when none carries any).

    ``summary/per_session`` (mean summaries), ``summary/tokens_mean`` (sampled tokens per summary),
    ``summary/compression`` (summarized / summary tokens, over all summaries), ``summary/
    budget_unfinished_frac`` (sessions that hit the budget without finishing) and
    ``summary/segments_mean``.
    """
    sessions = [s[0] for s in group_sessions(trajs) if "summaries" in s[0].metrics]
    if not sessions:
        return {}
    n = len(sessions)
    count = sum(t.metrics["summaries"] for t in sessions)
    made = sum(t.metrics["summary_tokens"] for t in sessions)
    return {
        "summary/per_session": count / n,
        "summary/tokens_mean": made / count if count else 0.0,
        "summary/compression": sum(t.metrics["summarized_tokens"] for t in sessions) / made if made else 0.0,
        "summary/budget_unfinished_frac": sum(t.metrics["hit_budget_unfinished"] for t in sessions) / n,
        "summary/segments_mean": sum(t.num_segments for t in sessions) / n,
    }
