"""The online gateway: an OpenAI-compatible proxy that logs every served generation and takes feedback.

Contract (:func:`create_gateway_app`, served by :class:`Gateway`):

- ``POST /v1/chat/completions`` is forwarded to ``online.gateway.upstream`` (a ``shipyard serve``
  server, streaming or not) and its answer returned unchanged, plus the header
  ``x-shipyard-request-id`` (the upstream's completion id: feedback names a generation as
  ``<request id>/<choice index>``). Two fields are the gateway's and are not forwarded: ``store``
  (``false``: the request is neither logged nor ever trained on; the answer says
  ``x-shipyard-stored: false``) and ``metadata`` (``session_id`` groups a user's requests; the
  ``x-shipyard-session`` header does the same). ``user`` is forwarded and logged only as an
  HMAC-SHA256 hash with the gateway's salt.
- After the answer is complete, one :class:`~shipyard.online.types.GenerationRecord` per choice
  goes to the :class:`~shipyard.online.buffer.LogBuffer`: prompt and sampled token ids, the
  sampler's per-token logprobs and weight versions (the upstream's ``shipyard`` extension),
  latency, messages and text. Logging never delays or fails the answer: a database that is down
  only grows the buffer (module doc of :mod:`shipyard.online.buffer`); an answer without the
  extension (another backend) is served and counted in ``unlogged``.
- ``POST /v1/feedback``: one event or ``{"events": [...]}`` (:class:`FeedbackEvent` fields;
  ``request_id`` + ``choice`` may stand for ``generation_id``); 202 when buffered, 400 naming the
  bad field, 503 with ``Retry-After`` when the buffer is full (retry with the same ``event_id``: an
  event counts once). Feedback naming a request that opted out is dropped (``feedback_opted_out``).
- ``GET /v1/models`` is forwarded; ``GET /health``; ``GET /stats`` (buffer counters, requests
  served, upstream errors).

Upstream failures keep OpenAI's error shape: the upstream's own error passes through with its
status; an unreachable upstream is 502, a slow one 504.

Upstreams (``online.gateway.upstream_kind``): Shipyard's server (its answers carry the
``shipyard`` extensions) or a vLLM OpenAI server, asked for ``logprobs`` and ``return_token_ids``
(removed from the answer unless the client asked) with the weight version read from
``GET /weight_info`` before the request (a version change during it is counted in
``version_changed``: vLLM's chat route does not say where it fell).

Limits: one gateway process holds its buffer in
memory: what is buffered when it is killed hard is lost, and counted nowhere (stop it with SIGTERM,
which flushes).
"""

from __future__ import annotations

import collections
import hashlib
import hmac
import json
import os
import secrets
import socket
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from shipyard.config.schema import GatewayConfig
from shipyard.online.buffer import LogBuffer
from shipyard.online.types import FeedbackEvent, GenerationRecord, LogSink

GATEWAY_FIELDS = ("store", "metadata")
"""Request fields the gateway consumes and does not forward."""


def _error(
    status: int, message: str, param: str | None = None, type_: str = "invalid_request_error"
) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": type_, "param": param, "code": None}}, status)


class _State:
    """What the gateway's routes share: the buffer, the salt, counters, opted-out request ids."""

    def __init__(self, cfg: GatewayConfig, buffer: LogBuffer) -> None:
        self.cfg, self.buffer = cfg, buffer
        salt = os.environ.get(cfg.user_salt_env, "")
        self.salt_is_random = not salt
        self.salt = salt.encode() if salt else secrets.token_bytes(32)
        self.counters = collections.Counter[str]()
        self.opted_out: collections.OrderedDict[str, None] = collections.OrderedDict()

    def user_hash(self, user: Any) -> str:
        if not user:
            return ""
        return hmac.new(self.salt, str(user).encode(), hashlib.sha256).hexdigest()

    def remember_opt_out(self, request_id: str) -> None:
        self.opted_out[request_id] = None
        while len(self.opted_out) > 100_000:
            self.opted_out.popitem(last=False)


