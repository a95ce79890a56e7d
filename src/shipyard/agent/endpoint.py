"""One agent session's OpenAI-compatible endpoint: token-exact records of a foreign harness's calls.

Contract: a :class:`SessionEndpoint` serves ``POST /v1/chat/completions`` (tools included, as
:mod:`shipyard.inference.serving.openai_api` renders and parses them), ``POST /v1/completions`` and
``GET /v1/models`` for one session, on a unix socket (the harness's sandbox reaches it through
:mod:`shipyard.agent.harness.relay`) or a loopback port, in front of any
:class:`~shipyard.inference.types.InferenceClient` (both backends). Requests need
``Authorization: Bearer <key>``. It:

- records every call (:class:`Call`): prompt ids, sampled ids, the sampler's logprobs, the weight
  version of every token, the finish reason, whether the prompt was ``exact``;
- never re-tokenizes model output: each reply is remembered as a *state*, the ids of its prompt
  and reply keyed by the conversation it ends (messages in canonical form,
  :func:`~shipyard.inference.serving.tools.canonical_assistant` for assistant turns, and the tools). A
  chat call whose history ends with such a reply (re-serialized however the client likes) is
  prompted with that state's ids, the template's turn close, and the new messages' text
  tokenized once; a text completion whose prompt extends a state's decoded text likewise. A
  call with earlier assistant turns and no matching state (an edited history, a template that
  rewrites old turns) is rendered from text and counted (``retokenized_calls``): its prompt
  starts a new segment, where the re-tokenized replies are context (loss mask 0), never trained;
- turns its calls into :class:`~shipyard.agent.types.Trajectory` segments (:meth:`segments`): a
  call whose prompt extends the current segment's ids joins it (the new prompt tokens are
  environment tokens, mask 0; the reply is sampled, mask 1), any other call starts a segment;
- holds the session's limits (:class:`~shipyard.config.schema.HarnessConfig`: calls, sampled
  tokens, context, wall time): a call over one gets HTTP 400 with ``code`` ``session_limit``;
  :meth:`close` answers new calls with 400 and cancels calls in flight: the endpoint's own
  connection to the inference server drops, and the server stops their rows.

Sampling: every call samples with ``sampling.temperature``/``top_p`` (unless
``harness.honor_sampling``), the seed :func:`~shipyard.agent.session.session_seed` gives the
session and the call's number (the built-in harness seeds its turns the same way), ``n = 1``, and
the harness's ``max_tokens`` and ``stop`` within the limits.

Example::

    ep = SessionEndpoint(client, tokenizer, cfg.harness, cfg.sampling, max_context=1536,
                         session=(group_id, sample_idx), uds="/tmp/s/endpoint.sock")
    ep.start()   # the harness calls it ...
    ep.close()
    segments = ep.segments(task.id)

Limits: ``n > 1`` and ``logprobs`` are refused (a session is one line of play); streaming is
answered as one chunk per reply (the whole reply at once).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import secrets
import threading
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict

from shipyard.agent.session import session_seed
from shipyard.agent.types import Trajectory
from shipyard.config.schema import HarnessConfig, SamplingConfig
from shipyard.inference.serving.openai_api import (
    ChatCompletionBody,
    ChatPlan,
    ChatRender,
    OpenAIError,
    chat_render,
    finish_reason,
    reply,
    sse,
    visible_text,
)
from shipyard.inference.serving.server import UvicornThread, errors_in_openai_shape
from shipyard.inference.serving.tools import canonical_assistant
from shipyard.inference.types import GenerateRequest, GenerateResult, InferenceClient, SamplingParams


@dataclass
class Call:
    """One model call of the session, as sampled."""

    kind: str
    """``chat`` or ``completion``."""
    prompt_ids: list[int]
    result: GenerateResult
    exact: bool
    """The prompt reuses every earlier reply it contains as sampled (or contains none)."""
    text: str
    """The reply's text as the harness saw it (content, or the raw text where calls were parsed)."""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    parsed: bool | None = None
    """Tool calls parsed (True), tried and failed (False), not looked for or not tried (None)."""
    gen_s: float = 0.0
    overhead_ms: float = 0.0
    """Time the endpoint spent on the call outside the inference server (rendering, matching)."""


@dataclass
class _State:
    ids: list[int]
    closed: bool
    """The reply ended with the EOS token (the template's turn close starts with it)."""


