"""Lossless delta codec for weight versions: ship only the bits an RL step changed.

Purpose: after one optimizer step at RL learning rates most bf16 weights are bit-identical to
the previous version (an Adam step of ~1e-6 is below half an ulp of all but the smallest
weights). ``encode_delta(parent, new)`` stores which elements changed and how, typically in
0.1-1% of the tensor's bytes; ``decode_delta(parent, data)`` rebuilds ``new`` bit for bit,
optionally straight into a live tensor (``out=``, the "apply" of a subscriber).

Contract:
- Bit-exact for bfloat16, float16, float32, float8_e4m3fn and float8_e5m2 (where torch has them),
  any shape, scalars and empty tensors included, every bit pattern (NaN payloads, +-inf, -0.0,
  subnormals): the codec works on raw integer bit patterns (``tensor.view(int16)``), never on
  float values.
- A blob carries its format version, dtype, shape, stream lengths and a crc32 of all of it:
  corrupted or truncated input, or a parent of another dtype or shape, raises ``ValueError``,
  never silent garbage. A wrong parent of the right shape is caught when its count of minority
  elements (below) differs from the encoder's; :func:`tensor_digest` is the end-to-end check.
- Deterministic: the same inputs give the same bytes, whatever ``workers``.
- ``encode_state``/``decode_state`` code tensors in parallel threads (numpy and zstd release
  the GIL); per thread, scratch is bounded (``CHUNK``-sized buffers plus arrays the size of the
  changed and minority elements), so the only full-size allocations are the outputs.

Format of one blob (integers little-endian)::

    fixed   magic "SYWC", format version, kind (delta/snapshot), dtype, position scheme,
            value scheme, gap width, split exponent (1 byte each), crc32 of the whole blob
    varints ndim, shape..., changed, minority, position bytes, value bytes (LEB128)
    pos     zstd frame (magicless): where the changed elements are, in the virtual order
    values  zstd frame (magicless): how they changed, one code per changed element, byte planes

A snapshot blob has the same header (changed/minority 0) and one stream in the position slot:
the zstd frame of the tensor's byte planes.

Virtual order (the conditioning that makes the change mask cheap): whether an element changes
depends on its magnitude - the ulp grows with the exponent while the update does not, so tiny
weights change at nearly every step and large ones rarely. Elements whose parent exponent is
below ``split_exp`` (the *minority*) come first, grouped by exponent, then every element in
index order (minority elements never count as changed there). Both sides derive this order
from the parent alone, so it costs no bytes; the encoder picks ``split_exp`` per tensor from
the exponent histograms of all and of changed elements (0: no minority), charging each
minority element ``SPLIT_COST_BITS`` for the time it costs. Changed positions then form dense
runs (tiny weights) and sparse scatters (the rest), each cheap to code.

Position schemes: ``gaps`` - the gaps between consecutive changed virtual positions as
fixed-width unsigned ints (1, 2, 4 or 8 bytes, the narrowest that fits), as byte planes;
``bitmap`` - one bit per virtual position, tried when more than ``BITMAP_MIN_DENSITY`` of the
elements changed; the smaller wins. Value schemes: ``ulp`` - the sign-flip bit over the
zigzag-coded step of the magnitude bits, i.e. the move in ulps (mostly +-1 at RL rates);
``xor`` - the xor of the bit patterns (wins for tiny weights, whose jumps repeat); both are
compressed and the smaller wins.

Snapshots (``encode_snapshot``/``decode_snapshot``) store a whole tensor as zstd of its byte
planes (the sign/exponent plane compresses, the mantissa plane barely does).

Carried state (optional): a caller that codes version after version passes a
:class:`MinorityIndex` per tensor (``index=``/``indexes=``), which replaces the pass that finds
the minority by O(minority) work; it holds 5 bytes per element below the split plus one exponent
class (measured on SmolLM2: 0.9% of the elements at lr 1e-6, 4% at 1e-5).

Limits: the work is CPU numpy (tensors on other devices are copied to the host and back); one
tensor is coded by one thread, so a model's largest tensor bounds the parallel speed-up; the
format assumes a little-endian host; deltas must be applied in order to the exact parent.

Name suffixes: ``_N`` one per element of the flat tensor, ``_C`` one per changed element,
``_M`` one per minority element, ``_E`` one per exponent value, ``_P`` one per byte plane.
"""

from __future__ import annotations

import hashlib
import math
import struct
import threading
import zlib
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
import torch
import xxhash
import zstandard

