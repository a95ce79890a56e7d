"""Sampler precision: a low-precision (bf16/fp16) model whose output head, and optionally its MoE
routers, compute in fp32.

The sampler's logprobs μ differ from the fp32 trainer's π_old mostly through rounding. The largest
single source in a bf16 sampler is the output head: the logits come out of the LM head rounded to
bf16 (8 significant bits: a logit near 10 moves by up to 0.03), and every token's logprob inherits
that error. MiniMax-M1 reports the same (their train/inference probability mismatch came from the LM
head's precision; they compute it in fp32). :func:`cast_for_sampling` casts a model to the sampling
dtype *except* for the parts named, which keep (or get) fp32 weights and run on fp32 inputs:

- ``fp32_head``: the final norm and the LM head. The norm sees the decoder's last hidden state
  upcast to fp32 (the residual stream itself stays in the sampling dtype), so the logits are the
  fp32 head applied to the bf16 hidden state. With tied embeddings the shared matrix is fp32 and the
  input embedding's output is cast to the sampling dtype, which is exactly the lookup a bf16 model
  does (rounding the fp32 row equals looking up the rounded row).
- ``fp32_router``: every MoE router (:data:`~shipyard.models.router_replay.ROUTER_CLASSES`) gets
  fp32 weights and an fp32 copy of its input, so router logits, softmax/sigmoid, top-k and gate
  weights are fp32; the experts then scale their bf16 outputs by the fp32 gate weights (the
  transformers expert loops promote the product and round it back into the bf16 residual stream).

Contract: the returned names are the parameters (and persistent buffers) that are fp32 afterwards;
the model is changed in place. Weights that were fp32 before the call keep their full fp32 values in
the fp32 parts (not the bf16-rounded ones). With neither part requested the result is exactly
``model.to(dtype)``. With ``dtype=torch.float32`` the call is ``model.float()`` and returns all
parameter names. The parts keep their names and shapes, so weight updates staged by name (the
engine's ``stage_weights``) land in them at full precision. Router replay hooks
(:class:`~shipyard.models.router_replay.RouterSeam`) compose with it: they see fp32 router logits
and compute fp32 gate weights with the architecture's own rule.

Limits: transformers' Llama-style layouts (``model.<base>.norm`` and ``get_output_embeddings()``) and
the three router classes; the decoder (attention, MLPs, experts, layer norms, residual stream) stays
in ``dtype``, so the mismatch it causes remains (see docs/mismatch.md, "what the rest is made of").
Call it once per model (a second call would add a second set of hooks; it raises instead).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from shipyard.models.router_replay import moe_routers

_MARK = "_shipyard_sampler_precision"


def _to_fp32(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
    """Forward pre-hook: floating positional inputs cast to fp32."""
    return tuple(a.float() if torch.is_tensor(a) and a.is_floating_point() else a for a in args)


def _cast_output(dtype: torch.dtype) -> Any:
    def hook(module: nn.Module, args: tuple[Any, ...], output: torch.Tensor) -> torch.Tensor:
        return output.to(dtype)

    return hook


def head_modules(model: nn.Module) -> tuple[nn.Module, nn.Module]:
    """``(final norm, LM head)`` of a transformers causal LM; ValueError when the layout is unknown."""
    base = getattr(model, getattr(model, "base_model_prefix", ""), None)
    norm = getattr(base, "norm", None)
    lm_head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if not isinstance(norm, nn.Module) or not isinstance(lm_head, nn.Linear):
        raise ValueError(
            f"{type(model).__name__}: no final norm at model.{getattr(model, 'base_model_prefix', '?')}.norm "
            "or no nn.Linear output embedding; fp32_head supports transformers' Llama-style causal LMs"
        )
    return norm, lm_head


def cast_for_sampling(
    model: nn.Module, dtype: torch.dtype, *, fp32_head: bool = False, fp32_router: bool = False
) -> list[str]:
    """Cast ``model`` to ``dtype`` in place, keeping the head and/or routers in fp32 (module doc).

    Returns the names of the parameters and buffers that are fp32 afterwards (sorted). Raises
    ValueError when ``dtype`` is not floating, when ``fp32_router`` is asked of a model without MoE
    routers, or when the model was already cast by this function.
    """
    if not dtype.is_floating_point:
        raise ValueError(f"sampling dtype must be a floating dtype, got {dtype}")
    if getattr(model, _MARK, False):
        raise ValueError("cast_for_sampling was already applied to this model; apply it once")
    if dtype == torch.float32:
        model.float()
        return sorted(name for name, _ in model.state_dict().items())
    keep: list[nn.Module] = []
    if fp32_head:
        keep.extend(head_modules(model))
    if fp32_router:
        routers = [r for _, r in moe_routers(model)]
        if not routers:
            raise ValueError(f"fp32_router: {type(model).__name__} has no MoE router")
        keep.extend(routers)
    kept = {
        id(t): (t, t.data) for m in keep for t in [*m.parameters(), *m.buffers()] if t.is_floating_point()
    }
    model.to(dtype)
    for tensor, data in kept.values():
        tensor.data = data.float()
    for module in keep:
        module.register_forward_pre_hook(_to_fp32)
    if fp32_head:
        embed = model.get_input_embeddings()
        if any(id(p) in kept for p in embed.parameters()):  # tied: fp32 matrix, lookup in dtype
            embed.register_forward_hook(_cast_output(dtype))
    setattr(model, _MARK, True)
    fp32_ids = {id(t) for t, _ in kept.values()}
    return sorted(
        name
        for name, t in model.state_dict(keep_vars=True).items()
        if id(t) in fp32_ids or t.dtype == torch.float32
    )


def apply_inference_precision(model: nn.Module, fp32_lm_head: bool, fp32_router: bool) -> list[str]:
    """The engine's side of ``inference.fp32_lm_head`` / ``inference.fp32_router``: when ``model``'s
    weights are in a low precision, run its head (and MoE routers, if it has any) in fp32; an fp32
    model is left untouched (its head already is fp32). Returns the fp32 names, [] when untouched."""
    dtype = next(model.parameters()).dtype
    if dtype == torch.float32 or not (fp32_lm_head or fp32_router):
        return []
    router = fp32_router and bool(moe_routers(model))
    return cast_for_sampling(model, dtype, fp32_head=fp32_lm_head, fp32_router=router)


def engine_precision(model: nn.Module, cfg: Any) -> dict[str, str]:
    """Cast a freshly loaded (fp32) engine model to ``cfg.inference.dtype`` resolved for its device
    (``auto``: bf16 where :func:`shipyard.models.hardware.bf16_support` says it is fast), then apply
    ``fp32_lm_head`` / ``fp32_router``. ``cfg`` is the :class:`InferenceConfig`. Returns the record the
    server shows on ``/stats``: ``{"dtype": ..., "reason": ...}``."""
    from shipyard.models.hardware import resolve_dtype

    device = next(model.parameters()).device.type
    dtype, reason = resolve_dtype(cfg.dtype, device, "inference.dtype")
    if dtype == torch.float32:
        apply_inference_precision(model, cfg.fp32_lm_head, cfg.fp32_router)  # as loaded, if already low
    else:  # from the fp32 weights: the fp32 parts keep their full values
        router = cfg.fp32_router and bool(moe_routers(model))
        cast_for_sampling(model, dtype, fp32_head=cfg.fp32_lm_head, fp32_router=router)
    return {"dtype": str(dtype).removeprefix("torch."), "reason": reason}
