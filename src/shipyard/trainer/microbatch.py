"""How a step's sequences are cut into micro-batches, so that a group's shared prompt runs once.

Contract of :func:`plan_micro_batches` (a list of :class:`MicroBatch`, indices and shared prefix):
- Every rank gets its share of :func:`rank_split` and the same number
  of micro-batches (padded with empty ones: a rank out of rows runs a zero-weight filler pass);
  every index appears exactly once over all ranks; no micro-batch holds more than ``micro_batch``
  rows, nor, with a ``token_budget``, more than that many padded tokens (rows × its longest row's
  length) unless it is a single row longer than the budget, which runs alone.
- Without prefix sharing: the rank's list (longest first) in consecutive slices, each as long as
  both caps allow.
- With prefix sharing (``trainer.share_prefix``): a rank's sequences are bucketed by ``group_id``
  (a GRPO group's sessions start with the same prompt), each bucket sorted longest first and cut
  into consecutive runs by dynamic programming, minimising :func:`forwarded_tokens`: the shared
  prefix once, each row's padded rest, plus :data:`CALL_TOKENS` per decoder call. A bucket whose
  sessions differ in length (a 487-token two-turn session among 160-token ones) is cut so the long
  one does not pad the others, and rows that share a prompt are not split for nothing.
The token budget (``trainer.micro_batch_tokens``) bounds the padded ``[B, T]`` that one forward and
backward hold activations for, whatever the sessions' lengths (verl's ``ppo_max_token_len_per_gpu``
plays this part): a shared prefix only lowers what is forwarded, and the ranks' micro-batches at
one position may run with the least of their prefixes, so the budget counts rows unshared. The
step's loss is normalised over the whole step (``StepNorm``), so how the rows are cut changes the
update only by float rounding.

Limits: buckets are by ``group_id``; sequences of other groups are never batched together, even if
they share a system prompt. Rows are padded, not packed: a micro-batch of one long and several short
rows costs rows × the longest.

On the seed-1 and seed-0 demo runs' stored rollouts (42 steps of 16 sessions), the trainer's
forwarded tokens (:func:`forwarded_tokens` summed, ``micro_batch`` 4): 194,660 padded tokens in
length order without sharing, 113,084 with the groups' prompts shared and cut here.

Shape legend: none (token lists).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from shipyard.agent.types import Trajectory

MIN_SHARED_PREFIX = 16
"""Shorter shared prefixes run with their rows (a second decoder call costs more than it saves)."""
CALL_TOKENS = 16
"""A micro-batch's fixed cost, in tokens, for the cut: an extra decoder call and backward are not
free, so the cut does not split rows for a saving of a few tokens."""


def _common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if len(differ) else n


def shared_prefix(seqs: Sequence[Sequence[int]]) -> int:
    """Leading tokens equal in every one of ``seqs``, capped so each keeps one of its own; 0 for one
    row or when under :data:`MIN_SHARED_PREFIX` (the ``prefix`` of
    :func:`~shipyard.trainer.logprobs.token_logprobs`)."""
    if len(seqs) < 2:  # an empty (filler) micro-batch included
        return 0
    first = np.asarray(seqs[0])
    common = min(_common_prefix(first, np.asarray(s)) for s in seqs[1:])
    return _usable(common, min(len(s) for s in seqs), len(seqs))


def _usable(common: int, shortest: int, rows: int) -> int:
    """The prefix shared for ``rows`` rows with ``common`` equal leading tokens (module doc)."""
    prefix = min(common, shortest - 1)
    return prefix if rows > 1 and prefix >= MIN_SHARED_PREFIX else 0


def forwarded_tokens(seqs: Sequence[Sequence[int]], share_prefix: bool) -> int:
    """Tokens the decoder forwards for one right-padded micro-batch of ``seqs``."""
    longest = max(len(s) for s in seqs)
    prefix = shared_prefix(seqs) if share_prefix else 0
    return prefix + len(seqs) * (longest - prefix)


def rank_split(trajectories: list[Trajectory], world: int) -> list[list[int]]:
    """Indices of the trajectories each rank trains, balanced by token count: longest first, each
    to the rank with the fewest tokens so far (ties to the lower rank). Each rank's list stays
    longest first, so its micro-batches hold sequences of similar length and pad little (on a CPU, a
    synthetic step of 22 sessions of mixed lengths took about 10% less time than in arrival order).
    Deterministic, so every rank computes the same split."""
    loads = [0] * world
    split: list[list[int]] = [[] for _ in range(world)]
    order = sorted(range(len(trajectories)), key=lambda i: (-len(trajectories[i].token_ids), i))
    for i in order:
        r = min(range(world), key=lambda k: (loads[k], len(split[k]), k))
        split[r].append(i)
        loads[r] += len(trajectories[i].token_ids)
    return split


def _fits(rows: int, longest: int, token_budget: int) -> bool:
    """Whether ``rows`` rows padded to ``longest`` fit ``token_budget`` (0: no budget; one row always)."""
    return token_budget == 0 or rows == 1 or rows * longest <= token_budget


def length_runs(lengths: Sequence[int], micro_batch: int, token_budget: int) -> list[tuple[int, int]]:
    """Consecutive runs ``[i, j)`` of ``lengths`` (longest first), each as long as both caps allow:
    the micro-batches without prefix sharing (and the fleet simulator's trainer cost)."""
    runs, i = [], 0
    while i < len(lengths):
        j = i + 1
        while j < len(lengths) and j - i < micro_batch and _fits(j + 1 - i, lengths[i], token_budget):
            j += 1
        runs.append((i, j))
        i = j
    return runs


def _cut(seqs: list[np.ndarray], micro_batch: int, token_budget: int) -> list[tuple[int, int]]:
    """Consecutive runs ``[i, j)`` of ``seqs`` (longest first) with the least forwarded tokens."""
    n = len(seqs)
    best = [0] + [-1] * n
    start = [0] * (n + 1)
    for j in range(1, n + 1):
        common = len(seqs[j - 1])
        for i in range(j - 1, max(0, j - micro_batch) - 1, -1):  # the run [i, j), growing leftwards
            if not _fits(j - i, len(seqs[i]), token_budget):
                break  # longer runs only add rows as long or longer
            common = min(common, _common_prefix(seqs[i], seqs[j - 1]))
            prefix = _usable(common, len(seqs[j - 1]), j - i)
            cost = best[i] + prefix + (j - i) * (len(seqs[i]) - prefix) + CALL_TOKENS
            if best[j] < 0 or cost < best[j]:
                best[j], start[j] = cost, i
    runs = []
    j = n
    while j:
        runs.append((start[j], j))
        j = start[j]
    return runs[::-1]


def _prefix_runs(
    trajectories: list[Trajectory], mine: list[int], micro_batch: int, token_budget: int
) -> list[list[int]]:
    buckets: dict[str, list[int]] = {}
    for i in mine:
        buckets.setdefault(trajectories[i].group_id, []).append(i)
    runs: list[list[int]] = []
    for idx in buckets.values():
        idx = sorted(idx, key=lambda i: (-len(trajectories[i].token_ids), i))
        seqs = [np.asarray(trajectories[i].token_ids) for i in idx]
        runs += [idx[a:b] for a, b in _cut(seqs, micro_batch, token_budget)]
    return sorted(runs, key=lambda run: (-len(trajectories[run[0]].token_ids), run[0]))


class MicroBatch(NamedTuple):
    indices: list[int]
    """Trajectory indices (empty: this rank's filler pass)."""
    prefix: int
    """Leading tokens run once for all rows (``token_logprobs(prefix=...)``); the least over the ranks'
    micro-batches at this position, so every rank makes the same decoder calls (FSDP gathers each
    block's weights per call)."""


def _length_runs(
    trajectories: list[Trajectory], mine: list[int], micro_batch: int, token_budget: int
) -> list[list[int]]:
    lengths = [len(trajectories[i].token_ids) for i in mine]  # rank_split lists them longest first
    return [mine[a:b] for a, b in length_runs(lengths, micro_batch, token_budget)]


def plan_micro_batches(
    trajectories: list[Trajectory],
    world: int,
    rank: int,
    micro_batch: int,
    share_prefix: bool,
    token_budget: int = 0,
) -> list[MicroBatch]:
    """``rank``'s micro-batches (module doc); the same on every rank. ``token_budget`` 0: rows only."""
    split = rank_split(trajectories, world)
    runs = _prefix_runs if share_prefix else _length_runs
    plans = [runs(trajectories, mine, micro_batch, token_budget) for mine in split]
    count = max(len(p) for p in plans)
    plans = [p + [[] for _ in range(count - len(p))] for p in plans]
    if not share_prefix:
        return [MicroBatch(idx, 0) for idx in plans[rank]]
    prefixes = [
        min(shared_prefix([trajectories[i].token_ids for i in p[k]]) for p in plans) for k in range(count)
    ]
    return [MicroBatch(idx, prefix) for idx, prefix in zip(plans[rank], prefixes, strict=True)]
