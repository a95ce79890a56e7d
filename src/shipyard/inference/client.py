"""Clients implementing :class:`shipyard.inference.types.InferenceClient`: over HTTP and in-process.

Contract:
- :class:`HttpInferenceClient` talks to :mod:`shipyard.inference.serving.server`: ``generate`` sends all
  of its sequences in one ``POST /generate`` (the server batches them with other callers'),
  ``version`` is ``GET /version``, ``wait_ready`` polls ``GET /health``. One pooled ``httpx``
  client is shared, so an instance may be used from several threads at once. Server-side
  rejections (HTTP 400) raise ValueError with the server's reason; other failures raise
  ``httpx.HTTPError`` subclasses, except ``version``'s: a server that does not answer it within
  :data:`VERSION_TIMEOUT_S` (cut off, frozen, gone), or a gateway answering 502/503/504 for it,
  raises ``ConnectionError`` naming it.
- :class:`LocalInferenceClient` gives the same interface over an in-process
  :class:`EmbeddedEngine`, through the same :class:`BatchScheduler` the server uses, so calls from
  several threads are batched together exactly as over HTTP.

Limits: no retries (a rollout worker decides what a failed call means); ``close()`` releases the
connection pool / the scheduler thread and the client is unusable afterwards.

Shape legend: no tensors here (token ids travel as lists).

Example::

    with HttpInferenceClient(server.url) as client:
        client.wait_ready(30)
        results = client.generate([GenerateRequest(prompt_ids=ids)])
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Any

import httpx

from shipyard.inference.engine.engine import EmbeddedEngine
from shipyard.inference.engine.scheduler import BatchScheduler
from shipyard.inference.types import UNAVAILABLE, VERSION_TIMEOUT_S, GenerateRequest, GenerateResult, Priority


class HttpInferenceClient:
    """InferenceClient over HTTP; thread-safe."""

    def __init__(self, url: str, timeout_s: float = 600.0, priority: Priority | None = None) -> None:
        """``priority``: the tier stamped on every request sent (None: each request's own)."""
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"url={url!r} must start with http:// or https://")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s={timeout_s} must be > 0")
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        self.priority = priority
        self._http = httpx.Client(
            base_url=self.url, timeout=httpx.Timeout(timeout_s, connect=min(timeout_s, 10.0))
        )

    def generate(self, requests: list[GenerateRequest]) -> list[GenerateResult]:
        """Sample every request in one call; results are in request order."""
        if not requests:
            return []
        return self._results(self._http.post("/generate", json=self._body(requests)), len(requests))

    async def agenerate(
        self, requests: list[GenerateRequest], http: httpx.AsyncClient
    ) -> list[GenerateResult]:
        """:meth:`generate` on the caller's async client (its base URL this server's): cancelling the
        awaiting task drops the connection, and the server stops the requests' rows."""
        return self._results(await http.post("/generate", json=self._body(requests)), len(requests))

    def _body(self, requests: list[GenerateRequest]) -> dict[str, Any]:
        """``POST /generate``'s body, each request stamped with ``priority`` where it is set."""
        if self.priority is not None:
            requests = [dataclasses.replace(r, priority=self.priority) for r in requests]
        return {"requests": [r.to_json() for r in requests]}

    @staticmethod
    def _results(resp: httpx.Response, n: int) -> list[GenerateResult]:
        _raise_for(resp)
        results = [GenerateResult.from_json(d) for d in resp.json()["results"]]
        assert len(results) == n, "the server answered a different number of results"
        return results

    def version(self) -> int:
        try:  # (the wait for a pooled connection keeps the client's own timeout)
            resp = self._http.get("/version", timeout=httpx.Timeout(VERSION_TIMEOUT_S, pool=self.timeout_s))
        except httpx.TransportError as e:
            raise ConnectionError(f"inference server {self.url} did not answer /version: {e!r}") from e
        if resp.status_code in UNAVAILABLE:  # a gateway in front of a server that is down
            raise ConnectionError(f"inference server {self.url} answered /version with {resp.status_code}")
        _raise_for(resp)
        return int(resp.json()["version"])

    def stats(self) -> dict[str, Any]:
        """The server's ``/stats``: engine counters, version, precision."""
        resp = self._http.get("/stats")
        _raise_for(resp)
        return dict(resp.json())

    def wait_ready(self, timeout_s: float = 60.0, poll_s: float = 0.1) -> int:
        """Poll ``/health`` until the server answers ok; returns its version; TimeoutError otherwise."""
        deadline = time.monotonic() + timeout_s
        last = "no answer yet"
        while True:
            try:
                resp = self._http.get("/health", timeout=max(poll_s, 1.0))
                if resp.status_code == 200 and resp.json().get("status") == "ok":
                    return int(resp.json()["version"])
                last = f"HTTP {resp.status_code}: {resp.text[:200]}"
            except httpx.TransportError as e:
                last = f"{type(e).__name__}: {e}"
            if time.monotonic() >= deadline:
                raise TimeoutError(f"inference server {self.url} not ready after {timeout_s}s ({last})")
            time.sleep(poll_s)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> HttpInferenceClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _raise_for(resp: httpx.Response) -> None:
    """ValueError for a 400 (our malformed request), httpx.HTTPStatusError for other failures."""
    if resp.status_code == 400:
        try:
            detail = resp.json().get("error", {}).get("message", resp.text)
        except ValueError:
            detail = resp.text
        raise ValueError(f"inference server rejected the request: {detail}")
    resp.raise_for_status()


class LocalInferenceClient:
    """InferenceClient over an in-process engine; concurrent callers are batched together."""

    def __init__(self, engine: EmbeddedEngine, gather_window_s: float = 0.005) -> None:
        self.engine = engine
        self._scheduler = BatchScheduler(engine, gather_window_s=gather_window_s)

    def generate(self, requests: list[GenerateRequest]) -> list[GenerateResult]:
        """Sample every request (batched with other threads' calls); results in request order."""
        return self._scheduler.generate(requests)

    async def agenerate(self, requests: list[GenerateRequest], http: Any = None) -> list[GenerateResult]:
        """:meth:`generate` awaited (``http`` unused: the engine is in-process); cancelling the
        awaiting task stops the requests' rows (they end with ``abort``)."""
        ticket = self._scheduler.submit(requests)
        try:
            return await asyncio.wrap_future(ticket)
        except asyncio.CancelledError:
            ticket.cancel_requests()
            raise

    def version(self) -> int:
        return self.engine.version

    def stats(self) -> dict[str, Any]:
        """The engine's counters and version (what a server's ``/stats`` starts with)."""
        return {**self.engine.stats, "version": self.engine.version}

    def wait_ready(self, timeout_s: float = 60.0) -> int:
        """Always ready in-process; returns the engine's version."""
        return self.engine.version

    def close(self) -> None:
        self._scheduler.close()

    def __enter__(self) -> LocalInferenceClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
