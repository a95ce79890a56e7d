"""The OpenAI-compatible chat-completions surface of the embedded engine's server.

Contract: :class:`ChatCompletionBody` accepts what the ``openai`` client sends for
``chat.completions.create``. Every parameter is either honoured or refused with HTTP 400 naming
it, never silently ignored:

- honoured: ``messages`` (``content`` as a string or a list of ``{"type": "text"}`` parts),
  ``model`` (must be the served model's id), ``temperature``, ``top_p``, ``max_tokens`` /
  ``max_completion_tokens`` (>= 1, and the prompt plus it must fit the context; unset = the rest of
  the context), ``n`` (<= ``max_n``), ``stop``, ``seed`` (choice ``i > 0`` draws from a seed hashed
  from ``(seed, i)``, so two requests never share a choice's stream; a seeded request is prefilled
  whole, never from the prefix cache, so the same seed repeats its output on an otherwise idle
  server; next to other requests its draws are the same but its logits may differ in the last bits
  with the batch's shape), ``logprobs`` and
  ``top_logprobs`` (<= 20), ``presence_penalty``, ``frequency_penalty``, ``logit_bias``,
  ``stream`` with ``stream_options.include_usage``, ``user`` (an end-user id: recorded by a
  gateway, it does not change sampling) and vLLM's extension ``ignore_eos`` (sample on past
  end-of-sequence tokens, to the length asked: for throughput at fixed lengths); ``null`` means
  "not given" for every optional field;
- tools: ``tools`` (function tools), ``tool_choice`` (``auto``, ``none``, ``required``, a named
  function) and ``parallel_tool_calls`` (false keeps the first call), messages with ``tool_calls``
  and ``tool`` messages: rendered and parsed as :mod:`shipyard.inference.serving.tools` says; a reply with
  calls comes back as ``message.tool_calls`` with ``finish_reason`` ``tool_calls`` (streamed: the
  content before the first call as it arrives, each call whole in one delta at the end); a reply
  that does not parse comes back as content and is counted (``/stats`` ``tool_parse_failures``);
- refused: ``functions``, ``response_format`` other than text, ``audio``, ... (the engine cannot
  constrain output), a role outside system/developer/user/assistant/tool, and any unknown field.

Errors use OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``, with the matching
status (400 invalid request, 404 unknown model or route, 503 shutting down, 500 engine failure).
:func:`chat_response` and :func:`stream_chunks` build the reply; a choice carries the extension
``shipyard: {token_ids, logprobs, versions}`` (the token-exact record RL needs), and the response
carries ``shipyard: {prompt_token_ids}``; streamed, both ride on each choice's finish chunk (a
gateway logs them: :mod:`shipyard.online.gateway`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from shipyard.inference.serving import tools as tool_calls
from shipyard.inference.types import GenerateRequest, GenerateResult, SamplingParams

UNSUPPORTED = (
    "functions",
    "function_call",
    "response_format",
    "audio",
    "modalities",
    "prediction",
    "reasoning_effort",
    "web_search_options",
    "store",
    "metadata",
    "service_tier",
)


CODES = {
    400: "invalid_request",
    401: "unauthorized",
    404: "not_found",
    500: "internal_error",
    502: "bad_gateway",
    503: "unavailable",
}
"""An error's ``code`` by HTTP status, unless the error names its own."""


class OpenAIError(Exception):
    """An error answered in OpenAI's shape."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        type_: str = "invalid_request_error",
        code: str | None = None,
    ) -> None:
        """``code``: the error's code (None: the status's, :data:`CODES`)."""
        super().__init__(message)
        self.status, self.message, self.param, self.type = status, message, param, type_
        self.code = code if code is not None else CODES.get(status)

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool | None = None


class ChatCompletionBody(BaseModel):
    """The request body (module doc); any other field lands in ``model_extra`` and is refused by
    name (:func:`_check_extra`)."""

    model_config = ConfigDict(extra="allow")
    model: str | None = None
    messages: list[dict[str, Any]] = Field(min_length=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    stop: str | list[str] | None = None
    seed: int | None = None
    n: int | None = Field(None, ge=1)
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    ignore_eos: bool | None = None


NO_OPS: dict[str, Any] = {"response_format": {"type": "text"}}
"""Values of unsupported fields that ask for nothing this server lacks (accepted)."""


def _check_extra(body: ChatCompletionBody) -> None:
    """Refuse every field this server does not honour: a known OpenAI one it cannot do (unless
    ``null`` or its no-op value) and any unknown one."""
    for name, value in (body.model_extra or {}).items():
        if name not in UNSUPPORTED:
            raise OpenAIError(400, f"unknown parameter {name!r}", name)
        if value is not None and (name not in NO_OPS or value != NO_OPS[name]):
            raise OpenAIError(
                400,
                f"{name} is not supported by this server (the embedded engine samples free text; "
                "it cannot constrain output)",
                name,
            )


@dataclass
class ChatPlan:
    """How one chat request is answered besides its engine requests: stop strings and tools."""

    stop: list[str]
    tool_format: tool_calls.ToolFormat | None = None
    """Set when the reply is parsed for tool calls (tools given, ``tool_choice`` not ``none``)."""
    forced: str = ""
    """Text prefilled as the reply's start (``tool_choice`` required or named; its ids end the prompt)."""
    parallel: bool = True
    """``parallel_tool_calls``: False keeps the first call of a reply."""


