"""The online database of record: served generations, user feedback, matured rewards (PostgreSQL).

Contract: :class:`OnlineDB` connects with a libpq DSN (``online.db.dsn``, or a
:class:`~shipyard.online.postgres.LocalPostgres`), and :meth:`OnlineDB.migrate` brings the schema
to :data:`MIGRATIONS`' last version: each migration runs once, in its own transaction, under an
advisory lock (several gateways may start at once), and is recorded in ``schema_migrations``.
Writes are idempotent: a generation or feedback event written twice (a retry after a lost
acknowledgement) is stored once (``ON CONFLICT DO NOTHING``), and :meth:`write_feedback` returns how
many were new. :meth:`mature` turns every generation older than ``mature_after_s`` that has no
reward yet into a ``rewards`` row (its signals joined by generation id and by session, combined by
a :class:`~shipyard.online.reward.RewardModel`, the breakdown kept as JSON); each row gets the next
``seq``, so :meth:`rewarded` hands the trainer generations in the order they matured, from a cursor.
:meth:`retain` deletes what is older than the retention window; :meth:`export_jsonl` writes the
joined records for analysis. No JSON file is the system of record.

Indexes serve the joins the trainer and the reward model need: feedback by generation and by
session, generations by creation time, session, weight version and prompt key, rewards by seq.

Example::

    db = OnlineDB(dsn); db.migrate()
    db.write_generations([record]); db.write_feedback([event])
    db.mature(RewardModel(cfg.online.reward), now=time.time())
    for item in db.rewarded(after_seq=0, limit=64): ...
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psycopg
from psycopg.types.json import Jsonb

from shipyard.online.types import FeedbackEvent, GenerationRecord, RewardedGeneration

if TYPE_CHECKING:
    from shipyard.online.reward import RewardModel

MIGRATIONS: list[tuple[int, str, str]] = [
    (
        1,
        "generations, feedback, rewards",
        """
        CREATE TABLE generations (
            generation_id text PRIMARY KEY,
            request_id text NOT NULL,
            session_id text NOT NULL DEFAULT '',
            user_hash text NOT NULL DEFAULT '',
            created_at timestamptz NOT NULL,
            model text NOT NULL,
            weight_version integer NOT NULL,
            prompt_key text NOT NULL,
            prompt_ids integer[] NOT NULL,
            token_ids integer[] NOT NULL,
            logprobs real[] NOT NULL,
            versions integer[] NOT NULL,
            finish_reason text NOT NULL,
            latency_ms real NOT NULL,
            messages jsonb NOT NULL,
            completion text NOT NULL,
            temperature real NOT NULL
        );
        CREATE INDEX generations_created ON generations (created_at);
        CREATE INDEX generations_session ON generations (session_id) WHERE session_id <> '';
        CREATE INDEX generations_version ON generations (weight_version);
        CREATE INDEX generations_prompt ON generations (prompt_key);
        CREATE TABLE feedback (
            event_id text PRIMARY KEY,
            kind text NOT NULL,
            value real NOT NULL,
            generation_id text NOT NULL DEFAULT '',
            session_id text NOT NULL DEFAULT '',
            occurred_at timestamptz NOT NULL,
            received_at timestamptz NOT NULL,
            detail jsonb NOT NULL
        );
        CREATE INDEX feedback_generation ON feedback (generation_id) WHERE generation_id <> '';
        CREATE INDEX feedback_session ON feedback (session_id) WHERE session_id <> '';
        CREATE INDEX feedback_received ON feedback (received_at);
        CREATE TABLE rewards (
            generation_id text PRIMARY KEY REFERENCES generations ON DELETE CASCADE,
            seq bigserial UNIQUE,
            reward real,
            breakdown jsonb NOT NULL,
            reward_model text NOT NULL,
            matured_at timestamptz NOT NULL
        );
        """,
    ),
    (
        2,
        "decisions of the gate, promotions and rollbacks",
        """
        CREATE TABLE decisions (
            id bigserial PRIMARY KEY,
            at timestamptz NOT NULL,
            action text NOT NULL CHECK (action IN ('promote', 'reject', 'rollback')),
            candidate integer,
            serving_before integer NOT NULL,
            serving_after integer,
            evidence jsonb NOT NULL
        );
        CREATE INDEX decisions_at ON decisions (at);
        """,
    ),
]
"""(version, what, SQL) in order; a released migration is never edited, a new one is appended."""

_GEN_NAMES = [
    "generation_id",
    "request_id",
    "session_id",
    "user_hash",
    "created_at",
    "model",
    "weight_version",
    "prompt_key",
    "prompt_ids",
    "token_ids",
    "logprobs",
    "versions",
    "finish_reason",
    "latency_ms",
    "messages",
    "completion",
    "temperature",
]
_GEN_COLS = ", ".join(_GEN_NAMES)
_GEN_COLS_G = ", ".join(f"g.{c}" for c in _GEN_NAMES)  # the same, of the alias ``g``
_LOCK_KEY = 0x5348495059  # advisory lock of the migrations ("SHIPY")


def prompt_key(prompt_ids: list[int]) -> str:
    """The prompt's identity for per-prompt baselines: a hash of its token ids."""
    return hashlib.blake2b(json.dumps(prompt_ids).encode(), digest_size=12).hexdigest()


