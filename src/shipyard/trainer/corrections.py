"""Sampler/trainer mismatch corrections: one constant (stop-gradient) weight per loss token.

With ρ_t = π_old(y_t) / μ(y_t) (``log_rho_BT = old_logprobs - infer_logprobs``), each correction
gives a weight ``w`` that multiplies the token's policy-loss term:

- ``none``: ``w = 1``.
- ``tis`` (truncated IS; Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You
  Off-Policy RL Training"): ``w = min(ρ, C)``.
- ``token_mask`` (masked IS at token level; Liu et al. 2025, "When Speed Kills Stability"):
  ``w = ρ · 1[a <= ρ <= b]``.
- ``sequence_mask`` (masked IS at sequence level, same source): with ``ρ_seq = Π_t ρ_t`` over the
  sequence's loss tokens, every token gets ``w = ρ_seq · 1[a <= ρ_seq <= b]``.
- ``geometric_mask`` (geometric-mean rejection, same source): with ``g = exp(mean_t log ρ_t)``,
  every token gets ``w = 1[a <= g <= b]``. Rejection only: ``g`` is not an IS weight, and inside
  the default window [0.999, 1.001] reweighting by it would move ``w`` by under 0.1%.
- ``icepop`` (IcePop, Ring-1T report "Every Step Evolves"): ``w = ρ · 1[a <= ρ <= b]``: tokens
  outside the window lose their gradient. It is ``token_mask``'s formula with IcePop's window
  ([0.5, 5]); the two names keep their papers' defaults.
- ``decoupled`` (decoupled PPO of AReaL, Fu et al. 2025): ``w = (π_prox / μ) · 1[ρ <= cap]`` with
  the proximal policy π_prox = π_old, i.e. ``ρ · 1[ρ <= cap]``; like AReaL's
  ``behav_imp_weight_cap``, tokens above the cap are dropped, not truncated (truncation is
  ``tis``). The PPO ratio of every loss type is already taken against π_old, so
  ``w · min(r A, clip(r) A)`` is AReaL's objective.

Contract: :class:`Correction` holds ``weight_BT`` (finite, >= 0, detached, exactly 0 off the loss
mask), ``masked_BT`` (loss tokens a window zeroed) and ``truncated_BT`` (loss tokens ``tis`` cut to
its cap). Windows are tested in log space, so a huge ``ρ_seq`` (long sequences) never becomes
``inf · 0``. Positions outside ``mask_BT`` may hold any garbage (replaced before use).
Limits: sequence-level weights need whole sequences in one call (micro-batches split by sequence).

Shape legend: B = sequences, T = padded length.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

CorrectionKind = Literal[
    "none", "tis", "token_mask", "sequence_mask", "geometric_mask", "icepop", "decoupled"
]
CORRECTIONS: tuple[str, ...] = (
    "none",
    "tis",
    "token_mask",
    "sequence_mask",
    "geometric_mask",
    "icepop",
    "decoupled",
)


@dataclass(frozen=True)
class Correction:
    """Per-token correction weights and which loss tokens the correction masked or truncated."""

    weight_BT: Tensor
    masked_BT: Tensor
    truncated_BT: Tensor


def _log_bound(x: float) -> float:
    return -math.inf if x == 0 else math.log(x)


def _prepare(log_rho_BT: Tensor, mask_BT: Tensor) -> tuple[Tensor, Tensor]:
    if log_rho_BT.dim() != 2 or log_rho_BT.shape != mask_BT.shape:
        raise ValueError(
            f"log_rho and mask must be [B, T] of one shape, got {tuple(log_rho_BT.shape)} "
            f"and {tuple(mask_BT.shape)}"
        )
    mask_BT = mask_BT.bool()
    return torch.where(mask_BT, log_rho_BT.detach(), log_rho_BT.new_zeros(())), mask_BT


def _check_window(low: float, high: float) -> None:
    if not (0.0 <= low < high):
        raise ValueError(f"correction window needs 0 <= low < high, got low={low}, high={high}")


def _windowed(log_x_BT: Tensor, mask_BT: Tensor, low: float, high: float, reweight: bool) -> Correction:
    """``x · 1[low <= x <= high]`` (or the bare indicator) from ``log x``, 0 off the mask."""
    _check_window(low, high)
    keep_BT = (log_x_BT >= _log_bound(low)) & (log_x_BT <= _log_bound(high)) & mask_BT
    value_BT = torch.exp(log_x_BT.clamp(max=_log_bound(high))) if reweight else torch.ones_like(log_x_BT)
    weight_BT = torch.where(keep_BT, value_BT, log_x_BT.new_zeros(()))
    return Correction(weight_BT, mask_BT & ~keep_BT, torch.zeros_like(mask_BT))


def no_correction(log_rho_BT: Tensor, mask_BT: Tensor) -> Correction:
    """``w = 1`` on loss tokens."""
    log_rho_BT, mask_BT = _prepare(log_rho_BT, mask_BT)
    none_BT = torch.zeros_like(mask_BT)
    return Correction(mask_BT.to(log_rho_BT.dtype), none_BT, none_BT)


def tis_weights(log_rho_BT: Tensor, mask_BT: Tensor, cap: float) -> Correction:
    """Truncated IS: ``w = min(ρ, cap)``."""
    if cap <= 0:
        raise ValueError(f"tis cap must be > 0, got {cap}")
    log_rho_BT, mask_BT = _prepare(log_rho_BT, mask_BT)
    weight_BT = torch.where(mask_BT, torch.exp(log_rho_BT.clamp(max=math.log(cap))), log_rho_BT.new_zeros(()))
    truncated_BT = (log_rho_BT > math.log(cap)) & mask_BT
    return Correction(weight_BT, torch.zeros_like(mask_BT), truncated_BT)


def token_mask_weights(log_rho_BT: Tensor, mask_BT: Tensor, low: float, high: float) -> Correction:
    """Token-level masked IS: ``w = ρ · 1[low <= ρ <= high]``."""
    log_rho_BT, mask_BT = _prepare(log_rho_BT, mask_BT)
    return _windowed(log_rho_BT, mask_BT, low, high, reweight=True)


def icepop_weights(log_rho_BT: Tensor, mask_BT: Tensor, low: float, high: float) -> Correction:
    """IcePop: only tokens with ``ρ`` in ``[low, high]`` keep their (ρ-weighted) gradient."""
    return token_mask_weights(log_rho_BT, mask_BT, low, high)


def _per_sequence(log_rho_BT: Tensor, mask_BT: Tensor, mean: bool) -> Tensor:
    """Sum (or mean) of ``log ρ`` over each sequence's loss tokens, broadcast back to ``[B, T]``."""
    log_B = log_rho_BT.sum(dim=1)
    if mean:
        log_B = log_B / mask_BT.sum(dim=1).clamp(min=1)
    return log_B[:, None].expand_as(log_rho_BT)


