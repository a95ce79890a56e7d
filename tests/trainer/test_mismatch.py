"""Hand-computed mismatch metrics, their probability buckets and micro-batch aggregation.

The 2x3 example (row 1's last slot is masked and holds garbage) has five loss tokens, in order:

    token:          t1     t2    t3     t4    t5
    μ probability:  0.05   0.3   0.95   0.6   0.2
    π_old prob.:    0.1    0.3   0.9    0.6   0.25
    ρ = π_old/μ:    2      1     18/19  1     1.25
    bucket:         [0,.1) [.1,.5) [.9,1] [.5,.9) [.1,.5)

k1 = -log ρ, k3 = ρ - 1 - log ρ, |Δp| = 0.05, 0, 0.05, 0, 0.05.
p99 of five values (linear interpolation): v(3) + 0.96 (v(4) - v(3)) on the sorted values v(0..4).

Shape legend: B = sequences, T = positions.
"""

from __future__ import annotations

import math

import pytest
import torch

from shipyard.trainer.corrections import correction_weights
from shipyard.trainer.loop import _named
from shipyard.trainer.mismatch import MISMATCH_KEYS, MismatchAccumulator, effective_sample_size

RHO = [2.0, 1.0, 18 / 19, 1.0, 1.25]
K1 = [-math.log(r) for r in RHO]
K3 = [r - 1 - math.log(r) for r in RHO]


def _example() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    mu_BT = torch.tensor([[0.05, 0.3, 0.95], [0.6, 0.2, 0.5]], dtype=torch.float64).log()
    old_BT = torch.tensor([[0.1, 0.3, 0.9], [0.6, 0.25, 0.5]], dtype=torch.float64).log()
    mu_BT[1, 2], old_BT[1, 2] = -math.inf, 50.0  # garbage in the masked slot
    return old_BT, mu_BT, torch.tensor([[1, 1, 1], [1, 1, 0]]).bool()


def _p99(values: list[float]) -> float:
    v = sorted(values)
    return v[3] + 0.96 * (v[4] - v[3])


def _measure(kind: str, low: float, high: float, rows: list[slice]) -> dict[str, float]:
    old_BT, mu_BT, mask_BT = _example()
    acc = MismatchAccumulator()
    for rows_slice in rows:
        o, m, k = old_BT[rows_slice], mu_BT[rows_slice], mask_BT[rows_slice]
        acc.add(o, m, k, correction_weights(kind, o - m, k, low=low, high=high))
    return acc.result()


def test_scalar_metrics_hand_computed() -> None:
    out = _measure("tis", 0.0, 1.5, [slice(0, 2)])
    assert out["k1"] == pytest.approx(sum(K1) / 5)
    assert out["k3"] == pytest.approx(sum(K3) / 5)
    assert out["k1_p99"] == pytest.approx(_p99(K1)) and out["k3_p99"] == pytest.approx(_p99(K3))
    assert out["k3_p99"] == pytest.approx(
        0.25 - math.log(1.25) + 0.96 * (1 - math.log(2) - 0.25 + math.log(1.25))
    )
    assert out["mean_abs_dp"] == pytest.approx(0.15 / 5) and out["max_abs_dp"] == pytest.approx(0.05)
    assert out["mean_rho"] == pytest.approx(sum(RHO) / 5)
    assert out["max_rho"] == pytest.approx(2.0) and out["min_rho"] == pytest.approx(18 / 19)
    assert out["ess"] == pytest.approx(sum(RHO) ** 2 / (5 * sum(r * r for r in RHO)))
    w = [1.5, 1.0, 18 / 19, 1.0, 1.25]  # TIS cap 1.5 truncates t1 only
    assert out["ess_corrected"] == pytest.approx(sum(w) ** 2 / (5 * sum(x * x for x in w)))
    assert out["tis_trunc_frac"] == pytest.approx(1 / 5) and out["mask_frac"] == 0.0


def test_bucket_metrics_hand_computed() -> None:
    out = _measure("tis", 0.0, 2.0, [slice(0, 2)])
    assert out["token_frac/bucket_0.0-0.1"] == pytest.approx(1 / 5)
    assert out["token_frac/bucket_0.1-0.5"] == pytest.approx(2 / 5)
    assert out["token_frac/bucket_0.5-0.9"] == pytest.approx(1 / 5)
    assert out["token_frac/bucket_0.9-1.0"] == pytest.approx(1 / 5)
    assert out["k1/bucket_0.0-0.1"] == pytest.approx(-math.log(2))
    assert out["k3/bucket_0.0-0.1"] == pytest.approx(1 - math.log(2))
    assert out["k3/bucket_0.1-0.5"] == pytest.approx((0 + 0.25 - math.log(1.25)) / 2)
    assert out["k1/bucket_0.1-0.5"] == pytest.approx(-math.log(1.25) / 2)
    assert out["abs_dp/bucket_0.1-0.5"] == pytest.approx(0.025)
    assert out["k3/bucket_0.5-0.9"] == 0.0 and out["abs_dp/bucket_0.5-0.9"] == 0.0
    assert out["k3/bucket_0.9-1.0"] == pytest.approx(18 / 19 - 1 + math.log(19 / 18))
    assert out["abs_dp/bucket_0.9-1.0"] == pytest.approx(0.05)
    assert set(out) <= MISMATCH_KEYS and len(out) == len(MISMATCH_KEYS)


