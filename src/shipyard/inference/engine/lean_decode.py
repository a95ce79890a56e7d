"""A decode step of a Llama-architecture model on a CPU without transformers' per-module Python.

Why: a decode step of SmolLM2-135M (30 layers) in bf16 on 2 threads spent about 12 ms of its 52 in
Python and small tensor ops (issue 39's profile), and part of that is transformers' own machinery
around the kernels: the decoder layer's and attention's keyword plumbing, the attention-interface
lookup, ``create_causal_mask``, output records and ``capture_outputs``. :class:`LeanDecode` runs
the same modules and functions in the same order on the same tensors, and leaves that machinery out
(measured: 57 -> 49 ms a step, 16 rows, bf16, 2 threads; ``benchmarks/inference_vllm.py``).

Contract: ``LeanDecode(model)(tokens_B, mask_BT, pos_B, cache)`` returns the logits of one new token
per row, ``[B, V]``, bit-identical to ``model(input_ids=tokens_B[:, None], attention_mask=mask_BT,
position_ids=pos_B[:, None], cache=cache, use_cache=True).logits[:, -1]`` (tests hold it so, fp32
and bf16 with the fp32 head, padded and unpadded rows), and writes the same keys/values into
``cache``. The norms, projections (packed or not), rotary embedding, embedding and head are called
as the modules they are, so their hooks (:mod:`shipyard.models.precision`'s fp32 head) and packed
GEMMs (:mod:`shipyard.inference.engine.packed`) act as in the full forward. The attention is
:func:`~shipyard.inference.engine.attention.packed_decode_sdpa`, the function the engine installs
for SDPA models, with the mask transformers builds for a one-token query: the rows' padding,
``[B, 1, 1, T]`` boolean, or None without padding.

Limits: :func:`lean_decode` returns None (the engine keeps the full forward) unless the model is
exactly transformers' ``LlamaForCausalLM`` with its own layer classes and no forward hooks in its
decoder layers or on the modules whose ``forward`` this replaces, runs the engine's ``shipyard_sdpa`` attention on a CPU and
every cache layer keeps all positions, with its decoder layers in one dtype. Mistral-, Qwen- and MoE-style models take the full forward.

Shape legend: B = rows, T = key/value length, H = query heads, KV = key/value heads, D = head size,
E = hidden size, V = vocabulary size.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import DynamicCache
from transformers.activations import SiLUActivation
from transformers.models.llama import modeling_llama as llama

from shipyard.inference.engine.attention import NAME, packed_decode_sdpa
from shipyard.inference.engine.kv_cache import full_attention
from shipyard.inference.engine.packed import PackedGroup, PackedLinear


def _hooked(module: nn.Module) -> bool:
    return bool(
        module._forward_hooks
        or module._forward_pre_hooks
        or getattr(module, "_forward_hooks_with_kwargs", None)
        or getattr(module, "_forward_pre_hooks_with_kwargs", None)
    )


def lean_decode(model: Any) -> LeanDecode | None:
    """A :class:`LeanDecode` for ``model``, or None where it must take the full forward (module doc)."""
    if type(model) is not llama.LlamaForCausalLM or next(model.parameters()).device.type != "cpu":
        return None
    if model.config._attn_implementation != NAME:  # set by the engine's use_packed_decode
        return None
    skipped: list[tuple[nn.Module, type]] = [(model.model, llama.LlamaModel)]
    for layer in model.model.layers:
        skipped += [
            (layer, llama.LlamaDecoderLayer),
            (layer.self_attn, llama.LlamaAttention),
            (layer.mlp, llama.LlamaMLP),
            (layer.input_layernorm, llama.LlamaRMSNorm),
            (layer.post_attention_layernorm, llama.LlamaRMSNorm),
        ]
    if any(type(m) is not cls for m, cls in skipped):
        return None
    if any(_hooked(m) for m in (model, model.model, *model.model.layers.modules())):  # none would run
        return None
    if len({p.dtype for p in model.model.layers.parameters()}) != 1:  # the decoder in one dtype
        return None
    if not full_attention(DynamicCache(config=model.config)):
        return None
    return LeanDecode(model)


Project = Callable[[torch.Tensor], list[torch.Tensor]]
"""Sibling projections of one ``[N, I]`` input: their ``[N, O]`` outputs, in order."""


def _projection(members: list[nn.Module]) -> Project:
    """One GEMM through the members' :class:`PackedGroup` where they form one, else each layer called."""
    group = getattr(members[0], "group", None)
    if isinstance(group, PackedGroup) and group.members == members:
        return group.columns
    if len(members) == 1 and isinstance(members[0], PackedLinear) and members[0].packed is not None:
        return members[0].columns
    return lambda x_NI: [m(x_NI) for m in members]


def _queries_keys_values(attn: Any) -> Project:
    """``[qk_N(H+KV)D, v_N(KV)D]``: the query and key columns side by side, as one packed GEMM leaves
    them (so one rotation covers both), or concatenated where the projections are separate layers."""
    group = getattr(attn.q_proj, "group", None)
    if isinstance(group, PackedGroup) and group.members == [attn.q_proj, attn.k_proj, attn.v_proj]:
        qk = group.bounds[2]

        def packed(x_NI: torch.Tensor) -> list[torch.Tensor]:
            y_NO = group.product(x_NI)
            return [y_NO[:, :qk], y_NO[:, qk:]]

        return packed
    return lambda x_NI: [torch.cat([attn.q_proj(x_NI), attn.k_proj(x_NI)], dim=-1), attn.v_proj(x_NI)]


