"""The diurnal production trace and its replay against a real tiered server."""

from __future__ import annotations

import math

import pytest

from shipyard.config.schema import ModelConfig, ScavengeConfig
from shipyard.fleet.trace import DiurnalTrace, ScavengerLoad, replay


def test_the_rate_swings_from_night_to_day_and_bursts_add_to_it() -> None:
    trace = DiurnalTrace(period_s=100, night_rps=0.1, day_rps=1.1, burst_rps=2.0, burst_s=5.0)
    assert trace.rate(0.0) == pytest.approx(0.1) and trace.rate(100.0) == pytest.approx(0.1)
    assert trace.rate(50.0) == pytest.approx(1.1) and trace.rate(25.0) == pytest.approx(0.6)
    assert (
        trace.rate(52.0, bursts=[50.0]) == pytest.approx(trace.rate(52.0) + 2.0)
        and trace.rate(56.0, bursts=[50.0]) < 1.1
    )


def test_arrivals_follow_the_rate_and_repeat_with_the_seed() -> None:
    trace = DiurnalTrace(period_s=200, periods=5, night_rps=0.2, day_rps=2.0, bursts_per_period=0.0)
    arrivals = trace.arrivals()
    assert (
        arrivals == trace.arrivals() and arrivals != DiurnalTrace(**{**trace.__dict__, "seed": 1}).arrivals()
    )
    expected = trace.duration_s * (0.2 + 2.0) / 2  # the cosine's mean
    assert abs(len(arrivals) - expected) < 4 * math.sqrt(expected)
    night = sum(a.t % 200 < 20 or a.t % 200 > 180 for a in arrivals)
    day = sum(80 < a.t % 200 < 120 for a in arrivals)
    assert day > 4 * night  # the same 40 s a day, at the peak and around midnight
    assert all(16 <= a.prompt_tokens <= 1024 and a.gen_tokens in trace.gen_tokens for a in arrivals)
    assert [a.t for a in arrivals] == sorted(a.t for a in arrivals)


def test_replay_against_a_tiered_server_serves_production_first() -> None:
    from shipyard.inference.client import HttpInferenceClient
    from shipyard.inference.engine.engine import EmbeddedEngine
    from shipyard.inference.serving.server import InferenceServer
    from shipyard.models.loading import load_model

    engine = EmbeddedEngine(*load_model(ModelConfig(source="tiny", tiny="dense")), max_batch=4)
    trace = DiurnalTrace(period_s=3.0, periods=1, night_rps=2.0, day_rps=6.0, bursts_per_period=0.0)
    with InferenceServer(engine, scavenge=ScavengeConfig(enabled=True, resume_after_s=0.1)) as server:
        # the trace's first request arrives at 0.3 s (seeded): the scavenger rows are running by then
        load = ScavengerLoad(HttpInferenceClient(server.url).generate, concurrency=4, gen_tokens=400).start()
        served = replay(trace.arrivals(), HttpInferenceClient(server.url).generate)
        load.stop()
        stats = server.app.state.scheduler.tier_stats
        over_http = HttpInferenceClient(server.url).stats()["tiers"]
    assert served and all(s.error is None and s.tokens > 0 for s in served)
    assert sum(s.tokens for s in served) == stats.production_tokens == over_http["production_tokens"]
    assert stats.preemptions > 0 and load.tokens > 0 and not load.errors
    assert len(stats.yields_s) > 0 and max(stats.yields_s) < 5.0
