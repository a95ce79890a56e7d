"""The delta codec's format constants, dtype bit views and zstd byte-plane streams (:mod:`.codec`).

Contract: :func:`_bits` views a tensor's raw bit patterns as unsigned integers of its width
(:data:`SUPPORTED_DTYPES`); :func:`_zstd` / :func:`_unzstd` code one magicless zstd frame with a
per-thread compressor; :func:`_to_planes` / :func:`_from_planes` split integers into byte planes.
"""

from __future__ import annotations

import struct
import threading
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
import torch
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
