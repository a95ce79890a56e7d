"""Sampler/trainer mismatch metrics of one optimizer step, overall and by token probability.

Per loss token, with μ the sampler's logprob, π_old the trainer's recompute and
``log ρ = log π_old - log μ``:
- ``k1 = log μ - log π_old = -log ρ`` and ``k3 = ρ - 1 - log ρ`` (estimators of KL(μ || π_old) on
  tokens sampled from μ; k3 >= 0), each as a mean and a 99th percentile (``k1_p99``, ``k3_p99``;
  linear interpolation between order statistics, ``torch.quantile``);
- ``|Δp| = |π_old - μ|`` in probability space: ``mean_abs_dp``, ``max_abs_dp``;
- ``ρ``: ``mean_rho``, ``max_rho``, ``min_rho``, and the normalised effective sample size
  ``ess = (Σ ρ)² / (n Σ ρ²)`` in (0, 1]; ``ess_corrected`` is the same for the correction weights
  ``w`` actually applied (0 when every token was masked);
- ``mask_frac`` / ``tis_trunc_frac``: fractions of loss tokens the correction masked / truncated;
- by the sampler's token probability ``p = exp(μ)`` in :data:`BUCKETS` (``[lo, hi)``, the last one
  closed): ``token_frac/bucket_lo-hi`` (share of loss tokens), and over the bucket's tokens
  ``k1/…``, ``k3/…``, ``abs_dp/…``, ``rho/…`` (means), ``k3_p99/…``, ``max_abs_dp/…``, ``ess/…``,
  ``mask_frac/…`` and ``tis_trunc_frac/…`` (left out when the bucket is empty);
- MoE routing (not from this accumulator: :meth:`shipyard.models.router_replay.RouterSeam.disagreement`
  in :func:`shipyard.trainer.step.train_step`): ``route_disagree`` (fraction of the sampler's
  routing decisions, token x top-k slot, that the trainer's own router would make differently),
  ``route_disagree/layer_<i>`` per MoE decoder layer, ``route_token_disagree`` (tokens differing in
  at least one layer): all 0 under replay on the tokens with a recorded route; and
  ``route_own_disagree``, how often the trainer's own router differs from the sampler's choice
  (equal to ``route_disagree`` without replay; what replay overrides with it).
Contract: :class:`MismatchAccumulator` collects the per-token values of every micro-batch (detached,
on their device) and computes everything once in :meth:`MismatchAccumulator.result`, so the step's
numbers do not depend on how it was split. Every key it can return is in :data:`MISMATCH_KEYS`.
Limits: memory is O(loss tokens of the step) (five floats each); no sequence-level statistics.

Shape legend: B = sequences, T = padded length, N = loss tokens of the step.
"""

from __future__ import annotations

import torch
from torch import Tensor

from shipyard.trainer.corrections import Correction

BUCKETS: tuple[tuple[float, float], ...] = ((0.0, 0.1), (0.1, 0.5), (0.5, 0.9), (0.9, 1.0))
SCALAR_KEYS = (
    "k1",
    "k1_p99",
    "k3",
    "k3_p99",
    "mean_abs_dp",
    "max_abs_dp",
    "mean_rho",
    "max_rho",
    "min_rho",
    "ess",
    "ess_corrected",
    "mask_frac",
    "tis_trunc_frac",
)
BUCKET_STATS = (
    "token_frac",
    "k1",
    "k3",
    "abs_dp",
    "rho",
    "k3_p99",
    "max_abs_dp",
    "ess",
    "mask_frac",
    "tis_trunc_frac",
)
ROUTING_KEYS = ("route_disagree", "route_token_disagree", "route_own_disagree")
ROUTING_LAYER_PREFIX = "route_disagree/layer_"


def bucket_name(low: float, high: float) -> str:
    """``bucket_0.9-1.0`` for the probability bucket ``[0.9, 1.0]``."""
    return f"bucket_{low:.1f}-{high:.1f}"


MISMATCH_KEYS = frozenset(SCALAR_KEYS) | {f"{s}/{bucket_name(*b)}" for s in BUCKET_STATS for b in BUCKETS}


def is_mismatch_key(key: str) -> bool:
    """Whether ``key`` is a mismatch metric: :data:`MISMATCH_KEYS`, the routing keys, or a per-layer one."""
    return key in MISMATCH_KEYS or key in ROUTING_KEYS or key.startswith(ROUTING_LAYER_PREFIX)


