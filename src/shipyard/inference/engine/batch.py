"""The running batch of the embedded engine: a job to admit, a row's decode state, and the batch
that holds the rows' padded KV cache, attention mask and positions in step.

Contract: :class:`Batch` keeps its rows, cache (one layer per model layer, ``[B, KV, T, D]``), mask
``attn_BT`` and positions ``pos_B`` aligned through :meth:`Batch.keep` (compaction: finished rows
leave, leading padding no kept row needs is cut) and :meth:`Batch.join` (a newly prefilled batch is
appended, the shorter cache left-padded to the longer). Rows are right-aligned: a row's padding is on
the left, so every row's next position is the last column. A batch whose cache has a
sliding-window layer is not joinable (:func:`~shipyard.inference.engine.kv_cache.full_attention`).
:class:`~shipyard.inference.engine.engine.EmbeddedEngine` owns the batches; nothing else mutates them.

Shape legend: B = rows, T = key/value length (padded prompt + generated), KV = key/value heads,
D = head size.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from shipyard.inference.engine.kv_cache import full_attention
from shipyard.inference.types import FinishReason, GenerateRequest, GenerateResult, SamplingParams


@dataclass
class Job:
    """A request to admit, the callback that receives its result, and the caller's optional hooks."""

    request: GenerateRequest
    done: Callable[[GenerateResult], None]
    cancelled: Callable[[], bool] | None = None
    """Polled once per decode step: True ends the row with ``finish_reason = "abort"`` (the tokens so far)."""
    on_token: Callable[[int, float, list[tuple[int, float]] | None], None] | None = None
    """Called (on the engine's thread) with each sampled token, its logprob and its top logprobs."""


@dataclass
class Row:
    """Decode state of one sequence of the running batch."""

    request: GenerateRequest
    done: Callable[[GenerateResult], None]
    """Called with the row's result the step it finishes."""
    job: Job
    prompt_len: int
    params: SamplingParams
    generator: torch.Generator
    stop_window: int
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish: FinishReason | None = None
    epoch: int = 0
    """The engine's weights epoch when the row was admitted (its KV cache is reusable only in that epoch)."""
    routes: list[torch.Tensor] = field(default_factory=list)
    """Pieces ``[n, L, K]`` (int16) of the experts used by each forwarded position, in order."""
    top: list[list[tuple[int, float]]] | None = None
    """Top logprobs per sampled token (when ``params.top_logprobs > 0``)."""
    cached: int = 0
    """Prompt tokens taken from the prefix cache at admission."""


def left_pad(x: torch.Tensor, width: int, dim: int) -> torch.Tensor:
    """``x`` with zeros prepended along ``dim`` up to ``width``."""
    missing = width - x.shape[dim]
    if missing == 0:
        return x
    pad = [0, 0] * (x.dim() - 1 - dim) + [missing, 0]
    return F.pad(x, pad)


class Batch:
    """A running chunk: rows, KV cache, attention mask and positions, kept in step by compaction."""

    def __init__(
        self, rows: list[Row], cache: DynamicCache, attn_BT: torch.Tensor, pos_B: torch.Tensor
    ) -> None:
        self.rows = rows
        self.cache = cache
        self.attn_BT = attn_BT
        self.pos_B = pos_B
        self.temps_B = torch.tensor([r.params.temperature for r in rows], dtype=torch.float32)
        self.top_p_B = torch.tensor([r.params.top_p for r in rows], dtype=torch.float32)

    def keep(self, keep: list[int]) -> None:
        """Drop every row not listed in ``keep`` and cut padding columns no kept row needs."""
        assert keep, "an empty batch is dropped by the caller, never compacted"
        idx = torch.tensor(keep, dtype=torch.long)
        self.rows = [self.rows[i] for i in keep]
        self.cache.batch_select_indices(idx.to(self.cache.layers[0].keys.device))
        self.attn_BT = self.attn_BT.index_select(0, idx)
        self.pos_B = self.pos_B.index_select(0, idx)
        self.temps_B = self.temps_B.index_select(0, idx)
        self.top_p_B = self.top_p_B.index_select(0, idx)
        lead = int(self.attn_BT.cumsum(dim=1).eq(0).sum(dim=1).min())
        if lead > 0 and self.joinable():
            for layer in self.cache.layers:
                layer.keys = layer.keys[:, :, lead:]
                layer.values = layer.values[:, :, lead:]
            self.attn_BT = self.attn_BT[:, lead:]

    def join(self, other: Batch) -> None:
        """Append ``other``'s rows; the shorter cache (and mask) is left-padded to the longer one."""
        width = max(self.attn_BT.shape[1], other.attn_BT.shape[1])
        for mine, theirs in zip(self.cache.layers, other.cache.layers, strict=True):
            mine.keys = torch.cat([left_pad(mine.keys, width, 2), left_pad(theirs.keys, width, 2)])
            mine.values = torch.cat([left_pad(mine.values, width, 2), left_pad(theirs.values, width, 2)])
        self.attn_BT = torch.cat([left_pad(self.attn_BT, width, 1), left_pad(other.attn_BT, width, 1)])
        self.rows = self.rows + other.rows
        self.pos_B = torch.cat([self.pos_B, other.pos_B])
        self.temps_B = torch.cat([self.temps_B, other.temps_B])
        self.top_p_B = torch.cat([self.top_p_B, other.top_p_B])

    def joinable(self) -> bool:
        """Whether rows can join: every cache layer keeps all positions (full attention)."""
        return full_attention(self.cache)

    def mask(self) -> torch.Tensor | None:
        """The attention mask, or None when no row has padding (lets SDPA take its causal path)."""
        return None if bool(self.attn_BT.all()) else self.attn_BT
