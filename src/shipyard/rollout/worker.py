"""Rollout worker: plays GRPO groups of agent sessions and writes them to ``rollouts/``.

Contract: worker ``w`` writes one :class:`RolloutBatch` per ``share = groups_per_step /
num_workers`` whole groups of ``group_size`` sessions each, to ``rollouts/<w>/<k:08d>.json.gz``
(atomic). The version gate paces it on the trainer's consumption, read from
``control/progress.json`` (:class:`~shipyard.rollout.types.TrainerProgress`, written after each
published version, and while the trainer waits with the groups it dropped credited): a group may start when the worker would hold at most ``(lag + 1) * share``
groups the trainer has not finished with, and its server is at most ``lag`` versions behind the
trainer's last published version. ``lag = 0`` in ``sync`` mode (batch k is sampled with version k
exactly: the rollouts wait for the trainer) and ``lag = max_off_policy_steps`` in ``async`` mode
(generation runs ahead of the trainer by at most that many versions). With every worker supplying,
that is "batch k starts once the server holds version k - lag"; when one falls silent (a region
cut off), the trainer takes the others' groups and they go on, so the run does not stop for it.
It always samples with the newest weights the server has; each token records its version. With
``rollout.streaming`` the worker does not wait for a batch's last session: groups start as
session slots free up, under the same gate, and batch ``k`` holds the ``k``-th ``share`` groups to
finish (the trainer drops what ends up over the staleness bound). A session that crashes
is recorded with its error (see :func:`shipyard.agent.play.play`). A session that summarized itself contributes
all its segments, in order, to its group's batch. The worker stops when ``control/finished``
appears in the store or ``stop`` is set; on restart it continues after its last written batch.
While the store cannot be reached (a region cut off from the origin) it keeps its batch and
retries every store call (:func:`~shipyard.store.retry.until_reachable`), and goes on sampling with
the version its server has and the progress it last read until the gate stops it; each batch
carries ``fleet.region`` and the adoptions its server reported since the previous batch.

Environment: each session runs through the worker's :class:`~shipyard.envs.environment.Environment`
(services such as PostgreSQL, squashed repositories, reward components, anti-cheat flags; closed
when :meth:`RolloutWorker.run` returns), so every trajectory carries ``reward_components`` and
``flags``. Function-task sessions take their sandbox from a :class:`SandboxPool` (pre-warmed,
commands capped at the core count; ``sandbox.pool.rollouts``, closed when :meth:`run` returns);
db and repo tasks get theirs from the environment. It trains on the tasks it is given
(:func:`~shipyard.orchestrate.components.build_worker` gives it the training split, the generated
db and repo tasks and the task files the config names: ``tasks.num_db``, ``tasks.num_repo``,
``tasks.files``); ``tasks.mix`` weighs the kinds a group draws from (:meth:`RolloutWorker.draw_task`). With
``anticheat.canary_rate > 0`` a group plays a canary task (passable only by
cheating, :func:`shipyard.envs.grading.anticheat.canary_tasks`) with that probability.
"""

from __future__ import annotations

import contextlib
import random
import threading
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import Any

import httpx

from shipyard.agent.play import play
from shipyard.agent.session import SessionSpec
from shipyard.agent.types import Trajectory
from shipyard.config.schema import ShipyardConfig
from shipyard.envs.environment import Environment
from shipyard.envs.grading.anticheat import canary_tasks
from shipyard.envs.sandbox.pool import SandboxPool
from shipyard.envs.types import Task
from shipyard.metrics.health import Beat
from shipyard.rollout.types import FINISHED_KEY, PROGRESS_KEY, ROLLOUT_PREFIX, RolloutBatch, TrainerProgress
from shipyard.store.retry import until_reachable
from shipyard.store.run import RunIdentity
from shipyard.store.types import Store
from shipyard.weights.versions import read_manifest


class WorkerStopping(Exception):
    """Raised inside a run whose worker was asked to stop while its server could not be reached."""


