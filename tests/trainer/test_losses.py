"""Hand-computed values and gradients for every policy-loss type and every mismatch correction.

The 2x3 example (row 1's last slot is masked and holds garbage) has, per loss token, the PPO
ratio r = π_θ/π_old, the sampler weight ρ = π_old/μ and the sequence advantage A:

    row 0 (A=+1): r = 1.0, 1.5, 0.5   ρ = 1.0, 0.8, 4.0   π_θ = 0.5, 0.6, 0.1
    row 1 (A=-1): r = 0.7, 1.1        ρ = 2.5, 1.2        π_θ = 0.21, 0.66

With ε_low = 0.2, ε_high = 0.25 the PPO term -min(rA, clip(r)A) is
    row 0: -1.0 | -1.25 (clipped) | -0.5          row 1: 0.8 (clipped) | 1.1
so its gradient d/dlog π_θ is -rA where unclipped and 0 where clipped:
    row 0: -1.0 | 0 | -0.5                        row 1: 0 | 1.1
Step denominators: 5 loss tokens, 2 sequences, Dr.GRPO's L = 4.

Shape legend: B = sequences, T = positions, G = group size.
"""

from __future__ import annotations

import math

import pytest
import torch

from shipyard.agent.types import Trajectory
from shipyard.config import ConfigError, load_config
from shipyard.config.schema import LossConfig
from shipyard.trainer.advantages import batch_advantages, group_advantages, overlong_penalty
from shipyard.trainer.corrections import CORRECTIONS, correction_weights
from shipyard.trainer.loss import LOSS_TYPES, StepNorm, grpo_loss, policy_loss

F64 = torch.float64
CLIP = dict(clip_low=0.2, clip_high=0.25)
NORM = StepNorm(tokens=5, seqs=2, seq_tokens=4)
MASK_BT = torch.tensor([[True, True, True], [True, True, False]])
PPO_TERMS_BT = torch.tensor([[-1.0, -1.25, -0.5], [0.8, 1.1, 0.0]], dtype=F64)
PPO_GRAD_BT = torch.tensor([[-1.0, 0.0, -0.5], [0.0, 1.1, 0.0]], dtype=F64)


def _example() -> dict[str, torch.Tensor]:
    old_p_BT = torch.tensor([[0.5, 0.4, 0.2], [0.3, 0.6, 0.1]], dtype=F64)
    ratio_BT = torch.tensor([[1.0, 1.5, 0.5], [0.7, 1.1, 1.0]], dtype=F64)
    mu_p_BT = torch.tensor([[0.5, 0.5, 0.05], [0.12, 0.5, 0.1]], dtype=F64)
    logprobs_BT = (old_p_BT * ratio_BT).log()
    infer_BT = mu_p_BT.log()
    logprobs_BT[1, 2], infer_BT[1, 2] = 100.0, -math.inf  # garbage in the masked slot
    return {
        "logprobs_BT": logprobs_BT.requires_grad_(True),
        "old_logprobs_BT": old_p_BT.log(),
        "infer_BT": infer_BT,
        "adv_B": torch.tensor([1.0, -1.0], dtype=F64),
        "mask_BT": MASK_BT.clone(),
    }


def _run(
    loss_type: str, ex: dict[str, torch.Tensor], weight_BT=None, **kw
) -> tuple[float, torch.Tensor, dict]:
    kw = {**CLIP, "norm": NORM, **kw}
    args = (ex["logprobs_BT"], ex["old_logprobs_BT"], ex["adv_B"], ex["mask_BT"], weight_BT)
    loss, metrics = policy_loss(loss_type, *args, **kw)
    loss.backward()
    return loss.item(), ex["logprobs_BT"].grad, metrics


