"""Discrete-event simulator of Shipyard's pipeline: what a run does at a scale this machine cannot run.

Contract: :func:`simulate` plays the real pipeline's rules with the speeds it is given
(:mod:`shipyard.fleet.types`) and returns a :class:`SimResult` whose throughput, trainer idle
share, staleness and sync lag are defined as the real run's (``summarize`` of its metrics):

- a rollout worker (``workers_per_server`` per server) plays batch ``k`` of ``groups_per_step``
  groups of ``group_size`` sessions, ``concurrency`` at a time, once its server holds version
  ``>= k - lag`` (``lag`` 0 in sync mode, ``max_off_policy_steps`` in async); the batch is
  delivered when its last session ends (the worker's barrier, as :class:`RolloutWorker`). The
  real worker paces on the trainer's consumption, which is this rule while every worker supplies
  its share (the simulator has no worker outages);
- a session is setup, then per turn one engine request (prompt tokens forwarded, tokens
  sampled) and the turn's environment delay;
- an engine is continuous batching as a fluid: up to ``max_batch`` rows, each advancing one token
  per decode step of ``step_base_s + step_per_row_s * rows``; admitting rows stalls the batch for
  their prefill; production requests are admitted before rollouts; applying a version pauses it;
- the trainer takes batch ``s - 1`` of every worker for step ``s``, trains for
  ``step_base_s + per_token_s * tokens``, publishes after ``publish_s``; each region's servers hold
  the version ``sync_s`` later. A trained session's staleness is the trainer's version minus the
  version its first token was sampled with; a session over ``max_off_policy_steps`` is dropped;
- on one host (``EngineProfile.contention > 0``), engine and trainer slow each other by
  ``1 + contention``: engines while the trainer steps or publishes, the optimizer step while an
  engine decodes (publishing is storage work and keeps its pace).

Limits: no memory model (KV cache size, preemption), no network contention between regions, one
model replica per server; everything is deterministic given ``seed``. Time is seconds from the
trainer's start with version 0 on every server.
"""

from __future__ import annotations

import heapq
import random
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from shipyard.fleet.types import (
    EngineProfile,
    PipelineSpec,
    ProductionLoad,
    RegionSpec,
    Session,
    SimResult,
    TrainerProfile,
    Workload,
)

_EPS = 1e-9


class _Loop:
    """The event queue: (time, order) keeps equal-time events in scheduling order."""

    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list[tuple[float, int, Callable[..., None], tuple[Any, ...]]] = []
        self._n = 0

    def at(self, t: float, fn: Callable[..., None], *args: Any) -> None:
        assert t >= self.now - _EPS, (t, self.now)
        heapq.heappush(self._heap, (max(t, self.now), self._n, fn, args))
        self._n += 1

    def run(self, done: Callable[[], bool]) -> None:
        while self._heap and not done():
            t, _, fn, args = heapq.heappop(self._heap)
            self.now = t
            fn(*args)


@dataclass(eq=False)
class _Job:
    prompt: int
    tokens: int
    done: Callable[[_Job], None]
    production: bool = False
    arrived: float = 0.0
    version: int = -1


