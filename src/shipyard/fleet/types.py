"""Records of the fleet simulator: what a server, the trainer and a session cost, and what a run shows.

A simulated run (:func:`shipyard.fleet.sim.simulate`) is the real pipeline's shape with measured
speeds: rollout workers play batches of agent sessions on inference servers grouped in regions,
the trainer takes one batch per worker per step, publishes a version, and each region adopts it
after its own sync time. Speeds come from :mod:`shipyard.fleet.calibrate` (this machine's
measurements) or from a documented profile for hardware this machine does not have.

Usage::

    from shipyard.fleet.types import EngineProfile, TrainerProfile, Workload, PipelineSpec, RegionSpec
    from shipyard.fleet.sim import simulate

    engine = EngineProfile(step_base_s=0.030, step_per_row_s=0.004, prefill_per_token_s=2e-4, max_batch=16)
    trainer = TrainerProfile(step_base_s=2.0, per_token_s=3e-3, publish_s=1.5)
    work = Workload.lognormal(turns=2, median_tokens=60, sigma=0.6, max_tokens=128, prompt_tokens=300)
    spec = PipelineSpec(mode="async", steps=14, groups_per_step=2, group_size=8, concurrency=16)
    out = simulate(spec, [RegionSpec("local", servers=1, sync_s=1.0)], engine, trainer, work, seed=0)
    print(out.samples_per_s, out.trainer_idle_frac)

Limits: an engine is a fluid model of continuous batching (every decoding row advances one token
per decode step of ``step_base_s + step_per_row_s * rows``; a prefill stalls the whole batch), so
it has no notion of memory pressure or preemption beyond ``max_batch``; environments are delays.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Literal

from shipyard.trainer.microbatch import length_runs


@dataclass(frozen=True)
class EngineProfile:
    """One inference server (one model replica)."""

    step_base_s: float
    """Seconds of a decode step that do not grow with the batch (weights read, launch overheads)."""
    step_per_row_s: float
    """Seconds a decode step grows per decoding row."""
    prefill_per_token_s: float
    """Seconds per prompt token forwarded at admission; the whole batch waits meanwhile."""
    max_batch: int
    """Rows decoded together; later requests queue."""
    apply_s: float = 0.0
    """Seconds the engine pauses to apply a new version."""
    contention: float = 0.0
    """Share by which engine and trainer slow each other on one host (a CPU machine running both; 0
    on separate devices): decode and prefill take ``1 + contention`` times longer while the trainer
    steps or publishes, the optimizer step while an engine decodes."""

    def step_s(self, rows: int) -> float:
        return self.step_base_s + self.step_per_row_s * rows

    def tokens_per_s(self, rows: int) -> float:
        return rows / self.step_s(rows)


@dataclass(frozen=True)
class TrainerProfile:
    """The trainer: one optimizer step on a batch of ``tokens`` sequence tokens, then a version."""

    step_base_s: float
    per_token_s: float
    publish_s: float
    """Seconds after the optimizer step before the version is in the store (checkpoint, publish)."""
    micro_batch: int = 0
    """Sequences per forward and backward (``trainer.micro_batch``), each padded to the longest of
    its micro-batch: a step costs its padded tokens. 0: its tokens."""
    micro_batch_tokens: int = 0
    """Most padded tokens per micro-batch (``trainer.micro_batch_tokens``; 0: rows only)."""

    def step_s(self, tokens: int) -> float:
        return self.step_base_s + self.per_token_s * tokens

    def cost_tokens(self, lengths: list[int]) -> int:
        """Tokens a step forwards for sequences of ``lengths``, padded per micro-batch in the
        trainer's order without prefix sharing (longest first, cut by both caps:
        :func:`shipyard.trainer.microbatch.plan_micro_batches`; ``trainer.share_prefix = false``). Sessions
        carry no prompt here, so a trainer that shares its groups' prompts (the default) forwards
        fewer: on the demo's rollouts 1,768 instead of 3,281 a step (``benchmarks/trainer_prefix.py``);
        calibrate ``per_token_s`` against the trainer being simulated."""
        if not self.micro_batch:
            return sum(lengths)
        lengths = sorted(lengths, reverse=True)
        runs = length_runs(lengths, self.micro_batch, self.micro_batch_tokens)
        return sum((j - i) * lengths[i] for i, j in runs)


@dataclass(frozen=True)
class Turn:
    new_prompt_tokens: int
    """Prompt tokens the engine forwards for this turn (the whole prompt on the first turn, the tool
    output on later ones: the prefix cache holds the rest)."""
    sampled_tokens: int
    env_s: float
    """Seconds after the turn's generation before the next (action, tool output, grading)."""