class CompletionBody(BaseModel):
    """``POST /v1/completions`` (what harnesses on the text API send)."""

    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    prompt: str | list[int]
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    n: int | None = None
    stream: bool | None = None


def _limit(message: str) -> OpenAIError:
    return OpenAIError(400, message, None, "session_limit_exceeded", code="session_limit")


def _message_key(m: dict[str, Any]) -> str:
    if m["role"] == "assistant":
        return "A" + canonical_assistant(m.get("content"), m.get("tool_calls"))
    return json.dumps([m["role"], m.get("content"), m.get("name")], ensure_ascii=False)


class SessionEndpoint:
    """One session's OpenAI-compatible endpoint (module doc)."""

    def __init__(
        self,
        client: InferenceClient,
        tokenizer: Any,
        harness: HarnessConfig,
        sampling: SamplingConfig,
        *,
        max_context: int,
        model_name: str = "policy",
        session: tuple[str, int] = ("", 0),
        seed: int = 0,
        uds: str | None = None,
        host: str = "127.0.0.1",
    ) -> None:
        """``session``: the group id and sample index of the session (its segments' ids, its seeds);
        ``seed``: the run's seed."""
        self.client, self.tok, self.cfg, self.sampling = client, tokenizer, harness, sampling
        self.max_context, self.model_name = max_context, model_name
        self.session, self.seed = session, seed
        self.key = "sk-session-" + secrets.token_hex(16)
        self.calls: list[Call] = []
        self.retokenized_calls = 0
        self.refused: dict[str, int] = {}
        """Calls answered 4xx, by reason (``session_limit``, ``invalid``, ``auth``)."""
        self._states: dict[str, _State] = {}
        self._closes: dict[str, str | None] = {}
        """:meth:`_close_text` by chat template."""
        self._texts: dict[str, list[int]] = {}
        self._lock = threading.Lock()
        self._closed = False
        self._started = time.monotonic()
        self._inflight: set[asyncio.Task[Any]] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ahttp: httpx.AsyncClient | None = None
        """The endpoint's connection to the inference server (made on the serving loop)."""
        self._http = UvicornThread(self._app(), host, 0, graceful_s=1, name="shipyard-session", uds=uds)

    # ----------------------------------------------------------------- lifecycle
    @property
    def url(self) -> str:
        """The base URL for a client on this host (loopback endpoints; ``uds`` ones need a transport)."""
        return f"{self._http.url}/v1"

    def start(self) -> SessionEndpoint:
        self._started = time.monotonic()
        self._http.start()
        return self

    def close(self) -> None:
        """Refuse new calls, cancel those in flight (their server stops their rows), stop serving;
        idempotent."""
        self._closed = True
        if self._loop is not None and not self._loop.is_closed():
            with contextlib.suppress(RuntimeError):  # the loop stopped meanwhile
                self._loop.call_soon_threadsafe(lambda: [t.cancel() for t in list(self._inflight)])
        self._http.stop(timeout_s=10)

    def __enter__(self) -> SessionEndpoint:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ----------------------------------------------------------------- HTTP
    def _app(self) -> FastAPI:
        @asynccontextmanager
        async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
            self._loop = asyncio.get_running_loop()
            yield
            if self._ahttp is not None:
                await self._ahttp.aclose()

        app = FastAPI(title="shipyard session endpoint", lifespan=lifespan)
        errors_in_openai_shape(app)

        @app.middleware("http")
        async def auth(request: Request, call_next: Any) -> Any:
            if request.headers.get("authorization") != f"Bearer {self.key}":
                self._count("auth")
                err = OpenAIError(401, "this session's endpoint needs its key", None, "authentication_error")
                return JSONResponse(err.body(), status_code=401)
            return await call_next(request)

        @app.get("/v1/models")
        async def models() -> dict[str, Any]:
            card = {"id": self.model_name, "object": "model", "created": 0, "owned_by": "shipyard"}
            return {"object": "list", "data": [card]}

        @app.post("/v1/chat/completions", response_model=None)
        async def chat(body: ChatCompletionBody) -> dict[str, Any] | StreamingResponse:
            out = await self._guard(self._chat(body))
            return _as_stream(out) if body.stream else out

        @app.post("/v1/completions", response_model=None)
        async def completions(body: CompletionBody) -> dict[str, Any] | StreamingResponse:
            out = await self._guard(self._completion(body))
            return _as_stream(out) if body.stream else out

        return app

    def _count(self, reason: str) -> None:
        with self._lock:
            self.refused[reason] = self.refused.get(reason, 0) + 1

    async def _guard(self, work: Any) -> dict[str, Any]:
        """Run one call's coroutine as a task :meth:`close` can cancel; count its refusals."""
        task = asyncio.ensure_future(work)
        self._inflight.add(task)
        try:
            return await task
        except asyncio.CancelledError as e:
            if not task.cancelled():  # the request itself was cancelled (the server stops)
                raise
            self._count("session_limit")
            raise _limit("the session ended during this call") from e
        except OpenAIError as e:
            self._count("session_limit" if e.type == "session_limit_exceeded" else "invalid")
            raise
        finally:
            self._inflight.discard(task)

    def _check_limits(self) -> int:
        """The sampled tokens left; OpenAIError when a limit is reached."""
        if self._closed:
            raise _limit("the session has ended")
        if time.monotonic() - self._started > self.cfg.timeout_s:
            raise _limit(f"the session's wall time (harness.timeout_s={self.cfg.timeout_s}) is over")
        if len(self.calls) >= self.cfg.max_calls:
            raise _limit(f"the session made its {self.cfg.max_calls} calls (harness.max_calls)")
        left = self.cfg.max_sampled_tokens - sum(len(c.result.token_ids) for c in self.calls)
        if left <= 0:
            raise _limit(
                f"the session sampled its {self.cfg.max_sampled_tokens} tokens (harness.max_sampled_tokens)"
            )
        return left

    def _params(
        self, asked: int | None, prompt_len: int, left: int, temp: Any, top_p: Any, stop: Any
    ) -> SamplingParams:
        room = self.max_context - prompt_len
        if room < 1:
            raise _limit(f"the prompt has {prompt_len} tokens; the session's context is {self.max_context}")
        honor = self.cfg.honor_sampling
        return SamplingParams(
            temperature=temp if honor and temp is not None else self.sampling.temperature,
            top_p=top_p if honor and top_p is not None else self.sampling.top_p,
            max_tokens=max(1, min(asked or self.sampling.max_tokens, room, left)),
            stop=[stop] if isinstance(stop, str) else list(stop or []),
            seed=session_seed(*self.session, len(self.calls), self.seed),
        )

    async def _sample(self, prompt: list[int], params: SamplingParams) -> tuple[GenerateResult, float]:
        t0 = time.perf_counter()
        url = getattr(self.client, "url", None)  # None: an in-process engine (evaluations)
        if self._ahttp is None and url is not None:
            timeout = httpx.Timeout(self.cfg.timeout_s, connect=10.0)
            self._ahttp = httpx.AsyncClient(base_url=url, timeout=timeout)
        try:
            [res] = await self.client.agenerate([GenerateRequest(prompt, params)], self._ahttp)
        except Exception as e:
            raise OpenAIError(
                502, f"the inference server failed: {type(e).__name__}: {e}", type_="server_error"
            ) from e
        return res, time.perf_counter() - t0

    # ----------------------------------------------------------------- chat
    async def _chat(self, body: ChatCompletionBody) -> dict[str, Any]:
        t0 = time.perf_counter()
        left = self._check_limits()
        if (body.n or 1) > 1 or body.logprobs:
            raise OpenAIError(400, "a session endpoint samples one choice without logprobs (n=1)", "n")
        render = chat_render(body, self.tok)
        prompt, exact = self._chat_prompt(render)
        params = self._params(
            body.max_completion_tokens or body.max_tokens,
            len(prompt),
            left,
            body.temperature,
            body.top_p,
            body.stop,
        )
        plan = dataclasses.replace(render.plan or ChatPlan([]), stop=params.stop)
        t1 = time.perf_counter()
        res, gen_s = await self._sample(prompt, params)
        t2 = time.perf_counter()
        message, finish, parsed = reply(self.tok, res, plan)
        assistant = {
            "role": "assistant",
            "content": message["content"],
            "tool_calls": message.get("tool_calls"),
        }
        key = self._key([*render.messages, assistant], render.kwargs.get("tools"))
        call = Call(
            "chat", prompt, res, exact, plan.forced + self.tok.decode(res.token_ids, skip_special_tokens=True)
        )
        call.tool_calls, call.parsed, call.gen_s = message.get("tool_calls", []), parsed, gen_s
        with self._lock:
            self._states[key] = _State(prompt + res.token_ids, res.finish_reason == "eos")
            call.overhead_ms = 1000 * ((t1 - t0) + (time.perf_counter() - t2))
            self.calls.append(call)
        return _chat_reply(self.model_name, message, finish, prompt, res)

    def _key(self, messages: list[dict[str, Any]], tools: Any) -> str:
        return json.dumps([[_message_key(m) for m in messages], tools], sort_keys=True, ensure_ascii=False)

    def _chat_prompt(self, render: ChatRender) -> tuple[list[int], bool]:
        """The prompt ids of a chat call and whether they are exact (module doc)."""
        msgs, tools = render.messages, render.kwargs.get("tools")
        last = max((i for i, m in enumerate(msgs) if m["role"] == "assistant"), default=-1)
        forced = render.forced_ids(self.tok)
        full = render.text(self.tok)
        if last >= 0:
            state = self._states.get(self._key(msgs[: last + 1], tools))
            prefix = render.text(self.tok, msgs[: last + 1], gen=False) if state else ""
            close = self._close_text(render)
            if state and close and full.startswith(prefix) and prefix.endswith(close):
                tail = close[len(self.tok.eos_token) :] if state.closed else close
                ids = self.tok(tail + full[len(prefix) :], add_special_tokens=False).input_ids
                return state.ids + ids + forced, True
            with self._lock:
                self.retokenized_calls += 1
        ids = self.tok(full, add_special_tokens=False).input_ids
        return ids + forced, last < 0

    def _close_text(self, render: ChatRender) -> str | None:
        """The template's text after an assistant turn's content, starting with EOS; None when the
        template does not close turns with EOS (then no reply can be spliced in as sampled)."""
        template = render.kwargs.get("chat_template") or ""
        if template not in self._closes:
            probe = [{"role": "user", "content": "\x01"}, {"role": "assistant", "content": "\x02"}]
            text = render.text(self.tok, probe, gen=False)
            after = text[text.index("\x02") + 1 :]
            self._closes[template] = after if after.startswith(self.tok.eos_token) else None
        return self._closes[template]

    # ----------------------------------------------------------------- completions
    async def _completion(self, body: CompletionBody) -> dict[str, Any]:
        t0 = time.perf_counter()
        left = self._check_limits()
        if (body.n or 1) > 1:
            raise OpenAIError(400, "a session endpoint samples one choice (n=1)", "n")
        if isinstance(body.prompt, list):
            prompt, exact = list(body.prompt), True
        else:
            prompt, exact = self._text_prompt(body.prompt)
        params = self._params(
            body.max_tokens or 16, len(prompt), left, body.temperature, body.top_p, body.stop
        )
        t1 = time.perf_counter()
        res, gen_s = await self._sample(prompt, params)
        t2 = time.perf_counter()
        text = visible_text(self.tok, res.token_ids, res.finish_reason, params.stop)
        call = Call("completion", prompt, res, exact, text, gen_s=gen_s)
        with self._lock:
            decoded = self.tok.decode(prompt + res.token_ids, skip_special_tokens=False)
            self._texts[decoded] = prompt + res.token_ids
            call.overhead_ms = 1000 * ((t1 - t0) + (time.perf_counter() - t2))
            self.calls.append(call)
        return {
            "id": f"cmpl-{uuid.uuid4().hex}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": self.model_name,
            "choices": [{"index": 0, "text": text, "finish_reason": finish_reason(res), "logprobs": None}],
            "usage": _usage(len(prompt), len(res.token_ids)),
        }

    def _text_prompt(self, text: str) -> tuple[list[int], bool]:
        """A text prompt's ids: the longest earlier state whose text it extends, then the rest."""
        best = max((t for t in self._texts if text.startswith(t)), key=len, default=None)
        if best is not None:
            return self._texts[best] + self.tok(text[len(best) :], add_special_tokens=False).input_ids, True
        if self._texts:
            with self._lock:
                self.retokenized_calls += 1
        return self.tok(text, add_special_tokens=False).input_ids, not self._texts

    # ----------------------------------------------------------------- trajectories
    def segments(self, task_id: str) -> list[Trajectory]:
        """The session's calls as token-exact segments (module doc); [] when it made no call."""
        segs: list[Trajectory] = []
        for call in self.calls:
            cur = segs[-1] if segs else None
            if cur is None or call.prompt_ids[: len(cur.token_ids)] != cur.token_ids or not call.exact:
                cur = _new_segment(task_id, *self.session, call, len(segs))
                segs.append(cur)
            else:
                _extend(cur, call.prompt_ids[len(cur.token_ids) :], self.tok)
            _append_reply(cur, call)
        for seg in segs:
            seg.num_segments = len(segs)
        return segs

    def metrics(self) -> dict[str, Any]:
        """The session's endpoint counters (every segment carries them) and each call's overhead
        (ms spent in the endpoint itself, rendering, matching and answering, not generating)."""
        parsed = [c.parsed for c in self.calls if c.parsed is not None]
        return {
            "calls": len(self.calls),
            "retokenized_calls": self.retokenized_calls,
            "tool_calls": sum(len(c.tool_calls) for c in self.calls),
            "tool_call_parse_frac": sum(parsed) / len(parsed) if parsed else 1.0,
            "tool_call_attempts": len(parsed),
            "refused_calls": sum(self.refused.values()),
            "overhead_ms": [round(c.overhead_ms, 3) for c in self.calls],
        }


