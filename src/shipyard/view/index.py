"""The rollout index of one run: a row per session, built from the run's own store, incrementally.

Contract: :meth:`RolloutIndex.refresh` lists ``rollouts/`` in the run's store and reads each batch
it has not read yet (in key order), adding one :class:`~shipyard.view.types.RolloutRow` per
session; rows learn the trainer step that consumed their group (the run's ``consumed`` records)
whenever :meth:`set_consumed` is called. A batch that cannot be read (a torn or foreign object) is
counted in ``unreadable`` with its key, never fatal. :meth:`page` filters, sorts and slices the
rows. Reading happens in the caller's thread; :meth:`refresh` takes ``budget_s`` so a server can
index a large run a slice at a time and answer meanwhile (``indexed`` / ``batches`` say how far
it is). Nothing is copied out of the store: rows hold the batch key and positions; an opened
session is read from its batch again (:meth:`batch`, a small LRU cache).

Limits: the whole index lives in memory (about 1 KB per session: 10,000 sessions are ~10 MB).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from typing import Any

from shipyard.agent.types import Trajectory, group_sessions
from shipyard.rollout.types import ROLLOUT_PREFIX, RolloutBatch
from shipyard.store.types import Store
from shipyard.view.types import RolloutQuery, RolloutRow, task_family


class RolloutIndex:
    def __init__(self, store: Store, cache_batches: int = 16) -> None:
        self.store = store
        self.rows: list[RolloutRow] = []
        self.by_id: dict[str, RolloutRow] = {}
        self.unreadable: dict[str, str] = {}
        self.batches = 0
        self._done: set[str] = set()
        self._pending: list[str] = []
        self._consumed: dict[str, int] = {}
        self._cache: OrderedDict[str, RolloutBatch] = OrderedDict()
        self._cache_size = cache_batches
        self._lock = threading.RLock()
        self._refreshing = threading.Lock()

    @property
    def indexed(self) -> int:
        return len(self._done)

    def set_consumed(self, consumed: dict[str, int]) -> None:
        """``group_id -> step`` that trained it; rows without a step get theirs (and staleness)."""
        with self._lock:
            self._consumed = consumed
            for row in self.rows:
                if row.step is None and row.group_id in consumed:
                    _set_step(row, consumed[row.group_id])

    def refresh(self, budget_s: float = 1.0) -> bool:
        """Read new batches for up to ``budget_s``; True when every listed batch is indexed."""
        with self._refreshing:  # one reader at a time; concurrent requests wait their turn
            return self._refresh(budget_s)

    def _refresh(self, budget_s: float) -> bool:
        if not self._pending:
            keys = sorted(k for k in self.store.list(ROLLOUT_PREFIX) if k not in self._done)
            self._pending = keys[::-1]
            self.batches = len(self._done) + len(keys)
        deadline = time.perf_counter() + budget_s
        while self._pending and time.perf_counter() < deadline:
            key = self._pending.pop()
            try:
                batch = RolloutBatch.from_bytes(self.store.get(key))
            except FileNotFoundError:
                continue  # collected between list and get
            except (OSError, ValueError, TypeError, KeyError, EOFError) as e:
                self.unreadable[key] = f"{type(e).__name__}: {e}"
                self._done.add(key)
                continue
            self._add(key, batch)
        return not self._pending

    def _add(self, key: str, batch: RolloutBatch) -> None:
        position = {id(t): i for i, t in enumerate(batch.trajectories)}
        rows = [
            _row(key, batch, segs, [position[id(t)] for t in segs])
            for segs in group_sessions(batch.trajectories)
        ]
        with self._lock:
            for row in rows:
                if row.group_id in self._consumed:
                    _set_step(row, self._consumed[row.group_id])
                self.rows.append(row)
                self.by_id[row.id] = row
            self._done.add(key)

    def page(self, q: RolloutQuery) -> dict[str, Any]:
        with self._lock:
            rows = [r for r in self.rows if q.accepts(r)]
        down = q.descending()
        # rows without the value (None: not trained yet) come last in either order
        rows.sort(
            key=lambda r: (q.value(r) is not None if down else q.value(r) is None, q.value(r) or 0.0),
            reverse=down,
        )
        return {
            "total": len(rows),
            "offset": q.offset,
            "rows": [r.to_json() for r in rows[q.offset : q.offset + q.limit]],
        }

    def batch(self, key: str) -> RolloutBatch:
        """The batch at ``key`` (cached; the most recently used ``cache_batches`` are kept)."""
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        batch = RolloutBatch.from_bytes(self.store.get(key))
        with self._lock:
            self._cache[key] = batch
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return batch

    def families(self) -> list[str]:
        with self._lock:
            return sorted({r.family for r in self.rows})


def _set_step(row: RolloutRow, step: int) -> None:
    row.step = step
    row.staleness = max(0, step - 1 - row.version_min) if row.version_min >= 0 else None


def _row(key: str, batch: RolloutBatch, segs: list[Trajectory], positions: list[int]) -> RolloutRow:
    first, last = segs[0], segs[-1]
    versions = [v for t in segs for v, m in zip(t.versions, t.loss_mask, strict=True) if m]
    return RolloutRow(
        id=first.session_id or f"{first.group_id}/{first.sample_idx}",
        key=key,
        positions=positions,
        task_id=first.task_id,
        family=task_family(first.task_id),
        group_id=first.group_id,
        sample_idx=first.sample_idx,
        worker=batch.worker_id,
        created_at=batch.created_at,
        reward=float(first.reward),
        flags=list(first.flags),
        finish=last.finish,
        error=first.error is not None,
        length=sum(len(t.token_ids) for t in segs),
        sampled=sum(t.num_sampled() for t in segs),
        turns=sum(t.num_turns for t in segs),
        segments=len(segs),
        version_min=min(versions, default=-1),
        version_max=max(versions, default=-1),
    )
