"""HTTP serving of an :class:`EmbeddedEngine`: FastAPI routes over the batching scheduler, uvicorn thread.

Contract:
- :func:`create_app` routes: ``POST /generate`` (token-in/token-out, body
  ``{"requests": [GenerateRequest.to_json(), ...]}`` -> ``{"results": [GenerateResult.to_json(), ...]}``),
  ``POST /v1/chat/completions`` (OpenAI-compatible, streaming or not: see
  :mod:`shipyard.inference.serving.openai_api` for what is honoured and what is refused),
  ``GET /v1/models`` and ``/v1/models/{id}``, ``GET /health`` -> ``{"status": "ok", "version": v}``,
  ``GET /version``, ``GET /stats`` (the engine's counters and ``precision``). Requests go through
  one :class:`~shipyard.inference.engine.scheduler.BatchScheduler` (continuous batching, a reserved lane
  for short requests). A client that disconnects cancels its requests: the engine stops their rows
  at the next decode step. Errors are OpenAI-shaped (``{"error": {"message", "type", "param",
  "code"}}``): 400 malformed, 404 unknown model or route, 503 shutting down, 500 engine failure.
- :class:`InferenceServer` runs uvicorn in a background thread on a socket it binds itself (port
  0 picks a free port, known as soon as ``start()`` returns); ``stop()`` stops accepting, lets
  running requests finish for ``drain_s`` seconds, cancels the rest (they return what they have
  with ``finish_reason`` ``abort``), and joins both threads.

Limits: the chat ``content`` is cut before the stop string (OpenAI style) while
``shipyard.token_ids`` keep the token that completed it; tool calls are parsed, not constrained
(:mod:`shipyard.inference.serving.tools`); no constrained output (``response_format``).

Shape legend: no tensors here (token ids travel as lists).
"""

from __future__ import annotations

import asyncio
import os
import socket
import threading
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from shipyard.config.schema import ScavengeConfig
from shipyard.inference.engine.engine import EmbeddedEngine
from shipyard.inference.engine.scheduler import BatchScheduler, SchedulerClosed, Ticket
from shipyard.inference.serving.openai_api import (
    ChatCompletionBody,
    ChatPlan,
    OpenAIError,
    chat_requests,
    chat_response,
    sse,
    stream_chunks,
)
from shipyard.inference.types import GenerateRequest, GenerateResult

MAX_GENERATE_REQUESTS = 1024
"""Most requests one ``POST /generate`` may carry (a rollout worker sends one per session turn)."""


class GenerateBody(BaseModel):
    """Body of ``POST /generate``."""

    requests: list[dict[str, Any]]


def served_name(engine: EmbeddedEngine, model_name: str | None) -> str:
    """The model id clients use: ``model_name``, else the last part of the model's path (never a
    filesystem path), else ``shipyard``."""
    if model_name:
        return model_name
    path = str(getattr(engine.model.config, "name_or_path", "") or "")
    return os.path.basename(path.rstrip("/")) or "shipyard"


def _submit(scheduler: BatchScheduler, requests: list[GenerateRequest], on_token: Any = None) -> Ticket:
    try:
        return scheduler.submit(requests, on_token)
    except ValueError as e:
        raise OpenAIError(400, str(e)) from e
    except SchedulerClosed as e:
        raise OpenAIError(503, str(e), type_="server_error") from e


