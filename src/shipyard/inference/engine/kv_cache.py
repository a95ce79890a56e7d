"""Key/value cache layers with room to grow: a decode step writes its one position in place.

Why: transformers' ``DynamicLayer`` appends a step's keys/values with ``torch.cat``, which copies every
layer's whole cache on every decode step: a cost that grows with rows x length, and was the largest
piece of a CPU decode step after the linears and the attention (``benchmarks/kv_cache.py``).
:class:`SlackLayer` keeps a layer's keys and values in buffers with ``slack`` spare positions and hands
the attention a view of their filled part, so a step writes one position, and a layer is copied only
when its buffer is full (once every ``slack`` steps) or when the engine replaced its tensors (a
compaction, a join of new rows, a cut of leading padding: those copy the cache anyway).

Contract: the same keys and values, in the same order, as ``DynamicLayer``: ``keys``/``values`` are
``[B, KV, T, D]`` views of ``[B, KV, T + free, D]`` buffers (the attention reads them strided; the
engine's tests hold its outputs bit-identical to ``DynamicLayer``'s). Code may assign ``keys`` and
``values`` (the engine does, and so do transformers' ``batch_select_indices`` and ``crop``): the next
update then writes after them, in their buffer if they are a prefix of it, else in a new one.
Limits: full-attention layers only (a sliding-window layer keeps transformers' own); a view handed out
earlier keeps its contents up to its own length, but positions after a ``crop`` are written over.

Shape legend: B = rows, KV = key/value heads, T = cached positions, N = positions being added, D = head size.

Example::

    cache = slack_cache(model.config)  # SlackLayer layers; a sliding-window model keeps transformers' own
    out = model(input_ids=ids_BT, use_cache=True, **{cache_kwarg(model): cache})
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

SLACK = 64
"""Spare positions a buffer is made with: a decode step copies a layer once every this many steps."""


def _is_prefix_of(view: torch.Tensor, buf: torch.Tensor | None) -> bool:
    """Whether ``view`` is ``buf[:, :, :T]`` (same storage start, rows, heads and strides)."""
    return (
        buf is not None
        and view.dim() == 4
        and view.data_ptr() == buf.data_ptr()
        and view.shape[:2] == buf.shape[:2]
        and view.stride() == buf.stride()
    )


def _append(
    view_BKTD: torch.Tensor, buf: torch.Tensor | None, new_BKND: torch.Tensor, slack: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``view_BKTD`` followed by ``new_BKND``, as a view of a buffer with room; returns (view, buffer)."""
    t = view_BKTD.shape[2] if view_BKTD.dim() == 4 else 0  # lazy initialisation leaves a 1-d empty tensor
    n = new_BKND.shape[2]
    if not (_is_prefix_of(view_BKTD, buf) and t + n <= buf.shape[2]):
        b, k, _, d = new_BKND.shape
        buf = new_BKND.new_empty((b, k, t + n + slack, d))
        if t:
            buf[:, :, :t].copy_(view_BKTD)
    assert buf is not None
    buf[:, :, t : t + n].copy_(new_BKND)
    return buf[:, :, : t + n], buf


class SlackLayer(DynamicLayer):
    """A full-attention cache layer whose keys/values grow in place (module doc)."""

    def __init__(self, slack: int = SLACK) -> None:
        super().__init__()
        self.slack = slack
        self._keys_buf: torch.Tensor | None = None
        self._values_buf: torch.Tensor | None = None

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.keys, self._keys_buf = _append(self.keys, self._keys_buf, key_states, self.slack)
        self.values, self._values_buf = _append(self.values, self._values_buf, value_states, self.slack)
        return self.keys, self.values

    def reset(self) -> None:
        self._keys_buf = self._values_buf = None
        super().reset()


def slack_cache(config: Any, slack: int = SLACK) -> DynamicCache:
    """A ``DynamicCache`` for ``config``: :class:`SlackLayer` layers when every layer is plain full
    attention and ``slack > 0``, else transformers' own layers (sliding windows and other kinds stay
    as they are; ``slack = 0`` is transformers' ``torch.cat`` per step)."""
    cache = DynamicCache(config=config)
    if slack > 0 and all(type(layer) is DynamicLayer for layer in cache.layers):
        cache.layers = [SlackLayer(slack) for _ in cache.layers]
    return cache


def full_attention(cache: DynamicCache) -> bool:
    """Every layer keeps all positions (no sliding window): rows can be joined, cut and reused."""
    return all(type(layer) in (DynamicLayer, SlackLayer) for layer in cache.layers)


def cache_kwarg(model: Any) -> str:
    """The name ``model.forward`` takes its KV cache under: ``cache`` where it has that argument
    (transformers 5.2x renamed it, warning on every call that passes the old name), else
    ``past_key_values``."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
