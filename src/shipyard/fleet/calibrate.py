"""Calibrate the simulator from measurements: engine timings, a run's records and its store.

Contract (pure functions over measured figures; nothing here times anything itself):

- :func:`fit_engine`: an :class:`EngineProfile` from timed engine calls (decode steps, row-steps
  and prompt tokens forwarded against wall seconds), by least squares on
  ``seconds = base * steps + per_row * row_steps + per_token * prompt_tokens``;
- :func:`fit_trainer`: a :class:`TrainerProfile` from a run's train records (``time/train_s``
  against the step's sequence tokens; ``publish_s`` is what a step's clock holds besides waiting
  and training: checkpoint, publish);
- :func:`workload_from_batches`: the sessions a run played (tokens forwarded and sampled per
  turn, the session's ``setup_s`` and each turn's ``env_s`` as :class:`~shipyard.agent.session`
  records them);
- :func:`sync_lag` and :func:`run_figures`: what the real run showed (adoption lag from the
  store's adoption records; throughput over the whole run and after its first step).

Limits: a trajectory recorded before turn timings existed has ``env_s = 0``; the fits assume the
engine's and the trainer's costs are linear in their sizes (checked by the fit residual the
benchmark prints).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from shipyard.agent.types import Trajectory, group_sessions
from shipyard.fleet.types import EngineProfile, Session, TrainerProfile, Turn, Workload
from shipyard.rollout.types import ROLLOUT_PREFIX, RolloutBatch
from shipyard.store.types import Store
from shipyard.weights.types import ADOPTIONS_PREFIX


@dataclass(frozen=True)
class EnginePoint:
    """One timed engine call."""

    decode_steps: int
    row_steps: int
    """Sum over decode steps of the rows decoded (= tokens generated after the first of each row)."""
    prompt_tokens: int
    seconds: float


def fit_engine(points: list[EnginePoint], max_batch: int, apply_s: float = 0.0) -> EngineProfile:
    """Least-squares engine costs (module doc); a negative coefficient is an error of the measurement."""
    if len(points) < 3:
        raise ValueError(f"fit_engine needs at least 3 timed calls of different shapes, got {len(points)}")
    a = np.array([[p.decode_steps, p.row_steps, p.prompt_tokens] for p in points], dtype=float)
    y = np.array([p.seconds for p in points])
    (base, per_row, per_token), *_ = np.linalg.lstsq(a, y, rcond=None)
    if min(base, per_row, per_token) < 0:
        raise ValueError(
            f"engine fit has a negative cost (base {base:.4g}, per row {per_row:.4g}, per prompt token "
            f"{per_token:.4g}): time calls that vary batch size and prompt length more"
        )
    return EngineProfile(float(base), float(per_row), float(per_token), max_batch, apply_s)


def engine_fit_error(profile: EngineProfile, points: list[EnginePoint]) -> float:
    """Largest relative error of the fitted profile on the calls it was fitted to."""
    worst = 0.0
    for p in points:
        pred = (
            profile.step_base_s * p.decode_steps
            + profile.step_per_row_s * p.row_steps
            + profile.prefill_per_token_s * p.prompt_tokens
        )
        worst = max(worst, abs(pred - p.seconds) / p.seconds)
    return worst


def fit_linear(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Intercept and slope of ``ys`` on ``xs``, the slope held >= 0 (a flat fit if it is not)."""
    x, y = np.asarray(xs, dtype=float), np.asarray(ys, dtype=float)
    if len(x) < 2 or np.ptp(x) == 0:
        return float(y.mean()), 0.0
    slope, icpt = np.polyfit(x, y, 1)
    if slope < 0:
        return float(y.mean()), 0.0
    return float(icpt), float(slope)


def fit_trainer(records: list[dict[str, Any]], step_tokens: dict[int, int]) -> TrainerProfile:
    """Trainer costs from train records and each step's sequence tokens (:func:`step_tokens`)."""
    train = [r for r in records if r.get("kind") == "train" and r["step"] in step_tokens]
    if len(train) < 2:
        raise ValueError("fit_trainer needs at least 2 train records with known step tokens")
    base, per_token = fit_linear([step_tokens[r["step"]] for r in train], [r["time/train_s"] for r in train])
    publish = []
    for prev, cur in zip(train, train[1:], strict=False):
        if cur["step"] == prev["step"] + 1:
            gap = cur["time/elapsed_s"] - prev["time/elapsed_s"] - cur["time/step_s"]
            publish.append(gap)
    return TrainerProfile(base, per_token, float(np.median(publish)) if publish else 0.0)


