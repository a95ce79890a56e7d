"""Verified rollouts: a batch from a node the trainer does not control is trained on only after checks.

Contract: :meth:`RolloutVerifier.admit` decides, per :class:`RolloutBatch`, before the trainer's
feed queues any of it (``fleet.verify``). A node is the batch's ``worker_id``. Batches of nodes in
``trusted`` pass; their sessions' logprob mismatch calibrates the tolerance. A batch of any other
node passes only if every check holds, cheapest first:

1. **replay**: no group whose sessions (task, sampled tokens and logprobs, bit for bit) were all
   seen before in this run, under whatever group id;
2. **digest**: every version its tokens were sampled with is claimed (``batch.claims``) with the
   state digest of that version's manifest in the run's store;
3. **logprobs**: for a random ``rollout_frac`` of its sessions, a random ``token_frac`` of each
   one's sampled tokens (at least ``min_tokens``): the claimed version's weights, loaded from the
   store, give the logprobs again; the session's mean |claimed - recomputed| is at most the
   tolerance (``tolerance``, or ``tolerance_margin`` x the largest seen on trusted nodes);
4. **rewards**: a random ``regrade_frac`` of its sessions are replayed (their actions, in order)
   in a fresh sandbox and graded; the reward must equal the claimed one.

A node that fails is quarantined: the evidence (check, batch, session, figures) is written to
``fleet/quarantine/<node>.json`` in the run's store, every later batch of it is refused, and
:meth:`quarantined` tells the feed to drop its groups already queued. Nothing of a refused batch
is trained on. Which sessions and tokens are checked is drawn from ``seed`` and the batch id, so
a node cannot know in advance.

Limits: claims are what the node says it ran (the digest binds a claim to a published version;
the recomputed logprobs test it); a node serving a version within the tolerance of the claimed one
(e.g. the previous step) can pass; the replay memory lives in the trainer process (a restarted
trainer starts it empty; the feed's consumed group ids still refuse a replay under its old ids).
"""

from __future__ import annotations

import hashlib
import json
import random
import struct
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from shipyard.agent.types import Trajectory, group_sessions
from shipyard.config.schema import ShipyardConfig, VerifyConfig
from shipyard.envs.environment import Environment
from shipyard.envs.types import Task
from shipyard.rollout.types import RolloutBatch
from shipyard.store.types import Store
from shipyard.weights.versions import load_version, read_manifest

QUARANTINE_PREFIX = "fleet/quarantine/"
Regrade = Callable[[Task, list[Trajectory]], float]
"""Replays a session's segments in a fresh sandbox and returns the reward its files earn."""


@dataclass
class Evidence:
    node: str
    check: str
    """``replay``, ``digest``, ``logprobs`` or ``rewards``."""
    batch_id: str
    session_id: str
    detail: dict[str, Any]
    at: float = field(default_factory=time.time)


@dataclass
class VerifyStats:
    batches: int = 0
    refused_batches: int = 0
    sessions_checked: int = 0
    tokens_checked: int = 0
    sessions_regraded: int = 0
    seconds: float = 0.0
    """Time spent checking (loading versions included)."""
    honest_mismatch: list[float] = field(default_factory=list)
    """Per checked trusted session, its mean |claimed - recomputed| logprob."""


def session_fingerprint(segments: list[Trajectory]) -> str:
    """Task, sampled tokens and their logprobs of a session, bit for bit."""
    h = hashlib.sha256(segments[0].task_id.encode())
    for t in segments:
        for tok, lp, m in zip(t.token_ids, t.logprobs, t.loss_mask, strict=True):
            if m:
                h.update(struct.pack("<id", tok, lp))
    return h.hexdigest()


class VersionModels:
    """Scoring models of published versions, loaded from the store on demand (the last ``keep``)."""

    def __init__(self, store: Store, make_model: Callable[[], Any], keep: int = 3) -> None:
        self.store, self.make_model, self.keep = store, make_model, keep
        self._models: OrderedDict[int, Any] = OrderedDict()

    def get(self, version: int) -> Any:
        if version in self._models:
            self._models.move_to_end(version)
            return self._models[version]
        model = self.make_model() if len(self._models) < self.keep else self._models.popitem(last=False)[1]
        params = dict(model.named_parameters())
        for name, tensor in load_version(self.store, version).items():
            params[name].data.copy_(tensor.to(params[name].dtype))
        self._models[version] = model
        return model