class _Server:
    """One engine: rows decoding as a fluid, queues (production first), stalls for prefill and applies.

    Every decoding row advances at the same rate, so the server keeps one counter, ``progress``
    (tokens each row has advanced since the start), and a heap of the counter value at which each
    row ends: an event costs O(log rows)."""

    def __init__(self, loop: _Loop, profile: EngineProfile, name: str) -> None:
        self.loop, self.p, self.name = loop, profile, name
        self.rows: list[tuple[float, int, _Job]] = []
        self.queue: deque[_Job] = deque()
        self.prod_queue: deque[_Job] = deque()
        self.progress = 0.0
        self.stall_until = 0.0
        self.last = 0.0
        self.epoch = 0
        self.admitted = 0
        self.version = 0
        self.busy_s = 0.0
        self.slow = 1.0
        """Time multiplier of decode steps and prefills (``1 + contention`` while the trainer computes)."""
        self.on_version: list[Callable[[], None]] = []
        self.on_busy: Callable[[], None] | None = None
        """Called when the server starts or stops decoding (the host's trainer slows meanwhile)."""

    def submit(self, job: _Job) -> None:
        job.arrived = self.loop.now
        (self.prod_queue if job.production else self.queue).append(job)
        busy = bool(self.rows)
        self._advance()
        self._admit()
        self._schedule()
        self._busy_changed(busy)

    def _busy_changed(self, before: bool) -> None:
        if self.on_busy is not None and bool(self.rows) != before:
            self.on_busy()

    def apply(self, version: int) -> None:
        self._advance()
        self.stall_until = max(self.loop.now, self.stall_until) + self.p.apply_s
        self.busy_s += self.p.apply_s
        self.version = version
        self._schedule()
        for fn in self.on_version:
            fn()

    def set_slow(self, slow: float) -> None:
        self._advance()
        self.slow = slow
        self._schedule()

    def _advance(self) -> None:
        now = self.loop.now
        start = max(self.last, self.stall_until)
        if self.rows and now > start:
            self.progress += (now - start) / (self.p.step_s(len(self.rows)) * self.slow)
            self.busy_s += now - start
        self.last = max(self.last, now)

    def _admit(self) -> None:
        prefill = 0
        while len(self.rows) < self.p.max_batch and (self.prod_queue or self.queue):
            job = (self.prod_queue or self.queue).popleft()
            job.version = self.version
            heapq.heappush(self.rows, (self.progress + job.tokens, self.admitted, job))
            self.admitted += 1
            prefill += job.prompt
        if prefill:
            cost = prefill * self.p.prefill_per_token_s * self.slow
            self.stall_until = max(self.loop.now, self.stall_until) + cost
            self.busy_s += cost

    def _schedule(self) -> None:
        self.epoch += 1
        if self.rows:
            least = max(self.rows[0][0] - self.progress, 0.0)
            t = max(self.loop.now, self.stall_until) + least * self.p.step_s(len(self.rows)) * self.slow
            self.loop.at(t, self._tick, self.epoch)

    def _tick(self, epoch: int) -> None:
        if epoch != self.epoch:
            return
        self._advance()
        finished = []
        while self.rows and self.rows[0][0] <= self.progress + 1e-6:
            finished.append(heapq.heappop(self.rows)[2])
        self._admit()
        self._schedule()
        self._busy_changed(True)
        for job in finished:
            job.done(job)


@dataclass
class _Batch:
    seq: int
    sessions: list[tuple[Session, int]] = field(default_factory=list)
    """Finished sessions with the version their first token was sampled with."""


class _Worker:
    """A rollout worker bound to one server, under the real worker's version gate. Barrier mode (the
    real :class:`RolloutWorker`): batch ``k`` starts whole and is delivered when its last session
    ends. Streaming mode (``PipelineSpec.streaming``): groups start as session slots free up, group
    ``g`` once the server holds ``>= g // groups_per_step - lag``; batches are formed from groups in
    the order they finish."""

    def __init__(self, sim: _Sim, server: _Server, rng: random.Random) -> None:
        self.sim, self.server, self.rng = sim, server, rng
        self.seq, self.started, self.in_flight = 0, 0, 0
        self.pending: deque[tuple[Session, list[tuple[Session, int]]]] = deque()
        """Sessions of started groups waiting for one of the ``concurrency`` slots."""
        self.done_groups: list[list[tuple[Session, int]]] = []
        server.on_version.append(self.try_start)

    def try_start(self) -> None:
        spec = self.sim.spec
        slots = (
            max(spec.concurrency, spec.group_size)
            if spec.streaming
            else spec.groups_per_step * spec.group_size
        )
        while self.started < spec.steps * spec.groups_per_step:
            k = self.started // spec.groups_per_step
            if self.in_flight + spec.group_size > slots or self.server.version < k - spec.lag:
                return
            if not spec.streaming and self.started % spec.groups_per_step == 0 and self.in_flight:
                return  # barrier: the next batch waits for the last session of this one
            group: list[tuple[Session, int]] = []
            self.pending += [(self.sim.work.draw(self.rng), group) for _ in range(spec.group_size)]
            self.started += 1
            self.in_flight += spec.group_size
            self._pump()

    def _pump(self) -> None:
        while self.pending and self.in_flight - len(self.pending) < self.sim.spec.concurrency:
            session, group = self.pending.popleft()
            self.sim.loop.at(self.sim.loop.now + session.setup_s, self._turn, session, group, 0, -1)

    def _turn(self, session: Session, group: list[tuple[Session, int]], k: int, version: int) -> None:
        if k == len(session.turns):
            self._session_done(session, group, version)
            return
        turn = session.turns[k]

        def done(job: _Job) -> None:
            first = job.version if version < 0 else version
            self.sim.loop.at(self.sim.loop.now + turn.env_s, self._turn, session, group, k + 1, first)

        self.server.submit(_Job(turn.new_prompt_tokens, turn.sampled_tokens, done))

    def _session_done(self, session: Session, group: list[tuple[Session, int]], version: int) -> None:
        spec = self.sim.spec
        group.append((session, version))
        self.in_flight -= 1
        if len(group) == spec.group_size:
            self.done_groups.append(group)
        if len(self.done_groups) >= spec.groups_per_step and (spec.streaming or self.in_flight == 0):
            take, self.done_groups = (
                self.done_groups[: spec.groups_per_step],
                self.done_groups[spec.groups_per_step :],
            )
            self.sim.trainer.deliver(_Batch(self.seq, [s for g in take for s in g]))
            self.seq += 1
        self._pump()
        self.try_start()


