"""The tiered scheduler: production first, scavenger rows preempted and resumed without loss."""

import threading
import time
from typing import Any

import pytest

from shipyard.config.schema import ScavengeConfig
from shipyard.inference.engine.engine import EmbeddedEngine
from shipyard.inference.engine.scheduler import BatchScheduler
from shipyard.inference.types import GenerateRequest, SamplingParams

NO_EOS = {0: -100.0, 1: -100.0, 2: -100.0}
"""Logit bias that keeps the tiny model's special tokens (eos among them) from ending a row early."""


def _req(n: int, priority: str = "production", seed: int = 0, temperature: float = 0.0) -> GenerateRequest:
    params = SamplingParams(temperature=temperature, max_tokens=n, seed=seed, logit_bias=NO_EOS)
    return GenerateRequest([5, 6, 7, 8], params, priority=priority)  # type: ignore[arg-type]


def _counter(at: int) -> tuple[threading.Event, Any]:
    seen, event = [0], threading.Event()

    def count(*_: Any) -> None:
        seen[0] += 1
        if seen[0] >= at:
            event.set()

    return event, count


def test_production_preempts_a_scavenger_row_which_resumes_to_the_same_tokens(model_tok) -> None:
    reference = EmbeddedEngine(*model_tok, max_batch=2).generate([_req(120, "scavenger")])[0]
    engine = EmbeddedEngine(*model_tok, max_batch=2, prefix_cache_mb=64)
    sched = BatchScheduler(
        engine, reserved_slots=0, scavenge=ScavengeConfig(enabled=True, resume_after_s=0.2)
    )
    try:
        flowing, count = _counter(20)
        scav = sched.submit([_req(120, "scavenger")], on_token=count)
        assert flowing.wait(30)
        prod = sched.submit([_req(4)])
        prod_result = prod.result(timeout=30)
        assert not scav.done(), "the production request finished while the scavenger row waits"
        [joined] = scav.result(timeout=60)
    finally:
        sched.close(drain_s=1.0)
    assert len(prod_result[0].token_ids) == 4
    stats = sched.tier_stats
    assert stats.preemptions == 1 and len(stats.yields_s) == 1 and stats.yields_s[0] < 5.0
    # the preempted row left at the step boundary before production was admitted: production
    # started a batch of its own instead of joining (and copying) the scavenger's cache
    assert engine.stats["joins"] == 0
    # greedy: the joined parts are the uninterrupted generation, token for token
    assert (
        joined.token_ids == reference.token_ids
        and joined.finish_reason == reference.finish_reason == "length"
    )
    assert len(joined.logprobs) == len(joined.versions) == 120
    assert max(abs(a - b) for a, b in zip(joined.logprobs, reference.logprobs, strict=True)) < 1e-4
    assert stats.production_tokens == 4 and stats.scavenger_requests == 1
    # one quiet period after production; the row came back no sooner than resume_after_s
    assert stats.quiet_periods == 1 and 0.2 <= stats.resume_wait_s < 5.0
    assert engine.stats["prefix_prefill_s"] > 0 and engine.stats["decode_s"] > engine.stats["prefill_s"] > 0


def test_finish_mode_lets_scavenger_rows_end_and_holds_new_ones_back(model_tok) -> None:
    engine = EmbeddedEngine(*model_tok, max_batch=2)
    cfg = ScavengeConfig(enabled=True, mode="finish", resume_after_s=0.3)
    sched = BatchScheduler(engine, reserved_slots=0, scavenge=cfg)
    try:
        flowing, count = _counter(10)
        first = sched.submit([_req(60, "scavenger", seed=1, temperature=1.0)], on_token=count)
        assert flowing.wait(30)
        prod = sched.submit([_req(40)])
        later = sched.submit([_req(8, "scavenger", seed=2)])
        [prod_result] = prod.result(timeout=30)
        prod_done = time.monotonic()
        later_result = later.result(timeout=30)
        later_done = time.monotonic()
        first.result(timeout=30)
    finally:
        sched.close(drain_s=1.0)
    stats = sched.tier_stats
    assert stats.preemptions == 0 and len(first.result()[0].token_ids) == 60
    assert len(prod_result.token_ids) == 40 and len(later_result[0].token_ids) == 8
    # the later scavenger request (8 tokens: milliseconds) waited out production and its quiet period
    assert later_done - prod_done >= 0.3
    assert len(stats.yields_s) == 1  # the running row gave its slot back when it ended


def test_scavenger_rows_may_keep_their_allowance_next_to_production(model_tok) -> None:
    engine = EmbeddedEngine(*model_tok, max_batch=4)
    cfg = ScavengeConfig(enabled=True, rows_with_production=1)
    sched = BatchScheduler(engine, reserved_slots=0, scavenge=cfg)
    try:
        flowing, count = _counter(30)
        scav = sched.submit([_req(80, "scavenger", seed=s) for s in range(3)], on_token=count)
        assert flowing.wait(30)
        sched.submit([_req(4)]).result(timeout=30)
        results = scav.result(timeout=60)
    finally:
        sched.close(drain_s=1.0)
    assert sched.tier_stats.preemptions == 2  # three rows, one may stay
    assert [len(r.token_ids) for r in results] == [80, 80, 80]