class _Layer:
    """What a decode step reads of one ``LlamaDecoderLayer``."""

    def __init__(self, layer: Any) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        self.norm1, self.norm2 = layer.input_layernorm, layer.post_attention_layernorm
        self.qk_v = _queries_keys_values(attn)
        self.o = _projection([attn.o_proj])
        self.gate_up = _projection([mlp.gate_proj, mlp.up_proj])
        self.down = _projection([mlp.down_proj])
        self.act = F.silu if isinstance(mlp.act_fn, SiLUActivation) else mlp.act_fn
        self.attn = attn


def _rms_norm(norm: Any, h_NE: torch.Tensor) -> torch.Tensor:
    """``LlamaRMSNorm.forward``: the same fp32 ops (``x * rsqrt(mean(x^2) + eps)``), in ATen's composite
    ``rms_norm`` rather than one Python call each (bit-identical: ``tests/inference/test_lean_decode.py``)."""
    x_NE = F.rms_norm(h_NE.to(torch.float32), (h_NE.shape[-1],), None, norm.variance_epsilon)
    return norm.weight * x_NE.to(h_NE.dtype)


def _rotate(x_BHD: torch.Tensor, cos_B11D: torch.Tensor, sin_B11D: torch.Tensor) -> torch.Tensor:
    """``apply_rotary_pos_emb`` for one tensor, op for op (``x * cos + rotate_half(x) * sin``)."""
    half = x_BHD.shape[-1] // 2
    rotated = torch.cat((-x_BHD[..., half:], x_BHD[..., :half]), dim=-1)
    return (x_BHD * cos_B11D) + (rotated * sin_B11D)


def _additive_mask(mask_BT: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``[B, 1, 1, T]``: 0 where attended, -inf where padded, in ``dtype``: what SDPA makes of the
    boolean mask on every call (``convert_boolean_attn_mask``), made once for the step's layers."""
    return torch.zeros(mask_BT.shape, dtype=dtype).masked_fill_(mask_BT == 0, float("-inf"))[:, None, None, :]


class LeanDecode:
    """One decode step of a transformers ``LlamaForCausalLM`` on a CPU (module doc)."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.layers = [_Layer(layer) for layer in model.model.layers]
        attn = model.model.layers[0].self_attn
        self.heads = model.config.num_attention_heads
        self.kv_heads = model.config.num_key_value_heads
        self.head_dim = int(attn.head_dim)
        self.scaling = float(attn.scaling)

    @torch.no_grad()
    def __call__(
        self, tokens_B: torch.Tensor, mask_BT: torch.Tensor | None, pos_B: torch.Tensor, cache: DynamicCache
    ) -> torch.Tensor:
        base = self.model.model
        h_BE = base.embed_tokens(tokens_B)
        cos_BD, sin_BD = base.rotary_emb(h_BE, pos_B)
        cos_B11D, sin_B11D = cos_BD[:, None, None, :], sin_BD[:, None, None, :]
        mask_B11T = None if mask_BT is None else _additive_mask(mask_BT, h_BE.dtype)
        for layer, cache_layer in zip(self.layers, cache.layers, strict=True):
            attended_BE = self._attention(
                layer, _rms_norm(layer.norm1, h_BE), cos_B11D, sin_B11D, mask_B11T, cache_layer
            )
            h_BE = h_BE + attended_BE
            gate_BI, up_BI = layer.gate_up(_rms_norm(layer.norm2, h_BE))
            (mlp_BE,) = layer.down(layer.act(gate_BI) * up_BI)
            h_BE = h_BE + mlp_BE
        return self.model.lm_head(base.norm(h_BE))

    def _attention(
        self,
        layer: _Layer,
        x_BE: torch.Tensor,
        cos_B11D: torch.Tensor,
        sin_B11D: torch.Tensor,
        mask_B11T: torch.Tensor | None,
        cache_layer: Any,
    ) -> torch.Tensor:
        """``LlamaAttention.forward`` for a one-token query: q and k rotated in one pass (the same
        elementwise ops on each element), then the engine's packed SDPA."""
        b, d, h, kv = x_BE.shape[0], self.head_dim, self.heads, self.kv_heads
        qk_BE, v_BE = layer.qk_v(x_BE)
        qk_BH1D = _rotate(qk_BE.view(b, h + kv, 1, d), cos_B11D, sin_B11D)
        k_BKTD, v_BKTD = cache_layer.update(qk_BH1D[:, h:], v_BE.view(b, kv, 1, d))
        out_B1HD, _ = packed_decode_sdpa(
            layer.attn, qk_BH1D[:, :h], k_BKTD, v_BKTD, mask_B11T, scaling=self.scaling
        )
        (o_BE,) = layer.o(out_B1HD.reshape(b, h * d))
        return o_BE
