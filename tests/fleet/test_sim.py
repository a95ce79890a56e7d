"""The simulator against closed forms: continuous batching, barriers, versions, production priority."""

from __future__ import annotations

import pytest

from shipyard.fleet.sim import simulate
from shipyard.fleet.types import (
    EngineProfile,
    PipelineSpec,
    ProductionLoad,
    RegionSpec,
    Session,
    TrainerProfile,
    Turn,
    Workload,
)

ENGINE = EngineProfile(step_base_s=0.01, step_per_row_s=0.005, prefill_per_token_s=0.0, max_batch=16)
TRAINER = TrainerProfile(step_base_s=1.0, per_token_s=0.0, publish_s=0.5)
ONE = [RegionSpec("r", servers=1, sync_s=0.25)]


def work(*sampled: int, env_s: float = 0.0, prompt: int = 0) -> Workload:
    return Workload([Session(0.0, (Turn(prompt, n, env_s),), prompt + n) for n in sampled])


def spec(mode: str = "sync", steps: int = 3, group: int = 1, conc: int = 16, lag: int = 2) -> PipelineSpec:
    return PipelineSpec(mode, steps, 1, group, conc, max_off_policy_steps=lag)  # type: ignore[arg-type]


def test_sync_step_is_generation_then_training_then_sync() -> None:
    out = simulate(spec("sync", steps=3), ONE, ENGINE, TRAINER, work(100))
    gen = 100 * ENGINE.step_s(1)
    # step 1: generate, train, publish; later steps also wait for the region to adopt
    assert out.step_end_s[0] == pytest.approx(gen + 1.5)
    assert out.step_end_s[1] - out.step_end_s[0] == pytest.approx(0.25 + gen + 1.5)
    assert out.trainer_idle_s == pytest.approx(gen + 2 * (0.25 + gen))
    assert out.staleness == [0, 0, 0]
    assert out.sync_lag_s["r"] == pytest.approx([0.25, 0.25])  # the last version lands after the run


def test_rows_share_decode_steps_until_the_shorter_ends() -> None:
    out = simulate(
        spec("sync", steps=1, group=2),
        ONE,
        ENGINE,
        TRAINER,
        Workload([Session(0.0, (Turn(0, 10, 0.0),), 10)]),
    )
    assert out.step_end_s[0] == pytest.approx(10 * ENGINE.step_s(2) + 1.5)
    mixed = Workload([Session(0.0, (Turn(0, 10, 0.0),), 10), Session(0.0, (Turn(0, 20, 0.0),), 20)])
    # draw order is seeded; a group of 2 from {10, 20} holds either one length twice or both
    gens = {10 * ENGINE.step_s(2), 20 * ENGINE.step_s(2), 10 * ENGINE.step_s(2) + 10 * ENGINE.step_s(1)}
    for seed in range(6):
        end = simulate(spec("sync", steps=1, group=2), ONE, ENGINE, TRAINER, mixed, seed=seed).step_end_s[0]
        assert any(end == pytest.approx(g + 1.5) for g in gens)


def test_max_batch_queues_and_prefill_stalls_the_batch() -> None:
    small = EngineProfile(0.01, 0.005, prefill_per_token_s=0.001, max_batch=2)
    out = simulate(spec("sync", steps=1, group=3), ONE, small, TRAINER, work(10, prompt=100))
    # two rows prefill together (0.2 s) and decode 10 steps; the third prefills (0.1 s) alone after
    gen = 0.2 + 10 * small.step_s(2) + 0.1 + 10 * small.step_s(1)
    assert out.step_end_s[0] == pytest.approx(gen + 1.5)
    assert out.engine_busy_frac == pytest.approx(gen / (gen + 1.5))


def test_async_overlaps_training_within_the_staleness_bound() -> None:
    slow = TrainerProfile(step_base_s=2.0, per_token_s=0.0, publish_s=0.0)
    sync = simulate(spec("sync", steps=10), ONE, ENGINE, slow, work(200))
    asyn = simulate(spec("async", steps=10, lag=2), ONE, ENGINE, slow, work(200))
    gen = 200 * ENGINE.step_s(1)  # 3 s: generation is the slower stage
    assert sync.elapsed_s == pytest.approx(10 * (gen + 2.0) + 9 * 0.25)
    assert asyn.elapsed_s == pytest.approx(10 * gen + 2.0)  # the trainer waits only for samples
    assert max(asyn.staleness) <= 2 and max(sync.staleness) == 0
    assert asyn.samples_per_s / sync.samples_per_s > 1.5


def test_env_delays_and_turns_add_up() -> None:
    two = Workload([Session(0.3, (Turn(0, 10, 0.5), Turn(0, 20, 0.7)), 30)])
    out = simulate(spec("sync", steps=1), ONE, ENGINE, TRAINER, two)
    assert out.step_end_s[0] == pytest.approx(0.3 + 30 * ENGINE.step_s(1) + 1.2 + 1.5)
    assert out.tokens == 30 and out.samples == 1


def test_production_is_admitted_before_rollouts() -> None:
    one_slot = EngineProfile(0.01, 0.0, 0.0, max_batch=1)
    prod = ProductionLoad(rate_per_s=((0.0, 50.0),), prompt_tokens=0, sampled_tokens=1)
    busy = [RegionSpec("r", servers=1, sync_s=0.0, production=prod)]
    alone = simulate(spec("sync", steps=2, group=4), ONE, one_slot, TRAINER, work(50))
    shared = simulate(spec("sync", steps=2, group=4), busy, one_slot, TRAINER, work(50))
    assert shared.production_latency_s and max(shared.production_latency_s) < 0.5 + 0.011
    assert shared.elapsed_s > alone.elapsed_s  # rollouts got only what production left


