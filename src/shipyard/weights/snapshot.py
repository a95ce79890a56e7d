"""Publish and read full-snapshot weight versions through the store.

Contract: :class:`WeightPublisher.publish` writes the tensors, then the manifest, then moves
``weights/LATEST``; it keeps the newest ``keep`` versions (older ones are deleted after LATEST
moved, so a subscriber always finds LATEST complete). :func:`load_version` verifies the SHA-256
of the file against the manifest and raises ``ValueError`` naming the version on a mismatch.
Limits: full snapshots only (a version costs the whole model's bytes); deltas come later.
"""

from __future__ import annotations

import hashlib
import time
from typing import Any

from shipyard.store.types import Store
from shipyard.weights.types import LATEST_KEY, WEIGHTS_PREFIX, Manifest, TensorEntry, version_dir

WEIGHTS_FILE = "model.safetensors"


def named_params(model: Any) -> dict[str, Any]:
    """The model's parameters by name, tied parameters once (what a version holds)."""
    return {n: p.detach() for n, p in model.named_parameters()}


def latest_version(store: Store) -> int | None:
    if not store.exists(LATEST_KEY):
        return None
    return int(store.get(LATEST_KEY).decode().strip())


def published_versions(store: Store) -> list[int]:
    out = set()
    for key in store.list(WEIGHTS_PREFIX):
        parts = key.split("/")
        if len(parts) == 3 and parts[2] == "manifest.json":
            out.add(int(parts[1]))
    return sorted(out)


def read_manifest(store: Store, version: int) -> Manifest:
    return Manifest.from_bytes(store.get(f"{version_dir(version)}/manifest.json"))


class WeightPublisher:
    def __init__(self, store: Store, keep: int = 3) -> None:
        if keep < 1:
            raise ValueError(f"keep={keep} must be >= 1 (the newest version must stay readable)")
        self.store = store
        self.keep = keep

    def has(self, version: int) -> bool:
        return self.store.exists(f"{version_dir(version)}/manifest.json")

    def publish(self, version: int, tensors: dict[str, Any], extra: dict[str, Any] | None = None) -> Manifest:
        from safetensors.torch import save

        data = save({k: v.contiguous() for k, v in tensors.items()})
        digest = hashlib.sha256(data).hexdigest()
        self.store.put(f"{version_dir(version)}/{WEIGHTS_FILE}", data)
        manifest = Manifest(
            version=version,
            kind="snapshot",
            files={WEIGHTS_FILE: digest},
            tensors={
                k: TensorEntry(str(v.dtype).removeprefix("torch."), list(v.shape)) for k, v in tensors.items()
            },
            state_digest=digest,
            created_at=time.time(),
            extra=extra or {},
        )
        self.store.put(f"{version_dir(version)}/manifest.json", manifest.to_bytes())
        self.store.put(LATEST_KEY, str(version).encode())
        self._gc(version)
        return manifest

    def _gc(self, newest: int) -> None:
        for v in published_versions(self.store):
            if v <= newest - self.keep:
                self.store.delete(f"{version_dir(v)}/manifest.json")
                for key in self.store.list(version_dir(v)):
                    self.store.delete(key)


def load_version(store: Store, version: int) -> dict[str, Any]:
    """Tensors of ``version``, verified against its manifest."""
    from safetensors.torch import load

    manifest = read_manifest(store, version)
    data = store.get(f"{version_dir(version)}/{WEIGHTS_FILE}")
    digest = hashlib.sha256(data).hexdigest()
    if digest != manifest.files[WEIGHTS_FILE]:
        raise ValueError(
            f"weights version {version}: digest {digest[:12]} != manifest {manifest.files[WEIGHTS_FILE][:12]}"
        )
    return load(data)
