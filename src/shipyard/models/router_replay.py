"""Router replay: record the experts an MoE router chose, and make another forward reuse them.

The seam is a forward hook on each MoE layer's router module of transformers 5.x:
``Qwen3MoeTopKRouter`` (Qwen3-MoE), ``MixtralTopKRouter`` (Mixtral) and ``DeepseekV3TopkRouter``
(DeepSeek-V3 / Kimi K2). All three return ``(router_logits, top_k_weights, top_k_index)`` from
their ``forward(hidden_states)`` over the flattened tokens ``[N, H]``; the sparse block then calls
its experts with the index and weights. Dense layers (Qwen3-MoE ``mlp_only_layers``, DeepSeek-V3's
first ``first_k_dense_replace`` layers) have no router and are skipped.

Per forward, :class:`RouterSeam` can
- **record**: keep each MoE layer's ids ``[N, K]`` of the experts used (``seam.recorded``; the
  planned ones where a plan is replayed), e.g. in the sampler;
- **replay** a plan ``[B, T, L, K]`` (``-1`` = no recorded route: route freely): the hook swaps the
  router's index for the planned one and recomputes the gate weights *from the live router logits*
  at the planned experts with the architecture's own rule (:func:`gate_weights`: softmax over all
  experts, gather, renormalise for Qwen3-MoE/Mixtral; sigmoid scores without the selection bias,
  optional renormalisation, ``routed_scaling_factor`` for DeepSeek-V3), so the router weight keeps
  its gradient while the selection is exactly the recorded one;
- **compare** a plan without replaying it, to measure how often the forward's own choice differs.
In replay and compare modes it counts, per MoE layer, the routing decisions (token x k slots) of
planned positions whose expert used is not in the plan, and those the router's own top-k would
have chosen differently (``seam.disagreement()``).

Contract: with a plan equal to the forward's own choices, replay is bit-identical to the unhooked
forward (the recomputed weights equal the router's: same ops, same order). DeepSeek-V3's
group-limited selection (``n_group``/``topk_group``) only matters for selection, so replay
ignores it. Limits: the hook assumes the router sees the tokens of exactly the planned ``[B, T]``
batch in row-major order (true for the three blocks above); expert parallelism is out of scope.

Shape legend: B = batch, T = sequence length, N = B*T flattened tokens, E = experts, K = experts
per token, L = MoE layers.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from shipyard.models.routes import decode_routes

ROUTER_CLASSES = ("Qwen3MoeTopKRouter", "MixtralTopKRouter", "DeepseekV3TopkRouter")


def moe_routers(model: nn.Module) -> list[tuple[int, nn.Module]]:
    """``(decoder layer index, router)`` of every MoE layer, in layer order (dense layers skipped)."""
    base = getattr(model, getattr(model, "base_model_prefix", ""), model)
    layers = getattr(base, "layers", None)
    if layers is None:
        return []
    out = []
    for i, layer in enumerate(layers):
        routers = [m for m in layer.modules() if type(m).__name__ in ROUTER_CLASSES]
        if len(routers) > 1:
            raise ValueError(f"decoder layer {i} holds {len(routers)} routers; one per layer is supported")
        out.extend((i, r) for r in routers)
    return out


def gate_weights(router: nn.Module, logits_NE: Tensor, index_NK: Tensor) -> Tensor:
    """The gate weights the router would give experts ``index_NK``, from its logits (differentiable)."""
    kind = type(router).__name__
    if kind == "Qwen3MoeTopKRouter":
        w_NK = torch.softmax(logits_NE, dtype=torch.float, dim=-1).gather(1, index_NK)
        if router.norm_topk_prob:
            w_NK = w_NK / w_NK.sum(dim=-1, keepdim=True)
        return w_NK.to(logits_NE.dtype)
    if kind == "MixtralTopKRouter":
        w_NK = torch.softmax(logits_NE.float(), dim=-1).gather(1, index_NK)
        return w_NK / w_NK.sum(dim=-1, keepdim=True)
    if kind == "DeepseekV3TopkRouter":
        w_NK = logits_NE.sigmoid().gather(1, index_NK)
        if router.norm_topk_prob:
            w_NK = w_NK / (w_NK.sum(dim=-1, keepdim=True) + 1e-20)
        return w_NK * router.routed_scaling_factor
    raise ValueError(f"no router-replay rule for {kind}; supported: {ROUTER_CLASSES}")


def route_mismatch(own_NK: Tensor, plan_NK: Tensor) -> Tensor:
    """Per token, how many of the planned experts are not among the forward's own ``K`` choices."""
    hit_NK = (plan_NK[:, :, None] == own_NK[:, None, :]).any(dim=-1)
    return (~hit_NK).sum(dim=-1)


