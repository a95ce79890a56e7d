"""The object-store interface every hand-off goes through (weights/, rollouts/, checkpoints).

Contract: keys are ``/``-separated relative paths. ``put`` is atomic: a reader sees either no
object or the whole object (local: write a temporary file, fsync, rename; S3: a single PUT or a
completed multipart upload). ``list(prefix)`` returns the keys under ``prefix`` sorted, never a
temporary file. Publishing protocols (manifest written last, then a pointer such as
``weights/LATEST``) are built on top of these guarantees by their users.

Example::

    store = open_store(StoreConfig(root="runs/store"))
    store.put("rollouts/w0-000001.json.gz", data)
    for key in store.list("rollouts/"):
        batch = store.get(key)
"""

from __future__ import annotations

from typing import Protocol


class Store(Protocol):
    def put(self, key: str, data: bytes) -> None:
        """Write ``data`` under ``key`` atomically (replacing any previous object)."""

    def get(self, key: str) -> bytes:
        """Read the whole object; raises ``FileNotFoundError`` naming the key when absent."""

    def exists(self, key: str) -> bool:
        """Whether ``key`` exists."""

    def list(self, prefix: str) -> list[str]:
        """Keys under ``prefix`` (recursively), sorted."""

    def delete(self, key: str) -> None:
        """Remove ``key`` if present."""
