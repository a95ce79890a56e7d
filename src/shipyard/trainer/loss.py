"""The policy-loss family (GRPO, DAPO, Dr.GRPO, GSPO, CISPO) with per-token correction weights.

Notation: μ is the sampler's (inference) logprob of a sampled token (``Trajectory.logprobs``),
π_old the trainer's recompute of the same token before the update, π_θ the differentiable
current policy, π_ref a frozen reference. ρ_t = π_old/μ corrects the sampler/trainer mismatch
(off-policy lag and numerics; turned into a weight ``w_t`` by :mod:`shipyard.trainer.corrections`);
r_t = π_θ/π_old is the PPO ratio; A the sequence's advantage (:mod:`shipyard.trainer.advantages`).

Per-token terms ``ℓ_t`` (before the weight ``w_t``):
- grpo / dapo / dr_grpo: ``-min(r_t A, clip(r_t, 1 - ε_low, 1 + ε_high) A)`` (PPO surrogate).
- gspo (arXiv:2507.18071, its token form): ``s_t = sg(s) · π_θ(y_t)/sg(π_θ(y_t))`` with the
  sequence ratio ``s = exp(mean_t log r_t)``, then ``-min(s_t A, clip(s_t, 1 - ε_low, 1 + ε_high) A)``.
  Its value is the sequence's ``s`` and, under the sequence-level mean below, its gradient is
  exactly GSPO's ``∇ min(s A, clip(s) A)``, while token weights ``w_t`` can still apply.
- cispo (MiniMax-M1, arXiv:2506.13585): ``-sg(clip(r_t, 1 - ε_low, 1 + ε_high)) · A · log π_θ``.
- plus, when ``kl_coef > 0``, ``kl_coef · k3_t`` with ``k3_t = π_ref/π_θ - log(π_ref/π_θ) - 1``
  (Schulman's k3 estimator of KL(π_θ || π_ref)); this term is not correction-weighted.
Aggregation, always against denominators of the WHOLE optimizer step (:class:`StepNorm`), so summing
the micro-batch losses (and gradients) gives the full-batch loss whatever the micro-batch size:
- dapo (arXiv:2503.14476), cispo: token mean, ``Σ_{i,t} w ℓ / N_tokens``.
- grpo (DeepSeekMath), gspo: sequence mean of token means, ``Σ_i (Σ_t w ℓ / |y_i|) / N_seqs``.
- dr_grpo (arXiv:2503.20783): ``Σ_{i,t} w ℓ / (N_seqs · L)`` with a constant ``L``.
:func:`grpo_loss` is the original single-purpose loss (dapo aggregation, TIS weight, its own
metrics) and keeps its signature and numbers.

Contract: ``old_logprobs``, ``infer_logprobs``, ``ref_logprobs`` and the weights are constants;
masked positions may hold any finite or infinite garbage (:func:`policy_loss` and :func:`grpo_loss`
replace it before any ``exp``; the ``*_objective`` functions expect that done and a bool mask).
Metrics come back as detached SUMS, COUNTS and MAXes (never means) so micro-batches merge exactly.
Limits: no entropy term; with one optimizer step per batch (this trainer) r_t = s = 1, so clipping
never fires and only the weights, the advantages and the aggregation shape the gradient.

Shape legend: G = group size, B = sequences in a micro-batch, T = padded sequence length.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from shipyard.trainer.advantages import group_advantages

__all__ = [
    "LOSS_TYPES",
    "MAX_KEYS",
    "SUM_KEYS",
    "MetricAccumulator",
    "StepNorm",
    "aggregate",
    "cispo_objective",
    "group_advantages",
    "grpo_loss",
    "clipped_token_objective",
    "gspo_objective",
    "k3_terms",
    "policy_loss",
]

LossType = Literal["grpo", "dapo", "dr_grpo", "gspo", "cispo"]
LOSS_TYPES: tuple[str, ...] = ("grpo", "dapo", "dr_grpo", "gspo", "cispo")
SUM_KEYS = ("loss_sum", "k1_sum", "k3_sum", "rho_sum", "clip_count", "tis_trunc_count", "token_count")
MAX_KEYS = ("max_abs_dp",)


@dataclass(frozen=True)
class StepNorm:
    """Denominators of the whole optimizer step (never of one micro-batch).

    ``tokens``: loss tokens in the step; ``seqs``: sequences with at least one loss token;
    ``seq_tokens``: Dr.GRPO's constant per-sequence budget ``L`` (``trainer.loss.dr_grpo_tokens``).
    """

    tokens: int | float
    seqs: int | float
    seq_tokens: int | float = 1

    def __post_init__(self) -> None:
        for name in ("tokens", "seqs", "seq_tokens"):
            if not getattr(self, name) > 0:
                raise ValueError(
                    f"StepNorm.{name} must be > 0 (counted over the whole step), got {getattr(self, name)}"
                )


def aggregate(loss_type: LossType, terms_BT: Tensor, mask_BT: Tensor, norm: StepNorm) -> Tensor:
    """Reduce per-token terms to the micro-batch's share of the step loss (module doc, Aggregation)."""
    masked_BT = torch.where(mask_BT, terms_BT, terms_BT.new_zeros(()))
    if loss_type in ("dapo", "cispo"):
        return masked_BT.sum() / norm.tokens
    if loss_type == "dr_grpo":
        return masked_BT.sum() / (norm.seqs * norm.seq_tokens)
    if loss_type in ("grpo", "gspo"):
        per_seq_B = masked_BT.sum(dim=1) / mask_BT.sum(dim=1).clamp(min=1)
        return per_seq_B.sum() / norm.seqs
    raise ValueError(f"trainer.loss.type must be one of {LOSS_TYPES}, got {loss_type!r}")