@dataclass(frozen=True)
class Session:
    setup_s: float
    turns: tuple[Turn, ...]
    tokens: int
    """Tokens the trainer forwards for this session (its segments' whole sequences)."""


@dataclass
class Workload:
    """Sessions to draw from: recorded ones (resampled) or a parametric long-tailed mix."""

    sessions: list[Session]

    def draw(self, rng: random.Random) -> Session:
        return rng.choice(self.sessions)

    @staticmethod
    def lognormal(
        turns: int,
        median_tokens: float,
        sigma: float,
        max_tokens: int,
        prompt_tokens: int,
        tool_tokens: int = 100,
        env_s: float = 0.5,
        setup_s: float = 0.05,
        n: int = 4096,
        seed: int = 0,
    ) -> Workload:
        """``n`` sessions of ``turns`` turns; sampled tokens per turn are lognormal(median, sigma) cut
        at ``max_tokens``: ``sigma`` sets the long tail (0.5: p99/median ~3; 1.5: ~30)."""
        rng = random.Random(seed)
        out = []
        for _ in range(n):
            ts = []
            for k in range(turns):
                sampled = min(max_tokens, max(1, round(median_tokens * math.exp(rng.gauss(0.0, sigma)))))
                ts.append(Turn(prompt_tokens if k == 0 else tool_tokens, sampled, env_s))
            out.append(Session(setup_s, tuple(ts), sum(t.new_prompt_tokens + t.sampled_tokens for t in ts)))
        return Workload(out)


@dataclass(frozen=True)
class ProductionLoad:
    """Production requests on a region's servers: Poisson arrivals at ``rate(t)`` per server, each
    a single turn that takes a batch slot before any rollout does."""

    rate_per_s: tuple[tuple[float, float], ...]
    """(time_s, requests/s per server) knots, linearly interpolated, held after the last."""
    prompt_tokens: int = 200
    sampled_tokens: int = 100

    def rate(self, t: float) -> float:
        knots = self.rate_per_s
        if t <= knots[0][0]:
            return knots[0][1]
        for (t0, r0), (t1, r1) in zip(knots, knots[1:], strict=False):
            if t <= t1:
                return r0 + (r1 - r0) * (t - t0) / (t1 - t0)
        return knots[-1][1]

    @property
    def peak(self) -> float:
        return max(r for _, r in self.rate_per_s)


@dataclass(frozen=True)
class RegionSpec:
    name: str
    servers: int
    sync_s: float
    """Seconds from a version in the store to this region's servers holding it (relay fetch, apply)."""
    workers_per_server: int = 1
    production: ProductionLoad | None = None


@dataclass(frozen=True)
class PipelineSpec:
    """The run's shape, as `trainer.*` and `rollout.*` set it."""

    mode: Literal["sync", "async"]
    steps: int
    groups_per_step: int
    """Groups per worker per step (``trainer.groups_per_step / rollout.num_workers``)."""
    group_size: int
    concurrency: int
    """Sessions a worker runs at once."""
    max_off_policy_steps: int = 2
    """The staleness bound: the worker's version gate (async) and the trainer's drop rule."""
    streaming: bool = False
    """Groups start as session slots free up and batches form in finishing order (no batch
    barrier); False is how :class:`~shipyard.rollout.worker.RolloutWorker` plays today."""

    @property
    def lag(self) -> int:
        return 0 if self.mode == "sync" else self.max_off_policy_steps


@dataclass
class SimResult:
    """What the simulated run shows; throughput figures are defined as the real run's summary."""

    elapsed_s: float
    """The trainer's clock at its last step."""
    samples: int
    tokens: int
    trainer_idle_s: float
    dropped_stale: int = 0
    """Sessions over the staleness bound when the trainer took them (never trained on)."""
    staleness: list[int] = field(default_factory=list)
    """Per trained session: trainer version minus the version its first token was sampled with."""
    sync_lag_s: dict[str, list[float]] = field(default_factory=dict)
    """Per region: seconds from each version's publication to its adoption by the region."""
    engine_busy_frac: float = 0.0
    """Share of server time spent decoding or prefilling (rollouts and production)."""
    production_latency_s: list[float] = field(default_factory=list)
    step_end_s: list[float] = field(default_factory=list)
    step_samples: list[int] = field(default_factory=list)

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.elapsed_s

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.elapsed_s

    @property
    def trainer_idle_frac(self) -> float:
        return self.trainer_idle_s / self.elapsed_s
