"""Sampling one token per row of a batch: the engine's sampler and the OpenAI-style logit controls.

Contract: :func:`sample_tokens` draws one token per row from the tempered distribution (greedy at
T = 0; top-p over the sorted nucleus), each row from its own generator, and returns the logprob of
the token under the distribution it was drawn from (after temperature, before top-p truncation).
:func:`adjust_logits` applies, per row and before sampling, ``logit_bias`` (added to the named
tokens' logits) and the presence and frequency penalties over the row's generated tokens (OpenAI's
definitions: ``logit[j] -= presence * (count[j] > 0) + frequency * count[j]``); rows without any
control are left untouched (bit for bit). :func:`top_logprobs` gives the ``k`` most likely tokens
of a row and their logprobs under the same distribution the sampled token's logprob is taken from.

Shape legend: ``B`` rows of the batch, ``V`` vocabulary, ``S`` sampling rows, ``K`` candidates.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from shipyard.inference.types import SamplingParams

NUCLEUS_TOPK = 1024
"""Top-p rows look for their nucleus among this many most likely tokens before sorting the vocabulary."""


def sample_tokens(
    logits_BV: torch.Tensor, temps_B: torch.Tensor, top_p_B: torch.Tensor, generators: list[torch.Generator]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row; returns ``(tokens_B, logprobs_B)``.

    Greedy rows (T = 0) take the argmax and draw no random number. Sampling rows draw one uniform
    from their own generator and invert the CDF of the tempered distribution (in vocabulary order
    when top_p = 1, in descending-probability order over the top-p nucleus otherwise), so a row's
    draw depends only on its own logits and generator.
    """
    assert logits_BV.dim() == 2 and len(generators) == logits_BV.shape[0]
    logits_BV = logits_BV.float()
    greedy_B = temps_B == 0
    scale_B = torch.where(greedy_B, 1.0, temps_B)
    # x / 1.0 is x: the common RL batch (every row at T = 1) skips a pass over [B, V]
    logp_BV = torch.log_softmax(
        logits_BV if bool((scale_B == 1).all()) else logits_BV / scale_B[:, None], dim=-1
    )
    sampling = (~greedy_B).nonzero().flatten().tolist()
    if len(sampling) < len(generators):  # greedy rows take the argmax
        tokens_B = logits_BV.argmax(dim=-1)
    if sampling:
        u_S = torch.stack([torch.rand((), generator=generators[i], dtype=torch.float64) for i in sampling])
        if len(sampling) == len(generators):  # every row samples: no gather of rows
            tokens_B = _draw(logp_BV.exp(), top_p_B.double(), u_S)
        else:
            rows_S = torch.tensor(sampling, dtype=torch.long)
            tokens_B[rows_S] = _draw(logp_BV[rows_S].exp(), top_p_B[rows_S].double(), u_S)
    logprobs_B = logp_BV.gather(1, tokens_B[:, None]).squeeze(1)
    return tokens_B, logprobs_B


def _draw(probs_SV: torch.Tensor, top_p_S: torch.Tensor, u_S: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draw per row: vocabulary order for top_p = 1, else over the sorted nucleus."""
    tokens_S = torch.zeros(probs_SV.shape[0], dtype=torch.long)
    plain = (top_p_S >= 1.0).nonzero().flatten()
    if len(plain) == len(top_p_S):  # no nucleus row: no gather of rows
        return _invert_cdf(probs_SV.double(), u_S)
    if len(plain):
        tokens_S[plain] = _invert_cdf(probs_SV[plain].double(), u_S[plain])
    nucleus = (top_p_S < 1.0).nonzero().flatten()
    if not len(nucleus):
        return tokens_S
    vals_NK, order_NK = probs_SV[nucleus].topk(min(NUCLEUS_TOPK, probs_SV.shape[1]), dim=-1)
    wide_N = vals_NK.double().sum(dim=-1) < top_p_S[nucleus]
    parts = [(nucleus[~wide_N], vals_NK[~wide_N], order_NK[~wide_N])]
    if bool(wide_N.any()):
        parts.append((nucleus[wide_N], *probs_SV[nucleus[wide_N]].sort(dim=-1, descending=True, stable=True)))
    for rows_R, vals_RK, order_RK in parts:
        if len(rows_R):
            vals_RK = vals_RK.double()
            keep_RK = (vals_RK.cumsum(dim=-1) - vals_RK) < top_p_S[rows_R, None]
            pos_R = _invert_cdf(vals_RK * keep_RK, u_S[rows_R])
            tokens_S[rows_R] = order_RK.gather(1, pos_R[:, None]).squeeze(1)
    return tokens_S


def _invert_cdf(weights_SK: torch.Tensor, u_S: torch.Tensor) -> torch.Tensor:
    """Index k with cdf[k-1] <= u * total < cdf[k]; never a zero-weight index."""
    cdf_SK = weights_SK.cumsum(dim=-1)
    total_S = cdf_SK[:, -1]
    target_S = torch.minimum(u_S * total_S, torch.nextafter(total_S, torch.zeros_like(total_S)))
    return torch.searchsorted(cdf_SK, target_S[:, None], right=True).squeeze(1)


def adjust_logits(
    logits_BV: torch.Tensor, params: Sequence[SamplingParams], generated: Sequence[list[int]]
) -> torch.Tensor:
    """``logits_BV`` with each row's logit bias and presence/frequency penalties applied (module doc)."""
    rows = [b for b, p in enumerate(params) if p.logit_bias or p.presence_penalty or p.frequency_penalty]
    if not rows:
        return logits_BV
    out_BV = logits_BV.clone()
    for b in rows:
        p = params[b]
        if p.logit_bias:
            ids = torch.tensor(list(p.logit_bias), dtype=torch.long)
            out_BV[b, ids] += torch.tensor(list(p.logit_bias.values()), dtype=out_BV.dtype)
        if generated[b] and (p.presence_penalty or p.frequency_penalty):
            ids, counts = torch.tensor(generated[b], dtype=torch.long).unique(return_counts=True)
            out_BV[b, ids] -= p.presence_penalty + p.frequency_penalty * counts.to(out_BV.dtype)
    return out_BV


def top_logprobs(logits_V: torch.Tensor, temperature: float, k: int) -> list[tuple[int, float]]:
    """The ``k`` most likely tokens of one row and their logprobs (after temperature; T = 0 as T = 1)."""
    logp_V = torch.log_softmax(logits_V.float() / (temperature or 1.0), dim=-1)
    vals_K, ids_K = logp_V.topk(min(k, logp_V.shape[-1]))
    return list(zip(ids_K.tolist(), vals_K.tolist(), strict=True))
