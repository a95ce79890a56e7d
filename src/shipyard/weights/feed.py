"""Version feed: push each committed weight version to its followers at once (HTTP long poll).

Purpose: a follower that polls an object store (a relay across a long-haul link, a server
reading its region's mirror) notices a version half a round trip after LATEST moved at best,
then spends a full round trip fetching its manifest and shards. A feed removes both: the writer
of the store (the trainer's publisher, or a relay for its region) serves ``GET /v1/next``; each
follower keeps one such request waiting, and the writer answers all of them the moment a
version is committed, with the version's manifest and, when the follower holds the delta's
parent and the delta is small, the delta's shards in the same response. A version then reaches a
follower one-way latency plus its bytes after commit: less than the poll path's floor of
one and a half round trips.

Contract:
- A push carries exactly what the store holds, announced only once the version is committed
  (its manifest written; the publisher moves LATEST right after): the manifest's bytes verbatim
  and shards the follower verifies against the manifest's SHA-256 before use
  (:meth:`~shipyard.weights.versions.VersionReader.provide`). A follower that acts on a push
  acts on a committed version.
- The feed never replaces the store. Followers keep polling it (at their usual ``poll_s``); a
  feed that is down, slow or restarted costs latency, never a version. A follower that fell
  behind by more than one version gets the manifest only and plans its path through the store.
- ``GET /v1/next?after=N&wait=S``: 200 with the newest version once it is newer than N (at once
  if it already is), 204 after S seconds without one. Body: a 4-byte big-endian length, a JSON
  header ``{"version", "parent", "manifest_bytes", "shards": [[name, size], ...]}``, the manifest
  bytes, then the listed shards back to back.

Limits: the feed keeps one version (the newest) in memory, its inline shards only while their
total is at most ``inline_max_bytes``; plain HTTP without authentication or TLS (run it inside
the trainer's network, or behind a proxy that adds them).

Example::

    feed = VersionFeed(port=8765).start()              # beside the publisher
    pub = WeightPublisher(store, feed=feed)
    relay.start(poll_s=2.0, feed_url=feed.url)         # in another region
"""

from __future__ import annotations

import contextlib
import http.client
import json
import socket
import struct
import threading
import urllib.parse
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from shipyard.weights.types import Manifest

FEED_PATH = "/v1/next"
_LEN = struct.Struct(">I")


@dataclass
class Push:
    """One version as a feed delivered it: the manifest and the shards sent inline (may be none)."""

    version: int
    parent: int | None
    manifest: Manifest
    manifest_bytes: bytes
    shards: dict[str, bytes] = field(default_factory=dict)


def pack_push(push: Push, inline: bool) -> bytes:
    shards = list(push.shards.items()) if inline else []
    header = {
        "version": push.version,
        "parent": push.parent,
        "manifest_bytes": len(push.manifest_bytes),
        "shards": [[name, len(data)] for name, data in shards],
    }
    head = json.dumps(header).encode()
    return b"".join([_LEN.pack(len(head)), head, push.manifest_bytes, *(data for _, data in shards)])


def unpack_push(body: bytes) -> Push:
    """The push in a feed response; ``ValueError`` when the body is not one."""
    try:
        (n,) = _LEN.unpack_from(body, 0)
        header = json.loads(body[4 : 4 + n])
        at = 4 + n + int(header["manifest_bytes"])
        manifest_bytes = body[4 + n : at]
        shards = {}
        for name, size in header["shards"]:
            shards[str(name)] = body[at : at + int(size)]
            at += int(size)
    except (struct.error, KeyError, TypeError, ValueError) as e:
        raise ValueError(f"feed response is not a version push: {e}") from e
    if at != len(body):
        raise ValueError(f"feed response: {len(body)} bytes, the header accounts for {at}")
    version = int(header["version"])
    manifest = Manifest.from_bytes(manifest_bytes, version)
    return Push(version, header["parent"], manifest, manifest_bytes, shards)


class VersionFeed:
    """The long-poll endpoint beside a store's writer (see the module contract)."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, inline_max_bytes: int = 64 << 20) -> None:
        self.inline_max_bytes = inline_max_bytes
        self.latest: Push | None = None
        self.served = 0
        """Responses that carried a version (a count per follower wake-up)."""
        self._cond = threading.Condition()
        self._closed = False
        self._server = ThreadingHTTPServer((host, port), _handler(self))
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="version-feed", daemon=True)

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    @property
    def url(self) -> str:
        host = str(self._server.server_address[0])
        return f"http://{'127.0.0.1' if host in ('0.0.0.0', '') else host}:{self.port}"

    def start(self) -> VersionFeed:
        self._thread.start()
        return self

    def announce(self, manifest: Manifest, manifest_bytes: bytes, shards: Mapping[str, bytes] | None) -> None:
        """``manifest``'s version is committed (its manifest is in the store); ``shards``: its
        delta's shards when the caller has them in memory (kept while they fit ``inline_max_bytes``)."""
        kept = dict(shards or {})
        if sum(len(d) for d in kept.values()) > self.inline_max_bytes:
            kept = {}
        delta = manifest.encodings.get("delta")
        parent = delta.parent if delta is not None else None
        if kept and (delta is None or {s.name for s in delta.shards} != set(kept)):
            kept = {}  # only a complete delta is worth sending
        with self._cond:
            if self.latest is None or manifest.version > self.latest.version:
                self.latest = Push(manifest.version, parent, manifest, manifest_bytes, kept)
                self._cond.notify_all()

    def wait_newer(self, after: int, wait_s: float) -> Push | None:
        with self._cond:
            self._cond.wait_for(
                lambda: self._closed or (self.latest is not None and self.latest.version > after), wait_s
            )
            latest = self.latest
        return latest if latest is not None and latest.version > after else None

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._thread.is_alive():  # shutdown() waits for a serve loop that never started
            self._server.shutdown()
        self._server.server_close()


