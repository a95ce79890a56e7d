"""Rollout feed: the trainer's view of ``rollouts/`` — groups in arrival order, stale ones dropped.

Contract: :meth:`RolloutFeed.take` returns ``n`` GRPO groups not consumed before (group ids in
``consumed`` are skipped, so a restarted trainer never trains on a rollout twice), in the order
their batches appeared in the store. A group is dropped (and counted) when its oldest sampled
token is more than ``max_off_policy_steps`` versions behind the trainer's current version.
Sessions that crashed (``Trajectory.error`` on any segment) or whose segments are not exactly
``0 .. num_segments - 1`` are removed from their group and counted; a group left with fewer than
two sessions is dropped. Counts (``dropped_errors``, ``dropped_stale``) are sessions, whatever
their number of segments. A returned group lists its sessions by ``sample_idx``, each session's
segments in order. It waits (polling the store) until enough groups arrived, raising
``TimeoutError`` after ``timeout_s`` with no new batch. A batch whose ``run_id`` is not the
trainer's run (another run's worker, or a batch from before runs were stamped) is never trained on:
its groups are counted in ``foreign_rejected`` (per take and in total) and skipped. With a
``gate`` (:class:`BatchGate`, e.g. :class:`shipyard.fleet.verify.RolloutVerifier`), a batch the
gate does not admit is skipped (its groups counted in ``refused``), and queued groups of a node the
gate has quarantined since are dropped (sessions counted in ``dropped_quarantined``).
``consumed_by`` counts, per worker, the groups the trainer is finished with (trained on, dropped,
refused, another run's, a second group of one id; after a restart, the checkpoint's consumed
groups as their batches are read again): the trainer publishes it as
:class:`~shipyard.rollout.types.TrainerProgress` and the workers gate on it; while a take waits, it
is published less the groups that take will train, so that the workers replace dropped groups.
With ``skip_uniform`` (``trainer.skip_uniform_groups``), groups whose sessions all earned one reward
are skipped like stale ones, up to that many per take (DAPO's dynamic sampling).
"""

from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from shipyard.agent.types import Trajectory, group_sessions, session_complete
from shipyard.rollout.types import ROLLOUT_PREFIX, RolloutBatch
from shipyard.store.types import Store


class BatchGate(Protocol):
    """Decides which rollout batches may be trained on (:mod:`shipyard.fleet.verify`)."""

    def admit(self, batch: RolloutBatch) -> bool: ...

    def quarantined(self, node: str) -> bool: ...


@dataclass
class Taken:
    groups: list[list[Trajectory]]
    wait_s: float
    dropped_stale: int = 0
    dropped_errors: int = 0
    foreign_rejected: int = 0
    refused: int = 0
    dropped_quarantined: int = 0
    skipped_uniform: int = 0
    """Groups skipped because every session earned the same reward (``skip_uniform``)."""
    staleness: list[int] = field(default_factory=list)
    regions: list[str] = field(default_factory=list)
    """Per taken group, the region of the worker that wrote it (parallel to ``staleness``)."""
    adoptions: list[dict[str, Any]] = field(default_factory=list)
    """Adoptions reported by batches read since the last take, each with its ``region``."""