def _usage(prompt: int, completion: int) -> dict[str, int]:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _chat_reply(
    model: str, message: dict[str, Any], finish: str, prompt: list[int], res: GenerateResult
) -> dict[str, Any]:
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "message": message, "finish_reason": finish, "logprobs": None}],
        "usage": _usage(len(prompt), len(res.token_ids)),
    }


def _as_stream(out: dict[str, Any]) -> StreamingResponse:
    """A whole reply as server-sent events: one delta with everything, then the finish chunk."""

    async def events() -> AsyncIterator[str]:
        head = {"id": out["id"], "created": out["created"], "model": out["model"]}
        for choice in out["choices"]:
            if out["object"] == "chat.completion":
                msg = choice["message"]
                delta: dict[str, Any] = {"role": "assistant", "content": msg["content"]}
                if msg.get("tool_calls"):
                    delta["tool_calls"] = [{"index": k, **c} for k, c in enumerate(msg["tool_calls"])]
                obj = "chat.completion.chunk"
                first = {"index": 0, "delta": delta, "finish_reason": None}
                last = {"index": 0, "delta": {}, "finish_reason": choice["finish_reason"]}
            else:
                obj = "text_completion"
                first = {"index": 0, "text": choice["text"], "finish_reason": None}
                last = {"index": 0, "text": "", "finish_reason": choice["finish_reason"]}
            yield sse({**head, "object": obj, "choices": [first]})
            yield sse({**head, "object": obj, "choices": [last]})
        yield sse("[DONE]")

    return StreamingResponse(events(), media_type="text/event-stream")


