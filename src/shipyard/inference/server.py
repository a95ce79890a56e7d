"""HTTP serving of an :class:`EmbeddedEngine`: a batching scheduler, FastAPI routes, uvicorn thread.

Contract:
- :class:`BatchScheduler` queues requests from any number of threads and feeds them to one
  worker thread running :meth:`EmbeddedEngine.serve` (continuous batching): at every decode step
  the engine's free slots are filled from the queue in arrival order, and a caller's future is
  resolved once all its requests have finished, while the others keep decoding. N concurrent
  single-sequence calls therefore share one batch, and a request arriving mid-generation joins it
  at the next step instead of waiting for the slowest row. When the engine is idle, the first
  arrival waits ``gather_window_s`` for others (stopping early once ``max_batch`` sequences are
  waiting) so they share one prefill. While idle it calls ``engine.apply_pending()`` every
  ``idle_poll_s`` so staged weights go live without traffic. A failure inside the engine fails
  every caller with a request in flight; the worker then goes on serving the queue.
- :func:`create_app` routes: ``POST /generate`` (token-in/token-out, body
  ``{"requests": [GenerateRequest.to_json(), ...]}`` -> ``{"results": [GenerateResult.to_json(), ...]}``),
  ``POST /v1/chat/completions`` (OpenAI-compatible subset, see :class:`ChatCompletionBody`; each
  choice carries an extension ``shipyard: {token_ids, logprobs, versions}``), ``GET /v1/models``,
  ``GET /health`` -> ``{"status": "ok", "version": v}``, ``GET /version`` -> ``{"version": v}``,
  ``GET /stats`` -> the engine's counters (sequences, decode steps, joins, prefix-cache hits, ...)
  and ``precision`` (the engine's dtype and why it was chosen).
  Malformed requests get HTTP 400 with the reason; a failed batch gets 500.
- :class:`InferenceServer` runs uvicorn in a background thread on a socket it binds itself (port
  0 picks a free port, known as soon as ``start()`` returns); ``stop()`` shuts uvicorn and the
  scheduler down and joins both threads.

Limits: no streaming (``stream: true`` is refused); chat ``n > 1`` samples n independent choices
with seeds ``seed + i`` when a seed is given; ``stop()`` waits for the batch being decoded to
finish (at most ``max_tokens`` steps); the chat ``content`` is cut before the stop string (OpenAI
style) while ``shipyard.token_ids`` keep the token that completed it.

Shape legend: no tensors here (token ids travel as lists).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import Future, InvalidStateError
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

import uvicorn
from fastapi import FastAPI, HTTPException
from pydantic import BaseModel, ConfigDict, Field

from shipyard.inference.engine import EmbeddedEngine, Job
from shipyard.inference.types import GenerateRequest, GenerateResult, SamplingParams


class _Item:
    """One ``submit`` call: its requests, how many were admitted, and the results so far."""

    def __init__(self, requests: list[GenerateRequest], fut: Future[list[GenerateResult]]) -> None:
        self.requests = requests
        self.fut = fut
        self.admitted = 0
        self.results: list[GenerateResult | None] = [None] * len(requests)
        self.left = len(requests)

    def resolve(self, i: int, result: GenerateResult) -> None:
        self.results[i] = result
        self.left -= 1
        if self.left == 0:
            with contextlib.suppress(InvalidStateError):  # failed meanwhile (close, engine error)
                self.fut.set_result([r for r in self.results if r is not None])


class SchedulerClosed(RuntimeError):
    """The scheduler was closed before (or instead of) running a request."""


class BatchScheduler:
    """Feeds concurrent ``submit`` calls into one continuous-batching ``engine.serve`` loop on a worker thread."""

    def __init__(
        self, engine: EmbeddedEngine, gather_window_s: float = 0.005, idle_poll_s: float = 0.05
    ) -> None:
        if gather_window_s < 0 or idle_poll_s <= 0:
            raise ValueError(
                f"gather_window_s={gather_window_s} must be >= 0 and idle_poll_s={idle_poll_s} > 0"
            )
        self.engine = engine
        self.gather_window_s = gather_window_s
        self.idle_poll_s = idle_poll_s
        self._queue: deque[_Item] = deque()
        self._cond = threading.Condition()
        self._closed = False
        self._thread: threading.Thread | None = None
        self._inflight: list[_Item] = []
        """Items with a request admitted into the engine and a future not yet resolved (worker thread only)."""

    def start(self) -> BatchScheduler:
        """Start the worker thread (idempotent)."""
        with self._cond:
            if self._closed:
                raise SchedulerClosed("the scheduler is closed")
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="shipyard-batcher", daemon=True)
                self._thread.start()
        return self

    def submit(self, requests: list[GenerateRequest]) -> Future[list[GenerateResult]]:
        """Queue ``requests`` (validated now, so a bad one fails alone); the future gets their results."""
        self.engine.validate(requests)
        fut: Future[list[GenerateResult]] = Future()
        if not requests:
            fut.set_result([])
            return fut
        self.start()
        with self._cond:
            if self._closed:
                raise SchedulerClosed("the scheduler is closed")
            self._queue.append(_Item(requests, fut))
            self._cond.notify_all()
        return fut

    def generate(self, requests: list[GenerateRequest]) -> list[GenerateResult]:
        """Blocking ``submit``: the results of ``requests`` once they have all finished."""
        return self.submit(requests).result()

    def close(self, timeout_s: float = 600.0) -> None:
        """Stop admitting; the worker finishes the rows it runs; queued requests fail with SchedulerClosed."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout_s)
        with self._cond:
            leftover, self._queue = list(self._queue), deque()
        for item in leftover:  # never admitted, or admitted in part when the admissions stopped
            if item.admitted > 0 or item.fut.set_running_or_notify_cancel():
                item.fut.set_exception(SchedulerClosed("inference server shut down before all requests ran"))

    def _run(self) -> None:
        while True:
            with self._cond:
                if not self._queue and not self._closed:
                    self._cond.wait(self.idle_poll_s)
                if self._closed:
                    return
                busy = bool(self._queue)
            if not busy:
                self.engine.apply_pending()
                continue
            try:  # serve returns (releasing the engine) once idle with an empty queue
                self.engine.serve(self._take)
            except Exception as e:  # the failure belongs to the callers with requests in flight
                for item in self._inflight:
                    if not item.fut.done():
                        item.fut.set_exception(e)
                with self._cond:  # a partly admitted item lost its running rows: it failed as a whole
                    self._queue = deque(item for item in self._queue if item not in self._inflight)

    def _take(self, free: int, idle: bool) -> list[Job] | None:
        """The engine's admission hook: up to ``free`` queued requests; None when closed or idle and empty."""
        with self._cond:
            if self._closed or (idle and not self._queue):
                return None
            if idle:
                self._gather()
            return self._pop(free)

    def _waiting(self) -> int:
        return sum(len(item.requests) - item.admitted for item in self._queue)

    def _gather(self) -> None:
        """Wait (holding the condition) up to the gather window for more requests to arrive."""
        deadline = time.monotonic() + self.gather_window_s
        while not self._closed and self._waiting() < self.engine.max_batch:
            left = deadline - time.monotonic()
            if left <= 0:
                return
            self._cond.wait(left)

    def _pop(self, free: int) -> list[Job]:
        """Up to ``free`` queued requests in arrival order; an item may be admitted over several steps."""
        jobs: list[Job] = []
        self._inflight = [item for item in self._inflight if not item.fut.done()]
        while self._queue and len(jobs) < free:
            item = self._queue[0]
            if item.admitted == 0:
                if not item.fut.set_running_or_notify_cancel():
                    self._queue.popleft()  # cancelled by its caller before it ran
                    continue
                self._inflight.append(item)
            while item.admitted < len(item.requests) and len(jobs) < free:
                jobs.append((item.requests[item.admitted], partial(item.resolve, item.admitted)))
                item.admitted += 1
            if item.admitted == len(item.requests):
                self._queue.popleft()
        return jobs