class RolloutFeed:
    def __init__(
        self,
        store: Store,
        run_id: str,
        consumed: set[str] | None = None,
        poll_s: float = 0.2,
        gate: BatchGate | None = None,
    ) -> None:
        self.store = store
        self.run_id = run_id
        self.consumed: set[str] = set(consumed or ())
        self.poll_s = poll_s
        self.foreign_rejected = 0
        """Groups of other runs' batches seen so far (never trained on)."""
        self._foreign_new = 0
        self.gate = gate
        self._refused_new = 0
        self._seen: set[str] = set()
        self._queue: deque[tuple[str, str, list[Trajectory]]] = deque()
        """(node, region, group) in arrival order."""
        self._adoptions: list[dict[str, Any]] = []
        self.consumed_by: Counter[str] = Counter()
        """Per worker id: its groups this trainer is finished with (trained, dropped or refused)."""
        self._queued: set[str] = set()
        """Group ids ever queued (a second group of one id is never trained)."""

    def poll(self) -> bool:
        """Read the batches that appeared since the last poll into the queue; True if any did."""
        new = [k for k in self.store.list(ROLLOUT_PREFIX) if k not in self._seen]
        batches = [RolloutBatch.from_bytes(self.store.get(k)) for k in new]
        self._seen.update(new)
        for batch in sorted(batches, key=lambda b: b.created_at):
            if batch.run_id != self.run_id:
                self._foreign_new += len(batch.groups())
                self.consumed_by[batch.worker_id] += len(batch.groups())  # it holds that worker's numbers
                continue
            if self.gate is not None and not self.gate.admit(batch):
                self._refused_new += len(batch.groups())
                self.consumed_by[batch.worker_id] += len(batch.groups())
                continue
            self._adoptions += [{**a, "region": batch.region} for a in batch.adoptions]
            for gid, group in batch.groups().items():
                if gid in self.consumed or gid in self._queued:  # consumed before, or a restarted
                    self.consumed_by[batch.worker_id] += 1  # streaming worker's second group of that id
                else:
                    self._queued.add(gid)
                    ordered = sorted(group, key=lambda t: (t.sample_idx, t.segment_idx))
                    self._queue.append((batch.worker_id, batch.region, ordered))
        return bool(new)

    def _await_batch(
        self,
        last_arrival: float,
        timeout_s: float,
        on_wait: Callable[[Counter[str]], None] | None,
        credit: Counter[str],
    ) -> float:
        """Poll once for batches: the time the last one arrived; without one, ``on_wait(credit)`` and a
        pause, or TimeoutError once none arrived for ``timeout_s``."""
        if self.poll():
            return time.time()
        if time.time() - last_arrival > timeout_s:
            raise TimeoutError(f"no rollout batch arrived under {ROLLOUT_PREFIX} for {timeout_s:.0f} s")
        if on_wait is not None:
            on_wait(credit)
        time.sleep(self.poll_s)
        return last_arrival

    def take(
        self,
        n: int,
        current_version: int,
        max_off_policy_steps: int,
        timeout_s: float,
        on_wait: Callable[[Counter[str]], None] | None = None,
        skip_uniform: int = 0,
    ) -> Taken:
        """``n`` groups (module docstring). While it waits for batches it calls ``on_wait`` with
        ``consumed_by`` less the groups this take will train: the workers may replace what it dropped.
        ``skip_uniform``: DAPO's dynamic sampling, at most this many groups whose sessions all earned
        the same reward (no advantage, no gradient) are skipped per take and the take waits for
        groups with signal instead; after that, uniform groups are taken (a policy that solves all or
        nothing must not stall the run)."""
        t0 = time.time()
        last_arrival = t0
        out = Taken(groups=[], wait_s=0.0)
        training: Counter[str] = Counter()
        # One loop on purpose: each drop reason below counts into ``out`` and credits ``consumed_by`` in
        # the same pass, in the order the module docstring gives; split up, the counters would travel.
        while len(out.groups) < n:
            if not self._queue:
                last_arrival = self._await_batch(
                    last_arrival, timeout_s, on_wait, self.consumed_by - training
                )
                continue
            node, region, group = self._queue.popleft()
            self.consumed.add(group[0].group_id)
            self.consumed_by[node] += 1
            sessions = group_sessions(group)
            if self.gate is not None and self.gate.quarantined(node):
                out.dropped_quarantined += len(sessions)
                continue
            ok = [s for s in sessions if session_complete(s) and all(t.error is None for t in s)]
            out.dropped_errors += len(sessions) - len(ok)
            trajs = [t for s in ok for t in s]
            oldest = [t.min_version() for t in trajs if t.num_sampled()]
            staleness = current_version - min(oldest, default=current_version)
            if len(ok) < 2:
                out.dropped_errors += len(ok)
                continue
            if staleness > max_off_policy_steps:
                out.dropped_stale += len(ok)
                continue
            if out.skipped_uniform < skip_uniform and len({s[0].reward for s in ok}) == 1:
                out.skipped_uniform += 1
                continue
            out.groups.append(trajs)
            training[node] += 1
            out.staleness.append(staleness)
            out.regions.append(region)
        out.wait_s = time.time() - t0
        out.adoptions, self._adoptions = self._adoptions, []
        out.foreign_rejected, self._foreign_new = self._foreign_new, 0
        out.refused, self._refused_new = self._refused_new, 0
        self.foreign_rejected += out.foreign_rejected
        return out
