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


def routes_from_vllm(
    prompt_routed_experts: Any, routed_experts: Any, moe_layers: list[int], num_experts: int
) -> dict[str, Any]:
    """A route record from vLLM's returned routed experts (``--enable-return-routed-experts``).

    vLLM returns ``prompt_routed_experts`` (``[prompt_len, num_moe_layers, top_k]``, response level)
    and per choice ``routed_experts`` (``[gen_len, num_moe_layers, top_k]``), int16 ids as nested
    JSON lists on the OpenAI server or arrays from the offline API; its layer axis already holds
    the MoE layers only, in order (pass their decoder-layer indices as ``moe_layers``). The record
    covers prompt + generated positions except the last generated token, which is never forwarded.
    """
    prompt = np.asarray(prompt_routed_experts, dtype=np.int64)
    gen = np.asarray(routed_experts, dtype=np.int64)
    for name, arr in (("prompt_routed_experts", prompt), ("routed_experts", gen)):
        if arr.ndim != 3 or arr.shape[1] != len(moe_layers):
            raise ValueError(
                f"vLLM {name} must be [tokens, {len(moe_layers)} MoE layers, top_k], got {arr.shape}"
            )
    if prompt.shape[2] != gen.shape[2]:
        raise ValueError(f"vLLM top_k differs: prompt {prompt.shape[2]}, generated {gen.shape[2]}")
    ids = np.concatenate([prompt, gen])
    return encode_routes(ids[: max(len(ids) - 1, 0)] if len(gen) else ids, moe_layers, num_experts)


def routes_from_sglang(
    meta_info: dict[str, Any], num_layers: int, top_k: int, moe_layers: list[int], num_experts: int
) -> dict[str, Any]:
    """A route record from SGLang's ``meta_info["routed_experts"]`` (``return_routed_experts=True``).

    SGLang sends base64 of the flat row-major ``[positions, num_layers, top_k]`` array over ALL
    decoder layers (dense layers hold placeholders), int32 unless ``meta_info["routed_experts_dtype"]``
    names another dtype; ``positions = prompt_len + output_len - 1`` (every forwarded token). The
    record keeps the MoE layers ``moe_layers`` (decoder-layer indices) only.
    """
    if "routed_experts" not in meta_info:
        raise ValueError(
            "SGLang meta_info has no 'routed_experts': send the request with return_routed_experts=True"
        )
    dtype = np.dtype(meta_info.get("routed_experts_dtype") or "int32")
    flat = np.frombuffer(base64.b64decode(meta_info["routed_experts"]), dtype=dtype)
    if flat.size % (num_layers * top_k):
        raise ValueError(
            f"SGLang routed_experts holds {flat.size} ids, not a multiple of num_layers*top_k = {num_layers * top_k}"
        )
    if any(not 0 <= i < num_layers for i in moe_layers):
        raise ValueError(f"moe_layers {moe_layers} must index the model's {num_layers} decoder layers")
    ids = flat.reshape(-1, num_layers, top_k)[:, moe_layers, :]
    return encode_routes(ids.astype(np.int64), moe_layers, num_experts)
