"""Hand-checked numbers for GRPO advantages, the clipped TIS policy-gradient loss and its metrics.

The 2x3 example (clip_low=0.2, clip_high=0.25, tis_cap=2, num_tokens=8) has, per trained token,
ratio r, importance weight ρ, advantage A and loss term w·(-min(rA, clip(r)A)):
row 0 (A=+1): r=1.0 ρ=1.0 -> -1.0 | r=1.5 ρ=0.8 -> -1.25*0.8 = -1.0 (clipped) | r=0.5 ρ=4 -> -0.5*2 = -1.0 (TIS cut)
row 1 (A=-1): r=0.7 ρ=2.5 -> 0.8*2 = 1.6 (clipped, TIS cut) | r=1.1 ρ=1.2 -> 1.1*1.2 = 1.32 | masked
Sum -0.08, loss -0.08/8 = -0.01. ρ sum 9.5, Π ρ = 9.6, max |Δp| = |0.3 - 0.12| = 0.18.

Shape legend: G = group size, B = sequences, T = positions.
"""

from __future__ import annotations

import math

import pytest
import torch

from shipyard.trainer.loss import MetricAccumulator, group_advantages, grpo_loss

CLIP = dict(clip_low=0.2, clip_high=0.25, tis_cap=2.0)


def _example() -> dict[str, torch.Tensor]:
    old_p_BT = torch.tensor([[0.5, 0.4, 0.2], [0.3, 0.6, 0.1]], dtype=torch.float64)
    ratio_BT = torch.tensor([[1.0, 1.5, 0.5], [0.7, 1.1, 1.0]], dtype=torch.float64)
    mu_p_BT = torch.tensor([[0.5, 0.5, 0.05], [0.12, 0.5, 0.1]], dtype=torch.float64)
    logprobs_BT = (old_p_BT * ratio_BT).log()
    infer_BT = mu_p_BT.log()
    # the masked slot holds garbage that would overflow exp() if it leaked into the loss
    logprobs_BT[1, 2], infer_BT[1, 2] = 100.0, -math.inf
    return {
        "logprobs_BT": logprobs_BT.requires_grad_(True),
        "old_logprobs_BT": old_p_BT.log(),
        "infer_logprobs_BT": infer_BT,
        "adv_B": torch.tensor([1.0, -1.0], dtype=torch.float64),
        "mask_BT": torch.tensor([[1, 1, 1], [1, 1, 0]]),
    }


def test_group_advantages_known_values() -> None:
    adv_G = group_advantages(torch.tensor([1.0, 2.0, 3.0]))
    expected = 1.0 / (math.sqrt(2.0 / 3.0) + 1e-4)
    torch.testing.assert_close(adv_G, torch.tensor([-expected, 0.0, expected]))
    adv_G = group_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0]))
    torch.testing.assert_close(adv_G, torch.tensor([1.0, -1.0, -1.0, 1.0]) * 0.5 / (0.5 + 1e-4))
    torch.testing.assert_close(
        group_advantages(torch.tensor([1.0, 2.0, 3.0]), scale_std=False), torch.tensor([-1.0, 0.0, 1.0])
    )


def test_group_advantages_all_equal_and_errors() -> None:
    for rewards in ([0.1, 0.1, 0.1], [1.0], [0.0] * 8):
        adv_G = group_advantages(torch.tensor(rewards))
        assert torch.equal(adv_G, torch.zeros(len(rewards)))
        assert torch.equal(
            group_advantages(torch.tensor(rewards), scale_std=False), torch.zeros(len(rewards))
        )
    with pytest.raises(ValueError):
        group_advantages(torch.zeros(2, 2))
    with pytest.raises(ValueError):
        group_advantages(torch.tensor([1.0, math.nan]))


def test_grpo_loss_hand_computed_value_and_metrics() -> None:
    ex = _example()
    loss, metrics = grpo_loss(**ex, **CLIP, num_tokens=8)
    assert loss.item() == pytest.approx(-0.01, abs=1e-12)
    res = MetricAccumulator()
    res.add(metrics)
    out = res.result()
    assert out["num_tokens"] == 5
    assert out["loss"] == pytest.approx(-0.01, abs=1e-12)
    assert out["clip_frac"] == pytest.approx(2 / 5)
    assert out["tis_trunc_frac"] == pytest.approx(2 / 5)
    assert out["mean_rho"] == pytest.approx(9.5 / 5)
    assert out["k1"] == pytest.approx(-math.log(9.6) / 5)
    assert out["k3"] == pytest.approx((4.5 - math.log(9.6)) / 5)
    assert out["max_abs_dp"] == pytest.approx(0.18)


def test_grpo_loss_gradient_hand_computed() -> None:
    ex = _example()
    loss, _ = grpo_loss(**ex, **CLIP, num_tokens=8)
    loss.backward()
    # unclipped: d/dlp of -w r A / N = -w r A / N; clipped and masked tokens: 0
    expected_BT = torch.tensor([[-1.0, 0.0, -0.5 * 2.0], [0.0, 1.1 * 1.2, 0.0]], dtype=torch.float64) / 8
    torch.testing.assert_close(ex["logprobs_BT"].grad, expected_BT)


def test_grpo_loss_gradient_at_ratio_one_is_minus_w_adv_over_n() -> None:
    gen = torch.Generator().manual_seed(0)
    old_BT = -torch.rand(3, 7, generator=gen) * 5
    infer_BT = old_BT + torch.randn(3, 7, generator=gen)
    mask_BT = torch.rand(3, 7, generator=gen) > 0.3
    adv_B = torch.tensor([0.7, -1.3, 0.0])
    logprobs_BT = old_BT.clone().requires_grad_(True)
    loss, metrics = grpo_loss(logprobs_BT, old_BT, infer_BT, adv_B, mask_BT, **CLIP, num_tokens=40)
    loss.backward()
    w_BT = torch.clamp(torch.exp(old_BT - infer_BT), max=2.0)
    expected_BT = torch.where(mask_BT, -w_BT * adv_B[:, None] / 40, torch.zeros(()))
    torch.testing.assert_close(logprobs_BT.grad, expected_BT)
    assert metrics["clip_count"].item() == 0


def test_micro_batches_sum_to_full_batch() -> None:
    ex = _example()
    full_loss, full_metrics = grpo_loss(**ex, **CLIP, num_tokens=5)
    acc, total = MetricAccumulator(), 0.0
    for b in range(2):
        part = {k: v[b : b + 1] for k, v in ex.items()}
        loss, metrics = grpo_loss(**part, **CLIP, num_tokens=5)
        acc.add(metrics)
        total += loss.item()
    whole = MetricAccumulator()
    whole.add(full_metrics)
    assert total == pytest.approx(full_loss.item(), abs=1e-12)
    assert acc.result() == pytest.approx(whole.result())


def test_grpo_loss_rejects_bad_arguments() -> None:
    ex = _example()
    with pytest.raises(ValueError):
        grpo_loss(**ex, **CLIP, num_tokens=0)
    with pytest.raises(ValueError):
        grpo_loss(**{**ex, "adv_B": torch.ones(3)}, **CLIP, num_tokens=5)
    with pytest.raises(ValueError):
        grpo_loss(**{**ex, "mask_BT": torch.ones(2, 2)}, **CLIP, num_tokens=5)
    with pytest.raises(ValueError):
        grpo_loss(**ex, clip_low=0.2, clip_high=0.2, tis_cap=0.5, num_tokens=5)
