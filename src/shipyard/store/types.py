"""The object-store interface every hand-off goes through (weights/, rollouts/, checkpoints).

Contract: keys are ``/``-separated relative paths. ``put`` is atomic: a reader sees either no
object or the whole object (local: write a temporary file, fsync, rename; S3: a single PUT or a
completed multipart upload). ``list(prefix)`` returns the keys under ``prefix`` sorted, never a
temporary file. ``get_range`` reads ``[start, end)`` of an object (an HTTP ranged GET on S3), so
one large object can be fetched over many connections and a broken transfer resumed (see
:mod:`shipyard.store.transfer`). Publishing protocols (manifest written last, then a pointer such
as ``weights/LATEST``) are built on top of these guarantees by their users. Every store counts
the payload bytes it moved in ``stats`` (what crossed the link, for benchmarks and tests).

Example::

    store = open_store(StoreConfig(root="runs/store"))
    store.put("rollouts/w0-000001.json.gz", data)
    for key in store.list("rollouts/"):
        batch = store.get(key)
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Protocol


@dataclass
class IOStats:
    """Payload bytes and requests a store served (thread-safe counters)."""

    bytes_read: int = 0
    bytes_written: int = 0
    reads: int = 0
    writes: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def read(self, n: int) -> None:
        with self._lock:
            self.bytes_read += n
            self.reads += 1

    def wrote(self, n: int) -> None:
        with self._lock:
            self.bytes_written += n
            self.writes += 1

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return {
                "bytes_read": self.bytes_read,
                "bytes_written": self.bytes_written,
                "reads": self.reads,
                "writes": self.writes,
            }


class Store(Protocol):
    stats: IOStats

    def put(self, key: str, data: bytes) -> None:
        """Write ``data`` under ``key`` atomically (replacing any previous object)."""

    def get(self, key: str) -> bytes:
        """Read the whole object; raises ``FileNotFoundError`` naming the key when absent."""

    def get_range(self, key: str, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` of the object (fewer only past its end); ``FileNotFoundError`` when absent."""

    def size(self, key: str) -> int:
        """Length of the object in bytes; ``FileNotFoundError`` naming the key when absent."""

    def exists(self, key: str) -> bool:
        """Whether ``key`` exists."""

    def list(self, prefix: str) -> list[str]:
        """Keys under ``prefix`` (recursively), sorted."""

    def delete(self, key: str) -> None:
        """Remove ``key`` if present."""
