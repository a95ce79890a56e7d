"""The embedded engine's server as the `openai` client (and a raw HTTP client) uses it: one test per
finding of issue 15 (cancel on disconnect, bounds, fairness, shutdown, parameters, logprobs, logit
controls, error shape, streaming).

Shape legend: no tensors here.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from shipyard.inference.engine.engine import EmbeddedEngine
from shipyard.inference.serving.server import InferenceServer

MSG = [{"role": "user", "content": "Write a haiku about the sea."}]


@pytest.fixture(scope="module")
def served(model_tok: tuple[Any, Any]) -> Iterator[tuple[EmbeddedEngine, InferenceServer]]:
    engine = EmbeddedEngine(*model_tok, max_batch=4)
    with InferenceServer(engine, gather_window_s=0.01, max_n=4, drain_s=2.0) as server:
        yield engine, server


@pytest.fixture()
def oai(served: tuple[EmbeddedEngine, InferenceServer]) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{served[1].url}/v1", api_key="unused", max_retries=0, timeout=120) as c:
        yield c


def _until(condition: Any, timeout_s: float = 60.0) -> None:
    """Wait until ``condition()`` holds (the engine's counters have no event to wait on)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.005)


def _idle(engine: EmbeddedEngine, timeout_s: float = 30.0) -> None:
    """Wait until the engine runs no row (its lock is free)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if engine._lock.acquire(timeout=0.05):
            engine._lock.release()
            return
    raise AssertionError("the engine kept running rows")


def test_models_have_an_id_not_a_path_and_can_be_retrieved(oai: openai.OpenAI, served) -> None:
    [card] = oai.models.list().data
    assert card.id == "shipyard" and "/" not in card.id and card.created > 0
    assert oai.models.retrieve(card.id).id == card.id
    with pytest.raises(openai.NotFoundError) as err:
        oai.models.retrieve("gpt-4o")
    assert err.value.body["param"] == "model" and "not served here" in err.value.body["message"]


def test_a_completion_has_created_usage_and_honours_null_and_list_content(oai: openai.OpenAI) -> None:
    out = oai.chat.completions.create(
        model="shipyard",
        messages=[
            {"role": "user", "content": [{"type": "text", "text": "Say "}, {"type": "text", "text": "hi"}]}
        ],
        max_tokens=5,
        seed=3,
        temperature=None,
        top_p=None,
        stop=None,
    )
    assert out.created > 0 and out.usage.completion_tokens == 5 and out.choices[0].finish_reason == "length"
    same = oai.chat.completions.create(
        model="shipyard", messages=[{"role": "user", "content": "Say hi"}], max_tokens=5, seed=3
    )
    assert same.choices[0].message.content == out.choices[0].message.content, "list content == its text"


def test_bad_parameters_are_refused_by_name(oai: openai.OpenAI, served) -> None:
    cases: list[tuple[dict[str, Any], str]] = [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 10**6}, "max_tokens"),
        ({"n": 5}, "n"),
        ({"top_logprobs": 3}, "top_logprobs"),
        ({"tools": [{"type": "retrieval"}]}, "tools[0]"),
        (
            {
                "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
                "tool_choice": {"type": "function", "function": {"name": "g"}},
            },
            "tool_choice",
        ),
        ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"extra_body": {"guided_json": {}}}, "guided_json"),
        ({"logit_bias": {"x": 1}}, "logit_bias"),
        ({"stream": True, "logprobs": True}, "logprobs"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
            "messages[0].content[0]",
        ),
    ]
    for extra, param in cases:
        kw = {"model": "shipyard", "messages": MSG, "max_tokens": 4, **extra}
        with pytest.raises(openai.BadRequestError) as err:
            oai.chat.completions.create(**kw)
        body = err.value.body
        assert body["param"] == param and body["type"] == "invalid_request_error", (extra, body)
    url = served[1].url
    for raw in (
        httpx.post(f"{url}/v1/chat/completions", json={"messages": MSG, "max_tokens": 0}),
        httpx.get(f"{url}/v1/no-such-route"),
        httpx.post(
            f"{url}/generate", json={"requests": [{"prompt_ids": [1], "params": {"logit_bias": {"x": 1}}}]}
        ),
    ):
        assert raw.status_code in (400, 404) and set(raw.json()) == {"error"}, raw.text
        assert set(raw.json()["error"]) == {"message", "type", "param", "code"}


def test_choices_of_different_requests_never_share_a_seed_stream(oai: openai.OpenAI) -> None:
    kw = {"model": "shipyard", "messages": MSG, "max_tokens": 12, "temperature": 1.0}
    a = oai.chat.completions.create(seed=1, n=2, **kw)
    b = oai.chat.completions.create(seed=2, n=1, **kw)
    again = oai.chat.completions.create(seed=1, n=2, **kw)
    tokens = [c.model_extra["shipyard"]["token_ids"] for c in a.choices]
    assert tokens[1] != b.choices[0].model_extra["shipyard"]["token_ids"], "seed+1 no longer overlaps"
    assert [c.model_extra["shipyard"]["token_ids"] for c in again.choices] == tokens, "still reproducible"


def test_the_same_seed_repeats_on_a_server_with_a_prefix_cache(model_tok) -> None:
    """Issue 41: a seeded request is prefilled whole, never from the prefix cache (a warm prefill's
    logits differ from the cold one's in the last bits; on SmolLM2 in bf16 that changed the haiku),
    so the same seed gives the same tokens; unseeded requests still start from cached prefixes."""
    engine = EmbeddedEngine(*model_tok, max_batch=4, prefix_cache_mb=64)
    kw = {"model": "shipyard", "messages": MSG, "max_tokens": 24, "temperature": 1.0}
    with (
        InferenceServer(engine, gather_window_s=0.01, drain_s=2.0) as server,
        openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120) as c,
    ):
        runs = [c.chat.completions.create(seed=11, **kw) for _ in range(3)]
        assert engine.stats["prefix_hits"] == 0, "a seeded request started from a cached prefix"
        ids = [r.choices[0].model_extra["shipyard"]["token_ids"] for r in runs]
        assert ids[0] == ids[1] == ids[2] and len(ids[0]) > 0
        c.chat.completions.create(**kw)  # unseeded: the same prompt is served from the cache
        assert engine.stats["prefix_hits"] == 1


def test_logprobs_and_top_logprobs_are_returned(oai: openai.OpenAI) -> None:
    out = oai.chat.completions.create(
        model="shipyard", messages=MSG, max_tokens=6, temperature=0, logprobs=True, top_logprobs=3
    )
    choice = out.choices[0]
    sampled = choice.model_extra["shipyard"]["logprobs"]
    content = choice.logprobs.content
    assert [c.logprob for c in content] == pytest.approx(sampled) and len(content) == 6
    for c in content:
        tops = [t.logprob for t in c.top_logprobs]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True)
        assert c.top_logprobs[0].token == c.token and c.top_logprobs[0].logprob == pytest.approx(c.logprob)


def test_logit_bias_and_penalties_change_sampling(oai: openai.OpenAI, model_tok) -> None:
    tok = model_tok[1]
    forced = tok.encode(" ocean", add_special_tokens=False)[0]
    out = oai.chat.completions.create(
        model="shipyard", messages=MSG, max_tokens=4, temperature=0, logit_bias={str(forced): 100}
    )
    assert out.choices[0].model_extra["shipyard"]["token_ids"] == [forced] * 4
    plain = oai.chat.completions.create(model="shipyard", messages=MSG, max_tokens=24, temperature=0)
    ids = plain.choices[0].model_extra["shipyard"]["token_ids"]
    pen = oai.chat.completions.create(
        model="shipyard",
        messages=MSG,
        max_tokens=24,
        temperature=0,
        frequency_penalty=2.0,
        presence_penalty=2.0,
    )
    pen_ids = pen.choices[0].model_extra["shipyard"]["token_ids"]
    assert len(set(pen_ids)) >= len(set(ids)) and pen_ids != ids, "penalties discourage repeats"


def test_ignore_eos_samples_on_to_the_length_asked(oai: openai.OpenAI, served) -> None:
    eos = min(served[0].eos_ids)
    kw: dict[str, Any] = {"model": "shipyard", "messages": MSG, "max_tokens": 6, "temperature": 0}
    kw["logit_bias"] = {str(eos): 100}  # every draw is the end-of-sequence token
    ends = oai.chat.completions.create(**kw)
    assert ends.choices[0].finish_reason == "stop" and ends.usage.completion_tokens == 1
    on = oai.chat.completions.create(**kw, extra_body={"ignore_eos": True})
    assert on.choices[0].finish_reason == "length" and on.usage.completion_tokens == 6
    assert on.choices[0].model_extra["shipyard"]["token_ids"] == [eos] * 6


def test_streaming_gives_the_same_text_and_usage_last(oai: openai.OpenAI) -> None:
    kw = {
        "model": "shipyard",
        "messages": MSG,
        "max_tokens": 16,
        "seed": 7,
        "temperature": 0.8,
        "stop": ["zq"],
    }
    whole = oai.chat.completions.create(**kw)
    chunks = list(oai.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 16
    assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) > 3, (
        "tokens arrive as they are made"
    )


def test_a_client_that_goes_away_cancels_its_generation(served) -> None:
    engine, server = served
    _idle(engine)
    before = dict(engine.stats)
    body = {"messages": MSG, "max_tokens": 1500, "temperature": 1.0, "seed": 1}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=1.0)
    with httpx.stream(
        "POST", f"{server.url}/v1/chat/completions", json={**body, "stream": True}, timeout=60
    ) as r:
        for line in r.iter_lines():  # hang up once tokens flow
            if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["delta"].get("content"):
                break
    _idle(engine)
    assert engine.stats["aborted"] - before["aborted"] == 2
    generated = engine.stats["generated_tokens"] - before["generated_tokens"]
    assert generated < 1500, f"the abandoned rows stopped early ({generated} tokens for two requests of 1500)"


def test_a_short_request_is_not_starved_by_long_ones(served, oai: openai.OpenAI) -> None:
    engine, server = served
    _idle(engine)
    done: list[float] = []
    admitted = engine.stats["sequences"]

    def long() -> None:
        oai.chat.completions.create(model="shipyard", messages=MSG, max_tokens=600, temperature=1.0)
        done.append(time.monotonic())

    threads = [threading.Thread(target=long) for _ in range(engine.max_batch)]  # more than their share
    for t in threads:
        t.start()
    share = server.app.state.scheduler.long_slots  # the long rows that can run: the rest wait
    _until(lambda: engine.stats["sequences"] - admitted >= share)
    t0 = time.monotonic()
    oai.chat.completions.create(model="shipyard", messages=MSG, max_tokens=8, temperature=1.0)
    short_at = time.monotonic()
    for t in threads:
        t.join()
    assert not done or min(done) > short_at, "the short request finished before any long one"
    assert short_at - t0 < (max(done) - t0) / 4


def test_shutdown_under_load_drains_then_cancels(model_tok) -> None:
    engine = EmbeddedEngine(*model_tok, max_batch=4)
    threads_before = set(threading.enumerate())
    server = InferenceServer(engine, drain_s=1.0).start()
    answers: list[Any] = []

    def call() -> None:
        body = {"messages": MSG, "max_tokens": 1800, "temperature": 1.0}
        answers.append(httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=120))

    threads = [threading.Thread(target=call) for _ in range(3)]
    for t in threads:
        t.start()
    _until(lambda: engine.stats["sequences"] == 3)  # all three are generating
    t0 = time.monotonic()
    server.stop()
    took = time.monotonic() - t0
    for t in threads:
        t.join(30)
    assert took < 10, f"stop() took {took:.1f} s under load"
    assert len(answers) == 3 and all(a.status_code == 200 for a in answers)
    assert {a.json()["choices"][0]["finish_reason"] for a in answers} == {"abort"}
    left = [t for t in set(threading.enumerate()) - threads_before if t.name.startswith("shipyard-")]
    assert not left, left


def test_a_cancelled_request_resolves_even_when_only_part_of_it_started(model_tok) -> None:
    from shipyard.inference.engine.scheduler import BatchScheduler
    from shipyard.inference.types import GenerateRequest, SamplingParams

    engine = EmbeddedEngine(*model_tok, max_batch=2)
    scheduler = BatchScheduler(engine, reserved_slots=0).start()
    try:
        reqs = [GenerateRequest([1, 2, 3], SamplingParams(max_tokens=3000, seed=i)) for i in range(4)]
        tokens, flowing = [0], threading.Event()

        def count(*_: Any) -> None:
            tokens[0] += 1
            if tokens[0] >= 10:
                flowing.set()

        ticket = scheduler.submit(reqs, on_token=count)  # two rows start, two wait for a slot
        assert flowing.wait(30)
        ticket.cancel_requests()
        results = ticket.result(timeout=30)
        assert len(results) == 2 and {r.finish_reason for r in results} == {"abort"}
        assert all(len(r.token_ids) < 3000 for r in results)
    finally:
        scheduler.close(drain_s=1.0)