def read_batches(store: Store) -> list[RolloutBatch]:
    return [RolloutBatch.from_bytes(store.get(k)) for k in sorted(store.list(ROLLOUT_PREFIX))]


def step_tokens(records: list[dict[str, Any]], batches: list[RolloutBatch]) -> dict[int, int]:
    """Per trainer step, the sequence tokens of the groups it consumed (the ``consumed`` records)."""
    tokens_of: dict[str, int] = {}
    for b in batches:
        for gid, trajs in b.groups().items():
            tokens_of[gid] = sum(len(t.token_ids) for t in trajs)
    out = {}
    for r in records:
        if r.get("kind") == "consumed" and all(g in tokens_of for g in r["groups"]):
            out[r["step"]] = sum(tokens_of[g] for g in r["groups"])
    return out


def session_of(segments: list[Trajectory]) -> Session:
    """One played session as the simulator sees it: per sampled turn, the prompt tokens the engine
    forwarded (the prompt less its ``cached`` tokens; where a record predates ``cached``, all of a
    segment's first prompt, then what came since the last sample) and the samples."""
    turns: list[Turn] = []
    setup = 0.0
    for seg in segments:
        seen = 0
        for t in seg.turns:
            setup += t.get("setup_s", 0.0)
            if "gen_s" not in t and t["role"] not in ("assistant", "summary"):
                continue
            forwarded = t["start"] - t.get("cached", seen)
            turns.append(Turn(forwarded, t["end"] - t["start"], float(t.get("env_s", 0.0))))
            seen = t["end"]
    return Session(setup, tuple(turns), sum(len(seg.token_ids) for seg in segments))


def workload_from_batches(batches: Iterable[RolloutBatch]) -> Workload:
    sessions = [session_of(s) for b in batches for s in group_sessions(b.trajectories)]
    sessions = [s for s in sessions if s.turns]
    if not sessions:
        raise ValueError("no played sessions in these rollout batches (is the run's store empty?)")
    return Workload(sessions)


def sync_lag(store: Store) -> list[float]:
    """Seconds from each version's publication to its adoption, per adoption record in the store."""
    out = []
    for key in store.list(ADOPTIONS_PREFIX):
        event = json.loads(store.get(key))
        if event.get("published_at") is not None:
            out.append(event["at"] - event["published_at"])
    return out


def run_figures(records: list[dict[str, Any]]) -> dict[str, float]:
    """Throughput of a real run, whole and after its first step (start-up excluded)."""
    train = [r for r in records if r.get("kind") == "train"]
    if len(train) < 2:
        raise ValueError("run_figures needs at least 2 train records")
    elapsed = train[-1]["time/elapsed_s"]
    samples = sum(r["rollout/samples"] for r in train)
    steady = sum(r["rollout/samples"] for r in train[1:])
    return {
        "samples_per_s": samples / elapsed,
        "steady_samples_per_s": steady / (elapsed - train[0]["time/elapsed_s"]),
        "trainer_idle_frac": sum(r["time/wait_s"] for r in train) / elapsed,
        "staleness_mean": float(np.mean([r["staleness/mean"] for r in train])),
        "steps": float(len(train)),
    }


def sim_figures(step_end_s: list[float], samples_per_step: list[int], idle_s: float) -> dict[str, float]:
    """The same figures for a simulated run (step end times and samples per step)."""
    elapsed = step_end_s[-1]
    return {
        "samples_per_s": sum(samples_per_step) / elapsed,
        "steady_samples_per_s": sum(samples_per_step[1:]) / (elapsed - step_end_s[0]),
        "trainer_idle_frac": idle_s / elapsed,
    }


def fit_contention(
    throughput: Callable[[float], float], target: float, hi: float = 4.0, iters: int = 40
) -> float:
    """The host contention at which a simulated run's ``throughput(contention)`` (falling as
    contention rises) meets the real run's ``target``, by bisection on ``[0, hi]``; 0 when the
    simulation without contention is already no faster than the run."""
    if throughput(0.0) <= target:
        return 0.0
    lo = 0.0
    for _ in range(iters):
        mid = (lo + hi) / 2
        if throughput(mid) > target:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2