def create_gateway_app(cfg: GatewayConfig, buffer: LogBuffer, client: httpx.AsyncClient) -> FastAPI:
    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        yield
        await client.aclose()

    app = FastAPI(title="shipyard online gateway", lifespan=lifespan)
    state = _State(cfg, buffer)
    app.state.gateway = state

    @app.post("/v1/chat/completions", response_model=None)
    async def chat(request: Request) -> Response:
        try:
            body = await request.json()
        except json.JSONDecodeError as e:
            return _error(400, f"request body is not JSON: {e}")
        if not isinstance(body, dict):
            return _error(400, "request body must be a JSON object")
        meta = body.get("metadata") or {}
        if not isinstance(meta, dict):
            return _error(400, "metadata must be an object", "metadata")
        store = body.get("store", True) is not False
        session = str(meta.get("session_id") or request.headers.get("x-shipyard-session") or "")
        forward = {k: v for k, v in body.items() if k not in GATEWAY_FIELDS}
        ctx = _Ctx(state, forward, session, store)
        if cfg.upstream_kind == "vllm" and store:
            await ctx.ask_vllm(client)
        if forward.get("stream"):
            return await _proxy_stream(client, ctx)
        return await _proxy_json(client, ctx)

    @app.post("/v1/feedback")
    async def feedback(request: Request) -> Response:
        return await _feedback(request, state)

    @app.get("/v1/models")
    async def models() -> Response:
        try:
            resp = await client.get("/v1/models")
        except httpx.HTTPError as e:
            return _error(502, f"upstream unreachable: {type(e).__name__}: {e}", type_="server_error")
        return Response(resp.content, resp.status_code, media_type="application/json")

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "log_sink_up": buffer.stats()["sink_up"]}

    @app.get("/stats")
    async def stats() -> dict[str, Any]:
        return {**state.counters, **buffer.stats(), "user_salt_random": state.salt_is_random}

    return app


async def _feedback(request: Request, state: _State) -> Response:
    """``POST /v1/feedback`` (module doc)."""
    try:
        body = await request.json()
        items = body["events"] if isinstance(body, dict) and "events" in body else [body]
        events = [_event(item) for item in items]
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
        return _error(400, f"invalid feedback: {e}")
    kept = [e for e in events if e.generation_id.rsplit("/", 1)[0] not in state.opted_out]
    state.counters["feedback_opted_out"] += len(events) - len(kept)
    if not state.buffer.add_feedback(kept):
        full = {"message": "feedback buffer full; retry with the same event_id", "type": "server_error"}
        return JSONResponse({"error": full}, 503, headers={"retry-after": "1"})
    state.counters["feedback_accepted"] += len(kept)
    return JSONResponse({"accepted": len(kept), "dropped_opted_out": len(events) - len(kept)}, 202)


async def _vllm_version(client: httpx.AsyncClient) -> int | None:
    """The weight version a vLLM server serves (Shipyard labels it; vLLM's ``default`` is 0); None
    when it does not say (a server without ``VLLM_SERVER_DEV_MODE``): the answer is then unlogged."""
    from shipyard.inference.backends.vllm_server import label_version

    try:
        resp = await client.get("/weight_info")
        resp.raise_for_status()
        return label_version(resp.json().get("weight_version"))
    except (httpx.HTTPError, ValueError):
        return None


def _event(item: Any) -> FeedbackEvent:
    """A feedback event from JSON; ``request_id`` (+ ``choice``) may stand for ``generation_id``."""
    if not isinstance(item, dict):
        raise ValueError("each event must be a JSON object")
    item = dict(item)
    if "request_id" in item:
        item["generation_id"] = f"{item.pop('request_id')}/{int(item.pop('choice', 0))}"
    item.setdefault("received_at", time.time())
    item.setdefault("occurred_at", item["received_at"])
    return FeedbackEvent.from_json(item)