def test_region_sync_sets_adoption_lag_and_staleness() -> None:
    regions = [RegionSpec("near", 1, sync_s=0.1), RegionSpec("far", 1, sync_s=4.0)]
    out = simulate(spec("async", steps=8, lag=3), regions, ENGINE, TRAINER, work(100))
    near, far = out.sync_lag_s["near"], out.sync_lag_s["far"]
    assert near == pytest.approx([0.1] * len(near)) and far == pytest.approx([4.0] * len(far))
    assert len(near) == 7 and len(far) >= 5
    assert max(out.staleness) <= 3


def test_bad_specs_are_refused() -> None:
    with pytest.raises(ValueError, match="RegionSpec.servers"):
        simulate(spec(), [RegionSpec("r", servers=0, sync_s=0.0)], ENGINE, TRAINER, work(1))
    with pytest.raises(ValueError, match="PipelineSpec"):
        simulate(spec(steps=0), ONE, ENGINE, TRAINER, work(1))


def test_streaming_keeps_servers_busy_past_a_straggler_and_drops_over_the_bound() -> None:
    tail = Workload(
        [Session(0.0, (Turn(0, 20, 0.0),), 20)] * 19 + [Session(0.0, (Turn(0, 2000, 0.0),), 2000)]
    )
    fast = TrainerProfile(step_base_s=0.2, per_token_s=0.0, publish_s=0.0)
    base = dict(
        mode="async", steps=30, groups_per_step=2, group_size=4, concurrency=16, max_off_policy_steps=1
    )
    barrier = simulate(PipelineSpec(**base), ONE, ENGINE, fast, tail)  # type: ignore[arg-type]
    stream = simulate(PipelineSpec(**base, streaming=True), ONE, ENGINE, fast, tail)  # type: ignore[arg-type]
    assert stream.samples_per_s > 1.25 * barrier.samples_per_s
    assert barrier.dropped_stale == 0 and max(barrier.staleness) <= 1
    assert max(stream.staleness) <= 1  # what finished too late was dropped, never trained on
    assert stream.dropped_stale > 0 and stream.samples + stream.dropped_stale == 30 * 8


def test_host_contention_slows_engine_and_trainer_while_both_compute() -> None:
    from dataclasses import replace

    shared = replace(ENGINE, contention=1.0)
    slow = TrainerProfile(step_base_s=2.0, per_token_s=0.0, publish_s=0.0)
    # sync: generation and training never overlap, so sharing the host costs nothing
    assert simulate(spec("sync", steps=4), ONE, shared, slow, work(200)).elapsed_s == pytest.approx(
        simulate(spec("sync", steps=4), ONE, ENGINE, slow, work(200)).elapsed_s
    )
    # async, steady state: a batch (3 s of generation alone) and a step (2 s alone) start together
    # and run at half speed; the step ends after 4 s, when 2 s of generation are done, and the last
    # second of generation runs alone: 5 s a step, against 3 s (generation-bound) on two devices
    out = simulate(spec("async", steps=8), ONE, shared, slow, work(200))
    alone = simulate(spec("async", steps=8), ONE, ENGINE, slow, work(200))
    assert out.step_end_s[5] - out.step_end_s[4] == pytest.approx(5.0)
    assert alone.step_end_s[5] - alone.step_end_s[4] == pytest.approx(3.0)


def test_contention_fit_finds_the_matching_slowdown() -> None:
    from dataclasses import replace

    from shipyard.fleet.calibrate import fit_contention

    slow = TrainerProfile(step_base_s=2.0, per_token_s=0.0, publish_s=0.0)

    def throughput(c: float) -> float:
        return simulate(
            spec("async", steps=6), ONE, replace(ENGINE, contention=c), slow, work(200)
        ).samples_per_s

    target = throughput(0.6)
    assert fit_contention(throughput, target) == pytest.approx(0.6, abs=1e-3)
    assert fit_contention(throughput, throughput(0.0) * 1.2) == 0.0  # faster than contention-free: none


def test_trainer_cost_counts_padded_micro_batches() -> None:
    assert TrainerProfile(0.0, 1.0, 0.0).cost_tokens([1, 5, 2, 2]) == 10
    assert TrainerProfile(0.0, 1.0, 0.0, micro_batch=2).cost_tokens([1, 5, 2, 2]) == 2 * 5 + 2 * 2
    assert TrainerProfile(0.0, 1.0, 0.0, micro_batch=4).cost_tokens([1, 5, 2]) == 3 * 5
    capped = TrainerProfile(0.0, 1.0, 0.0, micro_batch=4, micro_batch_tokens=8)
    assert capped.cost_tokens([1, 5, 2, 2, 9]) == 9 + 5 + 3 * 2  # 9 alone (over 8), 5 alone, 2+2+1


def test_trainer_cost_is_what_the_trainers_plan_pads() -> None:
    """The simulator's padded tokens against the trainer's own micro-batch plan (no prefix sharing)."""
    from shipyard.agent.types import Trajectory
    from shipyard.trainer.microbatch import plan_micro_batches

    lengths = [37, 300, 12, 90, 90, 41, 160, 8, 75, 75, 75, 20]
    trajs = [Trajectory("t", "g", i, [5] * n, [1] * n, [0.0] * n, [0] * n, 0) for i, n in enumerate(lengths)]
    for rows, tokens in [(4, 0), (4, 200), (3, 160), (8, 100)]:
        plan = plan_micro_batches(trajs, 1, 0, rows, share_prefix=False, token_budget=tokens)
        padded = sum(len(mb.indices) * max(lengths[i] for i in mb.indices) for mb in plan)
        profile = TrainerProfile(0.0, 1.0, 0.0, micro_batch=rows, micro_batch_tokens=tokens)
        assert profile.cost_tokens(lengths) == padded, (rows, tokens)
