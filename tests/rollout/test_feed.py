"""Trainer's rollout feed: arrival order, staleness drops, crashed sessions, no double use."""

import time
from collections import Counter
from pathlib import Path

import pytest

from shipyard.agent.types import Trajectory
from shipyard.rollout.types import RolloutBatch
from shipyard.store import LocalStore
from shipyard.trainer.feed import RolloutFeed


def _traj(gid: str, i: int, version: int, error: str | None = None, reward: float = 0.5) -> Trajectory:
    return Trajectory(
        "t",
        gid,
        i,
        [1, 2, 3, 4],
        [0, 0, 1, 1],
        [0.0, 0.0, -0.5, -0.7],
        [-1, -1, version, version],
        prompt_len=2,
        reward=reward,
        error=error,
    )


def _batch(store: LocalStore, name: str, groups: dict[str, int], errors: int = 0) -> None:
    trajs = []
    for gid, v in groups.items():
        trajs += [_traj(gid, i, v, error="boom" if i < errors else None) for i in range(4)]
    b = RolloutBatch(batch_id=name, worker_id="w0", created_at=time.time(), trajectories=trajs, run_id="r1")
    store.put(b.key(), b.to_bytes())


def test_batch_roundtrip_is_exact(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    _batch(store, "w0/00000000", {"g0": 3})
    b = RolloutBatch.from_bytes(store.get("rollouts/w0/00000000.json.gz"))
    assert b.trajectories[1] == _traj("g0", 1, 3)


def test_take_in_order_and_drop_stale_and_errors(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    _batch(store, "w0/00000000", {"old": 0, "g1": 4})
    _batch(store, "w0/00000001", {"crashy": 5}, errors=3)
    _batch(store, "w0/00000002", {"g2": 5, "bad": 5})
    feed = RolloutFeed(store, "r1")
    taken = feed.take(2, current_version=5, max_off_policy_steps=2, timeout_s=5)
    assert [g[0].group_id for g in taken.groups] == ["g1", "g2"]
    assert taken.dropped_stale == 4 and taken.dropped_errors == 4 and taken.staleness == [1, 0]
    taken = feed.take(1, current_version=5, max_off_policy_steps=2, timeout_s=5)
    assert [g[0].group_id for g in taken.groups] == ["bad"]
    with pytest.raises(TimeoutError, match="rollouts/"):
        feed.take(1, current_version=5, max_off_policy_steps=2, timeout_s=0.5)
    assert {"old", "g1", "crashy", "g2", "bad"} == feed.consumed


def test_restarted_feed_skips_consumed_groups(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    _batch(store, "w0/00000000", {"a": 1, "b": 1})
    feed = RolloutFeed(store, "r1")
    feed.take(1, current_version=1, max_off_policy_steps=0, timeout_s=5)
    again = RolloutFeed(store, "r1", consumed=feed.consumed)
    taken = again.take(1, current_version=1, max_off_policy_steps=0, timeout_s=5)
    assert [g[0].group_id for g in taken.groups] == ["b"]


def test_groups_and_adoptions_keep_their_region(tmp_path: Path) -> None:
    from shipyard.trainer.loop import _train_record

    store = LocalStore(tmp_path)
    for k, (name, region, groups, adopted) in enumerate(
        [
            (
                "eu/00000000",
                "eu",
                {"e0": 4, "e1": 2},
                [{"server": "s-eu", "version": 4, "at": 103.0, "published_at": 100.0}],
            ),
            (
                "us/00000000",
                "us",
                {"u1": 1, "u0": 5},
                [{"server": "s-us", "version": 5, "at": 201.5, "published_at": 200.0}],
            ),
        ]
    ):
        trajs = [_traj(gid, i, v) for gid, v in groups.items() for i in range(4)]
        b = RolloutBatch(name, name[:2], 100.0 + k, trajs, run_id="r1", region=region, adoptions=adopted)
        store.put(b.key(), b.to_bytes())
    feed = RolloutFeed(store, "r1")
    taken = feed.take(3, current_version=5, max_off_policy_steps=3, timeout_s=5)
    assert taken.regions == ["eu", "eu", "us"] and taken.staleness == [1, 3, 0]
    assert taken.dropped_stale == 4  # u1: 4 versions behind, from whichever region
    record = _train_record(taken, {}, {}, version=5, bound=3)
    assert record["region/eu/staleness_max"] == 3.0 and record["region/eu/groups"] == 2.0
    assert record["region/us/staleness_mean"] == 0.0
    assert record["region/eu/adoption_lag_s"] == 3.0 and record["region/us/adoption_lag_s"] == 1.5
    assert record["region/us/version"] == 5.0 and record["rollout/over_bound_trained"] == 0.0
    # the audit counts what a bound of 2 would have let through wrongly
    assert _train_record(taken, {}, {}, version=5, bound=2)["rollout/over_bound_trained"] == 4.0
    assert feed.take(0, 5, 3, 1).adoptions == []  # reported once


def test_the_workers_are_credited_what_the_trainer_finished_with(tmp_path: Path) -> None:
    """``consumed_by`` counts every group a worker wrote once the trainer is done with it (trained,
    stale, crashed, a second group of one id, another run's; a restarted feed recounts), and while a
    take waits it reports that less the groups it will train, so dropped ones get replaced."""
    store = LocalStore(tmp_path)
    _batch(store, "w0/00000000", {"old": 0, "g1": 4})
    _batch(store, "w0/00000001", {"crashy": 5, "g1": 5}, errors=3)  # g1 again: a restarted worker's
    foreign = RolloutBatch(
        "w0/00000002", "w0", time.time(), [_traj("x", i, 5) for i in range(4)], run_id="r0"
    )
    store.put(foreign.key(), foreign.to_bytes())
    feed = RolloutFeed(store, "r1", poll_s=0.01)
    seen: list[dict[str, int]] = []

    def credited(done: Counter[str]) -> None:
        seen.append(dict(done))
        if len(seen) == 1:  # the workers replace the dropped groups
            _batch(store, "w0/00000003", {"g3": 5})

    taken = feed.take(2, current_version=5, max_off_policy_steps=2, timeout_s=5, on_wait=credited)
    assert [g[0].group_id for g in taken.groups] == ["g1", "g3"]
    # waiting: old (stale), crashy (crashed), the second g1 and the foreign x are credited; g1 is not yet
    assert seen[0] == {"w0": 4}
    assert feed.consumed_by == {"w0": 6}
    again = RolloutFeed(store, "r1", consumed=feed.consumed)
    again.poll()
    assert again.consumed_by == {"w0": 6}


def test_dynamic_sampling_skips_uniform_groups_up_to_its_budget(tmp_path: Path) -> None:
    """``skip_uniform``: groups whose sessions all earned one reward are skipped (and credited, so the
    workers replace them) until the take has skipped that many; then uniform groups are taken."""
    store = LocalStore(tmp_path)
    rewards = {"u0": [0.0] * 4, "s1": [0.0, 1.0, 0.0, 0.0], "u2": [1.0] * 4, "s3": [0.5, 0.5, 0.5, 0.25]}
    rewards |= {"u4": [0.0] * 4, "u5": [0.0] * 4, "s6": [1.0, 0.0, 1.0, 1.0]}
    trajs = [_traj(g, i, 5, reward=r) for g, rs in rewards.items() for i, r in enumerate(rs)]
    b = RolloutBatch(
        batch_id="w0/00000000", worker_id="w0", created_at=time.time(), trajectories=trajs, run_id="r1"
    )
    store.put(b.key(), b.to_bytes())
    feed = RolloutFeed(store, "r1", poll_s=0.01)
    first = feed.take(2, 5, 2, timeout_s=5, skip_uniform=2)
    assert [g[0].group_id for g in first.groups] == ["s1", "s3"] and first.skipped_uniform == 2
    assert feed.consumed_by == {"w0": 4}  # the skipped ones are credited: the workers replace them
    second = feed.take(2, 5, 2, timeout_s=5, skip_uniform=1)  # budget spent on u4: u5 is taken
    assert [g[0].group_id for g in second.groups] == ["u5", "s6"] and second.skipped_uniform == 1
    off = RolloutFeed(store, "r1", poll_s=0.01).take(2, 5, 2, timeout_s=5)
    assert [g[0].group_id for g in off.groups] == ["u0", "s1"] and off.skipped_uniform == 0