async def _client_gone(request: Request) -> None:
    """Return once the client has closed its connection. The body is read already, so the server's
    next message is ``http.disconnect``: sent when the connection closes (or the response is done).
    Event-driven, where polling ``is_disconnected`` every 0.1 s woke the event loop 10 times a second
    per open request, and took the GIL from the engine's batcher each time."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _results(ticket: Ticket, request: Request | None = None) -> list[GenerateResult]:
    """Await ``ticket``; if the client disconnects meanwhile, cancel its requests (module doc)."""
    waiting = asyncio.wrap_future(ticket)
    gone = asyncio.ensure_future(_client_gone(request)) if request is not None else None
    try:
        if gone is not None:
            await asyncio.wait({waiting, gone}, return_when=asyncio.FIRST_COMPLETED)
            if gone.done():  # the rows stop at the next decode step; the ticket resolves with them
                ticket.cancel_requests()
        await asyncio.wait({waiting})
    except asyncio.CancelledError:  # the server cancelled the request task (shutdown)
        ticket.cancel_requests()
        raise
    finally:
        if gone is not None:
            gone.cancel()
    try:
        return waiting.result()
    except SchedulerClosed as e:
        raise OpenAIError(503, str(e), type_="server_error") from e
    except Exception as e:  # report engine failures to the caller
        raise OpenAIError(500, f"{type(e).__name__}: {e}", type_="server_error") from e


def errors_in_openai_shape(app: FastAPI) -> None:
    @app.exception_handler(OpenAIError)
    async def _openai(_: Request, e: OpenAIError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, e: RequestValidationError) -> JSONResponse:
        err = e.errors()[0]
        loc = [str(p) for p in err.get("loc", ()) if p != "body"]
        param = ".".join(loc) or None
        message = (
            f"unknown parameter {param!r}"
            if err.get("type") == "extra_forbidden"
            else f"{param}: {err.get('msg')}"
        )
        return JSONResponse(OpenAIError(400, message, param).body(), status_code=400)

    @app.exception_handler(StarletteHTTPException)  # FastAPI's HTTPException and the router's 404/405
    async def _http(_: Request, e: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(OpenAIError(e.status_code, str(e.detail)).body(), status_code=e.status_code)


def create_app(
    engine: EmbeddedEngine,
    gather_window_s: float = 0.005,
    model_name: str | None = None,
    max_n: int = 8,
    drain_s: float = 5.0,
    reserved_slots: int | None = None,
    scavenge: ScavengeConfig | None = None,
) -> FastAPI:
    """The FastAPI app; its scheduler starts on first use and closes (draining) with the app's lifespan.
    ``reserved_slots``: slots long requests may not take (None: a quarter of ``max_batch``; 0: FIFO).
    ``scavenge``: production and scavenger tiers (:mod:`shipyard.inference.engine.scheduler`)."""
    scheduler = BatchScheduler(
        engine, gather_window_s=gather_window_s, reserved_slots=reserved_slots, scavenge=scavenge
    )
    name = served_name(engine, model_name)

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        scheduler.start()
        yield
        await asyncio.to_thread(scheduler.close, drain_s)

    app = FastAPI(title="shipyard inference", lifespan=lifespan)
    app.state.scheduler, app.state.engine = scheduler, engine
    app.state.stats_hooks = []  # callables adding to /stats (the embedded node: its adoptions)
    app.state.tool_counts = {"tool_calls_parsed": 0, "tool_parse_failures": 0}
    errors_in_openai_shape(app)

    @app.post("/generate")
    async def generate(body: GenerateBody, request: Request) -> dict[str, Any]:
        if len(body.requests) > MAX_GENERATE_REQUESTS:
            raise OpenAIError(
                400, f"{len(body.requests)} requests in one call; at most {MAX_GENERATE_REQUESTS}", "requests"
            )
        try:
            requests = [GenerateRequest.from_json(d) for d in body.requests]
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise OpenAIError(400, f"malformed GenerateRequest: {e}", "requests") from e
        return {"results": [r.to_json() for r in await _results(_submit(scheduler, requests), request)]}

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(
        body: ChatCompletionBody, request: Request
    ) -> dict[str, Any] | StreamingResponse:
        requests, plan = chat_requests(body, engine.tokenizer, name, engine.max_positions, max_n)
        if body.stream:
            return _stream(scheduler, requests, body, engine.tokenizer, name, plan, app.state.tool_counts)
        results = await _results(_submit(scheduler, requests), request)
        return chat_response(
            engine.tokenizer, body, name, requests[0].prompt_ids, results, plan, app.state.tool_counts
        )

    _add_info_routes(app, scheduler, name)
    return app


def _stream(
    scheduler: BatchScheduler,
    requests: list[GenerateRequest],
    body: ChatCompletionBody,
    tok: Any,
    name: str,
    plan: ChatPlan,
    counts: dict[str, int],
) -> StreamingResponse:
    """Submit now (so a refusal is a plain error), stream as tokens arrive; a client that goes away
    closes the generator, which cancels the requests."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[tuple[int, int] | list[GenerateResult] | BaseException] = asyncio.Queue()
    ticket = _submit(
        scheduler, requests, lambda i, tok_id, *_: loop.call_soon_threadsafe(queue.put_nowait, (i, tok_id))
    )

    def finished(fut: Any) -> None:
        loop.call_soon_threadsafe(queue.put_nowait, fut.exception() or fut.result())

    ticket.add_done_callback(finished)

    async def events() -> AsyncIterator[tuple[int, int] | list[GenerateResult]]:
        while True:
            event = await queue.get()
            if isinstance(event, BaseException):
                raise event
            yield event
            if isinstance(event, list):
                return

    async def body_iter() -> AsyncIterator[str]:
        try:
            async for chunk in stream_chunks(events(), tok, body, name, requests[0].prompt_ids, plan, counts):
                yield chunk
        except Exception as e:  # after the 200 headers: an error event, which the client raises as APIError
            status = 503 if isinstance(e, SchedulerClosed) else 500
            yield sse(OpenAIError(status, f"{type(e).__name__}: {e}", type_="server_error").body())
            yield sse("[DONE]")
        finally:
            ticket.cancel_requests()  # a no-op once finished; stops the rows of a client that left

    return StreamingResponse(body_iter(), media_type="text/event-stream")


