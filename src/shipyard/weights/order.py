"""The virtual order of a tensor's elements that makes a delta's change mask cheap (:mod:`.codec`).

Contract: both sides derive the order from the parent alone: elements whose exponent is below the
split (the minority) first, grouped by exponent, then every element in index order.
:func:`_choose_split` picks the split from exponent histograms; :class:`MinorityIndex` carries the
minority from one version to the next so it is found in O(minority) work.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from shipyard.weights.bits import (
    _LOCAL,
    CHUNK,
    HIST_SAMPLE,
    MAX_MINORITY_FRACTION,
    SPLIT_COST_BITS,
    _Bits,
)

# ---------------------------------------------------------------- scans and the virtual order (conditioning)


def _scratch(name: str, n: int, dtype: type[np.generic]) -> np.ndarray:
    """A reusable per-thread buffer of ``n`` values (at most CHUNK: it stays in cache, no page faults)."""
    buf = _LOCAL.__dict__.get(name)
    if buf is None or buf.dtype != dtype or buf.size < n:
        buf = np.empty(max(n, CHUNK), dtype=dtype)
        setattr(_LOCAL, name, buf)
    return buf[:n]


def _chunks(n: int) -> Iterator[tuple[int, int]]:
    return ((s, min(s + CHUNK, n)) for s in range(0, n, CHUNK))


def _cat(parts: list[np.ndarray], dtype: type[np.generic]) -> np.ndarray:
    return np.concatenate(parts) if parts else np.zeros(0, dtype=dtype)


def _scan_changed(p_N: np.ndarray, n_N: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(indices ascending, old bits, new bits) of the changed elements, a cached chunk at a time."""
    idx, old, new = [], [], []
    for s, e in _chunks(p_N.size):
        p, n = p_N[s:e], n_N[s:e]
        hit = np.flatnonzero(np.not_equal(p, n, out=_scratch("mask", e - s, np.bool_)))
        idx.append(hit + s)
        old.append(p[hit])
        new.append(n[hit])
    return _cat(idx, np.int64), _cat(old, p_N.dtype), _cat(new, p_N.dtype)


def _binary_entropy_bits(c: np.ndarray, n: np.ndarray) -> np.ndarray:
    """``n * H(c / n)`` elementwise in bits (0 where c is 0 or n)."""
    c, n = np.asarray(c, dtype=np.float64), np.asarray(n, dtype=np.float64)
    rest = n - c
    with np.errstate(divide="ignore", invalid="ignore"):
        ones = np.where(c > 0, c * np.log2(c / n), 0.0)
        zeros = np.where(rest > 0, rest * np.log2(rest / n), 0.0)
    return -(ones + zeros)


def _entropy_of_counts(counts: np.ndarray) -> float:
    """Total order-0 entropy in bits of a sequence with these symbol counts."""
    c = counts[counts > 0].astype(np.float64)
    return float(-(c * np.log2(c / c.sum())).sum()) if c.size else 0.0