class _Trainer:
    def __init__(self, sim: _Sim, profile: TrainerProfile, workers: int) -> None:
        self.sim, self.p, self.workers = sim, profile, workers
        self.step, self.busy, self.wait_from = 0, False, 0.0
        self.batches: dict[int, list[_Batch]] = {}
        self.training, self.work_left, self.last, self.rate, self.epoch = False, 0.0, 0.0, 1.0, 0
        self.rng = random.Random(f"trainer/{sim.seed}")

    def deliver(self, batch: _Batch) -> None:
        self.batches.setdefault(batch.seq, []).append(batch)
        self.try_step()

    def try_step(self) -> None:
        ready = self.batches.get(self.step, [])
        if self.busy or self.step >= self.sim.spec.steps or len(ready) < self.workers:
            return
        res, now = self.sim.result, self.sim.loop.now
        res.trainer_idle_s += now - self.wait_from
        sessions = [s for b in self.batches.pop(self.step) for s in b.sessions]
        bound = self.sim.spec.max_off_policy_steps
        res.dropped_stale += sum(self.step - v > bound for _, v in sessions)
        sessions = [(s, v) for s, v in sessions if self.step - v <= bound]
        res.step_samples.append(len(sessions))
        for session, version in sessions:
            res.samples += 1
            res.tokens += sum(t.sampled_tokens for t in session.turns)
            res.staleness.append(self.step - version)
        self.busy, self.training = True, True
        self.sim.contend(True)
        self.work_left, self.last = self.p.step_s(self.p.cost_tokens(self._train_order(sessions))), now
        self._reschedule()

    def _train_order(self, sessions: list[tuple[Session, int]]) -> list[int]:
        """Session lengths in the order the trainer forwards them: group by group, a group's sessions
        by sample index (which says nothing of their length: a seeded shuffle here)."""
        size = self.sim.spec.group_size
        out = []
        for i in range(0, len(sessions), size):
            lengths = [s.tokens for s, _ in sessions[i : i + size]]
            self.rng.shuffle(lengths)
            out += lengths
        return out

    def engines_changed(self) -> None:
        """An engine on the host started or stopped decoding: the optimizer step's pace changes."""
        if self.training:
            self.work_left -= (self.sim.loop.now - self.last) * self.rate
            self.last = self.sim.loop.now
            self._reschedule()

    def _reschedule(self) -> None:
        c = self.sim.engine.contention
        self.rate = 1.0 / (1.0 + c) if c and any(s.rows for s in self.sim.servers) else 1.0
        self.epoch += 1
        self.sim.loop.at(self.sim.loop.now + max(self.work_left, 0.0) / self.rate, self._trained, self.epoch)

    def _trained(self, epoch: int) -> None:
        if epoch != self.epoch:
            return
        self.training = False
        self.sim.loop.at(self.sim.loop.now + self.p.publish_s, self._published)

    def _published(self) -> None:
        now = self.sim.loop.now
        self.step += 1
        self.busy, self.wait_from = False, now
        self.sim.contend(False)
        self.sim.result.step_end_s.append(now)
        for region in self.sim.regions:
            self.sim.loop.at(now + region.spec.sync_s, region.adopt, self.step, now)
        self.try_step()