def _add_info_routes(app: FastAPI, scheduler: BatchScheduler, name: str) -> None:
    """``GET /v1/models`` (and one model), ``/health``, ``/version`` and ``/stats`` (with ``tiers``,
    the scheduler's :class:`~shipyard.inference.engine.scheduler.TierStats`, where tiers are on)."""
    engine = scheduler.engine
    created = int(time.time())
    card = {"id": name, "object": "model", "created": created, "owned_by": "shipyard"}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [card]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict[str, Any]:
        if model_id != name:
            raise OpenAIError(
                404, f"model {model_id!r} is not served here; this server serves {name!r}", "model"
            )
        return card

    @app.get("/health")
    async def health() -> dict[str, Any]:
        beat = engine.beat  # watched (`shipyard serve`, a placement): its progress, for a monitor
        watched = {"health": {**beat.record(), "pid": os.getpid()}} if beat else {}
        return {"status": "ok", "version": engine.version, **watched}

    @app.get("/version")
    async def version() -> dict[str, int]:
        return {"version": engine.version}

    @app.get("/stats")
    async def stats() -> dict[str, Any]:
        cache = engine.prefix
        return {
            **engine.stats,
            "version": engine.version,
            "precision": engine.precision,
            "prefix_cache_entries": 0 if cache is None else len(cache),
            "prefix_cache_bytes": 0 if cache is None else cache.nbytes,
            **app.state.tool_counts,
            **({"tiers": scheduler.tier_stats.as_dict()} if scheduler.scavenge is not None else {}),
            **{k: v for hook in app.state.stats_hooks for k, v in hook().items()},
        }


class UvicornThread:
    """An ASGI ``app`` served by uvicorn in a background thread, on a socket bound here (port 0 picks
    a free port, known once :meth:`start` returns; ``uds``: a unix socket at that path instead).
    Also used by the online gateway and the session endpoints."""

    def __init__(
        self,
        app: Any,
        host: str,
        port: int,
        graceful_s: int = 5,
        name: str = "shipyard-uvicorn",
        uds: str | None = None,
    ) -> None:
        if not 0 <= port <= 65535:
            raise ValueError(f"port={port} must be in [0, 65535]")
        self.app, self.host, self.port, self.graceful_s, self.name = app, host, port, graceful_s, name
        self.uds = uds
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None
        self._sock: socket.socket | None = None
        self._stopped = False

    @property
    def url(self) -> str:
        if self._sock is None:
            raise RuntimeError("the server is not started")
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def start(self, timeout_s: float = 30.0) -> None:
        """Bind, start uvicorn in a thread, and return once it accepts connections."""
        if self._thread is not None or self._stopped:
            raise RuntimeError("a server starts once (create a new one after stop())")
        if self.uds is not None:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.bind(self.uds)
            self._sock = sock
        else:
            family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
            sock = socket.socket(family, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            # accepted connections inherit it: a response's body, written after its headers, must not
            # wait for the client's delayed ACK (Nagle's algorithm: +40 ms on every request, measured)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.bind((self.host, self.port))
            self._sock, self.port = sock, sock.getsockname()[1]
        config = uvicorn.Config(
            self.app,
            log_level="warning",
            access_log=False,
            lifespan="on",
            timeout_graceful_shutdown=self.graceful_s,
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [sock]}, name=self.name, daemon=True
        )
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"uvicorn did not start on {self.host}:{self.port} within {timeout_s}s")
            time.sleep(0.01)

    def stop(self, timeout_s: float = 60.0) -> None:
        """Shut uvicorn down (running requests get ``graceful_s``) and join its thread; idempotent."""
        self._stopped = True
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout_s)
        if self._sock is not None:
            self._sock.close()
        self._server, self._thread, self._sock = None, None, None


class InferenceServer:
    """uvicorn serving :func:`create_app` in a background thread; also a context manager."""

    def __init__(
        self,
        engine: EmbeddedEngine,
        host: str = "127.0.0.1",
        port: int = 0,
        gather_window_s: float = 0.005,
        model_name: str | None = None,
        max_n: int = 8,
        drain_s: float = 5.0,
        reserved_slots: int | None = None,
        scavenge: ScavengeConfig | None = None,
    ) -> None:
        self.engine = engine
        self.drain_s = drain_s
        self.app = create_app(engine, gather_window_s, model_name, max_n, drain_s, reserved_slots, scavenge)
        self._http = UvicornThread(self.app, host, port, graceful_s=int(drain_s) + 5)

    @property
    def host(self) -> str:
        return self._http.host

    @property
    def port(self) -> int:
        return self._http.port

    @property
    def url(self) -> str:
        return self._http.url

    def start(self, timeout_s: float = 30.0) -> InferenceServer:
        """Bind, start uvicorn in a thread, and return once it accepts connections."""
        self._http.start(timeout_s)
        return self

    def stop(self, timeout_s: float = 60.0) -> None:
        """Refuse new requests (503), let running ones finish for ``drain_s``, cancel the rest (they
        answer with what they have), shut uvicorn down and join its thread and the scheduler's."""
        scheduler: BatchScheduler = self.app.state.scheduler
        closer = threading.Thread(target=scheduler.close, args=(self.drain_s,), name="shipyard-drain")
        closer.start()
        self._http.stop(timeout_s)
        closer.join(timeout_s)

    def __enter__(self) -> InferenceServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
