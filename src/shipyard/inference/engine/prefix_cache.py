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
  the first sampled token), or None; :meth:`PrefixCache.cached_len` says how many prompt tokens
  that lookup would serve, without using the entry (admission budgets count only the rest).
- The engine clears the cache whenever new weights go live and stores a row only if no update
  landed while it ran, so reused keys/values were computed with the weights now serving.

- A prompt that shares at least ``min_shared`` leading tokens with an entry without extending it
  (sessions under one system prompt and task template) reuses those positions of the entry.

Limits: linear scan over entries (a few hundred at most at realistic budgets); CPU memory (the
tensors stay where the model's cache lives); entries do not share storage (a radix tree would store
a system prompt once). The engine stores every prompt right after its prefill, so rows of one
prompt admitted together or while the first still runs reuse it; a prompt shorter than
``min_shared + 1`` tokens is not reused that way (a lookup leaves one token to prefill).

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


def _common_len(a: list[int], b: list[int], limit: int) -> int:
    """Length of the common prefix of ``a`` and ``b``, at most ``limit`` (whole-slice compares
    first: most entries either match a turn entirely or diverge early)."""
    if a[:limit] == b[:limit]:
        return limit
    lo, hi = 0, limit  # a[:lo] == b[:lo] and a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


class PrefixCache:
    """LRU store of :class:`PrefixEntry` under a byte budget; see the module docstring."""

    def __init__(self, budget_bytes: int, min_shared: int = 32) -> None:
        if budget_bytes <= 0:
            raise ValueError(f"prefix cache budget_bytes={budget_bytes} must be > 0")
        self.budget_bytes = budget_bytes
        self.min_shared = min_shared
        """Shortest shared prefix (tokens) worth reusing from an entry the prompt does not extend."""
        self.shared_hits = 0
        """Lookups answered with part of an entry (a shared system prompt, not the session's own turn)."""
        self._entries: OrderedDict[int, PrefixEntry] = OrderedDict()
        self._next = 0
        self.nbytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, prompt: list[int]) -> PrefixEntry | None:
        """The stored entry sharing the longest prefix with ``prompt`` (marked recently used), cut to
        that prefix: a whole entry the prompt extends (an agent's next turn), or the first ``n``
        positions of one when ``n >= min_shared`` (another session under the same system prompt:
        causal attention makes those keys and values depend on those tokens alone). At least one
        prompt token is always left to prefill."""
        best_key, best_len = self._best(prompt)
        if best_key is None:
            return None
        self._entries.move_to_end(best_key)
        hit = self._entries[best_key]
        if best_len == len(hit.tokens):
            return hit
        self.shared_hits += 1
        return PrefixEntry(
            hit.tokens[:best_len],
            [k[:, :best_len] for k in hit.keys_HND],
            [v[:, :best_len] for v in hit.values_HND],
        )

    def cached_len(self, prompt: list[int]) -> int:
        """How many leading tokens of ``prompt`` a :meth:`lookup` now would serve from the cache
        (0: none); nothing is marked used or counted."""
        return self._best(prompt)[1]

    def _best(self, prompt: list[int]) -> tuple[int | None, int]:
        """The key of the entry sharing the longest usable prefix with ``prompt``, and its length."""
        best_key, best_len = None, 0
        cap = len(prompt) - 1
        for key, entry in self._entries.items():
            n = _common_len(entry.tokens, prompt, min(len(entry.tokens), cap))
            if n > best_len and (n == len(entry.tokens) or n >= self.min_shared):
                best_key, best_len = key, n
        return best_key, best_len

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