class GenerateBody(BaseModel):
    """Body of ``POST /generate``."""

    requests: list[dict[str, Any]]


class ChatCompletionBody(BaseModel):
    """The OpenAI chat-completions fields we honour; other fields are ignored."""

    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    messages: list[dict[str, Any]] = Field(min_length=1)
    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    n: int = Field(1, ge=1)
    stream: bool = False


def _chat_prompt(tokenizer: Any, messages: list[dict[str, Any]]) -> list[int]:
    try:
        enc = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=True
        )
    except Exception as e:  # template errors come from malformed messages
        raise ValueError(f"chat template failed on these messages: {e}") from e
    return list(enc["input_ids"])


def _chat_choice(tokenizer: Any, index: int, res: GenerateResult, stop: list[str]) -> dict[str, Any]:
    content = tokenizer.decode(res.token_ids, skip_special_tokens=True)
    if res.finish_reason == "stop":
        cuts = [content.find(s) for s in stop if s in content]
        content = content[: min(cuts)] if cuts else content
    return {
        "index": index,
        "message": {"role": "assistant", "content": content},
        "finish_reason": "length" if res.finish_reason == "length" else "stop",
        "logprobs": None,
        "shipyard": {"token_ids": res.token_ids, "logprobs": res.logprobs, "versions": res.versions},
    }


