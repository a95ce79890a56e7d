"""Object store over any fsspec filesystem with atomic object PUTs (S3-compatible via s3fs).

Contract: see :class:`shipyard.store.types.Store`. Keys live under ``root`` (``bucket/prefix``
for S3). A ``put`` is one PUT below ``2 * part_bytes`` and otherwise a multipart upload of
``part_bytes`` parts sent over ``connections`` concurrent requests, completed only when every part
arrived, so readers see the whole object or none (S3 semantics). ``get_range`` is an HTTP ranged
GET. Listing caches are off: every ``list``/``exists`` asks the server (a subscriber polls for
versions another process wrote).

Every call has a deadline: ``timeout_s`` per ``connections`` parts it moves (at least one), after
which it raises ``TimeoutError`` naming the key, so a server that accepts a request and never
answers (SeaweedFS with its disk full does) fails the caller instead of blocking it forever. A
server that cannot be reached (refused, reset, DNS) raises ``ConnectionError`` naming the key and
the root, never a client library's own exception, so callers that retry on ``OSError`` (relays,
subscribers) keep going while the store is down.

Limits: atomicity is the backend's (true for S3 PUT and multipart complete; not for a plain
local filesystem, which is why ``type = "local"`` uses :class:`~shipyard.store.local.LocalStore`).
Credentials come from the environment variables named in the config, never from the config.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
from typing import Any

from fsspec.exceptions import FSTimeoutError

from shipyard.store.types import IOStats


class FsspecStore:
    def __init__(
        self, fs: Any, root: str, connections: int = 8, part_bytes: int = 8 << 20, timeout_s: float = 120.0
    ) -> None:
        if connections < 1 or part_bytes < 5 << 20:
            raise ValueError(
                f"connections={connections} must be >= 1 and part_bytes={part_bytes} >= 5 MiB (S3 minimum part)"
            )
        self.timeout_s = timeout_s
        self.fs = fs
        self.root = root.strip("/")
        self.connections = connections
        self.part_bytes = part_bytes
        self.stats = IOStats()

    def path(self, key: str) -> str:
        if key.startswith("/") or ".." in key.split("/"):
            raise ValueError(f"store key {key!r} must be a relative path without '..'")
        return f"{self.root}/{key}"

    def put(self, key: str, data: bytes) -> None:
        path, kw = self.path(key), {"chunksize": self.part_bytes, "max_concurrency": self.connections}
        self._call(key, len(data), self.fs.pipe_file, path, data, **kw)
        self.stats.wrote(len(data))

    def get(self, key: str) -> bytes:
        data = self._missing_named(key, self.fs.cat_file, self.path(key))
        self.stats.read(len(data))
        return data

    def get_range(self, key: str, start: int, end: int) -> bytes:
        if not 0 <= start <= end:
            raise ValueError(f"range [{start}, {end}) of {key!r} must satisfy 0 <= start <= end")
        if start == end:
            return b""
        data = self._missing_named(key, self.fs.cat_file, self.path(key), start=start, end=end)
        self.stats.read(len(data))
        return data

    def size(self, key: str) -> int:
        return int(self._missing_named(key, self.fs.size, self.path(key)))

    def exists(self, key: str) -> bool:
        return bool(self._call(key, 0, self.fs.isfile, self.path(key)))

    def list(self, prefix: str) -> list[str]:
        base = self.path(prefix.rstrip("/")) if prefix.strip("/") else self.root
        try:
            found = self._call(prefix, 0, self.fs.find, base)
        except FileNotFoundError:
            return []
        cut = len(self.root) + 1
        return sorted(p[cut:] for p in found if p.startswith(f"{self.root}/"))

    def delete(self, key: str) -> None:
        try:
            self._call(key, 0, self.fs.rm_file, self.path(key))
        except FileNotFoundError:
            return

    def _missing_named(self, key: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        nbytes = kwargs["end"] - kwargs["start"] if "end" in kwargs else self.part_bytes
        try:
            return self._call(key, nbytes, fn, *args, **kwargs)
        except FileNotFoundError:
            raise FileNotFoundError(f"store object {key!r} not found under {self.root}") from None

    def _call(self, key: str, nbytes: int, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)`` (an fsspec call) within its deadline: ``timeout_s`` per round of
        ``connections`` parts of the ``nbytes`` it moves, at least one."""
        rounds = max(1, math.ceil(nbytes / (self.part_bytes * self.connections)))
        deadline = self.timeout_s * rounds
        try:
            return fn(*args, timeout=deadline, **kwargs)
        except FSTimeoutError:
            raise TimeoutError(
                f"store call on {key!r} under {self.root} got no answer within {deadline:.0f} s "
                "(store.timeout_s per round of parts): is the server up, and does it have disk space?"
            ) from None
        except _network_errors() as e:
            raise ConnectionError(f"store call on {key!r} under {self.root} failed: {e}") from e


@functools.cache
def _network_errors() -> tuple[type[BaseException], ...]:
    """The client libraries' exceptions for a server that cannot be reached (botocore, aiohttp)."""
    found: list[type[BaseException]] = []
    with contextlib.suppress(ImportError):
        from botocore.exceptions import BotoCoreError

        found.append(BotoCoreError)
    with contextlib.suppress(ImportError):
        from aiohttp import ClientError

        found.append(ClientError)
    return tuple(found)


def s3_store(
    root: str,
    endpoint_url: str | None,
    region: str,
    key_env: str,
    secret_env: str,
    connections: int,
    part_bytes: int,
    timeout_s: float = 120.0,
) -> FsspecStore:
    """An S3-compatible store at ``root`` = ``bucket[/prefix]`` (the bucket is created if absent)."""
    import s3fs

    bucket = root.strip("/").split("/")[0]
    if len(bucket) < 3:
        raise ValueError(
            f"store.root={root!r}: an S3 root is 'bucket[/prefix]' with a bucket of >= 3 characters"
        )
    fs = s3fs.S3FileSystem(
        key=os.environ.get(key_env),
        secret=os.environ.get(secret_env),
        client_kwargs={"endpoint_url": endpoint_url, "region_name": region},
        config_kwargs={
            "max_pool_connections": max(10, 2 * connections),
            "connect_timeout": min(10.0, timeout_s),
            "read_timeout": min(60.0, timeout_s),
        },
        max_concurrency=connections,
        use_listings_cache=False,
        skip_instance_cache=True,
    )
    store = FsspecStore(fs, root, connections=connections, part_bytes=part_bytes, timeout_s=timeout_s)
    if not store._call(bucket, 0, fs.exists, bucket):
        store._call(bucket, 0, fs.mkdir, bucket)
    return store