S0, S1 = 0.75 ** (1 / 3), 0.77**0.5  # GSPO sequence ratios exp(mean log r) of rows 0 and 1
CISPO_W_BT = torch.tensor([[1.0, 1.25, 0.8], [0.8, 1.1, 0.0]], dtype=F64)  # sg(clip(r, 0.8, 1.25))
CISPO_LOSS = (
    -math.log(0.5) - 1.25 * math.log(0.6) - 0.8 * math.log(0.1) + 0.8 * math.log(0.21) + 1.1 * math.log(0.66)
) / 5
TYPE_CASES = {
    # type: (clip overrides, loss, gradient, clipped tokens)
    "grpo": (
        {},
        ((-1 - 1.25 - 0.5) / 3 + (0.8 + 1.1) / 2) / 2,
        PPO_GRAD_BT / torch.tensor([[6.0], [4.0]], dtype=F64),
        2,
    ),
    "dapo": ({}, -0.85 / 5, PPO_GRAD_BT / 5, 2),
    "dr_grpo": ({}, -0.85 / (2 * 4), PPO_GRAD_BT / 8, 2),
    "gspo": (
        {"clip_low": 3e-4, "clip_high": 4e-4},
        (-S0 + (1 - 3e-4)) / 2,  # row 1: -min(-S1, -(1 - 3e-4)) = 1 - 3e-4 (clipped)
        torch.tensor([[-S0 / 6] * 3, [0.0, 0.0, 0.0]], dtype=F64),
        2,
    ),
    "cispo": ({}, CISPO_LOSS, -CISPO_W_BT * torch.tensor([[1.0], [-1.0]], dtype=F64) / 5, 3),
}


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_each_loss_type_hand_computed(loss_type: str) -> None:
    clip, want_loss, want_grad_BT, want_clipped = TYPE_CASES[loss_type]
    ex = _example()
    loss, grad_BT, metrics = _run(loss_type, ex, **clip)
    assert loss == pytest.approx(want_loss, abs=1e-12)
    torch.testing.assert_close(grad_BT, want_grad_BT)
    assert metrics["clip_count"].item() == want_clipped and metrics["token_count"].item() == 5
    assert metrics["kl_sum"].item() == 0.0


CORRECTION_CASES = {
    # kind: (low, high, expected weights w, masked, truncated, hand sum of w * PPO term)
    "none": (0.0, math.inf, [[1, 1, 1], [1, 1, 0]], 0, 0, -0.85),
    "tis": (0.0, 2.0, [[1, 0.8, 2], [2, 1.2, 0]], 0, 2, -1 - 1.0 - 1.0 + 1.6 + 1.32),
    "token_mask": (0.5, 2.0, [[1, 0.8, 0], [0, 1.2, 0]], 2, 0, -1 - 1.0 + 1.32),
    # ρ_seq: row 0 = 1 * 0.8 * 4 = 3.2 (outside [0.5, 3.1]), row 1 = 2.5 * 1.2 = 3.0 (inside)
    "sequence_mask": (0.5, 3.1, [[0, 0, 0], [3, 3, 0]], 3, 0, 3 * 0.8 + 3 * 1.1),
    # geometric mean: row 0 = 3.2^(1/3) = 1.474 (inside [0.5, 1.6]), row 1 = 3^(1/2) = 1.732 (outside)
    "geometric_mask": (0.5, 1.6, [[1, 1, 1], [0, 0, 0]], 2, 0, -2.75),
    "icepop": (0.9, 5.0, [[1, 0, 4], [2.5, 1.2, 0]], 1, 0, -1 - 4 * 0.5 + 2.5 * 0.8 + 1.2 * 1.1),
    "decoupled": (0.0, 3.0, [[1, 0.8, 0], [2.5, 1.2, 0]], 1, 0, -1 - 1.0 + 2.5 * 0.8 + 1.32),
}


@pytest.mark.parametrize("kind", CORRECTIONS)
def test_each_correction_hand_computed(kind: str) -> None:
    low, high, weights, masked, truncated, weighted_sum = CORRECTION_CASES[kind]
    ex = _example()
    corr = correction_weights(kind, ex["old_logprobs_BT"] - ex["infer_BT"], ex["mask_BT"], low=low, high=high)
    want_w_BT = torch.tensor(weights, dtype=F64)
    torch.testing.assert_close(corr.weight_BT, want_w_BT)
    assert corr.masked_BT.sum().item() == masked and corr.truncated_BT.sum().item() == truncated
    loss, grad_BT, _ = _run("dapo", ex, corr.weight_BT)
    assert loss == pytest.approx(weighted_sum / 5, abs=1e-12)
    torch.testing.assert_close(grad_BT, want_w_BT * PPO_GRAD_BT / 5)