class RolloutWorker:
    """One rollout worker; :func:`shipyard.orchestrate.components.build_worker` assembles it (its
    constructor does no I/O: the store is first read when :meth:`run` starts)."""

    def __init__(
        self,
        worker_id: str,
        cfg: ShipyardConfig,
        store: Store,
        spec: SessionSpec,
        tasks: list[Task],
        env: Environment,
        identity: RunIdentity,
    ) -> None:
        """``spec`` holds the policy's client and the harness every session is played by;
        ``tasks`` are every training task (the config's extra ones included); ``env`` is closed
        when :meth:`run` returns; ``identity`` is stamped into every batch (the trainer checks it)."""
        if not tasks:
            raise ValueError(
                "rollout worker needs at least one training task (check tasks.num_generated, tasks.files)"
            )
        self.tasks = tasks
        self.by_kind: dict[str, list[Task]] = {}
        for t in self.tasks:
            self.by_kind.setdefault(t.kind, []).append(t)
        self.mix = {k: w for k, w in cfg.tasks.mix.items() if w > 0}
        missing = sorted(k for k in self.mix if k not in self.by_kind)
        if missing:
            raise ValueError(
                f"tasks.mix weighs task kind(s) {missing} but the training set has none of them: "
                "set tasks.num_db / tasks.num_repo (or add task files), or drop them from tasks.mix"
            )
        self.worker_id = worker_id
        self.cfg = cfg
        self.store = store
        self.stop_event = threading.Event()
        self.identity = identity
        self.spec = spec
        self.share = cfg.trainer.groups_per_step // cfg.rollout.num_workers
        self.lag = 0 if cfg.trainer.mode == "sync" else cfg.trainer.max_off_policy_steps
        self.next_seq = 0
        """The next batch's sequence number: set from the store when :meth:`run` starts."""
        self._progress = TrainerProgress()
        self._progress_read = -1.0
        self.env = env
        self.canaries = canary_tasks()
        self.sandboxes: SandboxPool | None = None
        """Pre-warmed sandboxes for function tasks while :meth:`run` runs (``sandbox.pool.rollouts``)."""
        self._digests: dict[int, str] = {}
        self._reported: set[tuple[str, int]] = set()
        """Adoptions (server, version) already stamped into a batch."""
        self.sandbox_stats: dict[str, int] = {}
        """The pool's counters when the last :meth:`run` ended (created, warm_hits, peak_running, ...)."""
        self.beat: Beat | None = None
        """Where the worker reports progress (``sessions``, a tick per finished session; ``waiting``
        on the version gate, idle: the trainer is watched instead; ``done``; the run's watchdog,
        :mod:`shipyard.metrics.health`)."""

    def resume_seq(self) -> int:
        """The sequence number after this worker's last written batch (0 for a new worker); waits
        while the store is unreachable (a region cut off)."""
        prefix = f"{ROLLOUT_PREFIX}{self.worker_id}/"
        return len(until_reachable(lambda: self.store.list(prefix), "its batches", deadline_s=600))

    def should_stop(self) -> bool:
        """Asked to stop, or the run is finished; an unreachable store (a region cut off) is not
        taken for either: the worker goes on with the version it has."""
        if self.stop_event.is_set():
            return True
        try:
            return self.store.exists(FINISHED_KEY)
        except (TimeoutError, ConnectionError):
            return False

    def _write(self, batch: RolloutBatch) -> None:
        """Put ``batch`` in the store, retrying while the store is unreachable: the sessions are
        kept, and the trainer judges their staleness when they arrive."""
        data = batch.to_bytes()
        until_reachable(
            lambda: self.store.put(batch.key(), data), f"batch {batch.batch_id}", stop=self.stop_event
        )

    def progress(self) -> TrainerProgress:
        """The trainer's :class:`TrainerProgress`, read at most every 0.5 s; the last one read while
        the store is unreachable, and the empty one before the trainer's first version."""
        now = time.monotonic()
        if now - self._progress_read >= 0.5:
            self._progress_read = now
            with contextlib.suppress(FileNotFoundError, TimeoutError, ConnectionError):
                self._progress = TrainerProgress.from_bytes(self.store.get(PROGRESS_KEY))
        return self._progress

    def may_start(self, started: int, groups: int, version: int) -> bool:
        """The version gate (module docstring): may ``groups`` more start, with ``started`` started
        so far and the server at ``version``?"""
        p = self.progress()
        outstanding = started + groups - p.consumed.get(self.worker_id, 0)
        return outstanding <= (self.lag + 1) * self.share and version >= p.version - self.lag

    def server_version(self) -> int:
        """The server's version. While the server does not answer (cut off, frozen, restarting)
        the worker retries every second in phase ``unreachable``, which is not idle: past the
        worker's deadline its watchdog names it stuck (without a beat it waits unwatched). A worker
        asked to stop meanwhile ends its run (:meth:`run` returns)."""
        before, told = None if self.beat is None else self.beat.phase, False
        while True:
            try:
                version = self.spec.client.version()
            except (ConnectionError, TimeoutError) as e:
                if self.should_stop():
                    raise WorkerStopping from e
                if not told:
                    print(f"worker {self.worker_id}: {e}; retrying every second", flush=True)
                    told = True
                self._phase("unreachable")
                time.sleep(1.0)
                continue
            if told and before is not None:
                self._phase(before)
            return version

    def wait_for_gate(self, started: int, groups: int) -> bool:
        """Block until :meth:`may_start`; False if asked to stop meanwhile."""
        self._phase("waiting")
        while not self.may_start(started, groups, self.server_version()):
            if self.should_stop():
                return False
            time.sleep(0.1)
        return True

    def run(self, max_batches: int | None = None) -> int:
        """Produce batches until stopped, after the last one written before; returns how many
        were written."""
        written = 0
        self.next_seq = first = self.resume_seq()
        if self.cfg.sandbox.pool.rollouts:
            self.sandboxes = SandboxPool(self.cfg.sandbox)
        try:
            with ThreadPoolExecutor(
                max(self.cfg.rollout.concurrency, self.cfg.rollout.group_size),
                thread_name_prefix=f"{self.worker_id}-s",
            ) as pool:
                if self.cfg.rollout.streaming:
                    return self._run_streaming(pool, max_batches)
                while not self.should_stop() and (max_batches is None or written < max_batches):
                    if not self.wait_for_gate(self.next_seq * self.share, self.share):
                        break
                    batch = self.play_batch(pool, self.next_seq)
                    self._write(batch)
                    self.next_seq += 1
                    written += 1
        except WorkerStopping:  # stopped while its server could not be reached
            return self.next_seq - first
        finally:
            self._phase("done")
            self.env.close()  # stops services; a later run starts them again
            if self.sandboxes is not None:
                self.sandboxes.close()  # destroys every sandbox it made, handed out or warm
                self.sandbox_stats = dict(self.sandboxes.stats)
                self.sandboxes = None
        return written

    def _new_adoptions(self) -> list[dict[str, Any]]:
        """The server's adoptions not yet stamped into a batch (``RolloutBatch.adoptions``); none
        while the server does not answer (they go with a later batch)."""
        try:
            events = self.spec.client.stats().get("adoptions", [])
        except (httpx.HTTPError, ConnectionError, TimeoutError):
            return []
        new = [e for e in events if (e["server"], e["version"]) not in self._reported]
        self._reported.update((e["server"], e["version"]) for e in new)
        return new

    def digest(self, version: int) -> str:
        """The state digest of ``version`` the batch claims: the published manifest's (the version
        the server fetched, verified and applied is that manifest's); "" while none is published
        (a server started from the model files before the trainer published version 0)."""
        if version not in self._digests:
            try:
                manifest = until_reachable(
                    lambda: read_manifest(self.store, version), f"manifest {version}", stop=self.stop_event
                )
                self._digests[version] = manifest.state_digest
            except FileNotFoundError:
                return ""
        return self._digests[version]

    def play_session(self, task: Task, group_id: str, sample_idx: int) -> list[Trajectory]:
        """One session through the environment (function tasks take the worker's pool sandboxes)."""
        factory = self.sandboxes.acquire if self.sandboxes is not None else None
        segments = play(self.spec, task, group_id, sample_idx, self.env, factory)
        if self.beat is not None:
            self.beat.tick()
        return segments

    def _phase(self, phase: str) -> None:
        if self.beat is not None and self.beat.phase != phase:
            self.beat.enter(phase)

    def _start_group(
        self, pool: ThreadPoolExecutor, rng: random.Random, gid: str
    ) -> list[Future[list[Trajectory]]]:
        """Submit one group's sessions: a task drawn by ``rng`` (a canary at ``anticheat.canary_rate``)."""
        self._phase("sessions")
        task = self.draw_task(rng)
        rate = self.cfg.anticheat.canary_rate
        if rate and rng.random() < rate:
            task = rng.choice(self.canaries)
        return [
            pool.submit(self.play_session, task, f"{gid}/{task.id}", i)
            for i in range(self.cfg.rollout.group_size)
        ]

    def draw_task(self, rng: random.Random) -> Task:
        """A training task: uniform over all of them, or a kind drawn by ``tasks.mix`` first."""
        if not self.mix:
            return rng.choice(self.tasks)
        kinds = sorted(self.mix)
        kind = rng.choices(kinds, weights=[self.mix[k] for k in kinds])[0]
        return rng.choice(self.by_kind[kind])

    def play_batch(self, pool: ThreadPoolExecutor, seq: int) -> RolloutBatch:
        rng = random.Random(f"{self.cfg.run.seed}/{self.worker_id}/{seq}")
        version = self.server_version()
        t0 = time.time()
        jobs = [
            j
            for g in range(self.share)
            for j in self._start_group(pool, rng, f"{self.worker_id}/{seq:08d}/{g}")
        ]
        return self._batch(seq, [seg for j in jobs for seg in j.result()], t0, version)

    def _run_streaming(self, pool: ThreadPoolExecutor, max_batches: int | None) -> int:
        """``rollout.streaming``: groups start as session slots free up (``concurrency``, at least a
        group) under the version gate; batches are made of groups in the order they finish, so a
        long session holds back only its own group."""
        size, share = self.cfg.rollout.group_size, self.share
        slots = max(self.cfg.rollout.concurrency, size)
        started, written = self.next_seq * share, 0
        running: dict[str, tuple[list[Future[list[Trajectory]]], int, float]] = {}
        done: list[tuple[list[Trajectory], int, float]] = []
        while not self.should_stop() and (max_batches is None or written < max_batches):
            version = self.server_version()  # one request per pass, not two per group
            while (len(running) + 1) * size <= slots and self.may_start(started, 1, version):
                rng = random.Random(f"{self.cfg.run.seed}/{self.worker_id}/g{started}")
                gid = f"{self.worker_id}/g{started:08d}"
                running[gid] = (self._start_group(pool, rng, gid), version, time.time())
                started += 1
            futures = [f for fs, _, _ in running.values() for f in fs]
            if futures:
                wait(futures, timeout=0.1, return_when=FIRST_COMPLETED)
            else:
                self._phase("waiting")
                time.sleep(0.1)  # waiting for the version gate
            for gid in [g for g, (fs, _, _) in running.items() if all(f.done() for f in fs)]:
                fs, version, t0 = running.pop(gid)
                done.append(([seg for f in fs for seg in f.result()], version, t0))
            while len(done) >= share:
                take, done = done[:share], done[share:]
                trajs = [t for group, _, _ in take for t in group]
                batch = self._batch(
                    self.next_seq, trajs, min(t for _, _, t in take), min(v for _, v, _ in take)
                )
                self._write(batch)
                self.next_seq += 1
                written += 1
        return written

    def _batch(self, seq: int, trajs: list[Trajectory], t0: float, version: int) -> RolloutBatch:
        used = {v for t in trajs for v, m in zip(t.versions, t.loss_mask, strict=True) if m}
        return RolloutBatch(
            batch_id=f"{self.worker_id}/{seq:08d}",
            worker_id=self.worker_id,
            created_at=time.time(),
            trajectories=trajs,
            run=self.identity.name,
            run_id=self.identity.run_id,
            claims={str(v): self.digest(v) for v in sorted(used)},
            region=self.cfg.fleet.region,
            adoptions=self._new_adoptions(),
            stats={
                "seconds": time.time() - t0,
                "version_at_start": version,
                "errors": sum(t.error is not None and t.segment_idx == 0 for t in trajs),
                "sampled_tokens": sum(t.num_sampled() for t in trajs),
                "flagged_sessions": sum(bool(t.flags) and t.segment_idx == 0 for t in trajs),
            },
        )