class _Region:
    def __init__(self, sim: _Sim, spec: RegionSpec, servers: list[_Server]) -> None:
        self.sim, self.spec, self.servers = sim, spec, servers
        self.version = 0

    def adopt(self, version: int, published_at: float) -> None:
        if version <= self.version:
            return
        self.version = version
        self.sim.result.sync_lag_s.setdefault(self.spec.name, []).append(self.sim.loop.now - published_at)
        for s in self.servers:
            s.apply(version)


class _Production:
    """Poisson arrivals at ``load.rate(t)`` on one server (thinning at the peak rate)."""

    def __init__(self, sim: _Sim, server: _Server, load: ProductionLoad, rng: random.Random) -> None:
        self.sim, self.server, self.load, self.rng = sim, server, load, rng
        self._next()

    def _next(self) -> None:
        if self.load.peak > 0:
            self.sim.loop.at(self.sim.loop.now + self.rng.expovariate(self.load.peak), self._arrive)

    def _arrive(self) -> None:
        if self.rng.random() * self.load.peak < self.load.rate(self.sim.loop.now):
            job = _Job(self.load.prompt_tokens, self.load.sampled_tokens, self._done, production=True)
            self.server.submit(job)
        self._next()

    def _done(self, job: _Job) -> None:
        self.sim.result.production_latency_s.append(self.sim.loop.now - job.arrived)


class _Sim:
    def __init__(
        self,
        spec: PipelineSpec,
        regions: list[RegionSpec],
        engine: EngineProfile,
        trainer: TrainerProfile,
        work: Workload,
        seed: int,
    ) -> None:
        self.spec, self.work, self.engine, self.seed, self.loop = spec, work, engine, seed, _Loop()
        self.result = SimResult(elapsed_s=0.0, samples=0, tokens=0, trainer_idle_s=0.0)
        rng = random.Random(seed)
        self.servers: list[_Server] = []
        self.regions: list[_Region] = []
        workers: list[_Worker] = []
        for r in regions:
            servers = [_Server(self.loop, engine, f"{r.name}/{i}") for i in range(r.servers)]
            self.regions.append(_Region(self, r, servers))
            self.servers += servers
            workers += [
                _Worker(self, s, random.Random(rng.random()))
                for s in servers
                for _ in range(r.workers_per_server)
            ]
            if r.production is not None:
                for s in servers:
                    _Production(self, s, r.production, random.Random(rng.random()))
        self.trainer = _Trainer(self, trainer, len(workers))
        self.workers = workers
        if engine.contention:
            for s in self.servers:
                s.on_busy = self.trainer.engines_changed

    def contend(self, training: bool) -> None:
        """The trainer started or stopped its step (optimizer step, then publishing): engines on the
        same host slow down or recover."""
        if self.engine.contention:
            for s in self.servers:
                s.set_slow(1.0 + self.engine.contention if training else 1.0)

    def run(self) -> SimResult:
        for w in self.workers:
            w.try_start()
        self.loop.run(lambda: self.trainer.step >= self.spec.steps)
        res = self.result
        res.elapsed_s = self.loop.now
        for s in self.servers:
            s._advance()
        res.engine_busy_frac = sum(s.busy_s for s in self.servers) / max(
            len(self.servers) * res.elapsed_s, _EPS
        )
        return res


def simulate(
    spec: PipelineSpec,
    regions: list[RegionSpec],
    engine: EngineProfile,
    trainer: TrainerProfile,
    work: Workload,
    seed: int = 0,
) -> SimResult:
    """One simulated run (module doc); deterministic given ``seed``."""
    if not regions or any(r.servers < 1 for r in regions):
        raise ValueError("simulate needs at least one region with at least one server (RegionSpec.servers)")
    if spec.steps < 1 or spec.groups_per_step < 1 or spec.group_size < 1 or spec.concurrency < 1:
        raise ValueError(f"PipelineSpec fields must be >= 1: {spec}")
    return _Sim(spec, regions, engine, trainer, work, seed).run()