def test_config_correction_windows_and_type_defaults() -> None:
    assert LossConfig().correction_bounds() == (0.0, 2.0)
    assert LossConfig(correction="token_mask").correction_bounds() == (0.5, 2.0)
    assert LossConfig(correction="sequence_mask").correction_bounds() == (0.5, 2.0)
    assert LossConfig(correction="geometric_mask").correction_bounds() == (0.999, 1.001)
    assert LossConfig(correction="icepop").correction_bounds() == (0.5, 5.0)
    assert LossConfig(correction="decoupled", decoupled_cap=3.0).correction_bounds() == (0.0, 3.0)
    assert LossConfig(type="dapo").clip_range() == (0.2, 0.28)
    assert LossConfig(type="grpo").clip_range() == (0.2, 0.2)
    assert LossConfig(type="gspo").clip_range() == (3e-4, 4e-4)
    assert LossConfig(type="gspo", clip_high=1e-3).clip_range() == (3e-4, 1e-3)
    assert (
        LossConfig(type="dr_grpo").reward_scaling() == "none"
        and LossConfig(type="grpo").reward_scaling() == "group"
    )
    assert LossConfig(type="dr_grpo", scale_rewards="group").reward_scaling() == "group"


def test_default_config_reproduces_the_original_grpo_loss() -> None:
    """Shipped defaults (dapo, clip 0.2/0.28, TIS cap 2) give ``grpo_loss``'s value and gradient."""
    cfg, ex, ref = LossConfig(), _example(), _example()
    low, high = cfg.correction_bounds()
    corr = correction_weights(
        cfg.correction, ex["old_logprobs_BT"] - ex["infer_BT"], MASK_BT, low=low, high=high
    )
    clip_low, clip_high = cfg.clip_range()
    loss, grad_BT, _ = _run(cfg.type, ex, corr.weight_BT, clip_low=clip_low, clip_high=clip_high)
    ref_args = [ref[k] for k in ("logprobs_BT", "old_logprobs_BT", "infer_BT", "adv_B", "mask_BT")]
    ref_loss, _ = grpo_loss(*ref_args, clip_low=0.2, clip_high=0.28, tis_cap=2.0, num_tokens=5)
    ref_loss.backward()
    assert loss == pytest.approx(ref_loss.item(), abs=1e-12)
    torch.testing.assert_close(grad_BT, ref["logprobs_BT"].grad)


def test_kl_penalty_to_reference_hand_computed() -> None:
    ex = _example()
    # π_ref = π_θ / 2 on every token: d = log(π_ref/π_θ) = log 0.5, k3 = 0.5 - log 0.5 - 1, dk3/dlog π_θ = 1 - 0.5
    ref_BT = ex["logprobs_BT"].detach() + math.log(0.5)
    k3 = 0.5 - math.log(0.5) - 1
    loss, grad_BT, metrics = _run("dapo", ex, ref_logprobs_BT=ref_BT, kl_coef=0.1)
    assert loss == pytest.approx(-0.85 / 5 + 0.1 * k3, abs=1e-12)
    torch.testing.assert_close(grad_BT, (PPO_GRAD_BT + 0.1 * 0.5 * MASK_BT) / 5)
    assert metrics["kl_sum"].item() == pytest.approx(5 * k3)
    with pytest.raises(ValueError, match="kl_coef"):
        _run("dapo", _example(), kl_coef=0.1)


def _random_batch(gen: torch.Generator) -> dict[str, torch.Tensor]:
    old_BT = -torch.rand(4, 6, generator=gen, dtype=F64) * 3
    mask_BT = torch.rand(4, 6, generator=gen) > 0.3
    mask_BT[:, 0] = True
    return {
        "logprobs_BT": old_BT + 0.3 * torch.randn(4, 6, generator=gen, dtype=F64),
        "old_BT": old_BT,
        "infer_BT": old_BT + 0.3 * torch.randn(4, 6, generator=gen, dtype=F64),
        "ref_BT": old_BT + 0.2 * torch.randn(4, 6, generator=gen, dtype=F64),
        "adv_B": torch.tensor([1.0, -0.5, 0.7, -1.2], dtype=F64),
        "mask_BT": mask_BT,
    }


