"""Rollout batches: the unit that travels from rollout workers to the trainer through the store.

Contract: a batch holds whole GRPO groups (every trajectory of a ``group_id`` is in the same
batch). It is written once, atomically, to ``rollouts/<worker_id>/<seq:08d>.json.gz`` and never
modified; the trainer records the keys it consumed in its checkpoint so that no batch is trained
on twice across restarts.

Example::

    batch = RolloutBatch(batch_id="w0/00000003", worker_id="w0", created_at=time.time(), trajectories=trajs)
    store.put(batch.key(), batch.to_bytes())
    again = RolloutBatch.from_bytes(store.get(batch.key()))
"""

from __future__ import annotations

import gzip
import json
from dataclasses import dataclass, field
from typing import Any

from shipyard.agent.types import Trajectory

ROLLOUT_PREFIX = "rollouts/"
FINISHED_KEY = "control/finished"
"""Written by the trainer after its last step (relative to the run's store); rollout workers stop."""
PROGRESS_KEY = "control/progress.json"
""":class:`TrainerProgress`, rewritten by the trainer after each published version and, while it
waits for groups, with the groups it dropped credited (so the workers replace them)."""


@dataclass
class TrainerProgress:
    """What the trainer has done with the workers' groups: the version it last published and, per
    worker, how many of its groups it is finished with (trained on, dropped or refused). Rollout
    workers gate on it: a worker keeps at most ``(lag + 1) * share`` groups the trainer has not
    finished with, so the trainer's consumption, not each worker's batch count, paces generation,
    and a region that falls silent does not hold back the others (:mod:`shipyard.rollout.worker`)."""

    version: int = 0
    consumed: dict[str, int] = field(default_factory=dict)
    at: float = 0.0

    def to_bytes(self) -> bytes:
        return json.dumps({"version": self.version, "consumed": self.consumed, "at": self.at}).encode()

    @staticmethod
    def from_bytes(data: bytes) -> TrainerProgress:
        d = json.loads(data)
        return TrainerProgress(
            int(d["version"]), {k: int(v) for k, v in d["consumed"].items()}, float(d["at"])
        )


@dataclass
class RolloutBatch:
    batch_id: str
    worker_id: str
    created_at: float
    trajectories: list[Trajectory]
    stats: dict[str, Any] = field(default_factory=dict)
    run: str = ""
    """``run.name`` of the run whose worker wrote the batch."""
    run_id: str = ""
    """That run's id (``shipyard.store.run.RunIdentity``); the trainer rejects any other (or none)."""
    claims: dict[str, str] = field(default_factory=dict)
    """Per weights version its tokens were sampled with (a decimal string), the state digest of the
    weights the node says it ran; checked by :mod:`shipyard.fleet.verify` for untrusted nodes."""
    region: str = "local"
    """``fleet.region`` of the worker that wrote it (the trainer's per-region metrics)."""
    adoptions: list[dict[str, Any]] = field(default_factory=list)
    """Versions the worker's server went live with since its previous batch: ``{"version", "at",
    "published_at"}`` (wall-clock seconds; the server's subscriber events)."""

    def key(self) -> str:
        return f"{ROLLOUT_PREFIX}{self.batch_id}.json.gz"

    def to_bytes(self) -> bytes:
        d = {
            "batch_id": self.batch_id,
            "worker_id": self.worker_id,
            "created_at": self.created_at,
            "run": self.run,
            "run_id": self.run_id,
            "claims": self.claims,
            "region": self.region,
            "adoptions": self.adoptions,
            "stats": self.stats,
            "trajectories": [t.to_json() for t in self.trajectories],
        }
        return gzip.compress(json.dumps(d, separators=(",", ":")).encode(), compresslevel=3)

    @staticmethod
    def from_bytes(data: bytes) -> RolloutBatch:
        d = json.loads(gzip.decompress(data))
        trajs = [Trajectory.from_json(t) for t in d.pop("trajectories")]
        return RolloutBatch(trajectories=trajs, **d)

    def group_components(self) -> dict[str, dict[str, float]]:
        """Per group: the mean of each reward component over its sessions (``Trajectory.reward_components``
        of first segments; a component some sessions lack is averaged over those that have it)."""
        out: dict[str, dict[str, list[float]]] = {}
        for t in self.trajectories:
            if t.segment_idx == 0:
                for name, value in t.reward_components.items():
                    out.setdefault(t.group_id, {}).setdefault(name, []).append(value)
        return {g: {n: sum(v) / len(v) for n, v in comps.items()} for g, comps in out.items()}

    def groups(self) -> dict[str, list[Trajectory]]:
        out: dict[str, list[Trajectory]] = {}
        for t in self.trajectories:
            out.setdefault(t.group_id, []).append(t)
        return out