def _ppo_terms(ratio_BT: Tensor, adv_BT: Tensor, clip_low: float, clip_high: float) -> tuple[Tensor, Tensor]:
    """``-min(r A, clip(r) A)`` and where the clipped branch won (its gradient is 0 there)."""
    surr_BT = ratio_BT * adv_BT
    surr_clip_BT = torch.clamp(ratio_BT, 1.0 - clip_low, 1.0 + clip_high) * adv_BT
    return -torch.minimum(surr_BT, surr_clip_BT), surr_clip_BT < surr_BT


def clipped_token_objective(
    loss_type: LossType,
    lp_BT: Tensor,
    old_BT: Tensor,
    adv_BT: Tensor,
    mask_BT: Tensor,
    weight_BT: Tensor,
    clip_low: float,
    clip_high: float,
    norm: StepNorm,
) -> tuple[Tensor, Tensor]:
    """The clipped token surrogate shared by GRPO, DAPO and Dr.GRPO; they differ only in
    :func:`aggregate`: GRPO takes the token mean per sequence then the mean over sequences, DAPO the
    token mean over the whole step (clip-higher by its default range), Dr.GRPO the token sum over
    ``N_seqs · L`` (no length normalisation)."""
    terms_BT, clipped_BT = _ppo_terms(torch.exp(lp_BT - old_BT), adv_BT, clip_low, clip_high)
    return aggregate(loss_type, weight_BT * terms_BT, mask_BT, norm), clipped_BT


def gspo_objective(
    lp_BT: Tensor,
    old_BT: Tensor,
    adv_BT: Tensor,
    mask_BT: Tensor,
    weight_BT: Tensor,
    clip_low: float,
    clip_high: float,
    norm: StepNorm,
) -> tuple[Tensor, Tensor]:
    """GSPO: clipped sequence ratio ``exp(mean_t log r_t)`` (token form), mean over sequences."""
    log_r_BT = torch.where(mask_BT, lp_BT - old_BT, lp_BT.new_zeros(()))
    log_s_B = log_r_BT.sum(dim=1) / mask_BT.sum(dim=1).clamp(min=1)
    ratio_BT = torch.exp(log_s_B.detach()[:, None] + lp_BT - lp_BT.detach())
    terms_BT, clipped_BT = _ppo_terms(ratio_BT, adv_BT, clip_low, clip_high)
    return aggregate("gspo", weight_BT * terms_BT, mask_BT, norm), clipped_BT


