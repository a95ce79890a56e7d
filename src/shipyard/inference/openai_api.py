"""The OpenAI-compatible chat-completions surface of the embedded engine's server.

Contract: :class:`ChatCompletionBody` accepts what the ``openai`` client sends for
``chat.completions.create``. Every parameter is either honoured or refused with HTTP 400 naming
it, never silently ignored:

- honoured: ``messages`` (``content`` as a string or a list of ``{"type": "text"}`` parts),
  ``model`` (must be the served model's id), ``temperature``, ``top_p``, ``max_tokens`` /
  ``max_completion_tokens`` (>= 1, and the prompt plus it must fit the context; unset = the rest of
  the context), ``n`` (<= ``max_n``), ``stop``, ``seed`` (choice ``i > 0`` draws from a seed hashed
  from ``(seed, i)``, so two requests never share a choice's stream), ``logprobs`` and
  ``top_logprobs`` (<= 20), ``presence_penalty``, ``frequency_penalty``, ``logit_bias``,
  ``stream`` with ``stream_options.include_usage``, and ``user`` (an end-user id: recorded by a
  gateway, it does not change sampling); ``null`` means "not given" for every optional field;
- refused: ``tools``, ``functions``, ``response_format`` other than text, ``audio``, ... (the
  engine cannot constrain or call tools), and any unknown field.

Errors use OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``, with the matching
status (400 invalid request, 404 unknown model or route, 503 shutting down, 500 engine failure).
:func:`chat_response` and :func:`stream_chunks` build the reply; a choice carries the extension
``shipyard: {token_ids, logprobs, versions}`` (the token-exact record RL needs), and the response
carries ``shipyard: {prompt_token_ids}``; streamed, both ride on each choice's finish chunk (a
gateway logs them: :mod:`shipyard.online.gateway`).
"""

from __future__ import annotations

import hashlib
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from shipyard.inference.types import GenerateRequest, GenerateResult, SamplingParams

UNSUPPORTED = (
    "tools",
    "tool_choice",
    "functions",
    "function_call",
    "parallel_tool_calls",
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


class OpenAIError(Exception):
    """An error answered in OpenAI's shape."""

    def __init__(
        self, status: int, message: str, param: str | None = None, type_: str = "invalid_request_error"
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.type = status, message, param, type_

    def body(self) -> dict[str, Any]:
        code = {400: "invalid_request", 404: "not_found", 503: "unavailable", 500: "internal_error"}
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": code.get(self.status),
            }
        }


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


NO_OPS: dict[str, Any] = {"tool_choice": "none", "tools": [], "response_format": {"type": "text"}}
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
                "it cannot call tools or constrain output)",
                name,
            )


def _messages(messages: list[dict[str, Any]]) -> list[dict[str, str]]:
    """Messages with list-form content joined into text; a non-text part is refused by position."""
    out = []
    for i, m in enumerate(messages):
        content = m.get("content")
        if isinstance(content, list):
            parts = []
            for j, part in enumerate(content):
                if (
                    not isinstance(part, dict)
                    or part.get("type") != "text"
                    or not isinstance(part.get("text"), str)
                ):
                    raise OpenAIError(
                        400, "only text content parts are supported", f"messages[{i}].content[{j}]"
                    )
                parts.append(part["text"])
            content = "".join(parts)
        if not isinstance(m.get("role"), str) or not isinstance(content, str):
            raise OpenAIError(400, "a message needs a string role and text content", f"messages[{i}]")
        out.append({"role": m["role"], "content": content})
    return out


def choice_seed(seed: int | None, i: int) -> int | None:
    """Choice ``i``'s seed: ``seed`` itself for the first, a hash of ``(seed, i)`` for the others."""
    if seed is None or i == 0:
        return seed
    return int.from_bytes(hashlib.blake2b(f"{seed}/{i}".encode(), digest_size=8).digest(), "little") >> 1


def chat_requests(
    body: ChatCompletionBody, tokenizer: Any, served: str, context: int, max_n: int
) -> tuple[list[GenerateRequest], list[str]]:
    """The engine requests of ``body`` (one per choice) and its stop strings; OpenAIError if invalid."""
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
    try:
        prompt = list(
            tokenizer.apply_chat_template(
                _messages(body.messages), add_generation_prompt=True, tokenize=True, return_dict=True
            )["input_ids"]
        )
    except OpenAIError:
        raise
    except Exception as e:  # template errors come from malformed messages
        raise OpenAIError(400, f"chat template failed on these messages: {e}", "messages") from e
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
    )
    params = [SamplingParams(**{**base.__dict__, "seed": choice_seed(body.seed, i)}) for i in range(n)]
    return [GenerateRequest(prompt_ids=prompt, params=p) for p in params], stop


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


def _finish(res: GenerateResult) -> str:
    """OpenAI's finish reason: ``length``, ``stop`` (EOS or a stop string), or ``abort`` (cancelled:
    the client left or the server shut down before the end)."""
    return {"length": "length", "abort": "abort"}.get(res.finish_reason, "stop")


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
    stop: list[str],
) -> dict[str, Any]:
    prompt_len = len(prompt_ids)
    choices = []
    for i, res in enumerate(results):
        choices.append(
            {
                "index": i,
                "message": {
                    "role": "assistant",
                    "content": visible_text(tokenizer, res.token_ids, res.finish_reason, stop),
                },
                "finish_reason": _finish(res),
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

    def __init__(self, tokenizer: Any, stop: list[str]) -> None:
        self.tok, self.stop = tokenizer, stop
        self.ids: list[int] = []
        self.sent = ""
        self.hold = max((len(s) for s in stop), default=1) - 1

    def add(self, token: int) -> str:
        self.ids.append(token)
        text = _decode(self.tok, self.ids)
        ready = text[: len(text) - self.hold] if self.hold else text
        ready = ready.rstrip("\ufffd")  # a character whose bytes have not all arrived
        if (
            any(s in text for s in self.stop)
            or not ready.startswith(self.sent)
            or len(ready) <= len(self.sent)
        ):
            return ""
        delta, self.sent = ready[len(self.sent) :], ready
        return delta

    def rest(self, final: str) -> str:
        """What is left to send of ``final``: past what was sent (past the common prefix, should a
        decode ever rewrite sent text)."""
        common = 0
        while common < min(len(final), len(self.sent)) and final[common] == self.sent[common]:
            common += 1
        return final[common:]


def sse(data: dict[str, Any] | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data, separators=(',', ':'))}\n\n"


async def stream_chunks(
    events: AsyncIterator[tuple[int, int] | list[GenerateResult]],
    tokenizer: Any,
    body: ChatCompletionBody,
    served: str,
    prompt_ids: list[int],
    stop: list[str],
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

    texts = [StreamText(tokenizer, stop) for _ in range(n)]
    for i in range(n):
        yield chunk(i, {"role": "assistant", "content": ""})
    async for event in events:
        if isinstance(event, tuple):
            i, token = event
            if delta := texts[i].add(token):
                yield chunk(i, {"content": delta})
            continue
        for i, res in enumerate(event):
            final = visible_text(tokenizer, res.token_ids, res.finish_reason, stop)
            if rest := texts[i].rest(final):
                yield chunk(i, {"content": rest})
            yield chunk(i, {}, _finish(res), shipyard=_extension(res))
        if body.stream_options is not None and body.stream_options.include_usage:
            done = sum(len(r.token_ids) for r in event)
            usage = {
                "prompt_tokens": prompt_len,
                "completion_tokens": done,
                "total_tokens": prompt_len + done,
            }
            yield sse({**head, "choices": [], "usage": usage})
    yield sse("[DONE]")