@dataclass
class ChatRender:
    """How a chat request's messages become a prompt: template messages, the template's keyword
    arguments (``chat_template``, ``tools``) and the tool part of the plan (None without tools)."""

    messages: list[dict[str, Any]]
    kwargs: dict[str, Any]
    plan: ChatPlan | None

    def text(self, tokenizer: Any, messages: list[dict[str, Any]] | None = None, gen: bool = True) -> str:
        """The rendered text of ``messages`` (default: all), with the generation prompt if ``gen``."""
        chat = self.messages if messages is None else messages
        return tokenizer.apply_chat_template(chat, add_generation_prompt=gen, tokenize=False, **self.kwargs)

    def forced_ids(self, tokenizer: Any) -> list[int]:
        """Ids of the prefilled reply opening (``tool_choice`` required or named; [] otherwise)."""
        forced = self.plan.forced if self.plan is not None else ""
        return tokenizer(forced, add_special_tokens=False).input_ids if forced else []


def chat_render(body: ChatCompletionBody, tokenizer: Any) -> ChatRender:
    """Validate ``body``'s messages and tools and say how to render them; OpenAIError naming the field."""
    try:
        messages = tool_calls.chat_messages(body.messages)
        tools = tool_calls.check_tools(body.tools or [], body.tool_choice)
    except ValueError as e:
        raise OpenAIError(400, str(e), str(e).split(":")[0]) from e
    if not (tools or any(m["role"] == "tool" or m.get("tool_calls") for m in messages)):
        return ChatRender(messages, {}, None)
    try:
        template = tool_calls.tool_template(tokenizer)
        forced = tool_calls.forced_prefix(body.tool_choice, template.format) if tools else ""
    except ValueError as e:
        raise OpenAIError(400, str(e), "tools") from e
    parse = bool(tools) and body.tool_choice != "none"
    plan = ChatPlan([], template.format if parse else None, forced, body.parallel_tool_calls is not False)
    return ChatRender(messages, {"chat_template": template.template, "tools": tools or None}, plan)


def _prompt(body: ChatCompletionBody, tokenizer: Any) -> tuple[list[int], ChatPlan | None]:
    """The prompt ids of ``body``'s messages (with the tool template where tools are involved) and
    the tool part of its plan (None without tools)."""
    render = chat_render(body, tokenizer)
    try:
        ids = tokenizer.apply_chat_template(
            render.messages, add_generation_prompt=True, tokenize=True, return_dict=True, **render.kwargs
        )["input_ids"]
    except Exception as e:  # template errors come from malformed messages
        raise OpenAIError(400, f"chat template failed on these messages: {e}", "messages") from e
    return list(ids) + render.forced_ids(tokenizer), render.plan


def choice_seed(seed: int | None, i: int) -> int | None:
    """Choice ``i``'s seed: ``seed`` itself for the first, a hash of ``(seed, i)`` for the others."""
    if seed is None or i == 0:
        return seed
    return int.from_bytes(hashlib.blake2b(f"{seed}/{i}".encode(), digest_size=8).digest(), "little") >> 1