_T = TypeVar("_T")
FORMAT_VERSION = 1
MAGIC = b"SYWC"
KIND_DELTA, KIND_SNAPSHOT = 1, 2
POS_NONE, POS_GAPS, POS_BITMAP = 0, 1, 2
VAL_NONE, VAL_ULP, VAL_XOR = 0, 1, 2
_KIND_NAMES = {KIND_DELTA: "delta", KIND_SNAPSHOT: "snapshot"}
_POS_NAMES = {POS_NONE: "none", POS_GAPS: "gaps", POS_BITMAP: "bitmap"}
_VAL_NAMES = {VAL_NONE: "none", VAL_ULP: "ulp", VAL_XOR: "xor"}
ZSTD_LEVEL = 1
"""zstd level of delta streams (measured on real deltas: level 3 is no smaller, and slower)."""
SNAPSHOT_ZSTD_LEVEL = 1
BITMAP_MIN_DENSITY = 1 / 8
"""Below this change density gap coding wins (measured: near the entropy up to ~15%), so the
bitmap is not tried."""
SPLIT_COST_BITS = 1.0
"""Bits charged per minority element when choosing the split: finding, gathering and sorting it
costs ~10-20 ns, so only classes that save about a bit per element (those that nearly always
change) join the minority."""
MAX_MINORITY_FRACTION = 1 / 16
XOR_TRIAL_MAX = 4096
"""Value streams up to this many codes are always compressed both ways; longer ones are first
judged on this many codes from their two ends."""
CHUNK = 1 << 18
"""Elements per pass over a tensor (scratch stays in cache; scratch memory stays bounded)."""
HIST_SAMPLE = 1 << 13
"""The exponent histogram of a tensor is estimated from about this many sampled elements."""
MIN_SPLIT_CHANGED = 256
"""With fewer changed elements a split cannot pay for its pass over the tensor."""

# magic, version, kind, dtype, pos scheme, value scheme, gap width, split exponent, crc32; then
# LEB128 varints: ndim, shape..., changed, minority, pos bytes, value bytes; then the streams.
_FIXED = struct.Struct("<4sBBBBBBBI")


@dataclass(frozen=True)
class _Bits:
    """How one float dtype maps to raw bits."""

    code: int
    torch_dtype: torch.dtype
    view_dtype: torch.dtype
    np_dtype: type[np.unsignedinteger]
    width: int
    mant_bits: int
    exp_bits: int

    @property
    def nbytes(self) -> int:
        return self.width // 8

    @property
    def mag_mask(self) -> int:
        return (1 << (self.width - 1)) - 1


def _dtype_table() -> dict[torch.dtype, _Bits]:
    table = [
        _Bits(1, torch.bfloat16, torch.int16, np.uint16, 16, 7, 8),
        _Bits(2, torch.float16, torch.int16, np.uint16, 16, 10, 5),
        _Bits(3, torch.float32, torch.int32, np.uint32, 32, 23, 8),
    ]
    if hasattr(torch, "float8_e4m3fn"):
        table.append(_Bits(4, torch.float8_e4m3fn, torch.uint8, np.uint8, 8, 3, 4))
    if hasattr(torch, "float8_e5m2"):
        table.append(_Bits(5, torch.float8_e5m2, torch.uint8, np.uint8, 8, 2, 5))
    return {b.torch_dtype: b for b in table}


_BY_DTYPE = _dtype_table()
_SIGNED = {16: np.int16, 32: np.int32}
_BY_CODE = {b.code: b for b in _BY_DTYPE.values()}
SUPPORTED_DTYPES = tuple(_BY_DTYPE)


def _spec(t: torch.Tensor, what: str) -> _Bits:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{what} must be a torch.Tensor, got {type(t).__name__}")
    spec = _BY_DTYPE.get(t.dtype)
    if spec is None:
        names = ", ".join(str(d).removeprefix("torch.") for d in SUPPORTED_DTYPES)
        raise ValueError(f"{what} has dtype {t.dtype}; the weight codec supports {names}")
    return spec


def _bits(t: torch.Tensor, spec: _Bits) -> np.ndarray:
    """The flat raw bit patterns of ``t`` as unsigned ints (shares memory when on CPU)."""
    flat = t.detach().reshape(-1)
    if flat.device.type != "cpu":
        flat = flat.cpu()
    return flat.view(spec.view_dtype).numpy().view(spec.np_dtype)


# ---------------------------------------------------------------- zstd streams and planes


_LOCAL = threading.local()
_ZSTD_FORMAT = zstandard.FORMAT_ZSTD1_MAGICLESS
"""Frames without magic, content size or checksum: the blob header has sizes and a crc32."""


def _compressor(level: int) -> zstandard.ZstdCompressor:
    """This thread's zstd compressor for ``level`` (contexts are costly to build, not shareable)."""
    cache = _LOCAL.__dict__.setdefault("compressors", {})
    if level not in cache:
        params = zstandard.ZstdCompressionParameters.from_level(
            level, format=_ZSTD_FORMAT, write_checksum=0, write_content_size=0
        )
        cache[level] = zstandard.ZstdCompressor(compression_params=params)
    return cache[level]