def test_without_scavenge_tiers_are_served_alike(model_tok) -> None:
    engine = EmbeddedEngine(*model_tok, max_batch=2)
    sched = BatchScheduler(engine, reserved_slots=0)
    try:
        flowing, count = _counter(10)
        scav = sched.submit([_req(60, "scavenger")], on_token=count)
        assert flowing.wait(30)
        sched.submit([_req(4)]).result(timeout=30)
        assert len(scav.result(timeout=30)[0].token_ids) == 60
    finally:
        sched.close(drain_s=1.0)
    assert sched.tier_stats.preemptions == 0 and sched.tier_stats.production_tokens == 64


def test_a_request_naming_an_unknown_priority_is_refused() -> None:
    with pytest.raises(ValueError, match="priority='urgent'"):
        GenerateRequest.from_json({"prompt_ids": [1], "priority": "urgent"})
    assert GenerateRequest.from_json({"prompt_ids": [1], "priority": "scavenger"}).priority == "scavenger"


@pytest.mark.parametrize(("budget", "prefills"), [(4, 3), (8, 2), (512, 1)])
def test_scavenger_prefills_are_capped_per_step(model_tok, budget: int, prefills: int) -> None:
    engine = EmbeddedEngine(*model_tok, max_batch=4)
    sched = BatchScheduler(
        engine, reserved_slots=0, scavenge=ScavengeConfig(enabled=True, prefill_tokens=budget)
    )
    try:  # three 4-token prompts in one call: one row per step under 4 tokens, two under 8, all under 512
        results = sched.generate([_req(6, "scavenger", seed=s) for s in range(3)])
    finally:
        sched.close(drain_s=1.0)
    assert [len(r.token_ids) for r in results] == [6, 6, 6]
    assert engine.stats["batches"] == prefills


def test_preempted_rows_resume_together_since_their_prefix_is_cached(model_tok) -> None:
    engine = EmbeddedEngine(*model_tok, max_batch=4, prefix_cache_mb=64)
    sched = BatchScheduler(
        engine,
        reserved_slots=0,
        scavenge=ScavengeConfig(enabled=True, prefill_tokens=4, resume_after_s=0.1),
    )
    try:  # a 4-token budget: cold 4-token prompts go in one per step boundary
        flowing, count = _counter(30)
        scav = sched.submit([_req(120, "scavenger", seed=s, temperature=0.7) for s in range(3)], count)
        assert flowing.wait(30)
        assert engine.stats["batches"] == 3 and sched.tier_stats.preemptions == 0
        prod = GenerateRequest([9, 10, 11], SamplingParams(max_tokens=4, logit_bias=NO_EOS))
        sched.submit([prod]).result(timeout=30)
        results = scav.result(timeout=60)
    finally:
        sched.close(drain_s=1.0)
    assert sched.tier_stats.preemptions == 3 and [len(r.token_ids) for r in results] == [120] * 3
    # each continuation forwards one token (the rest is its own cached prefix): all three fit the
    # 4-token budget at one boundary; counted by prompt length they would take three
    assert engine.stats["prefix_hits"] == 3
    assert engine.stats["batches"] == 3 + 1 + 1


def test_a_long_scavenger_prompt_is_prefilled_in_pieces_through_the_prefix_cache(model_tok) -> None:
    prompt = [5 + (7 * k) % 90 for k in range(20)]
    params = SamplingParams(temperature=0.0, max_tokens=12, logit_bias=NO_EOS)
    req = GenerateRequest(prompt, params, priority="scavenger")
    reference = EmbeddedEngine(*model_tok, max_batch=2).generate([req])[0]
    engine = EmbeddedEngine(*model_tok, max_batch=2, prefix_cache_mb=64)
    sched = BatchScheduler(engine, reserved_slots=0, scavenge=ScavengeConfig(enabled=True, prefill_tokens=8))
    try:
        [result] = sched.generate([req])
    finally:
        sched.close(drain_s=1.0)
    # 20 prompt tokens under an 8-token cap: pieces [:8] and [:16], then the row forwards the last 4
    assert sched.tier_stats.prefill_chunks == 2 and engine.stats["batches"] == 3
    assert engine.stats["prefix_hits"] == 2 and engine.stats["prefix_tokens"] == 8 + 16
    assert result.token_ids == reference.token_ids and result.cached_tokens == 16
    assert max(abs(a - b) for a, b in zip(result.logprobs, reference.logprobs, strict=True)) < 1e-4
