"""Prefix KV cache: a finished sequence's keys and values, reused when a later request extends it.

An agent session sends each turn as a new request whose prompt is the previous request's prompt,
its sampled tokens and the tool's answer, token for token. Without reuse every turn prefills the
whole context again, and on a small window that prefill costs several times the decoding. The
engine stores the keys/values of every finished row here; a new request whose prompt starts with
a stored sequence prefills only the rest.

Contract:
- :meth:`PrefixCache.put` stores an entry: the tokens whose keys/values it holds (a finished
  row's prompt and all its sampled tokens but the last, which was never forwarded) and per layer
  ``keys_HND`` / ``values_HND``. Entries that are prefixes of the new one are dropped (a
  session's newer turn supersedes its older one). Least recently used entries are evicted while
  the cache holds more than ``budget_bytes``; an entry larger than the budget is not stored.
- :meth:`PrefixCache.lookup` returns the entry with the longest token sequence that is a proper
  prefix of the prompt (at least one prompt token is left to prefill, which yields the logits of
  the first sampled token), or None.
- The engine clears the cache whenever new weights go live and stores a row only if no update
  landed while it ran, so reused keys/values were computed with the weights now serving.

Limits: linear scan over entries (a few hundred at most at realistic budgets); CPU memory (the
tensors stay where the model's cache lives); no sharing of common prefixes between entries
(a radix tree would store a system prompt once).

Shape legend: H = key/value heads, N = stored positions, D = head dim.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch


@dataclass
class PrefixEntry:
    """Keys and values of ``tokens``, one ``[H, N, D]`` pair per layer."""

    tokens: list[int]
    keys_HND: list[torch.Tensor]
    values_HND: list[torch.Tensor]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys_HND, *self.values_HND))


class PrefixCache:
    """LRU store of :class:`PrefixEntry` under a byte budget; see the module docstring."""

    def __init__(self, budget_bytes: int) -> None:
        if budget_bytes <= 0:
            raise ValueError(f"prefix cache budget_bytes={budget_bytes} must be > 0")
        self.budget_bytes = budget_bytes
        self._entries: OrderedDict[int, PrefixEntry] = OrderedDict()
        self._next = 0
        self.nbytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, prompt: list[int]) -> PrefixEntry | None:
        """The stored entry with the longest proper prefix of ``prompt`` (marked recently used)."""
        best_key, best_len = None, 0
        for key, entry in self._entries.items():
            n = len(entry.tokens)
            if best_len < n < len(prompt) and prompt[:n] == entry.tokens:
                best_key, best_len = key, n
        if best_key is None:
            return None
        self._entries.move_to_end(best_key)
        return self._entries[best_key]

    def put(self, entry: PrefixEntry) -> None:
        """Store ``entry``, dropping the entries it extends, then evict LRU entries over budget."""
        size = entry.nbytes
        if size > self.budget_bytes or not entry.tokens:
            return
        n = len(entry.tokens)
        for key in [
            k
            for k, e in self._entries.items()
            if len(e.tokens) <= n and entry.tokens[: len(e.tokens)] == e.tokens
        ]:
            self._drop(key)
        self._entries[self._next] = entry
        self._next += 1
        self.nbytes += size
        while self.nbytes > self.budget_bytes:
            self._drop(next(iter(self._entries)))

    def clear(self) -> None:
        self._entries.clear()
        self.nbytes = 0

    def _drop(self, key: int) -> None:
        self.nbytes -= self._entries.pop(key).nbytes
