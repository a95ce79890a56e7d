"""Segmented sessions in the trainer: normalisation over sessions, the store round trip, a restarted
feed, crashed or incomplete sessions, the summary bonus, and a train step over segments."""

from __future__ import annotations

import dataclasses
import math
import time
from pathlib import Path

import pytest
import torch

from shipyard.agent.types import Trajectory, group_sessions
from shipyard.config.schema import LossConfig, SummaryConfig, TrainerConfig
from shipyard.models.loading import build_tiny
from shipyard.rollout.types import RolloutBatch
from shipyard.store import LocalStore
from shipyard.trainer.advantages import batch_advantages, group_advantages
from shipyard.trainer.feed import RolloutFeed
from shipyard.trainer.step import make_optimizer, train_step

SUMMARY = 2  # sampled tokens of each synthetic summary turn


def _segment(
    gid: str, idx: int, k: int, n: int, reward: float, version: int, error: str | None
) -> Trajectory:
    """Segment k of n: prompt (3 env), action (3 sampled), tool result (2 env), then a summary turn
    (2 sampled) unless it is the last segment. Ids are distinct per position so mix-ups show."""
    mask = [0, 0, 0, 1, 1, 1, 0, 0] + ([1] * SUMMARY if k < n - 1 else [])
    ids = [100 * (idx + 1) + 10 * k + t for t in range(len(mask))]
    return Trajectory(
        "t",
        gid,
        idx,
        ids,
        mask,
        [-0.5 if m else 0.0 for m in mask],
        [version if m else -1 for m in mask],
        prompt_len=3,
        reward=reward,
        reward_info={"passed": int(reward), "total": 1},
        num_turns=1,
        finish="summary" if k < n - 1 else "max_turns",
        error=error,
        metrics={"summaries": float(n - 1)},
        session_id=f"{gid}/{idx}",
        segment_idx=k,
        num_segments=n,
        summary_tokens=SUMMARY if k < n - 1 else 0,
    )


def _session(
    gid: str, idx: int, n: int, reward: float, version: int = 0, error: str | None = None
) -> list[Trajectory]:
    return [_segment(gid, idx, k, n, reward, version, error) for k in range(n)]


def _flat(session: list[Trajectory]) -> Trajectory:
    """The same session as one unsegmented record (its tokens concatenated, no session_id)."""
    t = session[0]
    lists = [
        [x for seg in session for x in getattr(seg, f)]
        for f in ("token_ids", "loss_mask", "logprobs", "versions")
    ]
    return Trajectory("t", t.group_id, t.sample_idx, *lists, prompt_len=3, reward=t.reward)


@pytest.mark.parametrize(
    "loss",
    [
        LossConfig(),
        LossConfig(type="dr_grpo", baseline="rloo"),
        LossConfig(overlong_max_tokens=30, overlong_cache_tokens=16),
    ],
)
def test_groups_are_normalised_over_sessions_not_segments(loss: LossConfig) -> None:
    one, five = _session("g", 0, 1, reward=0.0), _session("g", 1, 5, reward=1.0)
    other = [_session("h", i, n, reward=r) for i, (n, r) in enumerate([(3, 1.0), (2, 0.5), (1, 0.0)])]
    groups = [one + five, [t for s in other for t in s]]
    seg = batch_advantages(groups, loss)
    flat = batch_advantages([[_flat(one), _flat(five)], [_flat(s) for s in other]], loss)
    sizes = [1, 5, 3, 2, 1]
    assert len(seg.trajectories) == sum(sizes) == len(seg.advantages)
    expanded = [a for a, n in zip(flat.advantages, sizes, strict=True) for _ in range(n)]
    assert seg.advantages == pytest.approx(expanded, abs=1e-6)
    assert seg.stats == pytest.approx(flat.stats)
    assert seg.advantages[0] != seg.advantages[1]  # the group is not uniform: a real signal
    if loss.overlong_max_tokens is None:  # 2 sessions, rewards 0 and 1: exactly GRPO's two-sample advantages
        two = group_advantages(
            torch.tensor([0.0, 1.0]), scale_std=loss.reward_scaling() == "group", baseline=loss.baseline
        )
        assert seg.advantages[:6] == pytest.approx([two[0].item()] + [two[1].item()] * 5)


