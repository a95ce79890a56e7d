"""Whole states through the delta codec: digests, parallel encode/decode of name -> tensor maps, bounds.

Contract: :func:`tensor_digest` hashes a tensor's dtype, shape and raw bits (xxh3 or sha256);
:func:`encode_state` / :func:`decode_state` code every tensor of a state in ``workers`` threads,
deterministically; :func:`entropy_bound` is the order-0 entropy bound the codec is measured against.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
import xxhash

from shipyard.weights.bits import (
    _T,
    _bits,
    _spec,
)
from shipyard.weights.codec import (
    _ulp_codes,
    decode_delta,
    encode_delta,
)
from shipyard.weights.order import (
    MinorityIndex,
    _binary_entropy_bits,
    _entropy_of_counts,
)

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