def cispo_objective(
    lp_BT: Tensor,
    old_BT: Tensor,
    adv_BT: Tensor,
    mask_BT: Tensor,
    weight_BT: Tensor,
    clip_low: float,
    clip_high: float,
    norm: StepNorm,
) -> tuple[Tensor, Tensor]:
    """CISPO: ``-sg(clip(r)) · A · log π_θ``, token mean; clipping never removes a token's gradient."""
    ratio_BT = torch.exp(lp_BT - old_BT).detach()
    is_weight_BT = torch.clamp(ratio_BT, 1.0 - clip_low, 1.0 + clip_high)
    terms_BT = -is_weight_BT * adv_BT * lp_BT
    return aggregate("cispo", weight_BT * terms_BT, mask_BT, norm), is_weight_BT != ratio_BT


def k3_terms(lp_BT: Tensor, ref_BT: Tensor) -> Tensor:
    """Per-token k3 estimate of KL(π_θ || π_ref): ``exp(d) - d - 1`` with ``d = log π_ref - log π_θ``."""
    d_BT = ref_BT - lp_BT
    return torch.expm1(d_BT) - d_BT


def policy_loss(
    loss_type: LossType,
    logprobs_BT: Tensor,
    old_logprobs_BT: Tensor,
    adv_B: Tensor,
    mask_BT: Tensor,
    weight_BT: Tensor | None = None,
    *,
    clip_low: float,
    clip_high: float,
    norm: StepNorm,
    ref_logprobs_BT: Tensor | None = None,
    kl_coef: float = 0.0,
) -> tuple[Tensor, dict[str, Tensor]]:
    """The ``trainer.loss.type`` switch: one micro-batch's share of the step loss, and its metrics.

    ``weight_BT`` is the correction weight (None = 1). Returns ``(loss, metrics)``: ``loss`` has grad
    through ``logprobs_BT`` only; ``metrics`` holds detached sums ``loss_sum``, ``clip_count``,
    ``kl_sum`` (k3 to the reference over loss tokens; 0 without one) and ``token_count``.
    """
    _check_policy_args(
        loss_type, logprobs_BT, old_logprobs_BT, adv_B, mask_BT, weight_BT, clip_low, clip_high
    )
    if kl_coef < 0 or (kl_coef > 0 and ref_logprobs_BT is None):
        raise ValueError(
            f"trainer.loss.kl_coef={kl_coef}: must be >= 0, and > 0 needs ref_logprobs_BT (the frozen "
            "reference's logprobs of the same tokens)"
        )
    mask_BT = mask_BT.bool()
    zero = logprobs_BT.new_zeros(())
    lp_BT = torch.where(mask_BT, logprobs_BT, zero)
    old_BT = torch.where(mask_BT, old_logprobs_BT.detach().to(lp_BT.dtype), zero)
    w_BT = zero + 1 if weight_BT is None else torch.where(mask_BT, weight_BT.detach().to(lp_BT.dtype), zero)
    adv_BT = adv_B.detach().to(lp_BT.dtype)[:, None].expand_as(lp_BT)
    args = (lp_BT, old_BT, adv_BT, mask_BT, w_BT, clip_low, clip_high, norm)
    if loss_type in ("grpo", "dapo", "dr_grpo"):
        loss, clipped_BT = clipped_token_objective(loss_type, *args)
    elif loss_type == "gspo":
        loss, clipped_BT = gspo_objective(*args)
    else:
        loss, clipped_BT = cispo_objective(*args)
    kl_sum = zero.detach()
    if kl_coef > 0 and ref_logprobs_BT is not None:
        kl_BT = k3_terms(lp_BT, torch.where(mask_BT, ref_logprobs_BT.detach().to(lp_BT.dtype), zero))
        loss = loss + kl_coef * aggregate(loss_type, kl_BT, mask_BT, norm)
        kl_sum = torch.where(mask_BT, kl_BT, zero).sum().detach()
    metrics = {
        "loss_sum": loss.detach(),
        "clip_count": (clipped_BT & mask_BT).sum().to(lp_BT.dtype),
        "kl_sum": kl_sum,
        "token_count": mask_BT.sum().to(lp_BT.dtype),
    }
    return loss, metrics