class RolloutVerifier:
    """The checks of the module doc over one run's store."""

    def __init__(
        self,
        cfg: VerifyConfig,
        store: Store,
        models: VersionModels,
        tasks: Mapping[str, Task],
        regrade: Regrade,
        temperature: float,
    ) -> None:
        self.cfg, self.store, self.models, self.tasks = cfg, store, models, tasks
        self.regrade, self.temperature = regrade, temperature
        self.stats = VerifyStats()
        self.evidence: dict[str, Evidence] = {}
        self._seen: set[str] = set()
        self._digests: dict[int, str] = {}

    def quarantined(self, node: str) -> bool:
        return node in self.evidence

    @property
    def tolerance(self) -> float:
        if self.cfg.tolerance:
            return self.cfg.tolerance
        honest = self.stats.honest_mismatch
        if len(honest) < self.cfg.calibration_sessions:
            return self.cfg.tolerance_floor
        return max(self.cfg.tolerance_floor, self.cfg.tolerance_margin * max(honest))

    def admit(self, batch: RolloutBatch) -> bool:
        """True when the batch may be trained on (module doc); a failing node is quarantined."""
        t0 = time.perf_counter()
        try:
            return self._admit(batch)
        finally:
            self.stats.seconds += time.perf_counter() - t0

    def _admit(self, batch: RolloutBatch) -> bool:
        node = batch.worker_id
        self.stats.batches += 1
        if self.quarantined(node):
            self.stats.refused_batches += 1
            return False
        sessions = group_sessions(batch.trajectories)
        prints = {
            gid: [session_fingerprint(s) for s in group_sessions(g)] for gid, g in batch.groups().items()
        }
        rng = random.Random(f"{self.cfg.seed}/{batch.batch_id}")
        if node in self.cfg.trusted:
            for s in sessions[: max(0, self.cfg.calibration_sessions - len(self.stats.honest_mismatch))]:
                self.stats.honest_mismatch.append(self.mismatch(s, rng)[0])
            self._remember(prints)
            return True
        found = (
            self._replayed(batch, prints)
            or self._bad_digest(batch)
            or self._bad_logprobs(batch, sessions, rng)
            or self._bad_reward(batch, sessions, rng)
        )
        if found is not None:
            self._quarantine(found)
            self.stats.refused_batches += 1
            return False
        self._remember(prints)
        return True

    @staticmethod
    def _sample(sessions: list[list[Trajectory]], frac: float, rng: random.Random) -> list[list[Trajectory]]:
        if frac <= 0 or not sessions:
            return []
        return rng.sample(sessions, max(1, round(frac * len(sessions))))

    def _remember(self, prints: dict[str, list[str]]) -> None:
        self._seen.update(p for group in prints.values() for p in group)

    def _replayed(self, batch: RolloutBatch, prints: dict[str, list[str]]) -> Evidence | None:
        """A group whose session fingerprints (``prints``, per group id) were all seen before."""
        for gid, group in prints.items():
            if len(group) >= 2 and all(p in self._seen for p in group):
                return Evidence(batch.worker_id, "replay", batch.batch_id, gid, {"sessions": len(group)})
        return None

    def _published_digest(self, version: int) -> str | None:
        if version not in self._digests:
            try:
                self._digests[version] = read_manifest(self.store, version).state_digest
            except FileNotFoundError:
                return None
        return self._digests[version]

    def _bad_digest(self, batch: RolloutBatch) -> Evidence | None:
        used = sorted(
            {v for t in batch.trajectories for v, m in zip(t.versions, t.loss_mask, strict=True) if m}
        )
        for v in used:
            claimed, published = batch.claims.get(str(v)), self._published_digest(v)
            if claimed is None or claimed != published:
                detail = {"version": v, "claimed": claimed, "published": published}
                return Evidence(batch.worker_id, "digest", batch.batch_id, "", detail)
        return None

    def mismatch(self, segments: list[Trajectory], rng: random.Random) -> tuple[float, int]:
        """Mean |claimed - recomputed| over a random share of the session's sampled tokens."""
        import torch

        from shipyard.trainer.logprobs import token_logprobs

        diffs: list[float] = []
        for t in segments:
            positions = [i for i, m in enumerate(t.loss_mask) if m]
            if not positions:
                continue
            k = min(len(positions), max(self.cfg.min_tokens, round(self.cfg.token_frac * len(positions))))
            chosen = sorted(rng.sample(positions, k))
            by_version: dict[int, list[int]] = {}
            for i in chosen:
                by_version.setdefault(t.versions[i], []).append(i)
            for version, idx in by_version.items():
                end = idx[-1] + 1  # nothing after the last compared token is forwarded
                ids_BT = torch.tensor([t.token_ids[:end]])
                with torch.no_grad():
                    lp_BT = token_logprobs(
                        self.models.get(version),
                        ids_BT,
                        torch.ones_like(ids_BT),
                        temperature=self.temperature,
                    )
                diffs += [abs(float(lp_BT[0, i]) - t.logprobs[i]) for i in idx]
        self.stats.tokens_checked += len(diffs)
        self.stats.sessions_checked += 1
        return (sum(diffs) / len(diffs) if diffs else 0.0), len(diffs)

    def _bad_logprobs(
        self, batch: RolloutBatch, sessions: list[list[Trajectory]], rng: random.Random
    ) -> Evidence | None:
        for s in self._sample(sessions, self.cfg.rollout_frac, rng):
            mean_abs, n = self.mismatch(s, rng)
            if mean_abs > self.tolerance:
                detail = {"mean_abs_dlogprob": mean_abs, "tokens": n, "tolerance": self.tolerance}
                return Evidence(batch.worker_id, "logprobs", batch.batch_id, s[0].session_id, detail)
        return None

    def _bad_reward(
        self, batch: RolloutBatch, sessions: list[list[Trajectory]], rng: random.Random
    ) -> Evidence | None:
        for s in self._sample(sessions, self.cfg.regrade_frac, rng):
            task = self.tasks.get(s[0].task_id)
            claimed = s[-1].reward
            regraded = self.regrade(task, s) if task is not None else None
            self.stats.sessions_regraded += 1
            if regraded is None or abs(regraded - claimed) > 1e-6:
                detail = {"task": s[0].task_id, "claimed": claimed, "regraded": regraded}
                return Evidence(batch.worker_id, "rewards", batch.batch_id, s[0].session_id, detail)
        return None

    def _quarantine(self, ev: Evidence) -> None:
        self.evidence[ev.node] = ev
        self.store.put(f"{QUARANTINE_PREFIX}{ev.node}.json", json.dumps(asdict(ev), indent=1).encode())


