"""The serving line: the versions production servers follow, and every promotion and rollback.

Contract: a :class:`ServingLine` owns a store prefix that inference servers follow like any run's
(``shipyard serve`` with that store: they adopt each new version as a delta or snapshot). Its
versions only move forward: :meth:`promote` publishes a candidate's weights as the next serving
version, and :meth:`rollback` publishes the weights of an earlier serving version as the next
one, so servers adopt a rollback exactly as they adopt anything else, and a version number never
names two different weights. Every version is also kept as a snapshot (``snapshot_every = 1``) and
``keep`` of them stay in the store, so any kept version can be rolled back to.

Every decision (``promote``, ``reject``, ``rollback``, manual or from the gate) is a row of the
``decisions`` table with its evidence (the gate's suites and intervals, or who asked), written
before the version is published: a crash between the two leaves a recorded decision whose
version is missing, which :meth:`status` reports.

Example::

    line = ServingLine(open_store(...), db)
    line.promote(candidate_version, candidate_weights, decision)     # decision: a GateDecision
    line.rollback(3, reason="user reports")                          # serving 3's weights, as a new version
"""

from __future__ import annotations

import time
from typing import Any

from psycopg.types.json import Jsonb

from shipyard.online.database import OnlineDB
from shipyard.online.gate import GateDecision
from shipyard.store.types import Store


class ServingLine:
    def __init__(self, store: Store, db: OnlineDB, keep: int = 20, dtype: Any | None = None) -> None:
        from shipyard.weights.publisher import WeightPublisher

        self.store, self.db = store, db
        self.publisher = WeightPublisher(store, snapshot_every=1, keep=keep, dtype=dtype)

    def current(self) -> int:
        """The newest serving version (-1: none yet)."""
        from shipyard.weights.versions import latest_version

        v = latest_version(self.store)
        return -1 if v is None else v

    def publish(self, weights: dict[str, Any], extra: dict[str, Any]) -> int:
        """Publish ``weights`` as the next serving version; returns it."""
        return self._publish(self.current() + 1, weights, extra)

    def _publish(self, version: int, weights: dict[str, Any], extra: dict[str, Any]) -> int:
        self.publisher.publish(version, weights, extra=extra)
        return version

    def weights(self, version: int) -> dict[str, Any]:
        """The weights of serving ``version`` (verified), for a rollback or a gate."""
        from shipyard.weights.versions import load_version

        return load_version(self.store, version)

    def _record(
        self, action: str, candidate: int | None, before: int, after: int | None, evidence: dict[str, Any]
    ) -> int:
        with self.db.conn.cursor() as cur:
            cur.execute(
                "INSERT INTO decisions (at, action, candidate, serving_before, serving_after, evidence) "
                "VALUES (now(), %s, %s, %s, %s, %s) RETURNING id",
                (action, candidate, before, after, Jsonb(evidence)),
            )
            return int(cur.fetchone()[0])

    def decide(self, decision: GateDecision, weights: dict[str, Any] | None) -> int | None:
        """Record the gate's ``decision``; publish the candidate's ``weights`` when it promotes.
        Returns the new serving version, or None after a rejection."""
        if not decision.promote:
            self._record("reject", decision.candidate, self.current(), None, decision.to_json())
            return None
        assert weights is not None, "a promotion needs the candidate's weights"
        return self.promote(decision.candidate, weights, decision.to_json())

    def promote(self, candidate: int, weights: dict[str, Any], evidence: dict[str, Any]) -> int:
        before = self.current()
        self._record("promote", candidate, before, before + 1, evidence)
        return self._publish(before + 1, weights, {"online": {"action": "promote", "candidate": candidate}})

    def rollback(self, version: int, reason: str = "manual") -> int:
        """Serve ``version``'s weights again, as the next version; returns it."""
        before = self.current()
        if not 0 <= version <= before:
            raise ValueError(f"rollback to version {version}: serving versions are 0..{before}")
        weights = self.weights(version)  # before the record: a version that is gone raises here
        self._record(
            "rollback", None, before, before + 1, {"to": version, "reason": reason, "at": time.time()}
        )
        return self._publish(before + 1, weights, {"online": {"action": "rollback", "to": version}})

    def decisions(self, limit: int = 20) -> list[dict[str, Any]]:
        with self.db.conn.cursor() as cur:
            cur.execute(
                "SELECT id, extract(epoch FROM at), action, candidate, serving_before, serving_after, evidence "
                "FROM decisions ORDER BY id DESC LIMIT %s",
                (limit,),
            )
            keys = ("id", "at", "action", "candidate", "serving_before", "serving_after", "evidence")
            return [dict(zip(keys, row, strict=True)) for row in cur.fetchall()]

    def status(self) -> dict[str, Any]:
        """The serving version, the last decisions, and any recorded version that never appeared."""
        current = self.current()
        recent = self.decisions()
        missing = [
            d["serving_after"]
            for d in recent
            if d["serving_after"] is not None and d["serving_after"] > current
        ]
        return {"serving_version": current, "decisions": recent, "recorded_but_missing": missing}