def _check_policy_args(
    loss_type: str,
    logprobs_BT: Tensor,
    old_logprobs_BT: Tensor,
    adv_B: Tensor,
    mask_BT: Tensor,
    weight_BT: Tensor | None,
    clip_low: float,
    clip_high: float,
) -> None:
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"trainer.loss.type must be one of {LOSS_TYPES}, got {loss_type!r}")
    if not 0.0 <= clip_low <= 1.0 or clip_high < 0.0:
        raise ValueError(
            f"trainer.loss.clip_low must be in [0, 1] and clip_high >= 0, got {clip_low}, {clip_high}"
        )
    _check_shapes(logprobs_BT, adv_B, old_logprobs=old_logprobs_BT, mask=mask_BT, weight=weight_BT)


def _check_shapes(logprobs_BT: Tensor, adv_B: Tensor, **others: Tensor | None) -> None:
    shape = logprobs_BT.shape
    if logprobs_BT.dim() != 2 or logprobs_BT.numel() == 0:
        raise ValueError(f"logprobs must be a non-empty [B, T] tensor, got shape {tuple(shape)}")
    for name, t in others.items():
        if t is not None and t.shape != shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {tuple(shape)} like logprobs")
    if adv_B.shape != shape[:1]:
        raise ValueError(f"advantages have shape {tuple(adv_B.shape)}, expected ({shape[0]},)")


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

    Per token ``w_t * -min(r_t A, clip(r_t, 1 - clip_low, 1 + clip_high) A)`` with the constant
    ``w_t = min(ρ_t, tis_cap)``: ``policy_loss("dapo", ...)`` with ``tis`` weights. ``mask_BT``
    (bool or 0/1) selects the trained tokens. Returns ``(loss, metrics)``: ``loss`` is a scalar with
    grad through ``logprobs_BT`` only; ``metrics`` holds detached scalars named in :data:`SUM_KEYS`
    and :data:`MAX_KEYS`, merged by :class:`MetricAccumulator`.
    """
    _check_shapes(
        logprobs_BT, adv_B, old_logprobs=old_logprobs_BT, infer_logprobs=infer_logprobs_BT, mask=mask_BT
    )
    if not 0.0 <= clip_low < 1.0 or clip_high < 0.0:
        raise ValueError(f"need 0 <= clip_low < 1 and clip_high >= 0, got {clip_low}, {clip_high}")
    if tis_cap < 1.0:
        raise ValueError(f"tis_cap must be >= 1, got {tis_cap}")
    if num_tokens <= 0:
        raise ValueError(f"num_tokens (loss tokens in the whole step) must be > 0, got {num_tokens}")
    mask_BT = mask_BT.bool()
    zero = logprobs_BT.new_zeros(())
    lp_BT = torch.where(mask_BT, logprobs_BT, zero)
    old_BT = torch.where(mask_BT, old_logprobs_BT.detach().to(lp_BT.dtype), zero)
    infer_BT = torch.where(mask_BT, infer_logprobs_BT.detach().to(lp_BT.dtype), zero)
    adv_BT = adv_B.detach().to(lp_BT.dtype)[:, None].expand_as(lp_BT)
    log_rho_BT = old_BT - infer_BT  # ℓ = log π_old - log μ
    rho_BT = torch.exp(log_rho_BT)
    weight_BT = torch.clamp(rho_BT, max=tis_cap)
    norm = StepNorm(tokens=num_tokens, seqs=1)
    loss, clipped_BT = clipped_token_objective(
        "dapo", lp_BT, old_BT, adv_BT, mask_BT, weight_BT, clip_low, clip_high, norm
    )
    with torch.no_grad():
        maskf_BT = mask_BT.to(lp_BT.dtype)
        metrics = {
            "loss_sum": loss.detach(),
            "k1_sum": (-log_rho_BT * maskf_BT).sum(),
            "k3_sum": ((torch.expm1(log_rho_BT) - log_rho_BT) * maskf_BT).sum(),
            "rho_sum": (rho_BT * maskf_BT).sum(),
            "clip_count": (clipped_BT & mask_BT).sum().to(lp_BT.dtype),
            "tis_trunc_count": ((rho_BT > tis_cap) & mask_BT).sum().to(lp_BT.dtype),
            "token_count": maskf_BT.sum(),
            "max_abs_dp": torch.where(mask_BT, (old_BT.exp() - infer_BT.exp()).abs(), zero).max(),
        }
    return loss, metrics


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