def _chat_requests(
    engine: EmbeddedEngine, body: ChatCompletionBody
) -> tuple[list[GenerateRequest], list[str]]:
    if body.stream:
        raise ValueError("stream=true is not supported by this server")
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    max_tokens = body.max_completion_tokens or body.max_tokens or SamplingParams().max_tokens
    prompt = _chat_prompt(engine.tokenizer, body.messages)
    reqs = [
        GenerateRequest(
            prompt_ids=prompt,
            params=SamplingParams(
                temperature=body.temperature,
                top_p=body.top_p,
                max_tokens=max_tokens,
                stop=stop,
                seed=None if body.seed is None else body.seed + i,
            ),
        )
        for i in range(body.n)
    ]
    return reqs, stop


def _submitter(
    scheduler: BatchScheduler,
) -> Callable[[list[GenerateRequest]], Awaitable[list[GenerateResult]]]:
    """An async call that queues requests on ``scheduler`` and maps its failures to HTTP errors
    (400 invalid, 503 closed, 500 engine failure)."""

    async def run(requests: list[GenerateRequest]) -> list[GenerateResult]:
        try:
            fut = scheduler.submit(requests)
        except ValueError as e:
            raise HTTPException(status_code=400, detail=str(e)) from e
        except SchedulerClosed as e:
            raise HTTPException(status_code=503, detail=str(e)) from e
        try:
            return await asyncio.wrap_future(fut)
        except SchedulerClosed as e:
            raise HTTPException(status_code=503, detail=str(e)) from e
        except Exception as e:  # report engine failures to the caller
            raise HTTPException(status_code=500, detail=f"{type(e).__name__}: {e}") from e

    return run


def create_app(
    engine: EmbeddedEngine, gather_window_s: float = 0.005, model_name: str | None = None
) -> FastAPI:
    """The FastAPI app; its scheduler starts on first use and closes with the app's lifespan."""
    scheduler = BatchScheduler(engine, gather_window_s=gather_window_s)
    name = model_name or str(getattr(engine.model.config, "name_or_path", "") or "shipyard")

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        scheduler.start()
        yield
        await asyncio.to_thread(scheduler.close)

    app = FastAPI(title="shipyard inference", lifespan=lifespan)
    app.state.scheduler = scheduler
    app.state.engine = engine

    run = _submitter(scheduler)

    @app.post("/generate")
    async def generate(body: GenerateBody) -> dict[str, Any]:
        try:
            requests = [GenerateRequest.from_json(d) for d in body.requests]
        except (KeyError, TypeError) as e:
            raise HTTPException(status_code=400, detail=f"malformed GenerateRequest: {e}") from e
        return {"results": [r.to_json() for r in await run(requests)]}

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionBody) -> dict[str, Any]:
        try:
            requests, stop = _chat_requests(engine, body)
        except ValueError as e:
            raise HTTPException(status_code=400, detail=str(e)) from e
        results = await run(requests)
        completion = sum(len(r.token_ids) for r in results)
        prompt = len(requests[0].prompt_ids)
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": body.model or name,
            "choices": [_chat_choice(engine.tokenizer, i, r, stop) for i, r in enumerate(results)],
            "usage": {
                "prompt_tokens": prompt,
                "completion_tokens": completion,
                "total_tokens": prompt + completion,
            },
        }

    _add_info_routes(app, engine, name)
    return app


def _add_info_routes(app: FastAPI, engine: EmbeddedEngine, name: str) -> None:
    """``GET /v1/models``, ``/health``, ``/version`` and ``/stats``: what a client or an operator reads."""

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": name, "object": "model", "owned_by": "shipyard"}]}

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "version": engine.version}

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
        }


class InferenceServer:
    """uvicorn serving :func:`create_app` in a background thread; also a context manager."""

    def __init__(
        self, engine: EmbeddedEngine, host: str = "127.0.0.1", port: int = 0, gather_window_s: float = 0.005
    ) -> None:
        if not 0 <= port <= 65535:
            raise ValueError(f"port={port} must be in [0, 65535]")
        self.engine = engine
        self.host = host
        self.port = port
        self.app = create_app(engine, gather_window_s=gather_window_s)
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

    def start(self, timeout_s: float = 30.0) -> InferenceServer:
        """Bind, start uvicorn in a thread, and return once it accepts connections."""
        if self._thread is not None or self._stopped:
            raise RuntimeError("an InferenceServer starts once (create a new one after stop())")
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self.port))
        self._sock, self.port = sock, sock.getsockname()[1]
        config = uvicorn.Config(
            self.app, log_level="warning", access_log=False, lifespan="on", timeout_graceful_shutdown=5
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [sock]}, name="shipyard-uvicorn", daemon=True
        )
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"uvicorn did not start on {self.host}:{self.port} within {timeout_s}s")
            time.sleep(0.01)
        return self

    def stop(self, timeout_s: float = 60.0) -> None:
        """Shut uvicorn down (after the running batch) and join its thread and the scheduler's."""
        self._stopped = True
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout_s)
        self.app.state.scheduler.close(timeout_s)
        if self._sock is not None:
            self._sock.close()
        self._server, self._thread, self._sock = None, None, None

    def __enter__(self) -> InferenceServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