def chat_requests(
    body: ChatCompletionBody, tokenizer: Any, served: str, context: int, max_n: int
) -> tuple[list[GenerateRequest], ChatPlan]:
    """The engine requests of ``body`` (one per choice) and its plan; OpenAIError if invalid."""
    _check_extra(body)
    if body.model is not None and body.model != served:
        raise OpenAIError(
            404, f"model {body.model!r} is not served here; this server serves {served!r}", "model"
        )
    n = body.n or 1
    if n > max_n:
        raise OpenAIError(400, f"n={n} exceeds this server's limit of {max_n} choices per request", "n")
    if body.top_logprobs and not body.logprobs:
        raise OpenAIError(400, "top_logprobs needs logprobs=true", "top_logprobs")
    if body.logprobs and body.stream:
        raise OpenAIError(400, "logprobs are not streamed by this server; ask without stream", "logprobs")
    prompt, plan = _prompt(body, tokenizer)
    room = context - len(prompt)
    asked = body.max_completion_tokens or body.max_tokens
    if room < 1 or (asked is not None and asked > room):
        param = "max_completion_tokens" if body.max_completion_tokens else "max_tokens"
        raise OpenAIError(
            400,
            f"{param}={asked} does not fit: the prompt has {len(prompt)} tokens of a {context}-token context "
            f"({max(room, 0)} left)",
            param if asked is not None else "messages",
        )
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    bias = {int(k): v for k, v in (body.logit_bias or {}).items() if _is_int(k, "logit_bias")}
    base = SamplingParams(
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        max_tokens=asked or room,
        stop=stop,
        top_logprobs=body.top_logprobs or 0,
        presence_penalty=body.presence_penalty or 0.0,
        frequency_penalty=body.frequency_penalty or 0.0,
        logit_bias=bias,
        ignore_eos=bool(body.ignore_eos),
    )
    params = [SamplingParams(**{**base.__dict__, "seed": choice_seed(body.seed, i)}) for i in range(n)]
    plan = dataclasses.replace(plan, stop=stop) if plan is not None else ChatPlan(stop)
    # a seeded request is prefilled whole, so the same seed repeats its tokens on an idle server
    reuse = body.seed is None
    return [GenerateRequest(prompt_ids=prompt, params=p, reuse_prefix=reuse) for p in params], plan


def _is_int(key: str, param: str) -> bool:
    try:
        int(key)
    except ValueError:
        raise OpenAIError(400, f"{param} keys must be token ids, got {key!r}", param) from None
    return True


def _decode(tokenizer: Any, token_ids: list[int]) -> str:
    """Text of ``token_ids`` without special tokens and without clean-up (so a longer sequence's text
    extends a shorter one's: what streaming relies on)."""
    return tokenizer.decode(token_ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


def visible_text(tokenizer: Any, token_ids: list[int], finish: str, stop: list[str]) -> str:
    """The content a client sees: special tokens dropped, cut before the stop string that ended it."""
    content = _decode(tokenizer, token_ids)
    if finish == "stop":
        cuts = [content.find(s) for s in stop if s in content]
        content = content[: min(cuts)] if cuts else content
    return content


def finish_reason(res: GenerateResult) -> str:
    """OpenAI's finish reason: ``length``, ``stop`` (EOS or a stop string), or ``abort`` (cancelled:
    the client left or the server shut down before the end)."""
    return {"length": "length", "abort": "abort"}.get(res.finish_reason, "stop")


def reply(tokenizer: Any, res: GenerateResult, plan: ChatPlan) -> tuple[dict[str, Any], str, bool | None]:
    """One choice's assistant message, its finish reason, and whether its tool calls parsed (None:
    not parsed for tools, or nothing in it looked like a call)."""
    text = visible_text(tokenizer, res.token_ids, res.finish_reason, plan.stop)
    finish = finish_reason(res)
    if plan.tool_format is None:
        return {"role": "assistant", "content": text}, finish, None
    parsed = tool_calls.parse_tool_calls(plan.forced + text, plan.tool_format)
    if not parsed.tool_calls:
        tried = bool(plan.forced) or not parsed.ok
        return {"role": "assistant", "content": plan.forced + text}, finish, False if tried else None
    calls = parsed.tool_calls if plan.parallel else parsed.tool_calls[:1]
    message = {"role": "assistant", "content": parsed.content, "tool_calls": [c.to_openai() for c in calls]}
    return message, "tool_calls" if finish == "stop" else finish, True


def count_tools(counts: dict[str, int] | None, parsed: bool | None) -> None:
    """Add one reply's outcome to a server's tool counters (``tool_calls_parsed``/``tool_parse_failures``)."""
    if counts is not None and parsed is not None:
        key = "tool_calls_parsed" if parsed else "tool_parse_failures"
        counts[key] = counts.get(key, 0) + 1


def _logprobs(tokenizer: Any, res: GenerateResult, top: bool) -> dict[str, Any]:
    def entry(tok: int, lp: float) -> dict[str, Any]:
        text = tokenizer.decode([tok])
        return {"token": text, "logprob": lp, "bytes": list(text.encode())}

    content = []
    for k, (tok, lp) in enumerate(zip(res.token_ids, res.logprobs, strict=True)):
        item = entry(tok, lp)
        item["top_logprobs"] = [entry(t, v) for t, v in (res.top_logprobs or [])[k]] if top else []
        content.append(item)
    return {"content": content}


def _extension(res: GenerateResult) -> dict[str, Any]:
    return {"token_ids": res.token_ids, "logprobs": res.logprobs, "versions": res.versions}


def chat_response(
    tokenizer: Any,
    body: ChatCompletionBody,
    served: str,
    prompt_ids: list[int],
    results: list[GenerateResult],
    plan: ChatPlan,
    counts: dict[str, int] | None = None,
) -> dict[str, Any]:
    """The non-streamed response; ``counts`` gains the replies' tool-call outcomes."""
    prompt_len = len(prompt_ids)
    choices = []
    for i, res in enumerate(results):
        message, finish, parsed = reply(tokenizer, res, plan)
        count_tools(counts, parsed)
        choices.append(
            {
                "index": i,
                "message": message,
                "finish_reason": finish,
                "logprobs": _logprobs(tokenizer, res, bool(body.top_logprobs)) if body.logprobs else None,
                "shipyard": _extension(res),
            }
        )
    completion = sum(len(r.token_ids) for r in results)
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": served,
        "choices": choices,
        "shipyard": {"prompt_token_ids": prompt_ids},
        "usage": {
            "prompt_tokens": prompt_len,
            "completion_tokens": completion,
            "total_tokens": prompt_len + completion,
        },
    }


