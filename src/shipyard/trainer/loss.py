"""GRPO advantages and the clipped, truncated-importance-weighted policy-gradient loss.

Notation: μ is the sampler's (inference) logprob of a sampled token (``Trajectory.logprobs``),
π_old the trainer's recompute of the same token before the update, π_θ the differentiable
current policy. ρ_t = π_old/μ corrects the sampler/trainer mismatch (off-policy lag and
numerics); r_t = π_θ/π_old is the PPO ratio.

Contract:
- :func:`group_advantages` turns one group's rewards into advantages: ``(r - mean) / (std + eps)``
  (GRPO) or ``r - mean`` (Dr.GRPO, ``scale_std=False``). ``std`` is the population std
  (``correction=0``) so a group of one is well defined. A group whose rewards are all equal
  gets exact zeros (no eps-amplified rounding noise).
- :func:`grpo_loss` returns the loss of one micro-batch, already divided by the token count of
  the whole optimizer step (``num_tokens``), so summing the micro-batch losses (and their
  gradients) gives the token mean over the step. Per token:
  ``w_t * -min(r_t A, clip(r_t, 1 - clip_low, 1 + clip_high) A)`` with the constant weight
  ``w_t = min(ρ_t, tis_cap)``. ``old_logprobs`` and ``infer_logprobs`` are treated as constants.
- Metrics come back as detached SUMS, COUNTS and MAXes (never means) so that
  :class:`MetricAccumulator` merges micro-batches exactly and turns them into floats once.
Limits: no KL-to-reference or entropy term; masked positions may hold any finite or infinite
garbage (they are replaced before any ``exp``).

Shape legend: G = group size, B = sequences in a micro-batch, T = padded sequence length.
"""

from __future__ import annotations

import torch
from torch import Tensor

SUM_KEYS = ("loss_sum", "k1_sum", "k3_sum", "rho_sum", "clip_count", "tis_trunc_count", "token_count")
MAX_KEYS = ("max_abs_dp",)


def group_advantages(rewards_G: Tensor, scale_std: bool = True, eps: float = 1e-6) -> Tensor:
    """Advantages of one GRPO group: ``(r - mean) / (std + eps)``, or ``r - mean`` without std."""
    if rewards_G.dim() != 1 or rewards_G.numel() == 0:
        raise ValueError(
            f"rewards must be a non-empty 1-D tensor (one group), got shape {tuple(rewards_G.shape)}"
        )
    if eps <= 0:
        raise ValueError(f"eps must be > 0, got {eps}")
    rewards_G = rewards_G.to(torch.float32)
    if not torch.isfinite(rewards_G).all():
        raise ValueError(f"rewards must be finite, got {rewards_G.tolist()}")
    if bool((rewards_G == rewards_G[0]).all()):
        return torch.zeros_like(rewards_G)
    centered_G = rewards_G - rewards_G.mean()
    if not scale_std:
        return centered_G
    return centered_G / (rewards_G.std(correction=0) + eps)


