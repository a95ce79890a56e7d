"""Client helper for sending user signals to the gateway's ``POST /v1/feedback``.

Contract: each method builds one :class:`~shipyard.online.types.FeedbackEvent` (a fresh
``event_id``, ``occurred_at`` = now unless given) and sends it; :meth:`FeedbackClient.send` retries a
refused or unreachable gateway (503, connection errors, timeouts) with the *same* event id until
``deadline_s`` passes, so a retried event counts once and a gateway restart or a full buffer loses
nothing. A 400 (an invalid event) is raised at once as ``ValueError`` with the gateway's message.
Generations are named by ``generation_id`` (``<request id>/<choice>``; the request id is the
completion's ``id``, also in the ``x-shipyard-request-id`` header).

Example::

    fb = FeedbackClient("http://127.0.0.1:8700")
    fb.thumb(f"{completion.id}/0", up=True)
    fb.tests(f"{completion.id}/0", passed=False, detail={"command": "pytest -q"})
    fb.abandoned(session_id="s-42")
"""

from __future__ import annotations

import time
from typing import Any

import httpx

from shipyard.online.types import FeedbackEvent


class FeedbackClient:
    def __init__(self, base_url: str, timeout_s: float = 10.0, deadline_s: float = 120.0) -> None:
        self.http = httpx.Client(base_url=base_url.rstrip("/"), timeout=timeout_s)
        self.deadline_s = deadline_s
        self.retries = 0

    def close(self) -> None:
        self.http.close()

    def send(self, events: list[FeedbackEvent]) -> int:
        """Deliver ``events`` (module doc); returns how many the gateway accepted."""
        body = {"events": [e.to_json() for e in events]}
        deadline, wait = time.monotonic() + self.deadline_s, 0.2
        while True:
            try:
                resp = self.http.post("/v1/feedback", json=body)
                if resp.status_code == 202:
                    return int(resp.json()["accepted"])
                if resp.status_code == 400:
                    raise ValueError(resp.json()["error"]["message"])
                problem = f"HTTP {resp.status_code}: {resp.text[:200]}"
            except httpx.TransportError as e:
                problem = f"{type(e).__name__}: {e}"
            if time.monotonic() + wait > deadline:
                raise TimeoutError(f"feedback not delivered within {self.deadline_s:.0f} s (last: {problem})")
            self.retries += 1
            time.sleep(wait)
            wait = min(wait * 2, 5.0)

    def _one(self, kind: str, value: float, **kw: Any) -> FeedbackEvent:
        ev = FeedbackEvent.make(kind, value, **kw)
        self.send([ev])
        return ev

    def thumb(self, generation_id: str, up: bool, **kw: Any) -> FeedbackEvent:
        return self._one("thumb", 1.0 if up else -1.0, generation_id=generation_id, **kw)

    def score(self, generation_id: str, score: float, **kw: Any) -> FeedbackEvent:
        return self._one("score", score, generation_id=generation_id, **kw)

    def edit(self, generation_id: str, kept: bool, **kw: Any) -> FeedbackEvent:
        return self._one("edit", 1.0 if kept else -1.0, generation_id=generation_id, **kw)

    def tests(self, generation_id: str, passed: bool, **kw: Any) -> FeedbackEvent:
        return self._one("tests", 1.0 if passed else -1.0, generation_id=generation_id, **kw)

    def followup(self, generation_id: str, satisfied: bool, text: str = "", **kw: Any) -> FeedbackEvent:
        detail = {**kw.pop("detail", {}), **({"text": text} if text else {})}
        return self._one(
            "followup", 1.0 if satisfied else -1.0, generation_id=generation_id, detail=detail, **kw
        )

    def abandoned(self, session_id: str, **kw: Any) -> FeedbackEvent:
        return self._one("abandoned", -1.0, session_id=session_id, **kw)