class _Ctx:
    """One proxied request: what to forward and what to log."""

    def __init__(self, state: _State, forward: dict[str, Any], session: str, store: bool) -> None:
        self.state, self.forward, self.session, self.store = state, forward, session, store
        self.t0 = time.perf_counter()
        self.vllm = False
        self.vllm_version: int | None = None
        self.strip: set[str] = set()

    async def ask_vllm(self, client: httpx.AsyncClient) -> None:
        """A vLLM upstream: ask for token ids and logprobs (to strip later if the client did not),
        and note the served weight version."""
        self.vllm = True
        for name in ("logprobs", "return_token_ids"):
            if not self.forward.get(name):
                self.forward[name] = True
                self.strip.add(name)
        self.vllm_version = await _vllm_version(client)

    async def vllm_extensions(
        self, client: httpx.AsyncClient, data: dict[str, Any], choices: list[dict[str, Any]]
    ) -> None:
        """Give a vLLM answer Shipyard's ``shipyard`` extensions (the version of every token is the
        one served before the request; a request the version changed under is counted in
        ``version_changed``: vLLM's chat route does not say where)."""
        after = await _vllm_version(client)
        version = self.vllm_version if self.vllm_version is not None else after
        if after != version:
            self.state.counters["version_changed"] += 1
        data["shipyard"] = {"prompt_token_ids": data.get("prompt_token_ids")}
        for c in choices:
            ids = c.get("token_ids") or []
            lps = [float(e["logprob"]) for e in ((c.get("logprobs") or {}).get("content") or [])]
            c["shipyard"] = (
                {"token_ids": ids, "logprobs": lps, "versions": [version] * len(ids)}
                if len(lps) == len(ids)
                else None
            )

    def stripped(self, data: dict[str, Any]) -> dict[str, Any]:
        """``data`` as vLLM answers a client that did not ask for token ids or logprobs (the fields
        it asked for are null again), without the gateway's ``shipyard`` extensions."""
        ids = "return_token_ids" in self.strip
        out = {k: v for k, v in data.items() if k != "shipyard"}
        if ids and "prompt_token_ids" in out:
            out["prompt_token_ids"] = None
        choices = []
        for c in data.get("choices") or []:
            c = {k: v for k, v in c.items() if k != "shipyard"}
            if ids and "token_ids" in c:
                c["token_ids"] = None
            if "logprobs" in self.strip:
                c["logprobs"] = None
            choices.append(c)
        return {**out, "choices": choices}

    def headers(self, request_id: str) -> dict[str, str]:
        return {"x-shipyard-request-id": request_id, "x-shipyard-stored": "true" if self.store else "false"}

    def log(
        self, request_id: str, model: str, prompt_ids: list[int] | None, choices: list[dict[str, Any]]
    ) -> None:
        """Buffer one record per choice (or remember the opt-out); ``choices`` carry ``shipyard``
        extensions and ``text``."""
        self.state.counters["served"] += 1
        if not self.store:
            self.state.remember_opt_out(request_id)
            self.state.counters["opted_out"] += 1
            return
        if prompt_ids is None or any(c.get("shipyard") is None for c in choices):
            self.state.counters["unlogged"] += 1
            return
        latency = (time.perf_counter() - self.t0) * 1000
        user = self.state.user_hash(self.forward.get("user"))
        for i, c in enumerate(choices):
            ext = c["shipyard"]
            self.state.buffer.add_generation(
                GenerationRecord(
                    generation_id=f"{request_id}/{i}",
                    request_id=request_id,
                    session_id=self.session,
                    user_hash=user,
                    created_at=time.time(),
                    model=model,
                    weight_version=int(ext["versions"][0]) if ext["versions"] else -1,
                    prompt_ids=list(prompt_ids),
                    token_ids=list(ext["token_ids"]),
                    logprobs=[float(x) for x in ext["logprobs"]],
                    versions=list(ext["versions"]),
                    finish_reason=str(c.get("finish_reason") or ""),
                    latency_ms=latency,
                    messages=list(self.forward.get("messages") or []),
                    completion=c.get("text", ""),
                    temperature=float(
                        1.0 if self.forward.get("temperature") is None else self.forward["temperature"]
                    ),
                )
            )


async def _proxy_json(client: httpx.AsyncClient, ctx: _Ctx) -> Response:
    try:
        resp = await client.post("/v1/chat/completions", json=ctx.forward)
    except httpx.TimeoutException as e:
        return _error(504, f"upstream timed out: {e}", type_="server_error")
    except httpx.HTTPError as e:
        return _error(502, f"upstream unreachable: {type(e).__name__}: {e}", type_="server_error")
    if resp.status_code != 200:
        ctx.state.counters["upstream_errors"] += 1
        return Response(resp.content, resp.status_code, media_type="application/json")
    data = resp.json()
    rid = str(data.get("id", ""))
    choices = [{**c, "text": (c.get("message") or {}).get("content") or ""} for c in data.get("choices", [])]
    if ctx.vllm:
        await ctx.vllm_extensions(client, data, choices)
    ctx.log(rid, str(data.get("model", "")), (data.get("shipyard") or {}).get("prompt_token_ids"), choices)
    if not ctx.vllm:
        return Response(resp.content, 200, media_type="application/json", headers=ctx.headers(rid))
    return JSONResponse(ctx.stripped(data), 200, headers=ctx.headers(rid))


async def _proxy_stream(client: httpx.AsyncClient, ctx: _Ctx) -> Response:
    req = client.build_request("POST", "/v1/chat/completions", json=ctx.forward)
    try:
        resp = await client.send(req, stream=True)
    except httpx.TimeoutException as e:
        return _error(504, f"upstream timed out: {e}", type_="server_error")
    except httpx.HTTPError as e:
        return _error(502, f"upstream unreachable: {type(e).__name__}: {e}", type_="server_error")
    if resp.status_code != 200:
        content = await resp.aread()
        await resp.aclose()
        ctx.state.counters["upstream_errors"] += 1
        return Response(content, resp.status_code, media_type="application/json")
    seen = _StreamLog(ctx)
    lines = resp.aiter_lines()
    head: list[str] = []
    async for line in lines:  # up to the first chunk: it names the request, for the header
        head.append(seen.add(line))
        if seen.request_id or seen.done:
            break

    async def log() -> None:
        choices = seen.choices()
        if ctx.vllm:
            await ctx.vllm_extensions(client, {"prompt_token_ids": seen.prompt_ids}, choices)
        ctx.log(seen.request_id, seen.model, seen.prompt_ids, choices)

    async def body() -> AsyncIterator[bytes]:
        logged = False
        try:
            for line in head:
                if seen.done and not logged:  # logged before the client sees [DONE]
                    await log()
                    logged = True
                yield (line + "\n").encode()
            async for line in lines:
                out = seen.add(line)
                if seen.done and not logged:
                    await log()
                    logged = True
                yield (out + "\n").encode()
        finally:
            await resp.aclose()

    return StreamingResponse(body(), media_type="text/event-stream", headers=ctx.headers(seen.request_id))


