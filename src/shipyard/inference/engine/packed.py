"""oneDNN-packed linear layers for the embedded engine on a CPU: faster decode matmuls.

Why: PyTorch's CPU ``linear`` calls MKL's GEMM, which on this project's AMD EPYC reaches 45-100
GFLOP/s at decode shapes (16 rows); the same GEMM through oneDNN with the weight reordered once into
its blocked layout takes 1.4-2.9x less time (SmolLM2's LM head: 20.1 -> 7.0 ms a step on 2 threads,
``benchmarks/inference.py``). vLLM's CPU build does the same. Measured, not assumed: see
docs/benchmarks.md ("embedded engine vs vLLM").

Contract: :func:`pack_linears` replaces every ``nn.Linear`` of a CPU model in fp32 or bf16 by a
:class:`PackedLinear` that holds the SAME weight and bias parameters (state-dict names, parameter
objects and tied storage unchanged, so weight updates keep writing into them) plus a packed copy it
computes with. The packed copy goes stale when the weight is written: :meth:`PackedModel.refresh`
repacks the layers whose weight storage is among the given data pointers (the engine calls it after
applying a version, with the tensors it wrote). Output equals ``F.linear`` up to float summation
order.

Limits: CPU only (a no-op on other devices, or where PyTorch has no oneDNN); the packed copy doubles
the memory of the linear weights; a layer is repacked whole, whatever fraction of it changed.

Shape legend: N = rows (tokens), I = in features, O = out features.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

PACKABLE = (torch.float32, torch.bfloat16)


class PackedLinear(nn.Module):
    """``nn.Linear`` computing with a oneDNN-packed copy of its weight (module doc)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.weight = linear.weight
        self.bias = linear.bias
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed: torch.Tensor = self.repack()

    def repack(self) -> torch.Tensor:
        self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), None)
        return self.packed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x_NI = x.reshape(-1, self.in_features)
        if x_NI.dtype != self.weight.dtype:  # e.g. autocast: do what F.linear would
            return nn.functional.linear(x, self.weight, self.bias)
        bias = None if self.bias is None else self.bias.detach()
        y_NO = torch.ops.mkldnn._linear_pointwise(x_NI.contiguous(), self.packed, bias, "none", [], "")
        return y_NO.reshape(*x.shape[:-1], self.out_features)


class PackedModel:
    """The packed layers of one model, to refresh after its weights change."""

    def __init__(self, layers: list[PackedLinear]) -> None:
        self.layers = layers

    def refresh(self, data_ptrs: Iterable[int]) -> int:
        """Repack the layers whose weight lives at one of ``data_ptrs``; returns how many."""
        ptrs = set(data_ptrs)
        stale = [m for m in self.layers if m.weight.data_ptr() in ptrs]
        with torch.no_grad():
            for m in stale:
                m.repack()
        return len(stale)


def can_pack(model: nn.Module) -> bool:
    p = next(model.parameters())
    return p.device.type == "cpu" and torch.backends.mkldnn.is_available() and p.dtype in PACKABLE


def pack_linears(model: nn.Module) -> PackedModel:
    """Swap ``model``'s CPU linear layers (fp32/bf16) for :class:`PackedLinear` in place."""
    layers: list[PackedLinear] = []
    with torch.no_grad():
        for parent in list(model.modules()):
            for name, child in list(parent.named_children()):
                if (
                    type(child) is nn.Linear
                    and child.weight.dtype in PACKABLE
                    and child.weight.device.type == "cpu"
                ):
                    packed = PackedLinear(child)
                    setattr(parent, name, packed)
                    layers.append(packed)
    return PackedModel(layers)
