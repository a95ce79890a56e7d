"""Records of real-time RL from production traffic: what the gateway logs, what users signal, and
what the online trainer reads.

Contract: a :class:`GenerationRecord` is one served choice, token-exact (prompt and sampled ids,
the sampler's logprob of each sampled token, the weight version of each token), keyed by
``generation_id`` = ``<request_id>/<choice index>``. A :class:`FeedbackEvent` names the generation
(or only the session, for session-level signals such as ``abandoned``) it is about and carries
its own ``event_id``: the database keeps the first event of an id, so a client that retries counts
once. A :class:`RewardedGeneration` is a generation joined with its matured reward.

Signal values (``FeedbackEvent.value``), by kind (:data:`shipyard.config.schema.SIGNAL_KINDS`):
``thumb`` +1 / -1, ``score`` in [0, 1], ``edit`` +1 kept / -1 reverted, ``tests`` +1 passed / -1
failed, ``followup`` +1 satisfied / -1 dissatisfied, ``abandoned`` -1 (session-level).

Example::

    from shipyard.online.types import FeedbackEvent
    ev = FeedbackEvent.make("thumb", 1.0, generation_id="req-1/0")
    FeedbackEvent.from_json(ev.to_json()) == ev   # True
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Protocol

from shipyard.config.schema import SIGNAL_KINDS

VALUE_RANGE = {
    "thumb": (-1.0, 1.0),
    "score": (0.0, 1.0),
    "edit": (-1.0, 1.0),
    "tests": (-1.0, 1.0),
    "followup": (-1.0, 1.0),
    "abandoned": (-1.0, -1.0),
}
"""Allowed value of each signal kind (inclusive bounds)."""


@dataclass
class GenerationRecord:
    generation_id: str
    """``<request_id>/<choice index>``."""
    request_id: str
    session_id: str
    user_hash: str
    """HMAC-SHA256 of the end user's id with the gateway's salt (empty: no user given)."""
    created_at: float
    """Unix time the upstream answered."""
    model: str
    weight_version: int
    """Version of the weights that sampled the first token (``versions`` has every token's)."""
    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: str
    latency_ms: float
    """Upstream round trip seen by the gateway."""
    messages: list[dict[str, Any]] = field(default_factory=list)
    """The chat messages of the request (for regression suites and analysis)."""
    completion: str = ""
    """The text the client received."""
    temperature: float = 1.0
    """Sampling temperature of the request (the logprobs are of the tempered distribution)."""

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> GenerationRecord:
        return cls(**d)


@dataclass
class FeedbackEvent:
    event_id: str
    """Client-chosen id; a retried event repeats it and counts once."""
    kind: str
    value: float
    generation_id: str = ""
    """The generation the signal is about (``<request_id>/<choice>``); empty for a session-level one."""
    session_id: str = ""
    occurred_at: float = 0.0
    """When the user did it (the client's clock); ``received_at`` is the gateway's."""
    received_at: float = 0.0
    detail: dict[str, Any] = field(default_factory=dict)
    """Free-form context (the follow-up's text, the test command), kept for analysis."""

    def __post_init__(self) -> None:
        if self.kind not in SIGNAL_KINDS:
            raise ValueError(f"feedback kind {self.kind!r} is unknown; use one of {list(SIGNAL_KINDS)}")
        lo, hi = VALUE_RANGE[self.kind]
        if not lo <= float(self.value) <= hi:
            raise ValueError(f"feedback value {self.value} of kind {self.kind!r} is outside [{lo}, {hi}]")
        if not self.generation_id and not self.session_id:
            raise ValueError("feedback needs a generation_id or a session_id to be joined to")
        if not self.event_id or len(self.event_id) > 200:
            raise ValueError("feedback event_id must be a non-empty string of at most 200 characters")

    @classmethod
    def make(cls, kind: str, value: float, **kw: Any) -> FeedbackEvent:
        """A new event with a fresh id and ``occurred_at`` = now."""
        kw.setdefault("occurred_at", time.time())
        return cls(event_id=uuid.uuid4().hex, kind=kind, value=float(value), **kw)

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> FeedbackEvent:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown feedback field(s) {unknown}; fields are {sorted(known)}")
        return cls(**d)


@dataclass
class RewardedGeneration:
    """A generation whose reward matured: what the online trainer consumes."""

    record: GenerationRecord
    reward: float
    breakdown: dict[str, Any]
    """How the reward model combined the signals (``shipyard.online.reward``)."""
    matured_at: float


class LogSink(Protocol):
    """Where the gateway's records go (the PostgreSQL database, :mod:`shipyard.online.database`)."""

    def write_generations(self, records: list[GenerationRecord]) -> None:
        """Store records (one already stored is ignored)."""

    def write_feedback(self, events: list[FeedbackEvent]) -> int:
        """Store events; returns how many were new (a repeated ``event_id`` is ignored)."""