def _choose_split(p_N: np.ndarray, old_C: np.ndarray, spec: _Bits) -> int:
    """The split exponent minimizing the estimated mask entropy plus a time charge (0: none).

    ``old_C`` are the parent bits of the changed elements (their exponent histogram is exact);
    the histogram of all elements is estimated from a strided sample.
    """
    n, n_exp = p_N.size, 1 << spec.exp_bits
    mag_mask = spec.np_dtype(spec.mag_mask)
    stride = max(1, n // HIST_SAMPLE)
    sample = ((p_N[::stride] & mag_mask) >> spec.mant_bits).astype(np.intp)
    all_E = np.bincount(sample, minlength=n_exp) * (n / sample.size)
    chg_E = np.bincount(((old_C & mag_mask) >> spec.mant_bits).astype(np.intp), minlength=n_exp).astype(
        np.float64
    )
    all_E = np.maximum(all_E, chg_E)  # the sample may miss a class that changed
    below_all = np.concatenate([[0.0], np.cumsum(all_E)])
    below_chg = np.concatenate([[0.0], np.cumsum(chg_E)])
    minority_bits = np.concatenate([[0.0], np.cumsum(_binary_entropy_bits(chg_E, all_E))])
    majority_bits = _binary_entropy_bits(below_chg[-1] - below_chg, below_all[-1] - below_all)
    cost = minority_bits + majority_bits + SPLIT_COST_BITS * below_all
    cost[below_all > MAX_MINORITY_FRACTION * n] = np.inf
    cost[-1] = np.inf  # a split above every exponent would make everything minority
    return int(np.argmin(cost))


@dataclass
class _Order:
    """The virtual order of one tensor: minority by (exponent, index), then every element by index.

    Virtual position ``v < n_minority`` is element ``sorted_M[perm_M[v]]``; ``v >= n_minority``
    is element ``v - n_minority`` (minority elements never change there: their changes are
    coded in the first part). Plain index order in the second part makes mapping positions
    free; the skipped minority elements cost the gap coder next to nothing.
    """

    sorted_M: np.ndarray  # minority element indices, ascending
    perm_M: np.ndarray  # the minority in virtual order, as positions into sorted_M
    old_M: np.ndarray  # parent bits of the minority (ascending index order)
    new_M: np.ndarray | None  # new bits of the minority (encoder only)
    threshold: int  # magnitude bits below this are minority
    pos_M: np.ndarray | None = None  # where sorted_M lies in the MinorityIndex it came from

    @property
    def n_minority(self) -> int:
        return self.sorted_M.size


def _order(p_N: np.ndarray, n_N: np.ndarray | None, split_exp: int, spec: _Bits) -> _Order:
    """Find the minority (parent exponent below ``split_exp``; none when it is 0) and order it by
    exponent, stably. ``n_N`` (encoder only) also gathers the minority's new bits."""
    idx, exps = _scan_below(p_N, split_exp, spec)
    return _order_of(p_N, n_N, idx, exps, split_exp, spec)


def _scan_below(p_N: np.ndarray, exp: int, spec: _Bits) -> tuple[np.ndarray, np.ndarray]:
    """(indices ascending, exponents) of the elements whose exponent is below ``exp``: one pass."""
    mag_mask, threshold = spec.np_dtype(spec.mag_mask), spec.np_dtype(exp << spec.mant_bits)
    idx, exps = [], []
    for s, e in _chunks(p_N.size if exp else 0):
        mag = np.bitwise_and(p_N[s:e], mag_mask, out=_scratch("mag", e - s, spec.np_dtype))
        hit = np.flatnonzero(np.less(mag, threshold, out=_scratch("mask", e - s, np.bool_)))
        idx.append(hit + s)
        exps.append((mag[hit] >> spec.mant_bits).astype(np.uint8))
    return _cat(idx, np.int64), _cat(exps, np.uint8)


def _order_of(
    p_N: np.ndarray,
    n_N: np.ndarray | None,
    idx_M: np.ndarray,
    exp_M: np.ndarray,
    split_exp: int,
    spec: _Bits,
    pos_M: np.ndarray | None = None,
) -> _Order:
    perm_M = np.argsort(exp_M, kind="stable")
    new_M = n_N[idx_M] if n_N is not None else None
    return _Order(idx_M, perm_M, p_N[idx_M], new_M, split_exp << spec.mant_bits, pos_M)


class MinorityIndex:
    """The elements of one tensor whose exponent is below ``cap``, kept in step with the tensor.

    Finding a delta's minority costs a pass over the parent; a sender or receiver that codes one
    version after another keeps this index instead: it is built once (one pass), then advanced by
    every delta it codes or applies from the changed elements alone, so the minority of the next
    delta (any split up to ``cap``) costs O(index size), not O(tensor). The index must describe
    the exact parent it is used with; the codec advances it to describe the result, and the
    caller resets it (:meth:`reset`) whenever the tensor changes any other way. A wrong index
    gives a wrong result, which the decoded tensor's digest catches.
    """

    CAP_MARGIN = 1
    """Exponent classes kept above the split the index is built for (splits drift by a few)."""

    def __init__(self) -> None:
        self.cap = 0
        self.idx_K = np.zeros(0, dtype=np.int64)
        self.exp_K = np.zeros(0, dtype=np.uint8)
        self.builds = 0

    @property
    def built(self) -> bool:
        return self.cap > 0

    def reset(self) -> None:
        self.cap = 0
        self.idx_K, self.exp_K = self.idx_K[:0], self.exp_K[:0]

    def order(self, p_N: np.ndarray, n_N: np.ndarray | None, split_exp: int, spec: _Bits) -> _Order:
        """The virtual order for ``split_exp`` (rebuilds the index when the split exceeds its cap)."""
        if split_exp > self.cap:
            self.cap = min(split_exp + self.CAP_MARGIN, 1 << spec.exp_bits)
            idx_K, self.exp_K = _scan_below(p_N, self.cap, spec)
            self.idx_K = idx_K.astype(np.int32) if p_N.size < 1 << 31 else idx_K  # half the bytes to move
            self.builds += 1
        below = np.flatnonzero(self.exp_K < split_exp)
        return _order_of(p_N, n_N, self.idx_K[below], self.exp_K[below], split_exp, spec, below)

    def advance(
        self,
        idx_C: np.ndarray,
        old_C: np.ndarray,
        new_C: np.ndarray,
        spec: _Bits,
        known_K: np.ndarray | None = None,
    ) -> None:
        """Elements ``idx_C`` changed from ``old_C`` to ``new_C`` bits: update the index. The first
        ``known_K.size`` of them are in the index at positions ``known_K`` (the delta's minority)."""
        if not self.built or idx_C.size == 0:
            return
        k = 0 if known_K is None else known_K.size
        mag, threshold = spec.np_dtype(spec.mag_mask), spec.np_dtype(self.cap << spec.mant_bits)
        new_mag_C = new_C & mag
        now_C = new_mag_C < threshold
        was_R = (old_C[k:] & mag) < threshold  # the rest: in the index only if below the cap
        in_R = np.flatnonzero(was_R)
        pos = np.searchsorted(self.idx_K, idx_C[k:][in_R].astype(self.idx_K.dtype))
        if k:
            pos, in_R = np.concatenate([known_K, pos]), np.concatenate([np.arange(-k, 0), in_R])
        stays = now_C[in_R + k]
        self.exp_K[pos[stays]] = (new_mag_C[in_R[stays] + k] >> spec.mant_bits).astype(np.uint8)
        if not stays.all():
            keep = np.ones(self.idx_K.size, dtype=bool)
            keep[pos[~stays]] = False
            self.idx_K, self.exp_K = self.idx_K[keep], self.exp_K[keep]
        join = np.flatnonzero(now_C[k:] & ~was_R) + k
        if join.size:
            by_index = np.argsort(idx_C[join], kind="stable")
            j_idx = idx_C[join][by_index].astype(self.idx_K.dtype)
            j_exp = (new_mag_C[join][by_index] >> spec.mant_bits).astype(np.uint8)
            at = np.searchsorted(self.idx_K, j_idx)
            self.idx_K, self.exp_K = np.insert(self.idx_K, at, j_idx), np.insert(self.exp_K, at, j_exp)


def _to_virtual(
    changed: tuple[np.ndarray, np.ndarray, np.ndarray], order: _Order, spec: _Bits
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(virtual positions ascending, old bits, new bits) of the changed elements, and where the
    changed minority elements (they come first) lie in ``order.sorted_M``."""
    idx_C, old_C, new_C = changed
    m = order.n_minority
    if m == 0:
        return idx_C, old_C, new_C, np.zeros(0, dtype=np.intp)
    assert order.new_M is not None
    v_min = np.flatnonzero((order.old_M != order.new_M)[order.perm_M])
    pick = order.perm_M[v_min]
    majority = np.flatnonzero((old_C & spec.np_dtype(spec.mag_mask)) >= order.threshold)
    vpos_C = np.concatenate([v_min, idx_C[majority] + m])
    old = np.concatenate([order.old_M[pick], old_C[majority]])
    return vpos_C, old, np.concatenate([order.new_M[pick], new_C[majority]]), pick


def _from_virtual(
    vpos_C: np.ndarray, order: _Order, p_N: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(element indices, parent bits) of virtual positions (inverse of :func:`_to_virtual`), and
    where the changed minority elements (they come first) lie in ``order.sorted_M``."""
    m = order.n_minority
    if m == 0:
        return vpos_C, p_N[vpos_C], np.zeros(0, dtype=np.intp)
    cut = int(np.searchsorted(vpos_C, m))
    pick = order.perm_M[vpos_C[:cut]]
    majority = vpos_C[cut:] - m
    idx = np.concatenate([order.sorted_M[pick], majority])
    return idx, np.concatenate([order.old_M[pick], p_N[majority]]), pick
