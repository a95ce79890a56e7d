"""Local-directory store: the embedded default backend.

Contract: see :class:`shipyard.store.types.Store`. Atomicity comes from writing
``<key>.tmp-<pid>-<n>`` in the same directory, fsync, then ``os.replace``; temporary names are
never listed. Limits: one machine (or a shared POSIX filesystem with atomic rename).
"""

from __future__ import annotations

import itertools
import os
import threading
from pathlib import Path

from shipyard.store.types import IOStats

_TMP_MARK = ".tmp-"
_counter = itertools.count()
_lock = threading.Lock()


class LocalStore:
    def __init__(self, root: str | Path) -> None:
        self.root = Path(root).resolve()
        self.root.mkdir(parents=True, exist_ok=True)
        self.stats = IOStats()

    def path(self, key: str) -> Path:
        if key.startswith("/") or ".." in key.split("/"):
            raise ValueError(f"store key {key!r} must be a relative path without '..'")
        return self.root / key

    def put(self, key: str, data: bytes) -> None:
        dest = self.path(key)
        dest.parent.mkdir(parents=True, exist_ok=True)
        with _lock:
            n = next(_counter)
        tmp = dest.with_name(f"{dest.name}{_TMP_MARK}{os.getpid()}-{n}")
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, dest)
        self.stats.wrote(len(data))

    def get(self, key: str) -> bytes:
        try:
            data = self.path(key).read_bytes()
        except FileNotFoundError:
            raise FileNotFoundError(f"store object {key!r} not found under {self.root}") from None
        self.stats.read(len(data))
        return data

    def get_range(self, key: str, start: int, end: int) -> bytes:
        if not 0 <= start <= end:
            raise ValueError(f"range [{start}, {end}) of {key!r} must satisfy 0 <= start <= end")
        try:
            with open(self.path(key), "rb") as f:
                f.seek(start)
                data = f.read(end - start)
        except FileNotFoundError:
            raise FileNotFoundError(f"store object {key!r} not found under {self.root}") from None
        self.stats.read(len(data))
        return data

    def size(self, key: str) -> int:
        try:
            return self.path(key).stat().st_size
        except FileNotFoundError:
            raise FileNotFoundError(f"store object {key!r} not found under {self.root}") from None

    def exists(self, key: str) -> bool:
        return self.path(key).is_file()

    def list(self, prefix: str) -> list[str]:
        base = self.path(prefix.rstrip("/")) if prefix.strip("/") else self.root
        if not base.is_dir():
            return []
        keys = []
        for dirpath, _dirs, files in os.walk(base):
            for name in files:
                if _TMP_MARK in name:
                    continue
                keys.append(str(Path(dirpath, name).relative_to(self.root)))
        return sorted(keys)

    def delete(self, key: str) -> None:
        self.path(key).unlink(missing_ok=True)