def _loss_and_grad(
    loss_type: str, kind: str, ex: dict[str, torch.Tensor], norm: StepNorm
) -> tuple[float, torch.Tensor]:
    lp_BT = ex["logprobs_BT"].clone().requires_grad_(True)
    corr = correction_weights(kind, ex["old_BT"] - ex["infer_BT"], ex["mask_BT"], low=0.5, high=2.0)
    loss, _ = policy_loss(
        loss_type, lp_BT, ex["old_BT"], ex["adv_B"], ex["mask_BT"], corr.weight_BT,
        clip_low=0.2, clip_high=0.28, norm=norm, ref_logprobs_BT=ex["ref_BT"], kl_coef=0.05,
    )  # fmt: skip
    loss.backward()
    return loss.item(), lp_BT.grad


@pytest.mark.parametrize("kind", CORRECTIONS)
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_micro_batches_sum_to_the_full_batch(loss_type: str, kind: str) -> None:
    ex = _random_batch(torch.Generator().manual_seed(0))
    norm = StepNorm(tokens=int(ex["mask_BT"].sum()), seqs=4, seq_tokens=6)
    full_loss, full_grad_BT = _loss_and_grad(loss_type, kind, ex, norm)
    parts = [
        _loss_and_grad(loss_type, kind, {k: v[s] for k, v in ex.items()}, norm)
        for s in (slice(0, 1), slice(1, 4))
    ]
    assert sum(p[0] for p in parts) == pytest.approx(full_loss, abs=1e-12)
    torch.testing.assert_close(torch.cat([p[1] for p in parts]), full_grad_BT)
    assert full_grad_BT.abs().sum() > 0


def test_bad_arguments_raise_value_errors_naming_the_field() -> None:
    ex = _example()
    args = (ex["logprobs_BT"], ex["old_logprobs_BT"], ex["adv_B"], ex["mask_BT"])
    with pytest.raises(ValueError, match="trainer.loss.type"):
        policy_loss("ppo", *args, **CLIP, norm=NORM)
    with pytest.raises(ValueError, match="clip_low"):
        policy_loss("dapo", *args, clip_low=1.5, clip_high=0.2, norm=NORM)
    with pytest.raises(ValueError, match="weight has shape"):
        policy_loss("dapo", *args, torch.ones(2, 2), **CLIP, norm=NORM)
    with pytest.raises(ValueError, match="StepNorm.seqs"):
        StepNorm(tokens=5, seqs=0)
    with pytest.raises(ValueError, match="trainer.loss.correction"):
        correction_weights("clip", ex["old_logprobs_BT"], ex["mask_BT"], low=0, high=2)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="low < high"):
        correction_weights("token_mask", ex["old_logprobs_BT"], ex["mask_BT"], low=2, high=0.5)


def test_group_advantages_rloo_and_overlong_penalty() -> None:
    # RLOO: r_i - mean of the others. rewards [1, 0, 0, 1]: 1 - 1/3 = 2/3, 0 - 2/3 = -2/3
    rloo_G = group_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0]), scale_std=False, baseline="rloo")
    torch.testing.assert_close(rloo_G, torch.tensor([2 / 3, -2 / 3, -2 / 3, 2 / 3]))
    scaled_G = group_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0]), baseline="rloo")
    torch.testing.assert_close(scaled_G, torch.tensor([2 / 3, -2 / 3, -2 / 3, 2 / 3]) / (0.5 + 1e-4))
    assert torch.equal(group_advantages(torch.ones(3), baseline="rloo"), torch.zeros(3))
    # L_max = 10, L_cache = 4: free up to 6, then (6 - L) / 4, -1 beyond 10
    penalty_N = overlong_penalty(torch.tensor([5, 6, 8, 10, 11]), max_tokens=10, cache_tokens=4)
    torch.testing.assert_close(penalty_N, torch.tensor([0.0, 0.0, -0.5, -1.0, -1.0]))
    with pytest.raises(ValueError):
        overlong_penalty(torch.tensor([1]), max_tokens=4, cache_tokens=4)