def test_segments_survive_the_store_and_a_restarted_feed(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    sessions = {
        gid: [_session(gid, i, n, reward=float(i % 2)) for i, n in enumerate([3, 1, 4])] for gid in "ab"
    }
    trajs = [t for gid in "ab" for s in reversed(sessions[gid]) for t in reversed(s)]  # any order on disk
    batch = RolloutBatch("w0/00000000", "w0", time.time(), trajs, run_id="r1")
    store.put(batch.key(), batch.to_bytes())
    again = RolloutBatch.from_bytes(store.get(batch.key()))
    assert again.trajectories == trajs
    feed = RolloutFeed(store, "r1")
    first = feed.take(1, current_version=0, max_off_policy_steps=0, timeout_s=5)
    assert first.groups == [
        [t for s in sessions["a"] for t in s]
    ]  # sessions by sample_idx, segments in order
    assert first.dropped_errors == 0 and first.staleness == [0]
    restarted = RolloutFeed(store, "r1", consumed=set(feed.consumed))  # e.g. from a checkpoint's consumed ids
    second = restarted.take(1, current_version=0, max_off_policy_steps=0, timeout_s=5)
    assert second.groups == [[t for s in sessions["b"] for t in s]]
    with pytest.raises(TimeoutError):
        restarted.take(1, current_version=0, max_off_policy_steps=0, timeout_s=0.3)
    assert [len(s) for s in group_sessions(second.groups[0])] == [3, 1, 4]


def test_feed_counts_crashed_incomplete_and_stale_sessions_once(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    stale = _session("s", 0, 2, reward=1.0, version=0) + _session("s", 1, 4, reward=0.0, version=0)
    crashed = _session("g", 0, 3, reward=0.0, version=2, error="boom")
    partial = [t for t in _session("g", 1, 3, reward=1.0, version=2) if t.segment_idx != 1]
    good = _session("g", 2, 2, reward=1.0, version=2) + _session("g", 3, 1, reward=0.0, version=2)
    batch = RolloutBatch("w0/00000000", "w0", time.time(), stale + crashed + partial + good, run_id="r1")
    store.put(batch.key(), batch.to_bytes())
    taken = RolloutFeed(store, "r1").take(1, current_version=4, max_off_policy_steps=3, timeout_s=5)
    assert taken.groups == [good] and taken.staleness == [2]
    assert taken.dropped_stale == 2 and taken.dropped_errors == 2  # sessions, not segments


def test_summary_bonus_trains_summary_tokens_by_what_followed() -> None:
    s0 = _session("g", 0, 3, reward=1.0)  # summary 0 -> summarized again (0); summary 1 -> finished (1.0)
    s1 = _session("g", 1, 2, reward=0.0)  # summary 0 -> finished with reward 0 (0)
    cfg = SummaryConfig(segment_advantage="summary_bonus", bonus_coef=0.5)
    base = batch_advantages([s0 + s1], LossConfig())
    plain = batch_advantages([s0 + s1], LossConfig(), SummaryConfig())
    assert plain.advantages == base.advantages and plain.stats == base.stats
    bonus = batch_advantages([s0 + s1], LossConfig(), cfg)
    assert bonus.trajectories[:5] == base.trajectories and bonus.advantages[:5] == base.advantages
    views, extra = bonus.trajectories[5:], bonus.advantages[5:]
    mean = 1.0 / 3.0
    assert extra == pytest.approx([0.5 * (0 - mean), 0.5 * (1 - mean), 0.5 * (0 - mean)])
    for view, seg in zip(views, [s0[0], s0[1], s1[0]], strict=True):
        assert view.token_ids == seg.token_ids and view.logprobs == seg.logprobs
        assert view.loss_mask == [0] * (len(seg.token_ids) - SUMMARY) + [1] * SUMMARY
    assert bonus.stats["summary_bonus_views"] == 3.0
    same = batch_advantages([_session("g", 0, 2, 1.0) + _session("g", 1, 2, 1.0)], LossConfig(), cfg)
    assert len(same.trajectories) == 4  # equal signals: no bonus, no view
    broken = [dataclasses.replace(s0[0], reward=0.5), *s0[1:]]
    with pytest.raises(ValueError, match="different rewards"):
        batch_advantages([broken + s1], LossConfig())


def test_train_step_takes_segments_and_bonus_views() -> None:
    torch.manual_seed(0)
    model = build_tiny("dense", 49152, seed=0)
    s0, s1 = _session("g", 0, 3, reward=1.0), _session("g", 1, 2, reward=0.0)
    cfg = TrainerConfig(micro_batch=4)
    batch = batch_advantages([s0 + s1], cfg.loss, SummaryConfig(segment_advantage="summary_bonus"))
    out = train_step(model, make_optimizer(model, cfg), batch.trajectories, batch.advantages, cfg, pad_id=2)
    segment_tokens = sum(t.num_sampled() for t in s0 + s1)
    assert out["num_seqs"] == 5 + 3 and out["num_tokens"] == segment_tokens + 3 * SUMMARY
    assert out["skipped"] == 0.0 and math.isfinite(out["loss"])
