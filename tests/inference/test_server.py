"""Tests of :mod:`shipyard.inference.serving.server` and :mod:`shipyard.inference.client` over real HTTP.

Contract checked: ``/generate`` round-trips token-exact results equal to the engine's own;
``/v1/chat/completions`` applies the chat template and answers in OpenAI shape with the
``shipyard`` extension; concurrent callers (HTTP and in-process) are batched into fewer engine
batches; malformed requests get 400 / ValueError; staged weights go live while idle and show in
``/version``; ``stop()`` leaves no threads behind.

Shape legend: no tensors here.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from shipyard.config.schema import ModelConfig
from shipyard.inference.client import HttpInferenceClient, LocalInferenceClient
from shipyard.inference.engine.engine import EmbeddedEngine
from shipyard.inference.serving.openai_api import choice_seed
from shipyard.inference.serving.server import InferenceServer
from shipyard.inference.types import GenerateRequest, GenerateResult, SamplingParams
from shipyard.models.loading import load_model


@pytest.fixture(scope="module")
def served(model_tok: tuple[Any, Any]) -> Iterator[tuple[EmbeddedEngine, InferenceServer]]:
    engine = EmbeddedEngine(*model_tok, max_batch=8)
    with InferenceServer(engine, gather_window_s=0.05, model_name="tiny") as server:
        yield engine, server


@pytest.fixture()
def client(served: tuple[EmbeddedEngine, InferenceServer]) -> Iterator[HttpInferenceClient]:
    with HttpInferenceClient(served[1].url, timeout_s=60) as c:
        yield c


def _req(prompt: list[int], max_tokens: int = 6, **kw: Any) -> GenerateRequest:
    return GenerateRequest(prompt, SamplingParams(max_tokens=max_tokens, **kw))


def _concurrently(call: Any, reqs: list[GenerateRequest]) -> list[list[GenerateResult]]:
    """Each request in its own thread, released together by a barrier."""
    out: list[list[GenerateResult]] = [[] for _ in reqs]
    barrier = threading.Barrier(len(reqs))

    def one(i: int) -> None:
        barrier.wait()
        out[i] = call([reqs[i]])

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(reqs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return out


def test_health_and_version(
    client: HttpInferenceClient, served: tuple[EmbeddedEngine, InferenceServer]
) -> None:
    engine, server = served
    assert client.wait_ready(10) == engine.version == client.version()
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok", "version": engine.version}
    stats = httpx.get(f"{server.url}/stats").json()
    assert stats["sequences"] == engine.stats["sequences"] and stats["prefix_cache_entries"] == 0


def test_generate_round_trip_is_token_exact(
    client: HttpInferenceClient, served: tuple[EmbeddedEngine, InferenceServer]
) -> None:
    engine, _ = served
    reqs = [
        _req([5, 6, 7], 8, temperature=0.0),
        _req([9, 10], 5, temperature=0.9, seed=7),
        _req([3] * 9, 4, seed=8, top_p=0.8),
    ]
    over_http = client.generate(reqs)
    direct = engine.generate(reqs)
    assert [r.to_json() for r in over_http] == [r.to_json() for r in direct]
    assert [len(r.token_ids) for r in over_http] == [8, 5, 4]
    assert client.generate([]) == []


def test_concurrent_http_calls_are_batched(
    client: HttpInferenceClient, served: tuple[EmbeddedEngine, InferenceServer]
) -> None:
    engine, _ = served
    before = dict(engine.stats)
    reqs = [_req([10 + i, 20 + i, 30], 6, seed=i) for i in range(6)]
    results = _concurrently(client.generate, reqs)
    assert all(len(r) == 1 and len(r[0].token_ids) == 6 for r in results)
    assert engine.stats["sequences"] - before["sequences"] == 6
    assert engine.stats["batches"] - before["batches"] < 6 and engine.stats["largest_batch"] > 1
    [alone] = client.generate([reqs[2]])
    assert alone.token_ids == results[2][0].token_ids


def test_chat_completions(served: tuple[EmbeddedEngine, InferenceServer], model_tok: tuple[Any, Any]) -> None:
    engine, server = served
    tok = model_tok[1]
    messages = [{"role": "user", "content": "Say hello."}]
    body = {
        "model": "tiny",
        "messages": messages,
        "temperature": 0.7,
        "max_tokens": 7,
        "seed": 11,
        "n": 2,
        "stop": "zzzz-never",
    }
    resp = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)
    assert resp.status_code == 200, resp.text
    data = resp.json()
    prompt = tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]
    assert data["object"] == "chat.completion" and data["model"] == "tiny" and len(data["choices"]) == 2
    for i, choice in enumerate(data["choices"]):
        ext = choice["shipyard"]
        assert choice["index"] == i and choice["finish_reason"] == "length" and len(ext["token_ids"]) == 7
        assert choice["message"] == {
            "role": "assistant",
            "content": tok.decode(ext["token_ids"], skip_special_tokens=True),
        }
        assert len(ext["logprobs"]) == 7 and ext["versions"] == [engine.version] * 7
        seed = choice_seed(11, i)  # choice 0 keeps the seed; later choices hash (seed, i)
        [direct] = engine.generate([_req(list(prompt), 7, temperature=0.7, seed=seed, stop=["zzzz-never"])])
        assert direct.token_ids == ext["token_ids"]
    assert data["usage"] == {
        "prompt_tokens": len(prompt),
        "completion_tokens": 14,
        "total_tokens": len(prompt) + 14,
    }


def test_chat_stop_string_is_cut_from_content(
    served: tuple[EmbeddedEngine, InferenceServer], model_tok: tuple[Any, Any]
) -> None:
    _, server = served
    tok = model_tok[1]
    body: dict[str, Any] = {"messages": [{"role": "user", "content": "Go"}], "max_tokens": 12, "seed": 3}
    first = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60).json()["choices"][0]
    ids = first["shipyard"]["token_ids"]
    stop = next(
        tok.decode(ids[i : i + 1]).strip() for i in range(4, len(ids)) if tok.decode(ids[i : i + 1]).strip()
    )
    cut = httpx.post(f"{server.url}/v1/chat/completions", json={**body, "stop": [stop]}, timeout=60).json()[
        "choices"
    ][0]
    assert cut["finish_reason"] == "stop" and stop not in cut["message"]["content"]
    assert stop in tok.decode(cut["shipyard"]["token_ids"])


def test_malformed_requests_are_rejected(
    client: HttpInferenceClient, served: tuple[EmbeddedEngine, InferenceServer]
) -> None:
    _, server = served
    with pytest.raises(ValueError, match="prompt_ids is empty"):
        client.generate([_req([])])
    assert httpx.post(f"{server.url}/generate", json={"requests": [{"params": {}}]}).status_code == 400
    empty = httpx.post(f"{server.url}/v1/chat/completions", json={"messages": []})
    assert empty.status_code == 400 and empty.json()["error"]["param"] == "messages"


def test_staged_weights_go_live_when_idle(model_tok: tuple[Any, Any]) -> None:
    model, tok = load_model(ModelConfig(source="tiny", tiny="dense", seed=0))
    engine = EmbeddedEngine(model, tok)
    new = load_model(ModelConfig(source="tiny", tiny="dense", seed=1))[0].state_dict()
    threads_before = set(threading.enumerate())
    with InferenceServer(engine) as server, HttpInferenceClient(server.url) as client:
        [before] = client.generate([_req([4, 5, 6], 3)])
        engine.stage_weights(7, new)
        deadline = time.monotonic() + 60
        while client.version() != 7 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert client.version() == 7 and len(engine.pauses) == 1
        [after] = client.generate([_req([4, 5, 6], 3)])
    assert before.versions == [0, 0, 0] and after.versions == [7, 7, 7]
    assert set(threading.enumerate()) <= threads_before, "stop() left threads running"


def test_local_client_batches_threads(model_tok: tuple[Any, Any]) -> None:
    engine = EmbeddedEngine(*model_tok, max_batch=8)
    threads_before = set(threading.enumerate())
    with LocalInferenceClient(engine, gather_window_s=0.05) as client:
        reqs = [_req([7, 8, 9 + i], 4, seed=i) for i in range(5)]
        results = _concurrently(client.generate, reqs)
        assert client.version() == 0 and client.wait_ready() == 0
    assert [len(r[0].token_ids) for r in results] == [4] * 5
    assert engine.stats["sequences"] == 5 and engine.stats["batches"] < 5
    assert set(threading.enumerate()) <= threads_before, "close() left the scheduler thread running"


def test_request_arriving_mid_generation_joins_and_returns_first(model_tok: tuple[Any, Any]) -> None:
    """Continuous batching through the scheduler: a short call made while a long one decodes is
    admitted at the next step and answered while the long one is still running."""
    engine = EmbeddedEngine(*model_tok, max_batch=4)
    with LocalInferenceClient(engine, gather_window_s=0.0) as client:
        long_fut = client._scheduler.submit([_req([11, 12, 13], 400, seed=1, temperature=1.0)])
        deadline = time.monotonic() + 60
        while engine.stats["decode_steps"] < 3 and time.monotonic() < deadline:
            time.sleep(0.001)
        [short] = client.generate([_req([5, 6], 3, seed=2)])
        long_running = not long_fut.done()
        [long] = long_fut.result(timeout=120)
    assert len(short.token_ids) == 3 and engine.stats["joins"] == 1
    assert long_running and len(long.token_ids) == 400


def test_engine_failure_fails_inflight_callers_and_server_goes_on(model_tok: tuple[Any, Any]) -> None:
    engine = EmbeddedEngine(*model_tok, max_batch=4)
    real_decode = engine._decode_step
    calls = {"n": 0}

    def failing_once(*args: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("injected decode failure")
        return real_decode(*args)

    engine._decode_step = failing_once  # type: ignore[method-assign]
    with LocalInferenceClient(engine) as client:
        with pytest.raises(RuntimeError, match="injected decode failure"):
            client.generate([_req([1, 2, 3], 8, seed=0), _req([4, 5], 8, seed=1)])
        [after] = client.generate([_req([1, 2, 3], 4, seed=0)])
    assert len(after.token_ids) == 4
