"""Evaluate a policy on tasks with the same harness it is trained in.

Contract: :func:`evaluate` plays ``samples`` sessions per task (sampling from ``spec`` with the
evaluation temperature; 0 = greedy, so pass@1; sample ``i`` of a task draws its own seeds) through
any :class:`InferenceClient`, grades each in a fresh sandbox, and counts a session as passed only
when every hidden test passed. A task's ``passed`` and ``rewards`` are the means over its samples,
so pass@1 is estimated from ``samples`` draws per task (the unbiased pass@1 estimator of Chen et
al. 2021 with k = 1): with ``samples > 1`` a paired before/after difference
(:func:`shipyard.eval.stats.paired_diff_ci`) averages out the sampling noise of each task. Sessions
run ``concurrency`` at a time so the server batches them. A crashed session counts as failed.
A session that summarized itself is scored once (its reward is on every segment); its turns are
summed over its segments, and the means of its summary metrics (``summaries``, ``summary_tokens``,
``session_tokens``, ``hit_budget_unfinished``; :mod:`shipyard.agent.summarize`) and the most
``session_tokens`` of one session go to ``extra``. Sessions played through a session endpoint
(command harnesses, :mod:`shipyard.agent.endpoint`) add its counters, summed over sessions:
``tool_call_attempts`` (replies that tried a tool call), ``tool_call_parse_frac`` (of those, the
ones that parsed; absent when none tried), ``retokenized_calls`` and ``endpoint_calls``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from shipyard.agent.play import play
from shipyard.agent.session import SessionSpec
from shipyard.agent.types import Trajectory
from shipyard.envs.types import Task
from shipyard.eval.stats import wilson_ci

if TYPE_CHECKING:
    from shipyard.envs.environment import Environment


@dataclass
class EvalResult:
    task_ids: list[str]
    passed: list[float]
    """Per task: the fraction of its ``samples`` sessions that passed (0 or 1 with one sample)."""
    rewards: list[float]
    """Per task: the mean reward of its sessions."""
    errors: int = 0
    extra: dict[str, float] = field(default_factory=dict)
    samples: int = 1
    """Sessions played per task."""
    sample_passed: list[list[int]] = field(default_factory=list)
    """Per task, each sample's outcome (1 passed), in sample order: what ``passed`` averages."""

    @property
    def n(self) -> int:
        return len(self.passed)

    @property
    def pass_rate(self) -> float:
        return sum(self.passed) / max(self.n, 1)

    def ci95(self) -> tuple[float, float]:
        """Wilson interval counting each task as one trial (its pass fraction as the outcome):
        conservative when ``samples > 1``, since the samples of one task are not independent."""
        return wilson_ci(sum(self.passed), self.n)


def evaluate(
    spec: SessionSpec,
    tasks: list[Task],
    temperature: float,
    concurrency: int = 8,
    on_done: Callable[[], None] | None = None,
    env: Environment | None = None,
    samples: int = 1,
) -> EvalResult:
    """Pass@1 of ``spec``'s policy on ``tasks`` from ``samples`` sessions per task; ``on_done`` is
    called after each session.

    With ``env`` every session runs through its hooks (:meth:`Environment.play`: db and repo tasks
    get their sandboxes, services and graders; anti-cheat flags are counted in ``extra["flagged"]``).
    """
    sampling = spec.sampling.model_copy(update={"temperature": temperature})
    spec = dataclasses.replace(spec, sampling=sampling)

    assert samples >= 1, samples  # eval.samples_per_task is validated by the config

    def one(job: tuple[Task, int]) -> Trajectory:
        task, idx = job
        segments = play(spec, task, f"eval/{task.id}", idx, env)
        if on_done is not None:
            on_done()
        return dataclasses.replace(segments[-1], num_turns=sum(s.num_turns for s in segments))

    # sample-major order: every task's first sample before any task's second (a bar's rate is honest)
    jobs = [(task, idx) for idx in range(samples) for task in tasks]
    with ThreadPoolExecutor(concurrency, thread_name_prefix="eval") as pool:
        trajs = list(pool.map(one, jobs))
    per_task = [trajs[i :: len(tasks)] for i in range(len(tasks))]
    outcomes = [[int(tr.reward >= 1.0 and tr.error is None) for tr in ts] for ts in per_task]
    flagged = {"flagged": float(sum(bool(tr.flags) for tr in trajs))} if env is not None else {}
    return EvalResult(
        task_ids=[t.id for t in tasks],
        passed=[_mean(o) for o in outcomes],
        rewards=[_mean([tr.reward for tr in ts]) for ts in per_task],
        errors=sum(tr.error is not None for tr in trajs),
        samples=samples,
        sample_passed=outcomes,
        extra={
            "turns_mean": sum(tr.num_turns for tr in trajs) / max(len(trajs), 1),
            **_session_means(trajs),
            **_endpoint_counts(trajs),
            **flagged,
        },
    )


def _mean(xs: list[float] | list[int]) -> float:
    """Mean of one task's samples; exact for one sample (its 0/1 outcome stays 0.0 or 1.0)."""
    return sum(xs) / len(xs)


def _session_means(trajs: list[Trajectory]) -> dict[str, float]:
    """Means of the summary metrics over sessions that carry them (``<metric>_mean``, module doc)."""
    keys = ("summaries", "summary_tokens", "session_tokens", "hit_budget_unfinished")
    with_metrics = [tr.metrics for tr in trajs if "summaries" in tr.metrics]
    if not with_metrics:
        return {}
    out = {f"{k}_mean": sum(m[k] for m in with_metrics) / len(with_metrics) for k in keys}
    return {**out, "session_tokens_max": max(m["session_tokens"] for m in with_metrics)}


def _endpoint_counts(trajs: list[Trajectory]) -> dict[str, float]:
    """The session endpoint's counters summed over sessions that carry them (module doc)."""
    with_calls = [tr.metrics for tr in trajs if "tool_call_attempts" in tr.metrics]
    if not with_calls:
        return {}
    attempts = sum(m["tool_call_attempts"] for m in with_calls)
    parsed = sum(round(m["tool_call_parse_frac"] * m["tool_call_attempts"]) for m in with_calls)
    out = {
        "endpoint_calls": float(sum(m["calls"] for m in with_calls)),
        "retokenized_calls": float(sum(m["retokenized_calls"] for m in with_calls)),
        "tool_call_attempts": float(attempts),
    }
    return {**out, "tool_call_parse_frac": parsed / attempts} if attempts else out