def grpo_loss(
    logprobs_BT: Tensor,
    old_logprobs_BT: Tensor,
    infer_logprobs_BT: Tensor,
    adv_B: Tensor,
    mask_BT: Tensor,
    *,
    clip_low: float,
    clip_high: float,
    tis_cap: float,
    num_tokens: int | float,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Clipped PG loss with truncated importance sampling, normalised by the step's ``num_tokens``.

    ``mask_BT`` (bool or 0/1) selects the trained tokens. Returns ``(loss, metrics)``: ``loss``
    is a scalar with grad through ``logprobs_BT`` only; ``metrics`` holds detached scalars named
    in :data:`SUM_KEYS` and :data:`MAX_KEYS`.
    """
    _check_loss_args(
        logprobs_BT, old_logprobs_BT, infer_logprobs_BT, adv_B, mask_BT, clip_low, clip_high, tis_cap
    )
    if num_tokens <= 0:
        raise ValueError(f"num_tokens (loss tokens in the whole step) must be > 0, got {num_tokens}")
    mask_BT = mask_BT.bool()
    zero = logprobs_BT.new_zeros(())
    lp_BT = torch.where(mask_BT, logprobs_BT, zero)
    old_BT = torch.where(mask_BT, old_logprobs_BT.detach().to(lp_BT.dtype), zero)
    infer_BT = torch.where(mask_BT, infer_logprobs_BT.detach().to(lp_BT.dtype), zero)
    adv_BT = adv_B.detach().to(lp_BT.dtype)[:, None].expand_as(lp_BT)

    ratio_BT = torch.exp(lp_BT - old_BT)
    surr_BT = ratio_BT * adv_BT
    surr_clip_BT = torch.clamp(ratio_BT, 1.0 - clip_low, 1.0 + clip_high) * adv_BT
    pg_BT = -torch.minimum(surr_BT, surr_clip_BT)

    log_rho_BT = old_BT - infer_BT  # ℓ = log π_old - log μ
    rho_BT = torch.exp(log_rho_BT)
    weight_BT = torch.clamp(rho_BT, max=tis_cap)
    loss = torch.where(mask_BT, pg_BT * weight_BT, zero).sum() / num_tokens

    with torch.no_grad():
        maskf_BT = mask_BT.to(lp_BT.dtype)
        metrics = {
            "loss_sum": loss.detach(),
            "k1_sum": (-log_rho_BT * maskf_BT).sum(),
            "k3_sum": ((torch.expm1(log_rho_BT) - log_rho_BT) * maskf_BT).sum(),
            "rho_sum": (rho_BT * maskf_BT).sum(),
            "clip_count": ((-surr_clip_BT > -surr_BT) & mask_BT).sum().to(lp_BT.dtype),
            "tis_trunc_count": ((rho_BT > tis_cap) & mask_BT).sum().to(lp_BT.dtype),
            "token_count": maskf_BT.sum(),
            "max_abs_dp": torch.where(mask_BT, (old_BT.exp() - infer_BT.exp()).abs(), zero).max(),
        }
    return loss, metrics


def _check_loss_args(
    logprobs_BT: Tensor,
    old_logprobs_BT: Tensor,
    infer_logprobs_BT: Tensor,
    adv_B: Tensor,
    mask_BT: Tensor,
    clip_low: float,
    clip_high: float,
    tis_cap: float,
) -> None:
    shape = logprobs_BT.shape
    if logprobs_BT.dim() != 2 or logprobs_BT.numel() == 0:
        raise ValueError(f"logprobs must be a non-empty [B, T] tensor, got shape {tuple(shape)}")
    for name, t in (
        ("old_logprobs", old_logprobs_BT),
        ("infer_logprobs", infer_logprobs_BT),
        ("mask", mask_BT),
    ):
        if t.shape != shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {tuple(shape)} like logprobs")
    if adv_B.shape != shape[:1]:
        raise ValueError(f"advantages have shape {tuple(adv_B.shape)}, expected ({shape[0]},)")
    if not 0.0 <= clip_low < 1.0 or clip_high < 0.0:
        raise ValueError(f"need 0 <= clip_low < 1 and clip_high >= 0, got {clip_low}, {clip_high}")
    if tis_cap < 1.0:
        raise ValueError(f"tis_cap must be >= 1, got {tis_cap}")


class MetricAccumulator:
    """Merges :func:`grpo_loss` metrics over micro-batches; :meth:`result` gives final floats.

    Sums and counts add up, maxes take the max; tensors stay on their device until
    :meth:`result` (one host sync per step).
    """

    def __init__(self) -> None:
        self._acc: dict[str, Tensor] = {}

    def add(self, metrics: dict[str, Tensor]) -> None:
        for key, value in metrics.items():
            value = value.detach()
            if key in SUM_KEYS:
                self._acc[key] = self._acc[key] + value if key in self._acc else value
            elif key in MAX_KEYS:
                self._acc[key] = torch.maximum(self._acc[key], value) if key in self._acc else value
            else:
                raise ValueError(f"unknown metric {key!r}; known: {SUM_KEYS + MAX_KEYS}")

    def result(self) -> dict[str, float]:
        """loss, k1, k3, mean_rho, clip_frac, tis_trunc_frac, max_abs_dp, num_tokens (0 if empty)."""
        vals = {k: float(v) for k, v in self._acc.items()}
        n = vals.get("token_count", 0.0)
        denom = max(n, 1.0)
        return {
            "loss": vals.get("loss_sum", 0.0),
            "k1": vals.get("k1_sum", 0.0) / denom,
            "k3": vals.get("k3_sum", 0.0) / denom,
            "mean_rho": vals.get("rho_sum", 0.0) / denom,
            "clip_frac": vals.get("clip_count", 0.0) / denom,
            "tis_trunc_frac": vals.get("tis_trunc_count", 0.0) / denom,
            "max_abs_dp": vals.get("max_abs_dp", 0.0),
            "num_tokens": n,
        }
