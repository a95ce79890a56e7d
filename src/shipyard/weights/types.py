"""Records of published weight versions.

Contract: a version is an integer training step (0 = the base model). Version ``v`` lives in
``weights/<v:08d>/``: ``model.safetensors`` (the model's parameters, tied ones once, in the
serving dtype) and ``manifest.json``, written last. ``weights/LATEST`` holds the newest version
number and moves only after that version's manifest exists, so a reader that follows LATEST
never sees a partial version. The manifest carries a SHA-256 of every file and a digest of the
whole state; readers verify it before adopting. (Delta versions arrive with the weight-shipping
subsystem; this layout is the snapshot case.)

Example::

    pub = WeightPublisher(store)
    pub.publish(3, named_params(model))
    v = latest_version(store)                 # 3
    tensors = load_version(store, v)          # verified dict name -> tensor
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

WEIGHTS_PREFIX = "weights/"
LATEST_KEY = "weights/LATEST"


def version_dir(version: int) -> str:
    return f"{WEIGHTS_PREFIX}{version:08d}"


@dataclass
class TensorEntry:
    dtype: str
    shape: list[int]


@dataclass
class Manifest:
    version: int
    kind: str
    files: dict[str, str]
    tensors: dict[str, TensorEntry]
    state_digest: str
    created_at: float
    extra: dict[str, Any] = field(default_factory=dict)

    def to_bytes(self) -> bytes:
        return json.dumps(asdict(self), indent=1, sort_keys=True).encode()

    @staticmethod
    def from_bytes(data: bytes) -> Manifest:
        d = json.loads(data)
        d["tensors"] = {k: TensorEntry(**v) for k, v in d["tensors"].items()}
        return Manifest(**d)