class StreamText:
    """One choice's streamed text: what may be sent now without leaking part of a stop string or a
    half-decoded character, and the final remainder."""

    def __init__(self, tokenizer: Any, plan: ChatPlan) -> None:
        self.tok, self.stop = tokenizer, plan.stop
        self.ids: list[int] = []
        self.sent = ""
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.marker = "" if plan.tool_format != "hermes" or plan.forced else tool_calls.HERMES_START
        """Text is sent only up to where this could start (Hermes calls go out whole at the end)."""
        self.held = plan.tool_format is not None and not self.marker
        """Nothing is sent before the end (a llama3_json reply, or one prefilled as a call)."""

    def add(self, token: int) -> str:
        self.ids.append(token)
        if self.held:
            return ""
        text = _decode(self.tok, self.ids)
        ready = text[: len(text) - self.hold] if self.hold else text
        if self.marker:
            ready = _before_marker(ready, self.marker)
        ready = ready.rstrip("\ufffd")  # a character whose bytes have not all arrived
        if (
            any(s in text for s in self.stop)
            or not ready.startswith(self.sent)
            or len(ready) <= len(self.sent)
        ):
            return ""
        delta, self.sent = ready[len(self.sent) :], ready
        return delta

    def rest(self, final: str | None) -> str:
        """What is left to send of ``final``: past what was sent (past the common prefix, should a
        decode ever rewrite sent text)."""
        final = final or ""
        common = 0
        while common < min(len(final), len(self.sent)) and final[common] == self.sent[common]:
            common += 1
        return final[common:]


def _before_marker(text: str, marker: str) -> str:
    """``text`` up to where ``marker`` starts in it, or could start at its end."""
    if marker in text:
        return text[: text.index(marker)]
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return text[:-k]
    return text


def sse(data: dict[str, Any] | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data, separators=(',', ':'))}\n\n"


async def stream_chunks(
    events: AsyncIterator[tuple[int, int] | list[GenerateResult]],
    tokenizer: Any,
    body: ChatCompletionBody,
    served: str,
    prompt_ids: list[int],
    plan: ChatPlan,
    counts: dict[str, int] | None = None,
) -> AsyncIterator[str]:
    """Server-sent events of a streamed completion: a role chunk per choice, content deltas as tokens
    arrive (``(choice, token)`` events), a finish chunk per choice when the results arrive (with the
    ``shipyard`` extensions, module doc), the usage chunk when ``stream_options.include_usage``, then
    ``[DONE]``."""
    prompt_len = len(prompt_ids)
    head = {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": served,
    }
    n = body.n or 1

    def chunk(i: int, delta: dict[str, Any], finish: str | None = None, **extra: Any) -> str:
        choice = {"index": i, "delta": delta, "finish_reason": finish, "logprobs": None}
        return sse(
            {
                **head,
                "choices": [{**choice, **extra}],
                **({"shipyard": {"prompt_token_ids": prompt_ids}} if extra else {}),
            }
        )

    texts = [StreamText(tokenizer, plan) for _ in range(n)]
    for i in range(n):
        yield chunk(i, {"role": "assistant", "content": ""})
    async for event in events:
        if isinstance(event, tuple):
            i, token = event
            if delta := texts[i].add(token):
                yield chunk(i, {"content": delta})
            continue
        for i, res in enumerate(event):
            message, finish, parsed = reply(tokenizer, res, plan)
            count_tools(counts, parsed)
            if rest := texts[i].rest(message["content"]):
                yield chunk(i, {"content": rest})
            for k, call in enumerate(message.get("tool_calls", [])):
                yield chunk(i, {"tool_calls": [{"index": k, **call}]})
            yield chunk(i, {}, finish, shipyard=_extension(res))
        if body.stream_options is not None and body.stream_options.include_usage:
            done = sum(len(r.token_ids) for r in event)
            usage = {
                "prompt_tokens": prompt_len,
                "completion_tokens": done,
                "total_tokens": prompt_len + done,
            }
            yield sse({**head, "choices": [], "usage": usage})
    yield sse("[DONE]")
