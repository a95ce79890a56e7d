"""Per-token logprobs of a causal LM on right-padded batches, without full-vocab blow-up.

Contract:
- ``token_logprobs(model, ids_BT, attn_BT)[:, t] = log p(ids[t] | ids[<t])`` for every real
  (``attn == 1``) position ``t >= 1``; column 0, padding and positions outside the optional
  ``score_mask_BT`` are exactly 0. Logits are divided by ``temperature`` first, matching the
  sampler's logprobs (which are taken after temperature). Gradients flow when grad is enabled.
- Memory: the decoder runs once; the LM head runs only on the positions that are scored,
  ``chunk_tokens`` rows at a time, each chunk as ``target_logit - logsumexp(logits)``. With grad
  enabled each chunk is activation-checkpointed, so at most one chunk of ``[chunk, V]`` logits
  (plus its gradient) is alive at once instead of ``[B, T, V]`` logits, log-softmax and grad.
- Shared prefix (``prefix=P > 0``): every row starts with the same ``P`` real tokens (a GRPO
  group's prompt; :func:`shipyard.trainer.microbatch.shared_prefix` finds them). The decoder runs on
  those ``P`` tokens once, their keys and values are repeated for the batch and the rows' remaining
  tokens run on top of them. The math is the full forward's (the rows' gradients sum through the
  shared keys and values); values differ only by float rounding (below 1e-6 in fp32 on the tiny
  models), and a micro-batch of B rows forwards ``P`` fewer tokens for each of its ``B - 1`` other
  rows. A ``P`` the rows do not share, or that leaves a row no token of its own, is a ValueError.
- ``pad_batch`` / ``pad_ints`` / ``pad_floats`` right-pad Python lists into tensors.
Limits: the fast path needs an HF causal LM whose logits are exactly ``lm_head(decoder(x))``
(Llama, Qwen, Mistral, SmolLM, ...); models with logit soft-capping or scaling, or without a
linear output head, fall back to the full ``model(...).logits`` path (correct, more memory), which
shares no prefix. Prefix sharing needs the model's KV cache (every HF decoder with
``DynamicCache``) and is off under activation checkpointing (a recomputed block would append to
the cache again).
Batches must be right-padded (every row starts with a real token).

Shape legend: B = batch, T = padded length, H = hidden size, V = vocab, N = scored positions,
P = shared prefix length, S = T - P, M = P + B * S (rows of the hidden-state table).
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint


def _pad(
    seqs: Sequence[Sequence[int | float]], value: int | float, dtype: torch.dtype, device: Any
) -> Tensor:
    if len(seqs) == 0:
        raise ValueError("cannot pad an empty list of sequences")
    length = max(len(s) for s in seqs)
    if length == 0:
        raise ValueError("every sequence is empty; nothing to pad")
    rows = [list(s) + [value] * (length - len(s)) for s in seqs]
    return torch.tensor(rows, dtype=dtype, device=device)


def pad_ints(seqs: Sequence[Sequence[int]], value: int = 0, device: Any = None) -> Tensor:
    """Right-pad integer lists into a ``[B, T]`` int64 tensor."""
    return _pad(seqs, value, torch.long, device)


def pad_floats(seqs: Sequence[Sequence[float]], value: float = 0.0, device: Any = None) -> Tensor:
    """Right-pad float lists into a ``[B, T]`` float32 tensor."""
    return _pad(seqs, value, torch.float32, device)


def pad_batch(seqs: Sequence[Sequence[int]], pad_id: int, device: Any = None) -> tuple[Tensor, Tensor]:
    """Right-pad token lists: ``(ids_BT, attn_BT)``, both int64, ``attn`` 1 on real tokens."""
    ids_BT = pad_ints(seqs, pad_id, device)
    lengths_B = torch.tensor([len(s) for s in seqs], device=ids_BT.device)
    attn_BT = (torch.arange(ids_BT.shape[1], device=ids_BT.device)[None, :] < lengths_B[:, None]).long()
    return ids_BT, attn_BT


def _cache_arg(decoder: Any) -> str:
    """The decoder's name for a KV cache argument (transformers >= 5.24 renamed ``past_key_values``)."""
    return "cache" if "cache" in inspect.signature(decoder.forward).parameters else "past_key_values"