@dataclass
class LayerDisagreement:
    """Routing disagreement of one MoE layer over planned decisions: experts the forward used that
    differ from the plan (``differing``), and experts its own router would have chosen differently
    (``own_differing``; equal to ``differing`` unless the plan is replayed)."""

    differing: int = 0
    own_differing: int = 0
    decisions: int = 0


class RouterSeam:
    """Hooks on every router of ``model``; see the module doc. ``remove()`` takes them off."""

    def __init__(self, model: nn.Module) -> None:
        found = moe_routers(model)
        if not found:
            raise ValueError(
                f"{type(model).__name__} has no MoE router of {ROUTER_CLASSES}; nothing to replay"
            )
        self.layers = [i for i, _ in found]
        routers = [r for _, r in found]
        self.num_experts = int(routers[0].num_experts)
        self.top_k = int(routers[0].top_k)
        if any(int(r.top_k) != self.top_k for r in routers):
            raise ValueError("router replay needs every MoE layer to use the same top_k")
        self.record = False
        self.recorded: list[Tensor | None] = [None] * len(routers)
        self._plan_NLK: Tensor | None = None
        self._replay = False
        self._stats = [LayerDisagreement() for _ in routers]
        self._token_flags: list[Tensor] = []
        self._handles = [
            r.register_forward_hook(self._hook(slot), with_kwargs=False) for slot, r in enumerate(routers)
        ]

    def check_record(self, record: dict[str, Any], what: str) -> Any:
        """Decoded ``[n, L, K]`` ids of a route record made for this model; ValueError naming ``what``
        when it is malformed or made for other MoE layers, another ``k`` or another expert count."""
        ids_NLK = decode_routes(record)
        if (
            list(record["layers"]) != self.layers
            or record["k"] != self.top_k
            or record["experts"] != self.num_experts
        ):
            raise ValueError(
                f"{what} are for MoE layers {record['layers']}, k={record['k']}, {record['experts']} "
                f"experts; the model has {self.layers}, k={self.top_k}, {self.num_experts}"
            )
        return ids_NLK

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    @contextmanager
    def plan(self, plan_BTLK: Tensor, replay: bool) -> Iterator[None]:
        """Forwards inside replay (``replay=True``) or only compare against ``plan_BTLK`` (-1 = free)."""
        if plan_BTLK.dim() != 4 or plan_BTLK.shape[2:] != (len(self.layers), self.top_k):
            raise ValueError(
                f"route plan must be [B, T, {len(self.layers)} MoE layers, {self.top_k}], got "
                f"{tuple(plan_BTLK.shape)}"
            )
        self._plan_NLK = plan_BTLK.reshape(-1, len(self.layers), self.top_k).long()
        self._replay = replay
        try:
            yield
        finally:
            self._plan_NLK, self._replay = None, False

    def reset_disagreement(self) -> None:
        self._stats = [LayerDisagreement() for _ in self._stats]
        self._token_flags = []

    def disagreement_state(self) -> tuple[list[tuple[int, int, int]], list[Tensor]]:
        """The counts behind :meth:`disagreement` (per layer: differing, own, decisions; token flags
        on the CPU): what another trainer rank sends for :meth:`absorb`."""
        counts = [(s.differing, s.own_differing, s.decisions) for s in self._stats]
        return counts, [f.cpu() for f in self._token_flags]

    def absorb(self, state: tuple[list[tuple[int, int, int]], list[Tensor]]) -> None:
        """Add another rank's :meth:`disagreement_state` (same model) to this seam's counts."""
        counts, flags = state
        for s, (differing, own, decisions) in zip(self._stats, counts, strict=True):
            s.differing += differing
            s.own_differing += own
            s.decisions += decisions
        self._token_flags.extend(f.to(self._token_flags[0].device) if self._token_flags else f for f in flags)

    def disagreement(self) -> dict[str, float]:
        """Fractions since the last reset, over planned decisions (token x top-k slot): experts used
        that are not in the plan, ``route_disagree`` (all MoE layers) and ``route_disagree/layer_<i>``
        (decoder layer ``i``); ``route_token_disagree`` (planned tokens using a non-planned expert in
        at least one layer); ``route_own_disagree`` (the forward's own router choice vs the plan: what
        replay overrides). Under replay the first three are 0. Empty when nothing was planned."""
        total = sum(s.decisions for s in self._stats)
        if total == 0:
            return {}
        out = {
            "route_disagree": sum(s.differing for s in self._stats) / total,
            "route_own_disagree": sum(s.own_differing for s in self._stats) / total,
        }
        for layer, s in zip(self.layers, self._stats, strict=True):
            out[f"route_disagree/layer_{layer}"] = s.differing / max(s.decisions, 1)
        if self._token_flags:
            out["route_token_disagree"] = float(torch.cat(self._token_flags).float().mean())
        return out

    def _hook(self, slot: int) -> Any:
        def hook(router: nn.Module, _args: Any, output: tuple[Tensor, Tensor, Tensor]) -> Any:
            logits_NE, _weights_NK, index_NK = output
            replaced = None
            if self._plan_NLK is not None:
                plan_NK = self._plan_NLK[:, slot].to(index_NK.device)
                if plan_NK.shape != index_NK.shape:
                    raise ValueError(
                        f"route plan covers {plan_NK.shape[0]} tokens, the forward routes {index_NK.shape[0]}"
                    )
                planned_N = plan_NK[:, 0] >= 0
                if self._replay and bool(planned_N.any()):
                    new_index_NK = torch.where(planned_N[:, None], plan_NK, index_NK)
                    replaced = (logits_NE, gate_weights(router, logits_NE, new_index_NK), new_index_NK)
                used_NK = index_NK if replaced is None else replaced[2]
                own_NK = index_NK.detach()
                self._count(slot, own_NK[planned_N], used_NK.detach()[planned_N], plan_NK[planned_N])
            if self.record:  # the experts actually used (the plan's where replayed)
                used_NK = index_NK if replaced is None else replaced[2]
                self.recorded[slot] = used_NK.detach().to("cpu", torch.int16)
            return replaced

        return hook

    def _count(self, slot: int, own_PK: Tensor, used_PK: Tensor, plan_PK: Tensor) -> None:
        diff_P = route_mismatch(used_PK, plan_PK)
        stats = self._stats[slot]
        stats.differing += int(diff_P.sum())
        stats.own_differing += int(route_mismatch(own_PK, plan_PK).sum())
        stats.decisions += int(plan_PK.numel())
        flags_P = (diff_P > 0).cpu()
        if slot == 0:  # the first MoE layer opens a new forward's per-token flags
            self._token_flags.append(flags_P)
        elif self._token_flags and self._token_flags[-1].shape == flags_P.shape:
            self._token_flags[-1] |= flags_P


