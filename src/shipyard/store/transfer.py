"""Parallel, resumable transfers: one object over many connections, many objects at once.

Contract:
- :func:`download` fetches ``key`` into ``dest`` as ``chunk_bytes`` ranged reads over
  ``connections`` threads. Each chunk is written at its offset of ``dest.part`` and then recorded
  in the journal ``dest.part.journal``; a download killed at any point (even SIGKILL) resumes
  from the journal and fetches only the chunks not recorded. When the object is complete its
  SHA-256 is checked against ``sha256`` (when given); a mismatch deletes the partial file and
  journal and raises ``ValueError`` naming the key, so the next attempt starts clean. Only then
  is ``dest.part`` renamed to ``dest``. An existing ``dest`` of the right digest costs nothing.
- :func:`upload` puts many objects over ``connections`` threads; objects already present with
  the expected size are skipped (content-addressed keys make that a resume).

Limits: the journal trusts chunks it lists (a torn journal line is ignored; a chunk whose bytes
were lost with a machine crash is caught by the final digest). Chunks of one object are written
with ``os.pwrite``, so ``dest`` must be on a POSIX filesystem.
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from shipyard.store.types import Store

DEFAULT_CHUNK = 8 << 20


@dataclass
class TransferReport:
    """What one download moved: bytes and chunks fetched now, chunks found done by a previous try."""

    bytes_fetched: int = 0
    chunks_fetched: int = 0
    chunks_resumed: int = 0


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(8 << 20):
            h.update(block)
    return h.hexdigest()


def _read_journal(journal: Path, size: int, chunk_bytes: int) -> set[int]:
    """Chunk indices a previous attempt completed (empty when the journal is for another layout)."""
    if not journal.exists():
        return set()
    lines = journal.read_text().split("\n")
    if lines[0] != f"{size} {chunk_bytes}":
        return set()
    n_chunks = -(-size // chunk_bytes)
    return {int(x) for x in lines[1:] if x.isdigit() and int(x) < n_chunks}


def download(
    store: Store,
    key: str,
    dest: Path,
    sha256: str | None = None,
    size: int | None = None,
    connections: int = 8,
    chunk_bytes: int = DEFAULT_CHUNK,
    on_chunk: Callable[[int], None] | None = None,
) -> TransferReport:
    """Fetch ``key`` into ``dest`` (see the module contract); ``on_chunk(index)`` runs after each chunk."""
    if connections < 1 or chunk_bytes < 1:
        raise ValueError(f"connections={connections} and chunk_bytes={chunk_bytes} must be >= 1")
    report = TransferReport()
    if dest.exists() and (sha256 is None or file_sha256(dest) == sha256):
        return report
    size = store.size(key) if size is None else size
    part, journal = dest.with_name(dest.name + ".part"), dest.with_name(dest.name + ".part.journal")
    dest.parent.mkdir(parents=True, exist_ok=True)
    done = _read_journal(journal, size, chunk_bytes)
    if not done:
        journal.write_text(f"{size} {chunk_bytes}\n")
    report.chunks_resumed = len(done)
    todo = [i for i in range(-(-size // chunk_bytes)) if i not in done]
    lock = threading.Lock()
    fd = os.open(part, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        os.ftruncate(fd, size)
        with open(journal, "a") as jf:

            def one(i: int) -> None:
                start = i * chunk_bytes
                data = store.get_range(key, start, min(start + chunk_bytes, size))
                if len(data) != min(chunk_bytes, size - start):
                    raise FileNotFoundError(f"store object {key!r} is shorter than its {size} bytes")
                os.pwrite(fd, data, start)
                with lock:
                    jf.write(f"{i}\n")
                    jf.flush()
                    report.bytes_fetched += len(data)
                    report.chunks_fetched += 1
                if on_chunk is not None:
                    on_chunk(i)

            _run_all(one, todo, connections)
    finally:
        os.close(fd)
    if sha256 is not None and (got := file_sha256(part)) != sha256:
        part.unlink(missing_ok=True)
        journal.unlink(missing_ok=True)
        raise ValueError(f"store object {key!r}: sha256 {got[:12]} != expected {sha256[:12]} (corrupted)")
    os.replace(part, dest)
    journal.unlink(missing_ok=True)
    return report


def fetch_bytes(
    store: Store, key: str, size: int, connections: int = 8, chunk_bytes: int = DEFAULT_CHUNK
) -> bytes:
    """The whole object in memory, read as parallel ranged GETs when it spans several chunks."""
    if size <= chunk_bytes or connections == 1:
        return store.get(key)
    buf = bytearray(size)

    def one(i: int) -> None:
        start = i * chunk_bytes
        data = store.get_range(key, start, min(start + chunk_bytes, size))
        if len(data) != min(chunk_bytes, size - start):
            raise FileNotFoundError(f"store object {key!r} is shorter than its {size} bytes")
        buf[start : start + len(data)] = data

    _run_all(one, list(range(-(-size // chunk_bytes))), connections)
    return bytes(buf)


def upload(store: Store, objects: Mapping[str, bytes], connections: int = 8) -> int:
    """Put every object, ``connections`` at a time, skipping ones already stored at their size;
    returns the bytes sent."""
    sent = 0
    lock = threading.Lock()

    def one(key: str) -> None:
        nonlocal sent
        data = objects[key]
        if store.exists(key) and store.size(key) == len(data):
            return
        store.put(key, data)
        with lock:
            sent += len(data)

    _run_all(one, list(objects), connections)
    return sent


def _run_all(fn: Callable, items: list, connections: int) -> None:
    """``fn(item)`` for every item on ``connections`` threads; the first exception is re-raised."""
    if connections == 1 or len(items) < 2:
        for item in items:
            fn(item)
        return
    with ThreadPoolExecutor(max_workers=min(connections, len(items)), thread_name_prefix="transfer") as pool:
        for fut in [pool.submit(fn, item) for item in items]:
            fut.result()
