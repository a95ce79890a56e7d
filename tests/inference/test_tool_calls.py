"""Tool calling on the embedded server: the Hermes rendering, the parser, and the real ``openai``
client with ``tools`` against a tiny model taught to call one (``taught_model``, tests/conftest.py)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from tests.conftest import CALL, DONE, TOOLS

from shipyard.inference.engine.engine import EmbeddedEngine
from shipyard.inference.serving.openai_api import ChatPlan, reply
from shipyard.inference.serving.server import InferenceServer
from shipyard.inference.serving.tools import (
    canonical_assistant,
    chat_messages,
    parse_tool_calls,
    tool_template,
)
from shipyard.inference.types import GenerateResult

USER = [{"role": "user", "content": "Look at a.py"}]


@pytest.fixture(scope="module")
def served(taught_model: tuple[Any, Any]) -> Iterator[tuple[InferenceServer, openai.OpenAI]]:
    engine = EmbeddedEngine(*taught_model, max_batch=4)
    with InferenceServer(engine, model_name="taught") as server:
        yield server, openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)


def test_hermes_parser_reads_calls_content_and_unclosed_blocks() -> None:
    two = 'Let me look.\n<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>\n<tool_call>\n{"name": "b", "arguments": {"s": "é"}}'
    out = parse_tool_calls(two, "hermes")
    assert out.ok and out.content == "Let me look.\n"
    assert [(c.name, c.arguments) for c in out.tool_calls] == [("a", '{"x": 1}'), ("b", '{"s": "é"}')]
    assert parse_tool_calls("plain answer", "hermes").tool_calls == []
    bad = parse_tool_calls('<tool_call>\n{"name": "a", "arguments": {"x": 1</tool_call>', "hermes")
    assert not bad.ok and bad.tool_calls == [] and bad.content.startswith("<tool_call>")
    nameless = parse_tool_calls('<tool_call>{"arguments": {}}</tool_call>', "hermes")
    assert not nameless.ok
    llama = parse_tool_calls(
        '<|python_tag|>{"name": "f", "parameters": {"q": 2}}; {"name": "g", "arguments": {}}', "llama3_json"
    )
    assert [(c.name, c.arguments) for c in llama.tool_calls] == [("f", '{"q": 2}'), ("g", "{}")]
    assert parse_tool_calls("{not json", "llama3_json").ok is False


def test_the_hermes_template_renders_plain_chats_as_the_model_does(taught_model: tuple[Any, Any]) -> None:
    tok = taught_model[1]
    template = tool_template(tok)
    assert template.format == "hermes" and not template.native
    chats = [
        USER,
        [{"role": "system", "content": "Be brief."}, *USER],
        [*USER, {"role": "assistant", "content": "Sure."}, {"role": "user", "content": "Again"}],
    ]
    for chat in chats:
        for gen in (True, False):
            ours = tok.apply_chat_template(
                chat, chat_template=template.template, tokenize=False, add_generation_prompt=gen
            )
            assert ours == tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=gen)
    with_tools = tok.apply_chat_template(USER, tools=TOOLS, chat_template=template.template, tokenize=False)
    assert "<tools>\n" + json.dumps(TOOLS[0]) + "\n</tools>" in with_tools
    assert with_tools.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")


def test_messages_are_checked_and_assistant_forms_compare_equal() -> None:
    with pytest.raises(ValueError, match=r"messages\[0\].role: 'wizard'"):
        chat_messages([{"role": "wizard", "content": "x"}])
    with pytest.raises(ValueError, match=r"messages\[0\].content"):
        chat_messages([{"role": "user", "content": None}])
    call = {"id": "1", "type": "function", "function": {"name": "f", "arguments": '{"b": 1, "a": "x"}'}}
    other = {"id": "2", "type": "function", "function": {"name": "f", "arguments": {"a": "x", "b": 1}}}
    assert canonical_assistant(None, [call]) == canonical_assistant("", [other])
    assert canonical_assistant("hi ", None) == canonical_assistant("hi", [])
    assert canonical_assistant("hi", [call]) != canonical_assistant("hi", [])


def test_a_reply_becomes_tool_calls_or_counted_content(taught_model: tuple[Any, Any]) -> None:
    tok = taught_model[1]
    ids = tok(CALL, add_special_tokens=False).input_ids + [tok.eos_token_id]
    res = GenerateResult(ids, [0.0] * len(ids), [0] * len(ids), "eos")
    message, finish, parsed = reply(tok, res, ChatPlan([], "hermes"))
    assert parsed and finish == "tool_calls" and message["content"] is None
    assert message["tool_calls"][0]["function"] == {"name": "read_file", "arguments": '{"path": "a.py"}'}
    cut = GenerateResult(ids[:-12], [0.0] * (len(ids) - 12), [0] * (len(ids) - 12), "length")
    message, finish, parsed = reply(tok, cut, ChatPlan([], "hermes"))
    assert parsed is False and finish == "length" and message["content"] == tok.decode(ids[:-12])
    message, _, parsed = reply(tok, res, ChatPlan([], None))  # tool_choice none: content as sampled
    assert parsed is None and message == {"role": "assistant", "content": CALL}


def test_openai_client_gets_tool_calls_then_an_answer(served: tuple[InferenceServer, openai.OpenAI]) -> None:
    server, oai = served
    kw: dict[str, Any] = {"model": "taught", "tools": TOOLS, "temperature": 0, "max_tokens": 40}
    first = oai.chat.completions.create(messages=USER, **kw)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert (call.function.name, json.loads(call.function.arguments)) == ("read_file", {"path": "a.py"})
    history = [
        *USER,
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "print(1)"},
    ]
    second = oai.chat.completions.create(messages=history, **kw)
    assert second.choices[0].finish_reason == "stop" and second.choices[0].message.content == DONE
    stats = httpx.get(f"{server.url}/stats").json()
    assert stats["tool_calls_parsed"] >= 1


def test_streamed_tool_calls_match_the_whole_reply(served: tuple[InferenceServer, openai.OpenAI]) -> None:
    _, oai = served
    kw: dict[str, Any] = {
        "model": "taught",
        "messages": USER,
        "tools": TOOLS,
        "temperature": 0,
        "max_tokens": 40,
    }
    whole = oai.chat.completions.create(**kw).choices[0]
    content, calls, finish = "", [], None
    for chunk in oai.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            content += c.delta.content or ""
            calls += c.delta.tool_calls or []
            finish = c.finish_reason or finish
    assert content == "" and finish == "tool_calls", "no part of <tool_call> leaks as content"
    assert [(c.function.name, c.function.arguments) for c in calls] == [
        (t.function.name, t.function.arguments) for t in whole.message.tool_calls
    ]


def test_tool_choice_none_required_and_named(served: tuple[InferenceServer, openai.OpenAI]) -> None:
    server, oai = served
    kw: dict[str, Any] = {"model": "taught", "tools": TOOLS, "temperature": 0, "max_tokens": 40}
    none = oai.chat.completions.create(messages=USER, tool_choice="none", **kw).choices[0]
    assert none.message.tool_calls is None and none.message.content == CALL
    named = {"type": "function", "function": {"name": "read_file"}}
    for choice in ("required", named):
        out = oai.chat.completions.create(messages=USER, tool_choice=choice, **kw)
        prompt = out.model_extra["shipyard"]["prompt_token_ids"]
        # the prefilled opening ends the prompt; the reply parses or comes back as counted content
        msg = out.choices[0].message
        assert msg.tool_calls or msg.content.startswith("<tool_call>\n"), (choice, msg)
        assert len(prompt) > len(
            oai.chat.completions.create(messages=USER, **kw).model_extra["shipyard"]["prompt_token_ids"]
        )
    before = httpx.get(f"{server.url}/stats").json()["tool_parse_failures"]
    bad = oai.chat.completions.create(messages=USER, tool_choice=named, **{**kw, "max_tokens": 3}).choices[0]
    assert bad.message.tool_calls is None and bad.finish_reason == "length"
    assert httpx.get(f"{server.url}/stats").json()["tool_parse_failures"] == before + 1


def test_parallel_tool_calls_false_keeps_the_first(taught_model: tuple[Any, Any]) -> None:
    tok = taught_model[1]
    ids = tok(CALL + "\n" + CALL.replace("a.py", "b.py"), add_special_tokens=False).input_ids
    res = GenerateResult(ids, [0.0] * len(ids), [0] * len(ids), "eos")
    both, _, _ = reply(tok, res, ChatPlan([], "hermes"))
    first, _, _ = reply(tok, res, ChatPlan([], "hermes", parallel=False))
    assert len(both["tool_calls"]) == 2 and len(first["tool_calls"]) == 1
    assert first["tool_calls"][0]["function"]["arguments"] == '{"path": "a.py"}'