def _hidden_at(
    decoder: Any, ids_BT: Tensor, attn_BT: Tensor, b_N: Tensor, j_N: Tensor, prefix: int
) -> Tensor:
    """``[N, H]`` last hidden states of row ``b_N`` at position ``j_N``; with ``prefix`` > 0 the first
    ``prefix`` tokens (equal in every row) run once and the rest on their repeated keys and values."""
    if prefix == 0:
        hidden_BTH = decoder(input_ids=ids_BT, attention_mask=attn_BT, use_cache=False).last_hidden_state
        return hidden_BTH[b_N, j_N]
    from transformers import DynamicCache

    B, T = ids_BT.shape
    cache = DynamicCache(config=decoder.config)
    arg = _cache_arg(decoder)
    shared_1PH = decoder(input_ids=ids_BT[:1, :prefix], use_cache=True, **{arg: cache}).last_hidden_state
    cache.batch_repeat_interleave(B)  # differentiable: each row's gradient reaches the shared K/V
    tail = {"input_ids": ids_BT[:, prefix:], "attention_mask": attn_BT, arg: cache}
    tail_BSH = decoder(**tail, use_cache=True).last_hidden_state
    table_MH = torch.cat([shared_1PH[0], tail_BSH.reshape(B * (T - prefix), -1)])
    row_N = torch.where(j_N < prefix, j_N, prefix + b_N * (T - prefix) + (j_N - prefix))
    return table_MH[row_N]


def _chunk_logprobs(
    hidden_NH: Tensor, weight_VH: Tensor, bias_V: Tensor | None, targets_N: Tensor, inv_temp: float
) -> Tensor:
    logits_NV = F.linear(hidden_NH, weight_VH, bias_V).float()
    if inv_temp != 1.0:
        logits_NV = logits_NV * inv_temp
    target_N = logits_NV.gather(1, targets_N[:, None]).squeeze(1)
    return target_N - torch.logsumexp(logits_NV, dim=-1)


def _fast_path_parts(model: Any) -> tuple[Any, torch.nn.Linear] | None:
    """(decoder, lm_head) when logits are exactly ``lm_head(decoder(x).last_hidden_state)``."""
    config = getattr(model, "config", None)
    if (
        config is None
        or getattr(config, "final_logit_softcapping", None)
        or getattr(config, "logit_scale", None)
    ):
        return None
    attr = getattr(model, "base_model_prefix", "")
    decoder = getattr(model, attr, None) if attr else None
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if decoder is None or decoder is model or type(head) is not torch.nn.Linear:
        return None
    return decoder, head


def _checkpointed(model: Any) -> bool:
    """Whether the HF model recomputes its blocks in the backward (the name changed in 5.24)."""
    flag = getattr(model, "is_activation_checkpointing", None)
    return bool(getattr(model, "is_gradient_checkpointing", False) if flag is None else flag)


def _check_inputs(ids_BT: Tensor, attn_BT: Tensor, score_mask_BT: Tensor | None, temperature: float) -> None:
    if ids_BT.dim() != 2 or ids_BT.numel() == 0:
        raise ValueError(f"ids must be a non-empty [B, T] tensor, got shape {tuple(ids_BT.shape)}")
    if attn_BT.shape != ids_BT.shape or (score_mask_BT is not None and score_mask_BT.shape != ids_BT.shape):
        raise ValueError(f"attention/score masks must have the shape of ids {tuple(ids_BT.shape)}")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 to score tokens, got {temperature}")
    attn_b = attn_BT.bool()
    if not bool(attn_b[:, 0].all()) or bool((attn_b[:, 1:] & ~attn_b[:, :-1]).any()):
        raise ValueError(
            "batch must be right-padded: each attention row is ones then zeros, starting with a one"
        )


