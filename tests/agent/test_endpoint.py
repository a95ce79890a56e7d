"""The session endpoint with the real ``openai`` client: tool calls, re-serialized histories spliced
token-exact, edited histories counted, limits, cancellation (tiny model taught a tool call)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from tests.conftest import DONE, TOOLS, until

from shipyard.agent.endpoint import SessionEndpoint
from shipyard.config.schema import HarnessConfig, SamplingConfig
from shipyard.inference.client import HttpInferenceClient, LocalInferenceClient
from shipyard.inference.engine.engine import EmbeddedEngine
from shipyard.inference.serving.server import InferenceServer
from shipyard.inference.serving.tools import tool_template

USER = [{"role": "user", "content": "Look at a.py"}]


@pytest.fixture(scope="module")
def server(taught_model: tuple[Any, Any]) -> Iterator[InferenceServer]:
    with InferenceServer(EmbeddedEngine(*taught_model, max_batch=4)) as srv:
        yield srv


def _endpoint(server: InferenceServer, tok: Any, **harness: Any) -> SessionEndpoint:
    cfg = HarnessConfig(honor_sampling=True, **harness)
    client = HttpInferenceClient(server.url, timeout_s=60)
    return SessionEndpoint(client, tok, cfg, SamplingConfig(), max_context=1024)


def _oai(ep: SessionEndpoint) -> openai.OpenAI:
    return openai.OpenAI(base_url=ep.url, api_key=ep.key, max_retries=0)


def _play(oai: openai.OpenAI, edit: bool = False) -> list[Any]:
    """The taught session: a tool call, its result sent back re-serialized, the answer."""
    first = oai.chat.completions.create(
        model="policy", messages=USER, tools=TOOLS, max_tokens=40, temperature=0
    )
    msg = first.choices[0].message
    sent = msg.model_dump(exclude_none=True)  # what clients send back: ids, JSON-string arguments
    if edit:
        sent["tool_calls"][0]["function"]["arguments"] = json.dumps({"path": "b.py"})
    history = [*USER, sent, {"role": "tool", "tool_call_id": msg.tool_calls[0].id, "content": "print(1)"}]
    second = oai.chat.completions.create(
        model="policy", messages=history, tools=TOOLS, max_tokens=40, temperature=0
    )
    return [first, second]


def test_a_tool_session_is_one_token_exact_segment(server: InferenceServer, taught_model: Any) -> None:
    tok = taught_model[1]
    with _endpoint(server, tok) as ep:
        first, second = _play(_oai(ep))
    assert first.choices[0].finish_reason == "tool_calls" and second.choices[0].message.content == DONE
    assert ep.retokenized_calls == 0 and all(c.exact for c in ep.calls)
    [seg] = ep.segments("t")
    a, b = ep.calls
    assert b.prompt_ids[: len(a.prompt_ids) + len(a.result.token_ids)] == a.prompt_ids + a.result.token_ids
    assert seg.token_ids == b.prompt_ids + b.result.token_ids
    sampled = [i for i, m in enumerate(seg.loss_mask) if m]
    assert [seg.token_ids[i] for i in sampled] == a.result.token_ids + b.result.token_ids
    assert [seg.logprobs[i] for i in sampled] == a.result.logprobs + b.result.logprobs  # bit-identical
    assert [seg.versions[i] for i in sampled] == a.result.versions + b.result.versions
    # the spliced prompt is what a fresh render gives: the reply's tokens are the template's
    fresh = tok.apply_chat_template(
        [
            *USER,
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"type": "function", "function": {"name": "read_file", "arguments": {"path": "a.py"}}}
                ],
            },
            {"role": "tool", "content": "print(1)"},
        ],
        tools=TOOLS,
        chat_template=tool_template(tok).template,
        add_generation_prompt=True,
        tokenize=True,
        return_dict=True,
    )["input_ids"]
    assert list(fresh) == b.prompt_ids
    assert ep.metrics()["tool_call_parse_frac"] == 1.0 and ep.metrics()["tool_calls"] == 1


def test_an_edited_history_is_counted_and_starts_a_segment(
    server: InferenceServer, taught_model: Any
) -> None:
    with _endpoint(server, taught_model[1]) as ep:
        _play(_oai(ep), edit=True)
    assert ep.retokenized_calls == 1 and [c.exact for c in ep.calls] == [True, False]
    segs = ep.segments("t")
    assert len(segs) == 2 and [s.segment_idx for s in segs] == [0, 1]
    assert sum(segs[1].loss_mask) == len(ep.calls[1].result.token_ids), "only the new reply is trained"


def test_limits_answer_400_and_the_key_is_required(server: InferenceServer, taught_model: Any) -> None:
    with _endpoint(server, taught_model[1], max_calls=1) as ep:
        oai = _oai(ep)
        oai.chat.completions.create(model="policy", messages=USER, max_tokens=4)
        with pytest.raises(openai.BadRequestError) as err:
            oai.chat.completions.create(model="policy", messages=USER, max_tokens=4)
        assert err.value.body["code"] == "session_limit" and "harness.max_calls" in err.value.body["message"]
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=ep.url, api_key="sk-other", max_retries=0).models.list()
    assert ep.refused == {"session_limit": 1, "auth": 1}
    with _endpoint(server, taught_model[1], max_sampled_tokens=5) as ep:
        out = _oai(ep).chat.completions.create(model="policy", messages=USER, max_tokens=40)
        assert out.usage.completion_tokens <= 5 and out.choices[0].finish_reason == "length"


def test_closing_cancels_a_call_in_flight(
    server: InferenceServer, taught_model: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = server.engine
    # the call must still be generating when the endpoint closes: with no end-of-sequence token it
    # runs to its 900 tokens (the taught model's own EOS comes at whatever step its weights give:
    # after 21 tokens with transformers 5.24, which made the close race the call's end)
    monkeypatch.setattr(engine, "eos_ids", frozenset())
    ep = _endpoint(server, taught_model[1]).start()
    errors: list[BaseException] = []

    def long_call() -> None:
        try:
            _oai(ep).completions.create(model="policy", prompt="x " * 50, max_tokens=900, timeout=60)
        except Exception as e:
            errors.append(e)

    before, tokens = engine.stats["aborted"], engine.stats["generated_tokens"]
    t = threading.Thread(target=long_call)
    t.start()
    until(lambda: engine.stats["generated_tokens"] >= tokens + 10, timeout_s=30)
    assert t.is_alive(), "the call is still generating"
    t0 = time.monotonic()
    ep.close()
    t.join(30)
    assert not t.is_alive() and errors, "the harness's call ended with an error"
    assert time.monotonic() - t0 < 10
    until(lambda: engine.stats["aborted"] > before, timeout_s=10)
    assert engine.stats.get("aborted", 0) > before, "the server stopped generating it"
    assert ep.calls == []


def test_an_in_process_engine_serves_the_endpoint(taught_model: Any) -> None:
    """Evaluations run their engine in-process (no URL): the same session, token-exact."""
    tok = taught_model[1]
    with LocalInferenceClient(EmbeddedEngine(*taught_model, max_batch=4)) as client:
        cfg = HarnessConfig(honor_sampling=True)
        with SessionEndpoint(client, tok, cfg, SamplingConfig(), max_context=1024) as ep:
            first, second = _play(_oai(ep))
    assert first.choices[0].finish_reason == "tool_calls" and second.choices[0].message.content == DONE
    [seg] = ep.segments("t")
    a, b = ep.calls
    assert ep.retokenized_calls == 0 and seg.token_ids == b.prompt_ids + b.result.token_ids