class MismatchAccumulator:
    """Per-token mismatch values over micro-batches; :meth:`result` gives the step's float metrics.

    With ``tokens`` (a dict to fill), :meth:`keep` also records each sequence's trainer logprobs at
    its loss positions, in order (rounded to 1e-4), under the caller's key: what a person compares
    token by token with the sampler's (``shipyard view``)."""

    def __init__(self, tokens: dict[str, list[float]] | None = None) -> None:
        self._parts: dict[str, list[Tensor]] = {
            k: [] for k in ("log_rho", "p_mu", "dp", "w", "masked", "trunc")
        }
        self.tokens = tokens

    def keep(self, keys: list[str], old_logprobs_BT: Tensor, mask_BT: Tensor) -> None:
        """Record row ``b``'s trainer logprobs at its loss positions under ``keys[b]`` (if keeping)."""
        if self.tokens is None:
            return
        for key, row_T, mask_T in zip(keys, old_logprobs_BT.detach().float(), mask_BT.bool(), strict=True):
            self.tokens[key] = [round(v, 4) for v in row_T[mask_T].tolist()]

    def add(
        self, old_logprobs_BT: Tensor, infer_logprobs_BT: Tensor, mask_BT: Tensor, corr: Correction
    ) -> None:
        """Record the loss tokens (``mask_BT``) of one micro-batch and the correction applied to them."""
        if old_logprobs_BT.shape != infer_logprobs_BT.shape or old_logprobs_BT.shape != mask_BT.shape:
            raise ValueError(
                f"old_logprobs {tuple(old_logprobs_BT.shape)}, infer_logprobs "
                f"{tuple(infer_logprobs_BT.shape)} and mask {tuple(mask_BT.shape)} must share one [B, T] shape"
            )
        mask_BT = mask_BT.bool()
        old_N = old_logprobs_BT.detach()[mask_BT].double()
        infer_N = infer_logprobs_BT.detach()[mask_BT].double()
        self._parts["log_rho"].append(old_N - infer_N)
        self._parts["p_mu"].append(infer_N.exp())
        self._parts["dp"].append((old_N.exp() - infer_N.exp()).abs())
        self._parts["w"].append(corr.weight_BT.detach()[mask_BT].double())
        self._parts["masked"].append(corr.masked_BT[mask_BT])
        self._parts["trunc"].append(corr.truncated_BT[mask_BT])

    def state(self) -> tuple[dict[str, Tensor], dict[str, list[float]] | None]:
        """This accumulator's tokens (on the CPU) and kept logprobs: what another trainer rank sends
        for :meth:`absorb`."""
        parts = {k: torch.cat(v).cpu() if v else torch.zeros(0) for k, v in self._parts.items()}
        return parts, self.tokens

    def absorb(self, state: tuple[dict[str, Tensor], dict[str, list[float]] | None]) -> None:
        """Add another rank's :meth:`state`; :meth:`result` then covers both ranks' tokens."""
        parts, tokens = state
        for key, values in parts.items():
            if values.numel():
                self._parts[key].append(values)
        if self.tokens is not None and tokens:
            self.tokens.update(tokens)

    def result(self) -> dict[str, float]:
        """Scalar and bucket metrics (module doc); all scalars are 0.0 when no token was recorded."""
        if not self._parts["log_rho"] or sum(t.numel() for t in self._parts["log_rho"]) == 0:
            return {
                **dict.fromkeys(SCALAR_KEYS, 0.0),
                **{f"token_frac/{bucket_name(*b)}": 0.0 for b in BUCKETS},
            }
        log_rho_N, p_mu_N, dp_N, w_N = (torch.cat(self._parts[k]) for k in ("log_rho", "p_mu", "dp", "w"))
        k1_N = -log_rho_N
        k3_N = torch.expm1(log_rho_N) - log_rho_N
        rho_N = log_rho_N.exp()
        out = {
            "k1": k1_N.mean(),
            "k1_p99": torch.quantile(k1_N, 0.99),
            "k3": k3_N.mean(),
            "k3_p99": torch.quantile(k3_N, 0.99),
            "mean_abs_dp": dp_N.mean(),
            "max_abs_dp": dp_N.max(),
            "mean_rho": rho_N.mean(),
            "max_rho": rho_N.max(),
            "min_rho": rho_N.min(),
            "ess": effective_sample_size(rho_N),
            "ess_corrected": effective_sample_size(w_N),
            "mask_frac": torch.cat(self._parts["masked"]).double().mean(),
            "tis_trunc_frac": torch.cat(self._parts["trunc"]).double().mean(),
        }
        masked_N, trunc_N = (torch.cat(self._parts[k]).double() for k in ("masked", "trunc"))
        per_token = {"k1": k1_N, "k3": k3_N, "abs_dp": dp_N, "rho": rho_N, "mask_frac": masked_N}
        out.update(_bucket_stats(p_mu_N, {**per_token, "tis_trunc_frac": trunc_N}, k3_N, dp_N, rho_N))
        return {k: float(v) for k, v in out.items()}


def effective_sample_size(w_N: Tensor) -> Tensor:
    """Normalised ESS ``(Σ w)² / (n Σ w²)``: 1 for equal weights, 1/n for one dominant weight, 0 if all 0."""
    sq = (w_N * w_N).sum()
    if sq <= 0:
        return w_N.new_zeros(())
    return w_N.sum() ** 2 / (w_N.numel() * sq)


def _bucket_stats(
    p_mu_N: Tensor, means: dict[str, Tensor], k3_N: Tensor, dp_N: Tensor, rho_N: Tensor
) -> dict[str, Tensor]:
    """Token share per probability bucket; over each non-empty bucket the mean of every value in
    ``means``, the p99 of k3, the max |Δp| and the ESS of ρ."""
    edges = torch.tensor([low for low, _ in BUCKETS[1:]], dtype=p_mu_N.dtype, device=p_mu_N.device)
    index_N = torch.bucketize(p_mu_N, edges, right=True)  # [lo, hi): p == lo goes up; p = 1 in the last
    out: dict[str, Tensor] = {}
    for i, (low, high) in enumerate(BUCKETS):
        in_N = index_N == i
        name = bucket_name(low, high)
        out[f"token_frac/{name}"] = in_N.double().mean()
        if bool(in_N.any()):
            for key, v_N in means.items():
                out[f"{key}/{name}"] = v_N[in_N].mean()
            out[f"k3_p99/{name}"] = torch.quantile(k3_N[in_N], 0.99)
            out[f"max_abs_dp/{name}"] = dp_N[in_N].max()
            out[f"ess/{name}"] = effective_sample_size(rho_N[in_N])
    return out