def route_plan(
    records: list[dict[str, Any] | None], length: int, seam: RouterSeam, starts: list[int] | None = None
) -> Tensor:
    """``[B, length, L, K]`` int64 plan from per-sequence route records (-1 where none was recorded).

    Row ``b`` holds record ``b``'s ids at positions ``[s_b, s_b + n_b)`` with ``s_b = starts[b]``
    (default 0: right-padded batches, the trainer's layout; the engine's left-padded prefill passes
    each row's padding width); a None record leaves its row free. Raises ValueError when a record's MoE layers, ``k``
    or expert count do not match the model's, or it covers more than ``length`` positions.
    """
    plan_BTLK = torch.full((len(records), length, len(seam.layers), seam.top_k), -1, dtype=torch.long)
    for b, record in enumerate(records):
        if record is None:
            continue
        ids_NLK = seam.check_record(record, f"routes of sequence {b}")
        start = 0 if starts is None else starts[b]
        if start + ids_NLK.shape[0] > length:
            raise ValueError(
                f"routes of sequence {b} cover {ids_NLK.shape[0]} positions from {start}, the batch has {length}"
            )
        plan_BTLK[b, start : start + ids_NLK.shape[0]] = torch.from_numpy(ids_NLK.astype("int64"))
    return plan_BTLK
