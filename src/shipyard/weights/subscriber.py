"""Weight subscriber: keeps an inference engine on the newest published version.

Contract: :meth:`WeightSubscriber.poll_once` (a background thread calls it every ``poll_s``,
and at once when a :mod:`~shipyard.weights.feed` pushes a version) reads ``weights/LATEST`` (or
takes the pushed manifest and shards); when it names a version newer than the one the sink
serves, it plans the cheapest verified path from the served version
(:func:`~shipyard.weights.versions.reach`: a delta chain from the live weights, or a snapshot plus deltas), downloads the shards (resumable,
into ``cache_dir``) and decodes them into staging buffers while the live weights keep serving,
verifies every tensor's digest, then hands the tensors that changed to ``sink.stage``, with the
positions where each differs from the live copy (a delta step touches a fraction of a percent of a
tensor at RL rates), so the engine copies only those elements in place between decode steps and
the pause stays short; it reports the pause. A missing object or digest mismatch
makes it fall back to another path (recorded in ``errors``); with no path left it keeps serving
what it has and tries again on the next poll.

The subscriber renews ``weights/subscribers/<name>.json`` (its version and a heartbeat, see
:mod:`shipyard.weights.leases`), so garbage collection keeps the deltas it needs; ``stop``
removes the record. Memory: the live weights plus one staging copy.

Each adoption is recorded in ``adopted`` and in the store (``adoptions/<name>/<v>.json``):
version, wall-clock time, the version's publication time, steps taken (``"7:delta"``), bytes
fetched, fetch/decode seconds, the pause. Example::

    sub = WeightSubscriber(store, EngineSink(engine), name="server-0").start()
"""

from __future__ import annotations

import json
import os
import socket
import tempfile
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

from shipyard.store.transfer import DEFAULT_CHUNK
from shipyard.store.types import Store
from shipyard.weights.feed import FeedFollower, Push
from shipyard.weights.leases import remove_record, write_record
from shipyard.weights.publisher import named_params
from shipyard.weights.types import ADOPTIONS_PREFIX
from shipyard.weights.versions import VersionReader, reach, read_latest


class WeightSink(Protocol):
    """What a subscriber keeps current (an inference engine)."""

    def live(self) -> Mapping[str, Any]:
        """The weights being served, by name (read, never written, by the subscriber)."""

    def version(self) -> int:
        """The version being served."""

    def stage(
        self, version: int, tensors: dict[str, Any], positions: Mapping[str, Any] | None = None
    ) -> float | None:
        """Swap ``tensors`` in as ``version``; return once served, with the pause in seconds.
        The tensors are not mutated by the caller until this returns. ``positions[name]`` (flat
        int64 indices, or None) says the live tensor differs from ``tensors[name]`` only there."""


class EngineSink:
    """An :class:`~shipyard.inference.engine.engine.EmbeddedEngine` as a sink: stages without copying
    and waits until the engine applied the update (at its next decode-step boundary).

    ``applies=False`` when another thread owns the engine's compute (a server's batcher, which applies
    staged weights when idle too): the sink then only waits, so no second thread runs the engine's
    multi-threaded kernels. A second OpenMP thread team on the same cores throttles every team's
    spin-wait and made the server's decode steps ~20% slower (docs/benchmarks.md, issue 39)."""

    def __init__(self, engine: Any, wait_s: float = 600.0, applies: bool = True) -> None:
        self.engine = engine
        self.wait_s = wait_s
        self.applies = applies

    def live(self) -> Mapping[str, Any]:
        return named_params(self.engine.model)

    def version(self) -> int:
        return int(self.engine.version)

    def stage(
        self, version: int, tensors: dict[str, Any], positions: Mapping[str, Any] | None = None
    ) -> float | None:
        n = len(self.engine.pauses)
        self.engine.stage_weights(version, tensors, copy=False, positions=positions)
        deadline = time.monotonic() + self.wait_s
        while self.engine.version != version:
            if not (self.applies and self.engine.apply_pending()):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"engine did not apply weights version {version} in {self.wait_s} s")
                time.sleep(0.002)
        return self.engine.pauses[n] if len(self.engine.pauses) > n else None


