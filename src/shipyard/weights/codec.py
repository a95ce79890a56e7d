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

Modules: this one codes one tensor (positions, values, header, encode/decode/apply);
:mod:`.bits` holds the format constants, bit views and zstd byte planes; :mod:`.order` the virtual
order and :class:`~shipyard.weights.order.MinorityIndex`; :mod:`.states` whole states (parallel
encode/decode), digests and the entropy bound.

Name suffixes: ``_N`` one per element of the flat tensor, ``_C`` one per changed element,
``_M`` one per minority element, ``_E`` one per exponent value, ``_P`` one per byte plane.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass

import numpy as np
import torch

from shipyard.weights.bits import (
    _BY_CODE,
    _FIXED,
    _KIND_NAMES,
    _POS_NAMES,
    _VAL_NAMES,
    BITMAP_MIN_DENSITY,
    FORMAT_VERSION,
    KIND_DELTA,
    KIND_SNAPSHOT,
    MAGIC,
    MIN_SPLIT_CHANGED,
    POS_BITMAP,
    POS_GAPS,
    POS_NONE,
    SNAPSHOT_ZSTD_LEVEL,
    VAL_NONE,
    VAL_ULP,
    VAL_XOR,
    XOR_TRIAL_MAX,
    ZSTD_LEVEL,
    _Bits,
    _bits,
    _from_planes,
    _spec,
    _to_planes,
    _to_tensor,
    _unzstd,
    _zstd,
)
from shipyard.weights.order import (
    MinorityIndex,
    _choose_split,
    _from_virtual,
    _Order,
    _order,
    _scan_changed,
    _to_virtual,
)

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