def _traj(group: str, reward: float, sampled: int) -> Trajectory:
    n = sampled + 1
    return Trajectory("t", group, 0, [1] * n, [0] + [1] * sampled, [0.0] * n, [-1] + [0] * sampled, 1, reward)


def test_batch_advantages_filter_penalty_and_type_defaults() -> None:
    groups = [[_traj("a", 1.0, 3), _traj("a", 1.0, 9)], [_traj("b", 0.0, 3), _traj("b", 1.0, 3)]]
    cfg = LossConfig(
        type="dr_grpo", drop_uniform_groups=True, overlong_max_tokens=10, overlong_cache_tokens=4
    )
    batch = batch_advantages(groups, cfg)
    # group a (all solved) dropped despite its length penalty; group b: Dr.GRPO -> no std scaling
    assert [t.group_id for t in batch.trajectories] == ["b", "b"]
    assert batch.advantages == pytest.approx([-0.5, 0.5])
    assert batch.stats == {"dropped_groups": 1.0, "overlong_penalty_mean": pytest.approx(-0.75 / 4)}
    uniform = batch_advantages([groups[0]], cfg)  # nothing left: kept for measurement, zero advantage
    assert len(uniform.trajectories) == 2 and uniform.advantages == [0.0, 0.0]
    assert uniform.stats["dropped_groups"] == 1.0
    plain = batch_advantages(groups, LossConfig())  # no filter, no penalty, std-scaled group mean
    assert plain.advantages == pytest.approx([0.0, 0.0, -0.5 / (0.5 + 1e-4), 0.5 / (0.5 + 1e-4)])


def test_reward_scaling_group_batch_none_and_the_eps() -> None:
    """TRL's three scale_rewards choices on one step: a near-tie group and a solved/failed group."""
    near, split = [_traj("n", 0.500, 3), _traj("n", 0.501, 3)], [_traj("s", 0.0, 3), _traj("s", 1.0, 3)]
    adv = {
        mode: batch_advantages([near, split], LossConfig(scale_rewards=mode)).advantages
        for mode in ("group", "batch", "none")
    }
    # group: each group by its own std (+ eps 1e-4): the near-tie is blown up to +-0.83
    assert adv["group"] == pytest.approx(
        [-0.0005 / 0.0006, 0.0005 / 0.0006, -0.5 / 0.5001, 0.5 / 0.5001], rel=1e-3
    )
    # batch: centred per group, divided by the std of all four rewards (0.354...): the near-tie stays small
    batch_std = torch.tensor([0.5, 0.501, 0.0, 1.0]).std(correction=0).item()
    want = [-0.0005, 0.0005, -0.5, 0.5]
    assert adv["batch"] == pytest.approx([a / (batch_std + 1e-4) for a in want], rel=1e-3)
    assert abs(adv["batch"][0]) < 0.002
    assert adv["none"] == pytest.approx(want, rel=1e-3)
    # the old eps: the near-tie as large as solved against failed
    old = batch_advantages([near], LossConfig(scale_rewards="group", std_eps=1e-6)).advantages
    assert old == pytest.approx([-0.998, 0.998], abs=1e-3)
    assert LossConfig(type="dr_grpo").reward_scaling() == "none" and LossConfig().reward_scaling() == "group"


def test_loss_config_validates_and_loads_from_toml_overrides() -> None:
    with pytest.raises(ValueError, match="overlong_cache_tokens"):
        LossConfig(overlong_max_tokens=8, overlong_cache_tokens=8)
    with pytest.raises(ValueError, match="mask_low"):
        LossConfig(mask_low=1.0, mask_high=1.0)
    cfg = load_config(
        None, ["trainer.loss.type=gspo", "trainer.loss.correction=icepop", "trainer.loss.kl_coef=0.01"]
    )
    assert cfg.trainer.loss.type == "gspo" and cfg.trainer.loss.clip_range() == (3e-4, 4e-4)
    with pytest.raises(ConfigError, match="trainer.loss.typ: unknown field"):
        load_config(None, ["trainer.loss.typ=gspo"])
    with pytest.raises(ConfigError, match="trainer.loss.correction"):
        load_config(None, ["trainer.loss.correction=clip"])