def build_verifier(cfg: ShipyardConfig, store: Store, env: Environment) -> RolloutVerifier:
    """The verifier of a run: its training tasks (as the workers draw them), re-grading through
    ``env`` (the rewards the workers' environment computes) and the run's model for logprobs."""
    from shipyard.agent.session import replay_session
    from shipyard.agent.spec import SandboxWorkbench
    from shipyard.envs.grading.anticheat import canary_tasks
    from shipyard.envs.tasks.files import extra_training_tasks
    from shipyard.envs.tasks.splits import task_splits
    from shipyard.models.loading import load_model

    train, _ = task_splits(cfg)
    tasks = {t.id: t for t in [*train, *extra_training_tasks(cfg.tasks), *canary_tasks()]}
    bench = SandboxWorkbench(cfg.sandbox)

    def regrade(task: Task, segments: list[Trajectory]) -> float:
        with env.session(task, bench.sandbox, bench.grade) as hooks:
            return replay_session(cfg.agent, hooks, task, segments).reward

    def make_model() -> Any:
        return load_model(cfg.model)[0].eval()

    models = VersionModels(store, make_model, keep=cfg.trainer.max_off_policy_steps + 1)
    return RolloutVerifier(cfg.fleet.verify, store, models, tasks, regrade, cfg.sampling.temperature)