def _new_segment(task_id: str, group_id: str, idx: int, call: Call, k: int) -> Trajectory:
    n = len(call.prompt_ids)
    traj = Trajectory(
        task_id,
        group_id,
        idx,
        list(call.prompt_ids),
        [0] * n,
        [0.0] * n,
        [-1] * n,
        prompt_len=n,
        session_id=f"{group_id}/{idx}",
        segment_idx=k,
        num_segments=k + 1,
    )
    traj.turns.append({"role": "prompt", "start": 0, "end": n, "text": "", "exact": call.exact})
    return traj


def _extend(seg: Trajectory, ids: list[int], tok: Any) -> None:
    start = len(seg.token_ids)
    seg.token_ids += ids
    seg.loss_mask += [0] * len(ids)
    seg.logprobs += [0.0] * len(ids)
    seg.versions += [-1] * len(ids)
    seg.turns.append({"role": "tool", "start": start, "end": len(seg.token_ids), "text": tok.decode(ids)})


def _append_reply(seg: Trajectory, call: Call) -> None:
    res, start = call.result, len(seg.token_ids)
    seg.token_ids += res.token_ids
    seg.loss_mask += [1] * len(res.token_ids)
    seg.logprobs += res.logprobs
    seg.versions += res.versions
    seg.num_turns += 1
    turn: dict[str, Any] = {"role": "assistant", "start": start, "end": len(seg.token_ids), "text": call.text}
    turn.update(action="tool_calls" if call.tool_calls else "none", gen_s=round(call.gen_s, 4))
    if call.tool_calls:
        turn["tool_calls"] = [c["function"] for c in call.tool_calls]
    seg.turns.append(turn)