def _ts(t: float) -> datetime:
    return datetime.fromtimestamp(t, UTC)


class OnlineDB:
    """One connection to the online database (module doc); not shared between threads."""

    def __init__(self, dsn: str, connect_timeout_s: float = 5.0) -> None:
        if not dsn:
            raise ValueError(
                "online.db.dsn is empty: give a PostgreSQL connection string, or run the local server"
            )
        self.dsn = dsn
        self.conn = psycopg.connect(dsn, connect_timeout=max(1, int(connect_timeout_s)), autocommit=True)

    def close(self) -> None:
        self.conn.close()

    # ------------------------------------------------------------------ schema
    def schema_version(self) -> int:
        with self.conn.cursor() as cur:
            cur.execute("SELECT to_regclass('schema_migrations') IS NOT NULL")
            if not cur.fetchone()[0]:
                return 0
            cur.execute("SELECT coalesce(max(version), 0) FROM schema_migrations")
            return int(cur.fetchone()[0])

    def migrate(self) -> list[int]:
        """Apply the migrations this database lacks; returns the versions applied."""
        applied = []
        with self.conn.transaction(), self.conn.cursor() as cur:
            cur.execute("SELECT pg_advisory_xact_lock(%s)", (_LOCK_KEY,))
            cur.execute(
                "CREATE TABLE IF NOT EXISTS schema_migrations "
                "(version integer PRIMARY KEY, what text NOT NULL, applied_at timestamptz NOT NULL DEFAULT now())"
            )
            cur.execute("SELECT coalesce(max(version), 0) FROM schema_migrations")
            have = int(cur.fetchone()[0])
            for version, what, sql in MIGRATIONS:
                if version > have:
                    cur.execute(sql)
                    cur.execute(
                        "INSERT INTO schema_migrations (version, what) VALUES (%s, %s)", (version, what)
                    )
                    applied.append(version)
        return applied

    # ------------------------------------------------------------------ writes
    def write_generations(self, records: list[GenerationRecord]) -> None:
        rows = [
            (
                r.generation_id,
                r.request_id,
                r.session_id,
                r.user_hash,
                _ts(r.created_at),
                r.model,
                r.weight_version,
                prompt_key(r.prompt_ids),
                r.prompt_ids,
                r.token_ids,
                r.logprobs,
                r.versions,
                r.finish_reason,
                r.latency_ms,
                Jsonb(r.messages),
                r.completion,
                r.temperature,
            )
            for r in records
        ]
        marks = ", ".join(["%s"] * len(_GEN_NAMES))
        with self.conn.transaction(), self.conn.cursor() as cur:
            cur.executemany(
                f"INSERT INTO generations ({_GEN_COLS}) VALUES ({marks}) ON CONFLICT DO NOTHING", rows
            )

    def write_feedback(self, events: list[FeedbackEvent]) -> int:
        if not events:
            return 0
        rows = [
            (
                e.event_id,
                e.kind,
                e.value,
                e.generation_id,
                e.session_id,
                _ts(e.occurred_at or e.received_at),
                _ts(e.received_at or time.time()),
                Jsonb(e.detail),
            )
            for e in events
        ]
        new = 0
        with self.conn.transaction(), self.conn.cursor() as cur:
            cur.executemany(  # one round trip; a result set per event, empty when it was a repeat
                "INSERT INTO feedback (event_id, kind, value, generation_id, session_id, occurred_at, "
                "received_at, detail) VALUES (%s, %s, %s, %s, %s, %s, %s, %s) "
                "ON CONFLICT (event_id) DO NOTHING RETURNING event_id",
                rows,
                returning=True,
            )
            while True:
                new += cur.fetchone() is not None
                if not cur.nextset():
                    break
        return new

    # ------------------------------------------------------------------ rewards
    def mature(self, model: RewardModel, now: float, limit: int = 10_000) -> int:
        """Compute the reward of every generation served before ``now - mature_after_s`` that has
        none yet, oldest first; returns how many rows were written (skipped ones included, with a
        null reward)."""
        cutoff = _ts(now - model.cfg.mature_after_s)
        with self.conn.transaction(), self.conn.cursor() as cur:
            cur.execute(
                f"SELECT {_GEN_COLS} FROM generations g WHERE created_at <= %s AND NOT EXISTS "
                "(SELECT 1 FROM rewards r WHERE r.generation_id = g.generation_id) "
                "ORDER BY created_at, generation_id LIMIT %s FOR UPDATE SKIP LOCKED",
                (cutoff, limit),
            )
            records = [_record(row) for row in cur.fetchall()]
            if not records:
                return 0
            signals = self._signals(cur, records)
            rows = []
            for r in records:
                reward, breakdown = model.combine(r, signals.get(r.generation_id, []))
                rows.append((r.generation_id, reward, Jsonb(breakdown), model.name, _ts(now)))
            cur.executemany(
                "INSERT INTO rewards (generation_id, reward, breakdown, reward_model, matured_at) "
                "VALUES (%s, %s, %s, %s, %s) ON CONFLICT DO NOTHING",
                rows,
            )
        return len(rows)

    def _signals(self, cur: Any, records: list[GenerationRecord]) -> dict[str, list[FeedbackEvent]]:
        """Feedback of each record: events naming it, and session-level events of its session."""
        ids = [r.generation_id for r in records]
        sessions = sorted({r.session_id for r in records if r.session_id})
        cur.execute(
            "SELECT event_id, kind, value, generation_id, session_id, extract(epoch FROM occurred_at), "
            "extract(epoch FROM received_at), detail FROM feedback "
            "WHERE generation_id = ANY(%s) OR (generation_id = '' AND session_id = ANY(%s)) ORDER BY occurred_at",
            (ids, sessions),
        )
        by_gen: dict[str, list[FeedbackEvent]] = {}
        by_session: dict[str, list[FeedbackEvent]] = {}
        for row in cur.fetchall():
            ev = FeedbackEvent(
                row[0], row[1], float(row[2]), row[3], row[4], float(row[5]), float(row[6]), row[7]
            )
            if ev.generation_id:
                by_gen.setdefault(ev.generation_id, []).append(ev)
            else:
                by_session.setdefault(ev.session_id, []).append(ev)
        return {
            r.generation_id: by_gen.get(r.generation_id, []) + by_session.get(r.session_id, [])
            for r in records
        }

    def rewarded(self, after_seq: int = 0, limit: int = 256) -> list[tuple[int, RewardedGeneration]]:
        """(seq, item) of generations with a (non-null) reward, in maturity order after ``after_seq``."""
        with self.conn.cursor() as cur:
            cur.execute(
                f"SELECT r.seq, r.reward, r.breakdown, extract(epoch FROM r.matured_at), "
                f"{_GEN_COLS_G} FROM rewards r "
                "JOIN generations g USING (generation_id) WHERE r.seq > %s AND r.reward IS NOT NULL "
                "ORDER BY r.seq LIMIT %s",
                (after_seq, limit),
            )
            return [
                (int(row[0]), RewardedGeneration(_record(row[4:]), float(row[1]), row[2], float(row[3])))
                for row in cur.fetchall()
            ]

    # ------------------------------------------------------------------ upkeep
    def retain(self, days: float, now: float | None = None) -> dict[str, int]:
        """Delete generations (their rewards with them) and feedback older than ``days``."""
        cutoff = _ts((now if now is not None else time.time()) - days * 86400)
        with self.conn.transaction(), self.conn.cursor() as cur:
            cur.execute("DELETE FROM generations WHERE created_at < %s", (cutoff,))
            gens = cur.rowcount
            cur.execute("DELETE FROM feedback WHERE received_at < %s", (cutoff,))
            return {"generations": gens, "feedback": cur.rowcount}

    def counts(self) -> dict[str, int]:
        with self.conn.cursor() as cur:
            cur.execute(
                "SELECT (SELECT count(*) FROM generations), (SELECT count(*) FROM feedback), "
                "(SELECT count(*) FROM rewards), (SELECT count(*) FROM rewards WHERE reward IS NOT NULL)"
            )
            g, f, r, rr = cur.fetchone()
        return {"generations": g, "feedback": f, "matured": r, "rewarded": rr}

    def export_jsonl(self, path: Path, since: float = 0.0) -> int:
        """Write every generation served after ``since`` with its feedback and reward, one JSON
        object per line, atomically; returns the number of lines."""
        tmp = path.with_name(path.name + ".tmp")
        n = 0
        with open(tmp, "w") as f:
            for line in self._joined(since):
                f.write(json.dumps(line) + "\n")
                n += 1
        tmp.replace(path)
        return n

    def _joined(self, since: float) -> Iterator[dict[str, Any]]:
        with self.conn.transaction(), self.conn.cursor(name="export") as cur:  # server-side: streams
            cur.execute(
                f"SELECT {_GEN_COLS_G}, r.reward, r.breakdown, "
                "(SELECT coalesce(jsonb_agg(jsonb_build_object('event_id', f.event_id, 'kind', f.kind, "
                "'value', f.value, 'occurred_at', extract(epoch FROM f.occurred_at)) ORDER BY f.occurred_at), "
                "'[]'::jsonb) FROM feedback f WHERE f.generation_id = g.generation_id) "
                "FROM generations g LEFT JOIN rewards r USING (generation_id) "
                "WHERE g.created_at > %s ORDER BY g.created_at",
                (_ts(since),),
            )
            n = len(_GEN_NAMES)
            for row in cur:
                reward, breakdown, feedback = row[n:]
                yield {
                    **_record(row[:n]).to_json(),
                    "reward": reward,
                    "reward_breakdown": breakdown,
                    "feedback": feedback,
                }


def _record(row: Any) -> GenerationRecord:
    """A :class:`GenerationRecord` from a row in ``_GEN_COLS`` order."""
    return GenerationRecord(
        generation_id=row[0],
        request_id=row[1],
        session_id=row[2],
        user_hash=row[3],
        created_at=row[4].timestamp(),
        model=row[5],
        weight_version=int(row[6]),
        prompt_ids=list(row[8]),
        token_ids=list(row[9]),
        logprobs=[float(x) for x in row[10]],
        versions=list(row[11]),
        finish_reason=row[12],
        latency_ms=float(row[13]),
        messages=row[14],
        completion=row[15],
        temperature=float(row[16]),
    )
