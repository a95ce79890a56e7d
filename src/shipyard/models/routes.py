"""Compact records of MoE routing decisions: the ``routes`` field of trajectories and results.

A route record holds, for every forwarded token position ``t < n`` of a sequence and every MoE
layer (dense layers are skipped), the ``k`` expert ids the router chose, as a JSON-safe dict::

    {"v": 1, "n": 37, "layers": [0, 1], "k": 2, "experts": 8, "dtype": "uint8", "data": "<base64>"}

``data`` is the base64 of the C-order ``[n, L, k]`` array (``L = len(layers)``, the decoder-layer
indices of the MoE layers) in ``dtype``: ``uint8`` when ``experts <= 256``, else ``uint16``
(little-endian). Ids per token are kept in the router's own order (a set; order carries no
meaning). The positions are a prefix: a sequence's last token is sampled but never forwarded, so
it has no route; a consumer routes positions ``>= n`` itself.

Contract: :func:`encode_routes` / :func:`decode_routes` round-trip exactly; :func:`decode_routes`
raises ``ValueError`` naming the field on a malformed record. Torch-free (numpy only), so records
travel through the store and HTTP without the model stack.
Limits: at most 65536 experts per layer; every MoE layer must share one ``k``.

Shape legend: N = routed positions, L = MoE layers, K = experts per token.
"""

from __future__ import annotations

import base64
from typing import Any

import numpy as np

ROUTES_VERSION = 1


def routes_dtype(num_experts: int) -> np.dtype:
    """``uint8`` for at most 256 experts, ``uint16`` up to 65536."""
    if not 1 <= num_experts <= 65536:
        raise ValueError(f"num_experts={num_experts} must be in [1, 65536] to be stored as uint8/uint16")
    return np.dtype(np.uint8) if num_experts <= 256 else np.dtype("<u2")


def encode_routes(ids_NLK: Any, layers: list[int], num_experts: int) -> dict[str, Any]:
    """Pack ``[N, L, K]`` expert ids (numpy or torch, any int dtype) into a route record."""
    arr = np.asarray(ids_NLK.cpu() if hasattr(ids_NLK, "cpu") else ids_NLK)
    if arr.ndim != 3 or arr.shape[1] != len(layers):
        raise ValueError(f"route ids must be [N, {len(layers)} layers, K], got shape {arr.shape}")
    if arr.size and (arr.min() < 0 or arr.max() >= num_experts):
        raise ValueError(f"route ids must be in [0, {num_experts}), got [{arr.min()}, {arr.max()}]")
    dtype = routes_dtype(num_experts)
    data = np.ascontiguousarray(arr.astype(dtype)).tobytes()
    return {
        "v": ROUTES_VERSION,
        "n": int(arr.shape[0]),
        "layers": [int(i) for i in layers],
        "k": int(arr.shape[2]),
        "experts": int(num_experts),
        "dtype": dtype.name,
        "data": base64.b64encode(data).decode("ascii"),
    }


def decode_routes(record: dict[str, Any]) -> np.ndarray:
    """The ``[N, L, K]`` expert ids of a route record (uint8 or uint16)."""
    if not isinstance(record, dict):
        raise ValueError(f"routes must be a dict record, got {type(record).__name__}")
    missing = [f for f in ("v", "n", "layers", "k", "experts", "dtype", "data") if f not in record]
    if missing:
        raise ValueError(f"routes record lacks field(s) {missing}")
    if record["v"] != ROUTES_VERSION:
        raise ValueError(f"routes.v={record['v']!r}: only version {ROUTES_VERSION} is understood")
    dtype = routes_dtype(int(record["experts"]))
    if record["dtype"] != dtype.name:
        raise ValueError(
            f"routes.dtype={record['dtype']!r} but {record['experts']} experts need {dtype.name}"
        )
    raw = base64.b64decode(record["data"], validate=True)
    n, layers, k = int(record["n"]), len(record["layers"]), int(record["k"])
    if len(raw) != n * layers * k * dtype.itemsize:
        raise ValueError(
            f"routes.data holds {len(raw)} bytes, expected n*layers*k*{dtype.itemsize} = "
            f"{n * layers * k * dtype.itemsize}"
        )
    return np.frombuffer(raw, dtype=dtype).reshape(n, layers, k)