def _zstd(data: bytes | np.ndarray, level: int) -> bytes:
    return _compressor(level).compress(data)


def _unzstd(blob: bytes | memoryview, size: int, what: str) -> bytes:
    if "decompressor" not in _LOCAL.__dict__:
        _LOCAL.decompressor = zstandard.ZstdDecompressor(format=_ZSTD_FORMAT)
    try:
        out = _LOCAL.decompressor.decompress(blob, max_output_size=max(size, 1))
    except zstandard.ZstdError as e:
        raise ValueError(f"corrupted {what} stream: {e}") from e
    if len(out) != size:
        raise ValueError(f"corrupted {what} stream: {len(out)} bytes, expected {size}")
    return out


def _to_planes(a_C: np.ndarray) -> bytes:
    """Byte planes of an unsigned array: all lowest bytes, then all next bytes, ..."""
    if a_C.dtype.itemsize == 1:
        return a_C.tobytes()
    return np.concatenate([(a_C >> (8 * k)).astype(np.uint8) for k in range(a_C.dtype.itemsize)]).tobytes()


def _from_planes(raw: bytes, n: int, dtype: type[np.unsignedinteger]) -> np.ndarray:
    """Inverse of :func:`_to_planes`: a fresh, writable array of ``n`` values (shift-or beats a
    transposing copy by ~20x)."""
    if n == 0:
        return np.zeros(0, dtype=dtype)
    planes_PC = np.frombuffer(raw, dtype=np.uint8).reshape(-1, n)
    out_C = planes_PC[-1].astype(dtype)
    for plane in planes_PC[-2::-1]:
        out_C <<= 8
        out_C |= plane
    return out_C


def _to_tensor(bits_N: np.ndarray, spec: _Bits, shape: tuple[int, ...]) -> torch.Tensor:
    signed = bits_N if spec.width == 8 else bits_N.view(_SIGNED[spec.width])
    return torch.from_numpy(signed).view(spec.view_dtype).view(spec.torch_dtype).reshape(shape)


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


# ---------------------------------------------------------------- positions


def _encode_positions(vpos_C: np.ndarray, n: int) -> tuple[int, int, bytes]:
    """(scheme, gap width, zstd stream) of ascending virtual positions: the smaller coding."""
    gaps_C = np.diff(vpos_C, prepend=-1) - 1
    top = int(gaps_C.max())
    width = next(w for w in (1, 2, 4, 8) if top < 1 << (8 * w))
    gap_dtype = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[width]
    best = (POS_GAPS, width, _zstd(_to_planes(gaps_C.astype(gap_dtype)), ZSTD_LEVEL))
    if vpos_C.size > n * BITMAP_MIN_DENSITY:
        mask_N = np.zeros(n, dtype=bool)
        mask_N[vpos_C] = True
        bitmap = _zstd(np.packbits(mask_N), ZSTD_LEVEL)
        if len(bitmap) < len(best[2]):
            best = (POS_BITMAP, 0, bitmap)
    return best