def _handler(feed: VersionFeed) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        disable_nagle_algorithm = True  # the body follows the headers at once, not after a delayed ACK

        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            url = urllib.parse.urlparse(self.path)
            q = urllib.parse.parse_qs(url.query)
            try:
                if url.path != FEED_PATH:
                    raise LookupError(url.path)
                after = int(q.get("after", ["-1"])[0])
                wait_s = min(60.0, max(0.0, float(q.get("wait", ["20"])[0])))
            except (LookupError, ValueError):
                self.send_error(404 if url.path != FEED_PATH else 400)
                return
            push = feed.wait_newer(after, wait_s)
            if push is None:
                self.send_response(204)
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            body = pack_push(push, inline=push.parent == after)
            try:
                self.send_response(200)
                self.send_header("Content-Type", "application/octet-stream")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
            except (BrokenPipeError, ConnectionResetError):  # the follower left during its long poll
                return
            feed.served += 1

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (http.server's name)
            pass

    return Handler


class FeedFollower:
    """Keeps one long poll waiting on a feed and hands every push to ``on_push``.

    ``after()`` says the version the follower holds (asked before each request). Errors (feed
    down, bad responses) are recorded in ``errors`` and retried after ``retry_s``; the follower's
    store polling goes on meanwhile."""

    def __init__(
        self,
        url: str,
        after: Callable[[], int | None],
        on_push: Callable[[Push], None],
        wait_s: float = 20.0,
        retry_s: float = 1.0,
    ) -> None:
        parsed = urllib.parse.urlparse(url)
        if parsed.scheme != "http" or not parsed.hostname:
            raise ValueError(f"feed url {url!r}: expected http://host:port")
        self.host, self.port = parsed.hostname, parsed.port or 80
        self.after, self.on_push = after, on_push
        self.wait_s, self.retry_s = wait_s, retry_s
        self.errors: list[str] = []
        self.pushes = 0
        self.healthy = False
        """True once a long poll reached the feed, until one fails: pushes can be expected."""
        self._seen = -1
        self._conn: http.client.HTTPConnection | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="feed-follower", daemon=True)

    def start(self) -> FeedFollower:
        self._thread.start()
        return self

    def request(self, after: int) -> Push | None:
        """One long poll: the push for a version newer than ``after``, or None (none in ``wait_s``)."""
        if self._conn is None:
            self._conn = http.client.HTTPConnection(self.host, self.port, timeout=self.wait_s + 30)
        self._conn.request("GET", f"{FEED_PATH}?after={after}&wait={self.wait_s}")
        self.healthy = True  # connected and asked: the feed is there
        resp = self._conn.getresponse()
        body = resp.read()
        if resp.status == 204:
            return None
        if resp.status != 200:
            raise OSError(f"feed {self.host}:{self.port} answered {resp.status} {resp.reason}")
        return unpack_push(body)

    def _run(self) -> None:
        while not self._stop.is_set():
            held = self.after()
            # a push handed over but not yet adopted is not asked for again
            after = max(self._seen, -1 if held is None else held)
            try:
                push = self._refill(self.request(after), after)
            except (OSError, ValueError, http.client.HTTPException) as e:
                self.errors = [*self.errors[-9:], f"{type(e).__name__}: {e}"]
                self.healthy = False
                self._close_conn()
                self._stop.wait(self.retry_s)
                continue
            if push is not None and not self._stop.is_set():
                self.pushes += 1
                self._seen = push.version
                self.on_push(push)

    def _refill(self, push: Push | None, asked_after: int) -> Push | None:
        """``push``, or the same version asked for again with its delta inline when it came
        without (the long poll named an older version) but the follower has come to hold the
        delta's parent while it waited (at start, or after adopting a version by polling): the feed
        answers at once, one round trip instead of a fetch of the delta from the store."""
        if push is None or push.shards or push.parent is None or push.parent == asked_after:
            return push
        if push.parent != self.after():
            return push
        again = self.request(push.parent)
        return again if again is not None and again.version == push.version else push

    def _close_conn(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def stop(self) -> None:
        self._stop.set()
        conn = self._conn
        if conn is not None and conn.sock is not None:
            with contextlib.suppress(OSError):  # wakes the thread blocked in the long poll
                conn.sock.shutdown(socket.SHUT_RDWR)
        self._thread.join(timeout=5)
        self._close_conn()
