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

Sibling layers that read the same input (an attention block's ``q_proj``/``k_proj``/``v_proj``, an
MLP's ``gate_proj``/``up_proj``) share one :class:`PackedGroup`: one GEMM over their weights
concatenated, which the first sibling called computes and the others take their columns of (the same
input tensor object, as transformers passes it). One GEMM of the three or two is 10-30% faster than
their separate calls at decode shapes (SmolLM2-135M, bf16, 2 threads: 16 rows x 576 -> q, k, v 94 us
-> 60 us; gate, up 168 -> 149 us; issue 39).

Limits: CPU only (a no-op on other devices, or where PyTorch has no oneDNN); bf16 layers are packed
only where oneDNN packs bf16 on this CPU (AVX-512 or AVX-NE-CONVERT: :func:`packable`), and stay
plain ``nn.Linear`` elsewhere; the packed copy doubles
the memory of the linear weights; a layer (or group) is repacked whole, whatever fraction changed; a
grouped layer called on an input its group did not just compute runs the whole group's GEMM.

Shape legend: N = rows (tokens), I = in features, O = out features.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable

import torch
from torch import nn

PACKABLE = (torch.float32, torch.bfloat16)


def _gemm(x_NI: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x_NI.contiguous(), packed, bias, "none", [], "")


class PackedLinear(nn.Module):
    """``nn.Linear`` computing with a oneDNN-packed copy of its weight (module doc)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.weight = linear.weight
        self.bias = linear.bias
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.group: PackedGroup | None = None
        self.packed: torch.Tensor | None = self.repack()

    def repack(self) -> torch.Tensor | None:
        """Repack this layer's copy, or its group's (which holds the only copy of a grouped layer)."""
        if self.group is not None:
            self.group.repack()
            return None
        self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), None)
        return self.packed

    def columns(self, x_NI: torch.Tensor) -> list[torch.Tensor]:
        """``[y_NO]`` for a ``[N, I]`` input in the weight's dtype (an ungrouped layer; the shape of
        :meth:`PackedGroup.columns`)."""
        assert self.packed is not None
        return [_gemm(x_NI, self.packed, None if self.bias is None else self.bias.detach())]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x_NI = x.reshape(-1, self.in_features)
        if x_NI.dtype != self.weight.dtype:  # e.g. autocast: do what F.linear would
            return nn.functional.linear(x, self.weight, self.bias)
        if self.group is not None:
            y_NO = self.group.output(self, x)
        else:
            (y_NO,) = self.columns(x_NI)
        return y_NO.reshape(*x.shape[:-1], self.out_features)


class PackedGroup:
    """Sibling :class:`PackedLinear` layers reading one input, computed as one GEMM (module doc)."""

    def __init__(self, members: list[PackedLinear]) -> None:
        assert PackedGroup.fits(members)
        self.members = members
        self.bounds = [0]
        for m in members:
            self.bounds.append(self.bounds[-1] + m.out_features)
        self.packed = torch.empty(0)
        self._input: torch.Tensor | None = None
        self._outs: dict[int, torch.Tensor] = {}
        for m in members:
            m.group, m.packed = self, None
        self.repack()

    @staticmethod
    def fits(members: list[PackedLinear]) -> bool:
        """Can ``members`` share one GEMM (the same input width, weight dtype and bias presence)?"""
        return len({(m.in_features, m.weight.dtype, m.bias is None) for m in members}) == 1

    def repack(self) -> None:
        with torch.no_grad():
            weight = torch.cat([m.weight.detach() for m in self.members])
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
        self._input, self._outs = None, {}

    def product(self, x_NI: torch.Tensor) -> torch.Tensor:
        """The members' outputs side by side, ``[N, sum of O]`` for a ``[N, I]`` input: one GEMM."""
        bias = None
        if self.members[0].bias is not None:
            bias = torch.cat([m.bias.detach() for m in self.members if m.bias is not None])
        return _gemm(x_NI, self.packed, bias)

    def columns(self, x_NI: torch.Tensor) -> list[torch.Tensor]:
        """Every member's ``[N, O]`` output for a ``[N, I]`` input, from one GEMM (views of its result)."""
        y_NO = self.product(x_NI)
        return [y_NO[:, a:b] for a, b in zip(self.bounds[:-1], self.bounds[1:], strict=True)]

    def output(self, member: PackedLinear, x: torch.Tensor) -> torch.Tensor:
        """``member``'s columns of the group's product with ``x`` (computed once per input tensor)."""
        if self._input is not x or id(member) not in self._outs:
            outs = self.columns(x.reshape(-1, member.in_features))
            self._input = x
            self._outs = {id(m): y_NO for m, y_NO in zip(self.members, outs, strict=True)}
        out = self._outs.pop(id(member))
        if not self._outs:
            self._input = None  # every sibling took its columns: hold no reference
        return out


class PackedModel:
    """The packed layers of one model, to refresh after its weights change."""

    def __init__(self, layers: list[PackedLinear]) -> None:
        self.layers = layers

    def refresh(self, data_ptrs: Iterable[int]) -> int:
        """Repack the layers whose weight lives at one of ``data_ptrs``; returns how many."""
        ptrs = set(data_ptrs)
        stale = [m for m in self.layers if m.weight.data_ptr() in ptrs]
        groups = {id(m.group): m.group for m in stale if m.group is not None}
        with torch.no_grad():
            for m in stale:
                if m.group is None:
                    m.repack()
            for group in groups.values():
                group.repack()
        return len(stale)


@functools.cache
def packable(dtype: torch.dtype) -> bool:
    """Whether oneDNN packs a linear weight of ``dtype`` on this CPU. bf16 needs AVX-512 (bw, vl, dq)
    or AVX-NE-CONVERT; PyTorch says so only by refusing the reorder, so it is tried once, on a 2x2."""
    if dtype not in PACKABLE or not torch.backends.mkldnn.is_available():
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(2, 2, dtype=dtype), None)
    except RuntimeError:  # "mkldnn_reorder_linear_weight: bf16 path needs the cpu support ..."
        return False
    return True


def can_pack(model: nn.Module) -> bool:
    p = next(model.parameters())
    return p.device.type == "cpu" and packable(p.dtype)


SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
"""Names of layers that transformers' Llama-style blocks call one after another on the same input."""


def pack_linears(model: nn.Module) -> PackedModel:
    """Swap ``model``'s CPU linear layers (fp32, and bf16 where :func:`packable`) for :class:`PackedLinear` in place, siblings
    (:data:`SIBLINGS`) sharing one :class:`PackedGroup`."""
    layers: list[PackedLinear] = []
    with torch.no_grad():
        for parent in list(model.modules()):
            for name, child in list(parent.named_children()):
                if (
                    type(child) is nn.Linear
                    and packable(child.weight.dtype)
                    and child.weight.device.type == "cpu"
                ):
                    packed = PackedLinear(child)
                    setattr(parent, name, packed)
                    layers.append(packed)
            for names in SIBLINGS:
                members = [m for n in names if isinstance(m := getattr(parent, n, None), PackedLinear)]
                if len(members) == len(names) and PackedGroup.fits(members):
                    PackedGroup(members)
    return PackedModel(layers)