class TokenScorer(torch.nn.Module):
    """``model`` behind one ``forward`` that returns the logprobs of chosen positions.

    Everything that touches parameters (decoder, LM head) runs inside this forward, so a sharded
    trainer can make the scorer its FSDP root: the root's hooks gather the embeddings, final norm
    and head for the forward and reduce their gradients after the backward. ``token_logprobs``
    wraps a plain model in one on the fly; the parameters keep the model's names under ``model.``.
    """

    def __init__(self, model: Any, chunk_tokens: int = 1024) -> None:
        super().__init__()
        if chunk_tokens < 1:
            raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
        self.model = model
        self.chunk_tokens = chunk_tokens

    def forward(
        self,
        ids_BT: Tensor,
        attn_BT: Tensor,
        b_N: Tensor,
        t_N: Tensor,
        inv_temp: float,
        bf16_decoder: bool,
        prefix: int = 0,
    ) -> Tensor:
        """Logprobs ``[N]`` of ``ids_BT[b_N, t_N]``; ``prefix`` > 0: the first ``prefix`` tokens are
        the same in every row and run once (module doc)."""
        targets_N = ids_BT[b_N, t_N]
        parts = _fast_path_parts(self.model)
        if parts is None:
            if bf16_decoder:
                raise ValueError(
                    "bf16_decoder needs a model whose logits are lm_head(decoder(x)); disable it"
                )
            logits_BTV = self.model(input_ids=ids_BT, attention_mask=attn_BT, use_cache=False).logits
            logits_NV = logits_BTV[b_N, t_N - 1].float() * inv_temp
            return logits_NV.gather(1, targets_N[:, None]).squeeze(1) - torch.logsumexp(logits_NV, dim=-1)
        decoder, head = parts
        if _checkpointed(self.model):
            prefix = 0  # a recomputed block would append its keys and values to the cache again
        with torch.autocast(ids_BT.device.type, dtype=torch.bfloat16, enabled=bf16_decoder):
            hidden_NH = _hidden_at(decoder, ids_BT, attn_BT, b_N, t_N - 1, prefix).float()
        use_ckpt = torch.is_grad_enabled() and hidden_NH.requires_grad
        pieces = []
        for start in range(0, hidden_NH.shape[0], self.chunk_tokens):
            end = start + self.chunk_tokens
            args = (hidden_NH[start:end], head.weight, head.bias, targets_N[start:end])
            if use_ckpt:
                pieces.append(checkpoint(_chunk_logprobs, *args, inv_temp, use_reentrant=False))
            else:
                pieces.append(_chunk_logprobs(*args, inv_temp))
        return torch.cat(pieces) if pieces else hidden_NH.new_zeros((0,), dtype=torch.float32)


def token_logprobs(
    model: Any,
    ids_BT: Tensor,
    attn_BT: Tensor,
    *,
    score_mask_BT: Tensor | None = None,
    temperature: float = 1.0,
    chunk_tokens: int = 1024,
    bf16_decoder: bool = False,
    prefix: int = 0,
) -> Tensor:
    """``[B, T]`` float32 logprobs of each token given its prefix; 0 where not scored (see module doc).
    ``model`` is an HF causal LM (scored ``chunk_tokens`` head rows at a time) or a
    :class:`TokenScorer` (e.g. the sharded trainer's, with its own chunk size). ``prefix``: the
    first ``prefix`` tokens, the same in every row, run through the decoder once (module doc)."""
    _check_inputs(ids_BT, attn_BT, score_mask_BT, temperature)
    if prefix and not (
        int(attn_BT.sum(1).min()) > prefix and bool((ids_BT[:, :prefix] == ids_BT[:1, :prefix]).all())
    ):
        raise ValueError(
            f"prefix={prefix}: the rows must share their first {prefix} tokens and each have one more"
        )
    sel_BT = attn_BT.bool().clone()
    sel_BT[:, 0] = False
    if score_mask_BT is not None:
        sel_BT &= score_mask_BT.bool()
    b_N, t_N = sel_BT.nonzero(as_tuple=True)
    scorer = model if isinstance(model, TokenScorer) else TokenScorer(model, chunk_tokens)
    lp_N = scorer(ids_BT, attn_BT, b_N, t_N, 1.0 / temperature, bf16_decoder, prefix)
    out_BT = torch.zeros(ids_BT.shape, dtype=torch.float32, device=ids_BT.device)
    return out_BT.index_put((b_N, t_N), lp_N.float())
