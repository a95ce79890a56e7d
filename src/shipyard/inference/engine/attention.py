"""The engine's attention on CPUs: SDPA, with a decode step's query heads packed onto their KV heads.

Why: for a one-token query (a decode step) with grouped-query attention and no mask, transformers
calls SDPA with ``enable_gqa=True``, which on a CPU is 6-8x slower than the same attention with the
query's heads folded onto their key/value heads (``[B, H, 1, D] -> [B, KV, H/KV, D]``: one small
attention per KV head). transformers itself packs that way only when a mask is given, and it drops
the mask of a batch without padding, so a decode step of one row, or of rows of one length, took
the slow path (``benchmarks/decode_attention.py``: SmolLM2-135M, bf16, 1 thread, 480 positions, ms
a decode step, transformers' SDPA -> this: 12 rows without padding 252 -> 97, one row 56 -> 44,
padded rows the same call and time; the project's 2-core AMD EPYC). transformers 5.17 repeats the
key/value heads instead of packing even with a mask.

Contract: :func:`use_packed_decode` switches a model loaded with ``attn_implementation="sdpa"`` to
``"shipyard_sdpa"``: exactly SDPA (transformers' own function, its mask builder) for every query
longer than one token and for models without grouped heads, and otherwise the packed SDPA call
transformers makes for a masked decode step. The result is the same attention to rounding (SDPA's
CPU kernel accumulates in fp32 either way). A hand-written matmul-softmax decode was 13-17% faster
still, but its scores are rounded to bf16 before the softmax (5x SDPA's error on large scores).
Limits: CPU engines only; on CUDA transformers' ``enable_gqa`` path is the fast one and stays.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

NAME = "shipyard_sdpa"


def packed_decode_sdpa(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: ``query [B, H, Q, D]``, ``key``/``value
    [B, KV, T, D]``, ``attention_mask`` a boolean ``[B, 1, Q, T]`` or None; returns ``[B, Q, H, D]``."""
    groups = int(getattr(module, "num_key_value_groups", 1))
    plain = kwargs.get("position_bias") is None and kwargs.get("softcap") is None and not dropout
    if query.shape[2] != 1 or groups == 1 or not plain:  # transformers' SDPA, or its error
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    b, h, _, d = query.shape
    out_BKGD = F.scaled_dot_product_attention(
        query.reshape(b, h // groups, groups, d), key, value, attn_mask=attention_mask, scale=scaling
    )
    return out_BKGD.reshape(b, h, 1, value.shape[-1]).transpose(1, 2).contiguous(), None


def use_packed_decode(model: Any) -> bool:
    """Switch ``model`` (an HF causal LM on a CPU) to :func:`packed_decode_sdpa`; False, and nothing
    changed, when it does not use SDPA (eager, flex or a kernel of its own)."""
    if model.config._attn_implementation != "sdpa":
        return False
    AttentionInterface.register(NAME, packed_decode_sdpa)
    ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, sdpa_mask)
    model.set_attn_implementation(NAME)
    return True