def test_empty_buckets_are_left_out_and_p_one_is_in_the_last_bucket() -> None:
    acc = MismatchAccumulator()
    old_BT, mu_BT, mask_BT = (
        torch.tensor([[0.0, -0.1]]),
        torch.tensor([[0.0, 0.0]]),
        torch.tensor([[False, True]]),
    )
    acc.add(old_BT, mu_BT, mask_BT, correction_weights("none", old_BT - mu_BT, mask_BT, low=0, high=1))
    out = acc.result()
    assert out["token_frac/bucket_0.9-1.0"] == 1.0 and out["token_frac/bucket_0.0-0.1"] == 0.0
    assert "k3/bucket_0.0-0.1" not in out
    assert out["k1/bucket_0.9-1.0"] == pytest.approx(0.1)
    assert MismatchAccumulator().result()["k3"] == 0.0  # nothing recorded: zeros, no error


def test_mask_fraction_and_micro_batch_aggregation() -> None:
    whole = _measure("token_mask", 0.5, 1.5, [slice(0, 2)])
    split = _measure("token_mask", 0.5, 1.5, [slice(0, 1), slice(1, 2)])
    assert split == pytest.approx(whole)
    assert whole["mask_frac"] == pytest.approx(1 / 5) and whole["tis_trunc_frac"] == 0.0
    w = [0.0, 1.0, 18 / 19, 1.0, 1.25]  # t1 (ρ = 2) is outside [0.5, 1.5]
    assert whole["ess_corrected"] == pytest.approx(sum(w) ** 2 / (5 * sum(x * x for x in w)))


def test_effective_sample_size_limits() -> None:
    assert effective_sample_size(torch.ones(4)).item() == pytest.approx(1.0)
    assert effective_sample_size(torch.tensor([1.0, 0.0, 0.0, 0.0])).item() == pytest.approx(0.25)
    assert effective_sample_size(torch.zeros(3)).item() == 0.0


def test_loop_logs_mismatch_keys_under_mismatch() -> None:
    named = _named(
        {"k3": 1.0, "k3_p99": 2.0, "ess": 0.9, "k3/bucket_0.9-1.0": 0.1, "loss": 3.0, "clip_frac": 0.0}
    )
    assert named == {
        "mismatch/k3": 1.0,
        "mismatch/k3_p99": 2.0,
        "mismatch/ess": 0.9,
        "mismatch/k3/bucket_0.9-1.0": 0.1,
        "train/loss": 3.0,
        "train/clip_frac": 0.0,
    }


def test_bucketed_rho_ess_extremes_and_fractions_hand_computed() -> None:
    out = _measure("token_mask", 0.95, 1.5, [slice(0, 1), slice(1, 2)])  # masks t1 (ρ=2) and t3 (18/19)
    mid = "bucket_0.1-0.5"  # t2 (ρ=1) and t5 (ρ=1.25)
    assert out[f"rho/{mid}"] == pytest.approx(1.125)
    assert out[f"ess/{mid}"] == pytest.approx(2.25**2 / (2 * (1 + 1.5625)))
    assert out[f"max_abs_dp/{mid}"] == pytest.approx(0.05)
    assert out[f"k3_p99/{mid}"] == pytest.approx(0.99 * (0.25 - math.log(1.25)))
    assert out["mask_frac/bucket_0.0-0.1"] == 1.0 and out["mask_frac/bucket_0.9-1.0"] == 1.0
    assert out[f"mask_frac/{mid}"] == 0.0 and out[f"tis_trunc_frac/{mid}"] == 0.0
    assert out["ess/bucket_0.0-0.1"] == pytest.approx(1.0)  # one token: ESS 1


def test_routing_keys_are_mismatch_keys() -> None:
    from shipyard.trainer.mismatch import is_mismatch_key

    assert is_mismatch_key("route_disagree") and is_mismatch_key("route_disagree/layer_17")
    assert is_mismatch_key("route_own_disagree") and is_mismatch_key("ess/bucket_0.9-1.0")
    assert not is_mismatch_key("loss") and not is_mismatch_key("route_disagreement")