class _StreamLog:
    """What a streamed answer says about itself: its id, text per choice, and the extensions
    (Shipyard's, or vLLM's token ids and logprobs, which it strips when the client did not ask)."""

    def __init__(self, ctx: _Ctx) -> None:
        self.ctx = ctx
        self.request_id, self.model, self.done = "", "", False
        self.prompt_ids: list[int] | None = None
        self.text: dict[int, list[str]] = collections.defaultdict(list)
        self.ext: dict[int, dict[str, Any]] = {}
        self.finish: dict[int, str] = {}
        self.ids: dict[int, list[int]] = collections.defaultdict(list)
        self.lps: dict[int, list[dict[str, Any]]] = collections.defaultdict(list)

    def add(self, line: str) -> str:
        """Note what ``line`` says; returns the line to send on."""
        if not line.startswith("data: "):
            return line
        payload = line[6:]
        if payload == "[DONE]":
            self.done = True
            return line
        try:
            chunk = json.loads(payload)
        except json.JSONDecodeError:
            return line
        self.request_id = self.request_id or str(chunk.get("id", ""))
        self.model = self.model or str(chunk.get("model", ""))
        if (ext := chunk.get("shipyard")) is not None:
            self.prompt_ids = ext.get("prompt_token_ids")
        if chunk.get("prompt_token_ids") is not None:  # vLLM, first chunk
            self.prompt_ids = chunk["prompt_token_ids"]
        for c in chunk.get("choices") or []:
            i = int(c.get("index", 0))
            self.text[i].append((c.get("delta") or {}).get("content") or "")
            if c.get("finish_reason"):
                self.finish[i] = c["finish_reason"]
            if c.get("shipyard") is not None:
                self.ext[i] = c["shipyard"]
            self.ids[i] += c.get("token_ids") or []
            self.lps[i] += (c.get("logprobs") or {}).get("content") or []
        if not self.ctx.strip:
            return line
        return "data: " + json.dumps(self.ctx.stripped(chunk), separators=(",", ":"))

    def choices(self) -> list[dict[str, Any]]:
        n = max([*self.text, *self.ext, *self.ids], default=-1) + 1
        return [
            {
                "text": "".join(self.text.get(i, [])),
                "finish_reason": self.finish.get(i, ""),
                "shipyard": self.ext.get(i),
                "token_ids": self.ids.get(i, []),
                "logprobs": {"content": self.lps.get(i, [])},
            }
            for i in range(n)
        ]


class Gateway:
    """The gateway served by uvicorn in a thread, its buffer and its upstream client."""

    def __init__(self, cfg: GatewayConfig, open_sink: Callable[[], LogSink]) -> None:
        from shipyard.inference.serving.server import UvicornThread

        if not cfg.upstream:
            raise ValueError(
                "online.gateway.upstream is empty: set the inference server's URL, e.g. http://127.0.0.1:8000"
            )
        self.cfg = cfg
        self.buffer = LogBuffer(open_sink, cfg)
        self.client = httpx.AsyncClient(
            base_url=cfg.upstream.rstrip("/"),
            timeout=httpx.Timeout(cfg.upstream_timeout_s, connect=10.0),
            # TCP_NODELAY: a body written after its headers must not wait for a delayed ACK (40 ms)
            transport=httpx.AsyncHTTPTransport(
                limits=httpx.Limits(max_connections=512, max_keepalive_connections=64),
                socket_options=[(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)],
            ),
        )
        self.app = create_gateway_app(cfg, self.buffer, self.client)
        self._http = UvicornThread(self.app, cfg.host, cfg.port, name="shipyard-gateway")

    @property
    def url(self) -> str:
        return self._http.url

    def stats(self) -> dict[str, Any]:
        state: _State = self.app.state.gateway
        return {**state.counters, **self.buffer.stats()}

    def start(self) -> Gateway:
        self._http.start()
        return self

    def stop(self, flush_s: float = 10.0) -> int:
        """Stop serving, flush the buffer for up to ``flush_s``; returns the records left unwritten."""
        self._http.stop()
        return self.buffer.close(flush_s)

    def __enter__(self) -> Gateway:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
