"""Calibration: fits recover known costs, sessions are read from recorded turns, bad data is refused."""

from __future__ import annotations

import pytest

from shipyard.agent.types import Trajectory
from shipyard.fleet import calibrate as cal
from shipyard.fleet.types import EngineProfile


def test_engine_fit_recovers_known_costs() -> None:
    truth = EngineProfile(step_base_s=0.03, step_per_row_s=0.004, prefill_per_token_s=2e-4, max_batch=16)
    shapes = [(48, 47, 150), (48, 94, 600), (48, 376, 1200), (48, 752, 2400), (30, 400, 7200)]
    points = [
        cal.EnginePoint(
            s, r, p, truth.step_base_s * s + truth.step_per_row_s * r + truth.prefill_per_token_s * p
        )
        for s, r, p in shapes
    ]
    fit = cal.fit_engine(points, max_batch=16)
    assert fit.step_base_s == pytest.approx(0.03) and fit.step_per_row_s == pytest.approx(0.004)
    assert fit.prefill_per_token_s == pytest.approx(2e-4)
    assert cal.engine_fit_error(fit, points) < 1e-9


def test_engine_fit_refuses_too_few_or_negative() -> None:
    with pytest.raises(ValueError, match="at least 3"):
        cal.fit_engine([cal.EnginePoint(1, 1, 1, 1.0)] * 2, 16)
    # more rows costing less time: a measurement the linear model cannot hold
    bad = [
        cal.EnginePoint(10, 10, 100, 5.0),
        cal.EnginePoint(10, 100, 100, 1.0),
        cal.EnginePoint(10, 50, 2000, 3.0),
    ]
    with pytest.raises(ValueError, match="negative cost"):
        cal.fit_engine(bad, 16)


def test_trainer_fit_from_records() -> None:
    tokens = {1: 1000, 2: 2000, 3: 3000}
    records, elapsed = [], 0.0
    for step, n in tokens.items():
        train_s = 2.0 + 0.001 * n
        elapsed += 0.5 + train_s + 1.25  # wait, train, then checkpoint and publish
        records.append(
            {
                "kind": "train",
                "step": step,
                "time/train_s": train_s,
                "time/step_s": 0.5 + train_s,
                "time/elapsed_s": elapsed,
            }
        )
    fit = cal.fit_trainer(records, tokens)
    assert fit.step_base_s == pytest.approx(2.0) and fit.per_token_s == pytest.approx(0.001)
    assert fit.publish_s == pytest.approx(1.25)


def _traj(turns: list[dict], segment: int = 0) -> Trajectory:
    n = turns[-1]["end"]
    return Trajectory(
        "t", "g", 0, [0] * n, [0] * n, [0.0] * n, [0] * n, prompt_len=turns[0]["end"], segment_idx=segment
    )


def test_session_of_reads_tokens_and_timings_per_turn() -> None:
    turns = [
        {"role": "prompt", "start": 0, "end": 300, "text": "", "setup_s": 0.02},
        {"role": "assistant", "start": 300, "end": 360, "text": "", "gen_s": 3.0, "env_s": 0.4},
        {"role": "tool", "start": 360, "end": 420, "text": ""},
        {"role": "assistant", "start": 420, "end": 500, "text": "", "gen_s": 4.0, "env_s": 0.3},
    ]
    t = _traj(turns)
    t.turns = turns
    s = cal.session_of([t])
    assert s.setup_s == pytest.approx(0.02)
    assert [(x.new_prompt_tokens, x.sampled_tokens, x.env_s) for x in s.turns] == [
        (300, 60, 0.4),
        (60, 80, 0.3),
    ]
    assert s.tokens == 500
    turns[1]["cached"], turns[3]["cached"] = 81, 360  # a shared system prompt, then the whole turn
    s = cal.session_of([t])
    assert [x.new_prompt_tokens for x in s.turns] == [300 - 81, 60]


def test_run_figures_exclude_the_first_step_from_steady_throughput() -> None:
    recs = [
        {
            "kind": "train",
            "step": i,
            "rollout/samples": 16,
            "time/wait_s": w,
            "time/elapsed_s": e,
            "staleness/mean": 1.0,
        }
        for i, (w, e) in enumerate([(50.0, 60.0), (1.0, 90.0), (1.0, 120.0)], start=1)
    ]
    f = cal.run_figures(recs)
    assert f["samples_per_s"] == pytest.approx(48 / 120) and f["steady_samples_per_s"] == pytest.approx(
        32 / 60
    )
    assert f["trainer_idle_frac"] == pytest.approx(52 / 120)