class WeightSubscriber:
    def __init__(
        self,
        store: Store,
        sink: WeightSink,
        name: str | None = None,
        poll_s: float = 0.5,
        cache_dir: str | Path | None = None,
        lease_ttl_s: float = 120.0,
        connections: int = 8,
        chunk_bytes: int = DEFAULT_CHUNK,
        workers: int = 2,
    ) -> None:
        self.store = store
        self.sink = sink
        self.name = name or f"{socket.gethostname()}-{os.getpid()}-{id(self):x}"
        self.poll_s = poll_s
        self.lease_ttl_s = lease_ttl_s
        self._tmp = None if cache_dir is not None else tempfile.TemporaryDirectory(prefix="shipyard-weights-")
        root = Path(cache_dir).expanduser() if cache_dir is not None else Path(self._tmp.name)  # type: ignore[union-attr]
        cache = root / self.name  # one directory per subscriber: servers may share cache_dir
        self.reader = VersionReader(store, cache, connections, chunk_bytes, workers)
        self.errors: list[str] = []
        self.adopted: list[dict[str, Any]] = []
        self._verified = False
        self._staging: dict[str, Any] | None = None
        self._staging_version: int | None = None
        self._beat = 0.0
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._push: Push | None = None
        self._follower: FeedFollower | None = None
        self._thread: threading.Thread | None = None

    @property
    def current(self) -> int:
        return self.sink.version()

    def poll_once(self) -> bool:
        """Adopt LATEST if it is newer (or the version a feed pushed, without reading LATEST);
        True when a new version is being served."""
        cur = self.sink.version()
        push, self._push = self._push, None
        if push is not None and push.version > cur:
            self.reader.provide(push.version, push.shards)  # verified against the manifest when used
            latest, hint = push.version, push.manifest
        else:
            latest, hint = read_latest(self.store, known=cur)
        if time.time() - self._beat > self.lease_ttl_s / 4:
            self._renew(cur)
        if latest is None or latest <= cur:
            return False
        t0 = time.perf_counter()
        fetched0 = self.reader.stats.bytes_fetched
        live = self.sink.live()
        if self._staging is None:
            self._staging = self._new_staging(live, hint)
            self._staging_version = cur
        # staging still equal to the live weights: decode in place, no copy of what did not change
        base = self._staging if self._staging_version == cur else live
        self._staging_version = None
        try:
            got = reach(self.reader, latest, cur, base, self._staging, self._verified, hint, pristine=live)
        except LookupError as e:
            self.errors.append(str(e))
            return False
        self.errors.extend(got.errors)
        ready = time.perf_counter()
        # where live and staging hold the same dtype they differ only at the path's positions (an
        # engine in another dtype holds rounded copies: it takes whole tensors)
        positions = {
            k: got.positions.get(k) if live[k].dtype == got.state[k].dtype else None for k in got.changed
        }
        pause = self.sink.stage(latest, {k: got.state[k] for k in got.changed}, positions)
        self._verified = True
        self._staging_version = latest if set(got.state) == set(live) else None
        manifest = self.reader.manifests.get(latest)
        event = {
            "version": latest,
            "from": cur,
            "at": time.time(),
            "published_at": manifest.created_at if manifest is not None else None,
            "path": [f"{s.version}:{s.encoding}" for s in got.path],
            "bytes": self.reader.stats.bytes_fetched - fetched0,
            "ready_s": ready - t0,
            "pause_s": pause,
            "changed_tensors": len(got.changed),
            "recovered": got.errors,
        }
        self.adopted.append(event)
        self.store.put(f"{ADOPTIONS_PREFIX}{self.name}/{latest:08d}.json", json.dumps(event).encode())
        self._renew(latest)
        self.reader.clear_cache(below=latest)
        return True

    @staticmethod
    def _new_staging(live: Mapping[str, Any], hint: Any) -> dict[str, Any]:
        """A host copy of the live weights in the published dtypes (a bf16 store may feed an fp32
        engine: decoding runs on the published bits, the engine converts when it applies; the codec
        decodes in place into CPU tensors, so a GPU engine's staging is on the CPU too)."""
        import torch

        dtypes = {k: getattr(torch, t.dtype) for k, t in hint.tensors.items()} if hint is not None else {}
        return {k: t.detach().to("cpu", dtypes.get(k, t.dtype), copy=True) for k, t in live.items()}

    def _renew(self, version: int) -> None:
        write_record(self.store, self.name, version, self.lease_ttl_s)
        self._beat = time.time()

    def start(self, feed_url: str | None = None) -> WeightSubscriber:
        """Poll in a background thread every ``poll_s``; with ``feed_url`` (the feed of the store's
        writer: a region's relay, or the trainer), also adopt each version the moment it is pushed."""
        if feed_url is not None:
            self._follower = FeedFollower(feed_url, after=self.sink.version, on_push=self._on_push).start()
        self._thread = threading.Thread(target=self._run, name="weight-subscriber", daemon=True)
        self._thread.start()
        return self

    def _on_push(self, push: Push) -> None:
        self._push = push
        self._wake.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self.poll_s)
            self._wake.clear()
            if self._stop.is_set():
                break
            try:
                self.poll_once()
            except (OSError, ValueError, TimeoutError) as e:  # store unreachable: keep serving, retry
                self.errors.append(f"poll: {e}")

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._follower is not None:
            self._follower.stop()
        if self._thread is not None:
            self._thread.join(timeout=30)
        try:
            remove_record(self.store, self.name)
        except OSError as e:  # the record then expires after lease_ttl_s
            self.errors.append(f"stop: {e}")
        if self._tmp is not None:
            self._tmp.cleanup()