def sequence_mask_weights(log_rho_BT: Tensor, mask_BT: Tensor, low: float, high: float) -> Correction:
    """Sequence-level masked IS: every token gets ``ρ_seq · 1[low <= ρ_seq <= high]``, ``ρ_seq = Π ρ_t``."""
    log_rho_BT, mask_BT = _prepare(log_rho_BT, mask_BT)
    return _windowed(_per_sequence(log_rho_BT, mask_BT, mean=False), mask_BT, low, high, reweight=True)


def geometric_mask_weights(log_rho_BT: Tensor, mask_BT: Tensor, low: float, high: float) -> Correction:
    """Geometric-mean rejection: every token gets ``1[low <= exp(mean_t log ρ_t) <= high]``."""
    log_rho_BT, mask_BT = _prepare(log_rho_BT, mask_BT)
    return _windowed(_per_sequence(log_rho_BT, mask_BT, mean=True), mask_BT, low, high, reweight=False)


def decoupled_weights(log_rho_BT: Tensor, mask_BT: Tensor, cap: float) -> Correction:
    """Decoupled PPO behaviour weight: ``w = ρ · 1[ρ <= cap]`` (tokens above the cap dropped)."""
    log_rho_BT, mask_BT = _prepare(log_rho_BT, mask_BT)
    return _windowed(log_rho_BT, mask_BT, 0.0, cap, reweight=True)


def correction_weights(
    kind: CorrectionKind, log_rho_BT: Tensor, mask_BT: Tensor, *, low: float, high: float
) -> Correction:
    """The ``trainer.loss.correction`` switch; ``(low, high)`` is ``LossConfig.correction_bounds()``
    (``tis`` and ``decoupled`` read only ``high``, their cap; ``none`` reads neither)."""
    if kind == "none":
        return no_correction(log_rho_BT, mask_BT)
    if kind == "tis":
        return tis_weights(log_rho_BT, mask_BT, high)
    if kind == "token_mask":
        return token_mask_weights(log_rho_BT, mask_BT, low, high)
    if kind == "sequence_mask":
        return sequence_mask_weights(log_rho_BT, mask_BT, low, high)
    if kind == "geometric_mask":
        return geometric_mask_weights(log_rho_BT, mask_BT, low, high)
    if kind == "icepop":
        return icepop_weights(log_rho_BT, mask_BT, low, high)
    if kind == "decoupled":
        return decoupled_weights(log_rho_BT, mask_BT, high)
    raise ValueError(f"trainer.loss.correction must be one of {CORRECTIONS}, got {kind!r}")