def _decode_positions(scheme: int, width: int, blob: memoryview, n_changed: int, n: int) -> np.ndarray:
    if scheme == POS_GAPS:
        gap_dtype = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}.get(width)
        if gap_dtype is None:
            raise ValueError(f"corrupted delta header: gap width {width}")
        raw = _unzstd(blob, n_changed * width, "position")
        vpos_C = np.cumsum(_from_planes(raw, n_changed, gap_dtype).astype(np.int64) + 1) - 1
        if vpos_C.size and (vpos_C[-1] >= n or vpos_C[-1] < 0):
            raise ValueError(f"corrupted position stream: position {vpos_C[-1]} outside {n} elements")
        return vpos_C
    if scheme == POS_BITMAP:
        raw = _unzstd(blob, (n + 7) // 8, "position")
        vpos_C = np.flatnonzero(np.unpackbits(np.frombuffer(raw, np.uint8), count=n))
        if vpos_C.size != n_changed:
            raise ValueError(f"corrupted position stream: {vpos_C.size} positions, header says {n_changed}")
        return vpos_C
    raise ValueError(f"corrupted delta header: position scheme {scheme}")


# ---------------------------------------------------------------- values


def _ulp_codes(old_C: np.ndarray, new_C: np.ndarray, spec: _Bits) -> np.ndarray:
    """Sign-flip bit (top) | zigzag of the magnitude step wrapped to ``width - 1`` bits.

    Native-width unsigned arithmetic (wrapping): ``d = (new - old) mod 2**(w-1)`` is the step
    of the magnitude bits; zigzag maps steps 0, -1, +1, -2, ... to 0, 1, 2, 3, ...
    """
    sign = spec.np_dtype(1 << (spec.width - 1))
    d_C = (new_C - old_C) & spec.np_dtype(spec.mag_mask)
    negative_C = np.negative(d_C >> spec.np_dtype(spec.width - 2))  # all ones where d >= half
    return ((d_C << spec.np_dtype(1)) ^ negative_C) | ((old_C ^ new_C) & sign)


def _apply_ulp_codes(old_C: np.ndarray, code_C: np.ndarray, spec: _Bits) -> np.ndarray:
    """Inverse of :func:`_ulp_codes`: the new bit patterns."""
    sign, mag = spec.np_dtype(1 << (spec.width - 1)), spec.np_dtype(spec.mag_mask)
    zigzag_C = code_C & mag
    step_C = (zigzag_C >> spec.np_dtype(1)) ^ np.negative(zigzag_C & spec.np_dtype(1))
    return ((old_C + step_C) & mag) | ((old_C ^ code_C) & sign)


def _encode_values(old_C: np.ndarray, new_C: np.ndarray, n_minority: int, spec: _Bits) -> tuple[int, bytes]:
    """The value stream in the smaller scheme, ulp step or xor.

    Both are compressed when xor may win: short streams, streams where at least a quarter of
    the changes are minority (tiny) weights, whose repeated jumps zstd codes better as xor runs
    (order-0 estimates misjudge this), and streams whose first and last ``XOR_TRIAL_MAX / 2``
    codes compress smaller as xor. Elsewhere +-1 ulp steps dominate and ulp wins.
    """
    ulp_C, xor_C = _ulp_codes(old_C, new_C, spec), old_C ^ new_C
    ulp = _zstd(_to_planes(ulp_C), ZSTD_LEVEL)
    if old_C.size > XOR_TRIAL_MAX and n_minority * 4 < old_C.size:
        ends = np.r_[0 : XOR_TRIAL_MAX // 2, old_C.size - XOR_TRIAL_MAX // 2 : old_C.size]
        sample_ulp, sample_xor = (_zstd(_to_planes(c[ends]), ZSTD_LEVEL) for c in (ulp_C, xor_C))
        if len(sample_xor) >= len(sample_ulp):
            return VAL_ULP, ulp
    xor = _zstd(_to_planes(xor_C), ZSTD_LEVEL)
    return (VAL_ULP, ulp) if len(ulp) <= len(xor) else (VAL_XOR, xor)


def _decode_values(scheme: int, blob: memoryview, old_C: np.ndarray, spec: _Bits) -> np.ndarray:
    if scheme not in (VAL_ULP, VAL_XOR):
        raise ValueError(f"corrupted delta header: value scheme {scheme}")
    raw = _unzstd(blob, old_C.size * spec.nbytes, "value")
    code_C = _from_planes(raw, old_C.size, spec.np_dtype)
    return _apply_ulp_codes(old_C, code_C, spec) if scheme == VAL_ULP else old_C ^ code_C


# ---------------------------------------------------------------- header


def _varints(values: list[int]) -> bytes:
    """LEB128: 7 bits a byte, low first, high bit = more follows."""
    out = bytearray()
    for v in values:
        while v >= 0x80:
            out.append((v & 0x7F) | 0x80)
            v >>= 7
        out.append(v)
    return bytes(out)


def _read_varints(data: memoryview, offset: int, count: int) -> tuple[list[int], int]:
    values = []
    for _ in range(count):
        v = shift = 0
        while True:
            if offset >= len(data) or shift > 63:
                raise ValueError("truncated or corrupted weight blob header")
            byte = data[offset]
            offset += 1
            v |= (byte & 0x7F) << shift
            shift += 7
            if byte < 0x80:
                break
        values.append(v)
    return values, offset


@dataclass
class _Header:
    kind: int
    dtype: int
    shape: tuple[int, ...]
    pos_scheme: int = POS_NONE
    val_scheme: int = VAL_NONE
    gap_width: int = 0
    split_exp: int = 0
    n_changed: int = 0
    n_minority: int = 0
    pos_len: int = 0
    val_len: int = 0

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def pack(self, *streams: bytes) -> bytes:
        """The whole blob: header, then ``streams``; the crc32 covers all of it."""
        fixed = [MAGIC, FORMAT_VERSION, self.kind, self.dtype, self.pos_scheme, self.val_scheme]
        fixed += [self.gap_width, self.split_exp]
        sizes = [len(self.shape), *self.shape, self.n_changed, self.n_minority, self.pos_len, self.val_len]
        rest = _varints(sizes)
        crc = zlib.crc32(rest, zlib.crc32(_FIXED.pack(*fixed, 0)))
        for stream in streams:
            crc = zlib.crc32(stream, crc)
        return b"".join([_FIXED.pack(*fixed, crc), rest, *streams])


def _read_header(data: memoryview, kind: int | None) -> tuple[_Header, int]:
    """The header of a blob and the offset of its first stream; ValueError if the blob is not valid."""
    if len(data) < _FIXED.size:
        raise ValueError(f"weight blob of {len(data)} bytes is shorter than its {_FIXED.size}-byte header")
    f = _FIXED.unpack_from(data)
    if f[0] != MAGIC:
        raise ValueError(f"not a weight codec blob (magic {bytes(f[0])!r}, expected {MAGIC!r})")
    if f[1] != FORMAT_VERSION:
        raise ValueError(f"weight blob format version {f[1]}; this codec reads version {FORMAT_VERSION}")
    (ndim,), offset = _read_varints(data, _FIXED.size, 1)
    if ndim > 64:
        raise ValueError(f"corrupted weight blob header: {ndim} dimensions")
    sizes, offset = _read_varints(data, offset, ndim + 4)
    crc = zlib.crc32(data[_FIXED.size :], zlib.crc32(_FIXED.pack(*f[:-1], 0)))
    if crc != f[-1]:
        raise ValueError("corrupted weight blob: checksum mismatch")
    h = _Header(f[2], f[3], tuple(sizes[:ndim]), f[4], f[5], f[6], f[7], *sizes[ndim:])
    if h.dtype not in _BY_CODE or h.kind not in _KIND_NAMES or (kind is not None and h.kind != kind):
        raise ValueError(
            f"weight blob is kind {h.kind} with dtype code {h.dtype}; expected a {_KIND_NAMES.get(kind, 'weight')} blob"
        )
    if len(data) != offset + h.pos_len + h.val_len:
        raise ValueError(
            f"weight blob is {len(data)} bytes; its header says {offset + h.pos_len + h.val_len}"
        )
    return h, offset


# ---------------------------------------------------------------- public API: one tensor


def _minority(
    p_N: np.ndarray, n_N: np.ndarray | None, split_exp: int, spec: _Bits, index: MinorityIndex | None
) -> _Order:
    if index is None or split_exp == 0:
        return _order(p_N, n_N, split_exp, spec)
    return index.order(p_N, n_N, split_exp, spec)


def encode_delta(
    parent: torch.Tensor, new: torch.Tensor, index: MinorityIndex | None = None, update_parent: bool = False
) -> bytes:
    """The delta blob that turns ``parent`` into ``new`` (same dtype and shape), bit-exact.

    ``index`` (optional) describes ``parent`` (see :class:`MinorityIndex`); it is advanced to
    describe ``new``. The blob does not depend on it. ``update_parent=True`` then writes the
    changed elements into ``parent`` (a contiguous CPU tensor), so it equals ``new``: a sender
    that keeps the previous version touches only what changed instead of copying the tensor."""
    spec = _spec(parent, "parent")
    if not isinstance(new, torch.Tensor) or new.dtype != parent.dtype or new.shape != parent.shape:
        got = f"{new.dtype} {tuple(new.shape)}" if isinstance(new, torch.Tensor) else type(new).__name__
        raise ValueError(f"new tensor {got} does not match parent {parent.dtype} {tuple(parent.shape)}")
    if update_parent and (parent.device.type != "cpu" or not parent.is_contiguous()):
        raise ValueError("update_parent=True needs the parent as a contiguous CPU tensor")
    return _encode_delta(parent, new, spec, index, update_parent)


def _encode_delta(
    parent: torch.Tensor, new: torch.Tensor, spec: _Bits, index: MinorityIndex | None, update_parent: bool
) -> bytes:
    head = _Header(KIND_DELTA, spec.code, tuple(parent.shape))
    p_N, n_N = _bits(parent, spec), _bits(new, spec)
    changed = _scan_changed(p_N, n_N)
    head.n_changed = changed[0].size
    if head.n_changed == 0:
        return head.pack()
    if head.n_changed >= MIN_SPLIT_CHANGED:
        head.split_exp = _choose_split(p_N, changed[1], spec)
    order = _minority(p_N, n_N, head.split_exp, spec, index)
    vpos_C, old_C, new_C, pick = _to_virtual(changed, order, spec)
    if index is not None:
        _advance(index, order, vpos_C, old_C, new_C, pick, spec)
    head.pos_scheme, head.gap_width, pos = _encode_positions(vpos_C, p_N.size + order.n_minority)
    n_minority_changed = int(np.searchsorted(vpos_C, order.n_minority))
    head.val_scheme, val = _encode_values(old_C, new_C, n_minority_changed, spec)
    head.n_minority, head.pos_len, head.val_len = order.n_minority, len(pos), len(val)
    if update_parent:  # last: everything above reads the parent's bits
        p_N[changed[0]] = changed[2]
    return head.pack(pos, val)


def decode_delta(
    parent: torch.Tensor, data: bytes, out: torch.Tensor | None = None, index: MinorityIndex | None = None
) -> torch.Tensor:
    """Rebuild the new tensor from ``parent`` and a delta blob; write into ``out`` when given.

    ``out`` may be ``parent`` itself (apply in place, e.g. to the live parameter); it must have
    the parent's dtype and shape. Returns the tensor holding the result. ``index`` (optional)
    describes ``parent`` (see :class:`MinorityIndex`) and is advanced to describe the result;
    after an error it is reset.
    """
    return _decode_delta(parent, data, out, index)[0]


def apply_delta(
    parent: torch.Tensor, data: bytes, out: torch.Tensor | None = None, index: MinorityIndex | None = None
) -> tuple[torch.Tensor, np.ndarray]:
    """:func:`decode_delta`, also returning the flat indices of the elements that changed
    (int64, each once, not sorted): a receiver that keeps a second copy in step (the live weights of a server
    beside its staging copy) copies only those."""
    return _decode_delta(parent, data, out, index)


def _decode_delta(
    parent: torch.Tensor, data: bytes, out: torch.Tensor | None, index: MinorityIndex | None
) -> tuple[torch.Tensor, np.ndarray]:
    spec = _spec(parent, "parent")
    view = memoryview(data)
    head, offset = _read_header(view, KIND_DELTA)
    if head.dtype != spec.code or head.shape != tuple(parent.shape):
        stored = _BY_CODE[head.dtype].torch_dtype
        raise ValueError(
            f"delta is for {stored} {head.shape}; parent is {parent.dtype} {tuple(parent.shape)}"
        )
    target = _target(parent, out)
    p_N = _bits(parent, spec)
    idx_C, new_C = np.zeros(0, dtype=np.int64), None
    if head.n_changed > p_N.size or head.n_minority > p_N.size:
        raise ValueError(f"corrupted delta header: {head.n_changed} changed of {p_N.size} elements")
    if head.n_changed:
        try:
            idx_C, new_C = _decode_changes(p_N, head, view[offset:], spec, index)
        except ValueError:
            if index is not None:
                index.reset()
            raise
    if target.data_ptr() != parent.data_ptr() or target.device != parent.device:
        target.copy_(parent)
    if new_C is not None:
        _bits(target, spec)[idx_C] = new_C
    return _finish(target, out), idx_C.astype(np.int64, copy=False)


def _decode_changes(
    p_N: np.ndarray, head: _Header, streams: memoryview, spec: _Bits, index: MinorityIndex | None
) -> tuple[np.ndarray, np.ndarray]:
    """(element indices, new bits) of the changed elements; advances ``index``."""
    order = _minority(p_N, None, head.split_exp, spec, index)
    if order.n_minority != head.n_minority:
        raise ValueError(
            f"delta does not fit this parent: {order.n_minority} elements below its split, "
            f"the delta was made against {head.n_minority}"
        )
    n_virtual = p_N.size + order.n_minority
    pos_blob = streams[: head.pos_len]
    vpos_C = _decode_positions(head.pos_scheme, head.gap_width, pos_blob, head.n_changed, n_virtual)
    idx_C, old_C, pick = _from_virtual(vpos_C, order, p_N)
    new_C = _decode_values(head.val_scheme, streams[head.pos_len :], old_C, spec)
    if index is not None:
        _advance(index, order, idx_C, old_C, new_C, pick, spec, virtual=False)
    return idx_C, new_C


def _advance(
    index: MinorityIndex,
    order: _Order,
    pos_C: np.ndarray,
    old_C: np.ndarray,
    new_C: np.ndarray,
    pick: np.ndarray,
    spec: _Bits,
    virtual: bool = True,
) -> None:
    """Advance ``index`` by a delta's changes (minority first; ``pos_C`` virtual positions or,
    with ``virtual=False``, element indices)."""
    k, m = pick.size, order.n_minority
    idx_C = np.concatenate([order.sorted_M[pick], pos_C[k:] - m]) if virtual and m else pos_C
    index.advance(idx_C, old_C, new_C, spec, None if order.pos_M is None else order.pos_M[pick])


def _target(parent: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """A contiguous CPU tensor to decode into (``out`` itself when it qualifies)."""
    if out is None:
        return torch.empty_like(parent, device="cpu", memory_format=torch.contiguous_format)
    if out.dtype != parent.dtype or out.shape != parent.shape:
        raise ValueError(
            f"out is {out.dtype} {tuple(out.shape)}; it must match parent {parent.dtype} {tuple(parent.shape)}"
        )
    if out.device.type == "cpu" and out.is_contiguous():
        return out
    return torch.empty_like(parent, device="cpu", memory_format=torch.contiguous_format)


def _finish(target: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    if out is None or out is target:
        return target
    out.copy_(target)
    return out


def encode_snapshot(t: torch.Tensor) -> bytes:
    """A self-contained blob of ``t``: zstd of its byte planes (sign/exponent plane compresses)."""
    spec = _spec(t, "tensor")
    head = _Header(KIND_SNAPSHOT, spec.code, tuple(t.shape))
    payload = _zstd(_to_planes(_bits(t, spec)), SNAPSHOT_ZSTD_LEVEL)
    head.pos_len = len(payload)
    return head.pack(payload)


def decode_snapshot(data: bytes) -> torch.Tensor:
    """The tensor stored by :func:`encode_snapshot`."""
    view = memoryview(data)
    head, offset = _read_header(view, KIND_SNAPSHOT)
    spec = _BY_CODE[head.dtype]
    raw = _unzstd(view[offset:], head.numel * spec.nbytes, "snapshot")
    return _to_tensor(_from_planes(raw, head.numel, spec.np_dtype), spec, head.shape)


def describe_blob(data: bytes) -> dict[str, int | str | list[int]]:
    """The header of a delta or snapshot blob as a dict (schemes by name, counts, stream sizes)."""
    view = memoryview(data)
    h, offset = _read_header(view, None)
    return {
        "kind": _KIND_NAMES[h.kind],
        "dtype": str(_BY_CODE[h.dtype].torch_dtype).removeprefix("torch."),
        "shape": list(h.shape),
        "changed": h.n_changed,
        "split_exp": h.split_exp,
        "minority": h.n_minority,
        "pos_scheme": _POS_NAMES.get(h.pos_scheme, str(h.pos_scheme)),
        "gap_width": h.gap_width,
        "val_scheme": _VAL_NAMES.get(h.val_scheme, str(h.val_scheme)),
        "header_bytes": offset,
        "pos_bytes": h.pos_len if h.kind == KIND_DELTA else 0,
        "val_bytes": h.val_len,
        "payload_bytes": h.pos_len if h.kind == KIND_SNAPSHOT else 0,
        "total_bytes": len(view),
    }


DIGEST_ALGORITHMS = ("xxh3", "sha256")
"""``tensor_digest`` algorithms: ``xxh3`` (XXH3-128, ~30 GB/s, what versions are published
with) and ``sha256`` (what older manifests carry; still verified)."""


def tensor_digest(t: torch.Tensor, algorithm: str = "xxh3") -> str:
    """``<algorithm>:<hex>`` of the raw bytes, dtype and shape.

    XXH3-128 by default: a digest guards against corruption and against live weights that do
    not match the version they claim (shards in the store are SHA-256 checked separately), and
    at ~30 GB/s per core it keeps checking every decoded tensor cheap (SHA-256: ~1.7 GB/s).
    """
    spec = _spec(t, "tensor")
    if algorithm == "xxh3":
        h = xxhash.xxh3_128()
    elif algorithm == "sha256":
        h = hashlib.sha256()
    else:
        raise ValueError(f"digest algorithm {algorithm!r}; expected one of {DIGEST_ALGORITHMS}")
    h.update(f"{spec.torch_dtype}{tuple(t.shape)}".encode())
    h.update(memoryview(np.ascontiguousarray(_bits(t, spec))).cast("B"))
    return f"{algorithm}:{h.hexdigest()}"


def digest_matches(t: torch.Tensor, expected: str) -> bool:
    """Whether ``t`` has the digest ``expected`` (of whichever algorithm ``expected`` names)."""
    algorithm = expected.partition(":")[0]
    return algorithm in DIGEST_ALGORITHMS and tensor_digest(t, algorithm) == expected


# ---------------------------------------------------------------- public API: whole states


def _check_names(parent: Mapping[str, object], other: Mapping[str, object], what: str) -> None:
    missing, extra = sorted(set(parent) - set(other)), sorted(set(other) - set(parent))
    if missing or extra:
        raise ValueError(f"{what} names differ from the parent's: missing {missing[:5]}, extra {extra[:5]}")


def _map_tensors(
    fn: Callable[[str], _T], names: list[str], workers: int, numel: Callable[[str], int]
) -> dict[str, _T]:
    """``{name: fn(name)}`` on ``workers`` threads, largest tensors first (they bound the wall
    time); a ``ValueError`` is re-raised naming its tensor."""
    if workers < 1:
        raise ValueError(f"workers={workers} must be >= 1")

    def named(name: str) -> _T:
        try:
            return fn(name)
        except ValueError as e:
            raise ValueError(f"tensor {name!r}: {e}") from e

    if workers == 1 or len(names) < 2:
        return {name: named(name) for name in names}
    largest_first = sorted(names, key=numel, reverse=True)
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="weight-codec") as pool:
        done = dict(zip(largest_first, pool.map(named, largest_first), strict=True))
    return {name: done[name] for name in names}


def indexes_for(
    names: list[str], indexes: dict[str, MinorityIndex] | None
) -> dict[str, MinorityIndex | None]:
    """Each name's :class:`MinorityIndex` in ``indexes`` (created when missing), or None for all."""
    if indexes is None:
        return dict.fromkeys(names)
    return {k: indexes.setdefault(k, MinorityIndex()) for k in names}


def encode_state(
    parent: Mapping[str, torch.Tensor],
    new: Mapping[str, torch.Tensor],
    workers: int = 1,
    indexes: dict[str, MinorityIndex] | None = None,
) -> dict[str, bytes]:
    """Delta blobs of every tensor of ``new`` against ``parent`` (same names), on ``workers`` threads.
    ``indexes`` (name -> :class:`MinorityIndex` of ``parent``, kept by a caller that codes one
    version after another) is advanced to describe ``new``."""
    _check_names(parent, new, "new state")
    index = indexes_for(list(new), indexes)
    return _map_tensors(
        lambda k: encode_delta(parent[k], new[k], index[k]), list(new), workers, lambda k: new[k].numel()
    )


def decode_state(
    parent: Mapping[str, torch.Tensor],
    blobs: Mapping[str, bytes],
    workers: int = 1,
    out: Mapping[str, torch.Tensor] | None = None,
    indexes: dict[str, MinorityIndex] | None = None,
) -> dict[str, torch.Tensor]:
    """Apply every delta blob to its parent tensor, into ``out[name]`` when given (``out`` may be
    ``parent`` itself: the live weights, updated in place). Returns the new tensors by name.
    ``indexes`` as in :func:`encode_state` (advanced to describe the result).

    Each worker decodes one tensor at a time; its scratch is bounded (see the module contract),
    so with ``out`` no full-size memory is allocated at all.
    """
    _check_names(parent, blobs, "delta blobs")
    if out is not None:
        _check_names(parent, out, "out")

    index = indexes_for(list(blobs), indexes)

    def one(name: str) -> torch.Tensor:
        return decode_delta(parent[name], blobs[name], None if out is None else out[name], index[name])

    return _map_tensors(one, list(blobs), workers, lambda k: parent[k].numel())


# ---------------------------------------------------------------- entropy bound (for reports)


def _entropy_bits(keys: np.ndarray) -> float:
    """Total order-0 entropy in bits of a sequence of symbols."""
    return _entropy_of_counts(np.unique(keys, return_counts=True)[1]) if keys.size else 0.0


def _tensor_bound_bits(parent: torch.Tensor, new: torch.Tensor, conditioned: bool) -> float:
    spec = _spec(parent, "parent")
    p_N, n_N = _bits(parent, spec), _bits(new, spec)
    changed_C = np.flatnonzero(p_N != n_N)
    if not conditioned:
        mask = float(_binary_entropy_bits(np.array([changed_C.size]), np.array([p_N.size]))[0])
        return mask + _entropy_bits(p_N[changed_C] ^ n_N[changed_C])
    mag_mask = spec.np_dtype(spec.mag_mask)
    n_exp = 1 << spec.exp_bits
    exp_N = (p_N & mag_mask) >> spec.mant_bits
    exp_C = exp_N[changed_C].astype(np.int64)
    all_E = np.bincount(exp_N, minlength=n_exp).astype(np.float64)
    chg_E = np.bincount(exp_C, minlength=n_exp).astype(np.float64)
    codes_C = _ulp_codes(p_N[changed_C], n_N[changed_C], spec).astype(np.int64)
    values = _entropy_bits((exp_C << spec.width) | codes_C) - _entropy_bits(exp_C)
    return float(_binary_entropy_bits(chg_E, all_E).sum()) + values


def entropy_bound(
    parent: torch.Tensor | Mapping[str, torch.Tensor],
    new: torch.Tensor | Mapping[str, torch.Tensor],
    conditioned: bool = False,
) -> float:
    """Compression ratio an ideal order-0 coder of the delta could reach (raw bytes / bound).

    Unconditioned: per tensor, the Bernoulli entropy of the change mask plus the order-0
    entropy of the xor values of the changed elements. ``conditioned=True``: the mask and the
    ulp-step codes are each conditioned on the parent's exponent (what this codec exploits).
    """
    pairs = (
        [(parent[k], new[k]) for k in parent]
        if isinstance(parent, Mapping) and isinstance(new, Mapping)
        else [(parent, new)]
    )
    raw_bits = sum(p.numel() * p.element_size() * 8 for p, _ in pairs)
    bits = sum(_tensor_bound_bits(p, n, conditioned) for p, n in pairs)
    return math.inf if bits == 0 else raw_bits / bits
