"""Publish weight versions: a snapshot every K versions, deltas between, manifest last.

Contract: :meth:`WeightPublisher.publish` codes the new state tensor by tensor against the
previous published version (its *parent*, kept by the publisher as one copy in the serving
dtype), packs the blobs into shards of at most ``shard_bytes`` and uploads them over
``connections`` threads while coding continues, then writes the manifest (the commit point),
then tells its :class:`~shipyard.weights.feed.VersionFeed` (if any), then moves
``weights/LATEST``, then collects garbage (:func:`shipyard.weights.leases.collect_garbage`).
Version ``v`` carries a delta when a parent exists and a snapshot when ``v % snapshot_every == 0``
or no parent exists (the first version, or a parent of another structure). A publisher that
starts on a store that already holds versions loads LATEST (verified) as its parent, so a
restarted trainer keeps publishing deltas. Publishing the same version again with the same
tensors rewrites identical bytes (the codec is deterministic; shard names carry their digest).

Memory: the parent copy, the caller's tensors, the coded blobs of the tensors in flight and the
shards waiting for upload (bounded by ``connections`` shards) - never a second full copy of the
model. Limits: versions must increase; tensors are moved to the CPU to be coded.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from shipyard.store.types import Store
from shipyard.weights.feed import VersionFeed
from shipyard.weights.types import (
    CODEC_DELTA,
    CODEC_SNAPSHOT,
    LATEST_KEY,
    Encoding,
    Manifest,
    ShardEntry,
    TensorEntry,
    latest_bytes,
    latest_head,
    manifest_key,
    shard_key,
    state_digest,
)


def named_params(model: Any) -> dict[str, Any]:
    """The model's parameters by name, tied parameters once (what a version holds)."""
    return {n: p.detach() for n, p in model.named_parameters()}


class _ShardWriter:
    """Packs blobs into shards and uploads full shards in the background (bounded in flight)."""

    def __init__(
        self,
        store: Store,
        version: int,
        prefix: str,
        shard_bytes: int,
        pool: ThreadPoolExecutor,
        slots: int,
        resume: bool = True,
        keep_max: int = 0,
    ) -> None:
        self.store, self.version, self.prefix, self.resume = store, version, prefix, resume
        self.keep_max = keep_max
        self.kept: dict[str, bytes] | None = {} if keep_max > 0 else None
        """The shards' bytes, kept for a feed while their total is at most ``keep_max``."""
        self.shard_bytes, self.pool = shard_bytes, pool
        self.shards: list[ShardEntry] = []
        self.ranges: dict[str, list[int]] = {}
        self._parts: list[bytes] = []
        self._size = 0
        self._inflight: list[Future] = []
        self._slots = threading.Semaphore(max(2, slots))

    def add(self, name: str, blob: bytes) -> None:
        if self._size and self._size + len(blob) > self.shard_bytes:
            self._flush()
        self.ranges[name] = [len(self.shards), self._size, len(blob)]
        self._parts.append(blob)
        self._size += len(blob)

    def _flush(self) -> None:
        data = b"".join(self._parts)
        self._parts, self._size = [], 0
        sha = hashlib.sha256(data).hexdigest()
        entry = ShardEntry(f"{self.prefix}-{len(self.shards):05d}-{sha[:16]}.bin", len(data), sha)
        self.shards.append(entry)
        if self.kept is not None:
            self.kept[entry.name] = data
            if sum(len(d) for d in self.kept.values()) > self.keep_max:
                self.kept = None
        key = shard_key(self.version, entry.name)
        self._slots.acquire()

        def put() -> None:
            try:
                if not (self.resume and self.store.exists(key) and self.store.size(key) == len(data)):
                    self.store.put(key, data)
            finally:
                self._slots.release()

        self._inflight.append(self.pool.submit(put))

    def finish(self, codec: str, parent: int | None) -> Encoding:
        if self._parts or not self.shards:
            self._flush()
        for fut in self._inflight:
            fut.result()
        return Encoding(codec, parent, self.shards, self.ranges)


class WeightPublisher:
    def __init__(
        self,
        store: Store,
        snapshot_every: int = 10,
        keep: int = 2,
        shard_bytes: int = 64 << 20,
        workers: int = 2,
        connections: int = 8,
        lease_ttl_s: float = 120.0,
        deltas: bool = True,
        dtype: Any | None = None,
        feed: VersionFeed | None = None,
    ) -> None:
        if keep < 1 or snapshot_every < 1 or shard_bytes < 1:
            raise ValueError(
                f"keep={keep}, snapshot_every={snapshot_every} and shard_bytes={shard_bytes} must be >= 1"
            )
        self.store = store
        self.snapshot_every = snapshot_every
        self.keep = keep
        self.shard_bytes = shard_bytes
        self.workers = workers
        self.connections = connections
        self.lease_ttl_s = lease_ttl_s
        self.deltas = deltas
        self.dtype = dtype
        """torch dtype versions are published in (the serving dtype); None keeps the tensors' own."""
        """False: every version is a full snapshot (the baseline that ships whole models)."""
        self.feed = feed
        """Told of every version once its manifest is written (just before LATEST moves), with the
        delta's shards when they fit its ``inline_max_bytes`` (followers need no store round trip)."""
        self._parent: dict[str, Any] | None = None
        self._parent_version: int | None = None
        self._indexes: dict[str, Any] = {}
        """Per tensor, the codec's MinorityIndex of the parent (advanced by every delta coded)."""
        self._resumed = False
        self._manifests: dict[int, Manifest] = {}
        self.announced_at = 0.0
        """Wall-clock time LATEST last moved (the version became visible to readers)."""
        self._last_published: int | None = None

    def has(self, version: int) -> bool:
        return self.store.exists(manifest_key(version))

    def publish(
        self, version: int, tensors: Mapping[str, Any], extra: dict[str, Any] | None = None
    ) -> Manifest:
        """Write ``version`` (see the module contract); returns its manifest."""
        delta = self.delta_ready(version, tensors)
        part = self.encode(
            version, tensors, delta=delta, snapshot=not delta or version % self.snapshot_every == 0
        )
        return self.commit(version, [part], extra)

    def delta_ready(self, version: int, tensors: Mapping[str, Any]) -> bool:
        """Whether ``version`` can be coded as a delta of these tensors against the kept parent."""
        self._resume_parent(version)
        if self._parent_version is not None and version <= self._parent_version:
            return False  # republishing an old version: no delta against a newer parent
        return self.deltas and self._fits(tensors)

    def encode(
        self, version: int, tensors: Mapping[str, Any], *, delta: bool, snapshot: bool, prefix: str = ""
    ) -> PublishedPart:
        """Code and upload ``tensors`` of ``version`` (a delta against the kept parent and/or a
        snapshot), shards named with ``prefix``; no manifest (:meth:`commit` writes it). A trainer
        rank encodes the tensors it owns this way, in parallel with the others."""
        assert delta or snapshot, "a version needs at least one encoding"
        assert not delta or self.delta_ready(version, tensors), "delta asked for without a fitting parent"
        try:
            return self._write(version, tensors, self._parent if delta else None, snapshot, prefix)
        except BaseException:
            self._parent, self._parent_version = None, None  # the parent copy may be half updated
            self._indexes = {}
            raise

    def commit(
        self, version: int, parts: list[PublishedPart], extra: dict[str, Any] | None = None
    ) -> Manifest:
        """Write the manifest naming every part's shards (the commit point), tell the feed, move
        LATEST, collect garbage; returns the manifest. Every part must carry the same encodings."""
        manifest, kept = _merge(version, parts, extra or {})
        if (
            kept is not None
            and self.feed is not None
            and sum(map(len, kept.values())) > self.feed.inline_max_bytes
        ):
            kept = None  # each part fit the inline limit, together they do not
        data = manifest.to_bytes()
        self.store.put(manifest_key(version), data)  # the commit point: the version exists
        if self.feed is not None:  # followers need no LATEST: they get the manifest itself
            self.feed.announce(manifest, data, kept)
        self.store.put(LATEST_KEY, latest_bytes(version, data, latest_head(manifest)))
        self.announced_at = time.time()
        self._last_published = max(version, self._last_published or version)
        self._manifests[version] = manifest
        from shipyard.weights.leases import collect_garbage

        collect_garbage(self.store, keep=self.keep, cache=self._manifests)
        return manifest

    def _resume_parent(self, version: int) -> None:
        """Load LATEST (verified) as the parent the first time, when it precedes ``version``."""
        if self._resumed:
            return
        self._resumed = True
        from shipyard.weights.versions import latest_version, load_version

        latest = latest_version(self.store)
        if latest is None or latest >= version:
            return
        try:
            self._parent, self._parent_version = load_version(self.store, latest, self.workers), latest
        except (FileNotFoundError, ValueError, LookupError):
            self._parent, self._parent_version = None, None

    def _fits(self, tensors: Mapping[str, Any]) -> bool:
        p = self._parent
        return (
            p is not None
            and set(tensors) <= set(p)
            and all(
                p[k].dtype == (self.dtype or t.dtype) and p[k].shape == t.shape for k, t in tensors.items()
            )
        )

    def _writers(
        self, version: int, delta: bool, snapshot: bool, up: ThreadPoolExecutor, prefix: str
    ) -> dict[str, _ShardWriter]:
        """One shard writer per encoding the version gets (``delta``, ``snapshot``)."""
        # shards of a version this publisher has not written yet may exist only from an earlier
        # process (killed mid-upload): only then is each looked up first, to skip re-sending it
        resume = self._last_published is None or version <= self._last_published
        keep = {"delta": self.feed.inline_max_bytes if self.feed is not None else 0, "snapshot": 0}
        return {
            kind: _ShardWriter(
                self.store,
                version,
                f"{prefix}{kind}",
                self.shard_bytes,
                up,
                self.connections,
                resume,
                keep[kind],
            )
            for kind, wanted in (("delta", delta), ("snapshot", snapshot))
            if wanted
        }

    def _write(
        self,
        version: int,
        tensors: Mapping[str, Any],
        parent: dict[str, Any] | None,
        with_snapshot: bool,
        prefix: str,
    ) -> PublishedPart:
        """Code and upload the tensors; the part (entries, encodings, the delta shards' bytes when they
        fit the feed's inline limit). The kept parent becomes exactly these tensors."""
        from shipyard.weights.codec import encode_delta, encode_snapshot
        from shipyard.weights.states import indexes_for, tensor_digest

        entries: dict[str, TensorEntry] = {}
        if parent is None:
            self._indexes = {}  # a new parent: indexes are built again by the next delta
        index = indexes_for(list(tensors), self._indexes)
        parent_version = self._parent_version if parent is not None else None
        new_parent: dict[str, Any] = {} if parent is None else {n: parent[n] for n in tensors}
        with ThreadPoolExecutor(self.connections, thread_name_prefix="weights-upload") as up:
            writers = self._writers(version, parent is not None, with_snapshot, up, prefix)

            def code(name: str) -> tuple[str, str, dict[str, bytes]]:
                t = tensors[name].detach().to("cpu", self.dtype).contiguous()
                blobs = {}
                if parent is not None:  # the parent copy becomes t: only changed elements are written
                    blobs["delta"] = encode_delta(parent[name], t, index[name], update_parent=True)
                else:
                    new_parent[name] = t.clone()
                if with_snapshot:
                    blobs["snapshot"] = encode_snapshot(t)
                digest = tensor_digest(t)
                return name, digest, blobs

            for name, digest, blobs in _ordered_map(code, list(tensors), self.workers):
                t = tensors[name]
                dtype = str(self.dtype or t.dtype).removeprefix("torch.")
                entries[name] = TensorEntry(dtype, list(t.shape), digest)
                for kind, blob in blobs.items():
                    writers[kind].add(name, blob)
            codecs = {"delta": CODEC_DELTA, "snapshot": CODEC_SNAPSHOT}
            parents = {"delta": parent_version, "snapshot": None}
            encodings = {k: w.finish(codecs[k], parents[k]) for k, w in writers.items()}
            kept = writers["delta"].kept if "delta" in writers else None
        self._parent, self._parent_version = new_parent, version
        return PublishedPart(entries, encodings, kept)


@dataclass
class PublishedPart:
    """What one encoder wrote of a version: its tensors' entries and encodings (shards + byte ranges)
    and, when they fit the feed's inline limit, its delta shards' bytes."""

    entries: dict[str, TensorEntry]
    encodings: dict[str, Encoding]
    kept: dict[str, bytes] | None


def _merge(
    version: int, parts: list[PublishedPart], extra: dict[str, Any]
) -> tuple[Manifest, dict[str, bytes] | None]:
    """One manifest over the parts (shard indexes of later parts shifted past earlier ones' shards)."""
    kinds = set(parts[0].encodings)
    assert all(set(p.encodings) == kinds for p in parts), "every part must carry the same encodings"
    entries: dict[str, TensorEntry] = {}
    encodings = {}
    for kind in sorted(kinds):
        shards: list[ShardEntry] = []
        ranges: dict[str, list[int]] = {}
        for p in parts:
            enc = p.encodings[kind]
            ranges.update({n: [i + len(shards), off, size] for n, (i, off, size) in enc.ranges.items()})
            shards += enc.shards
        first = parts[0].encodings[kind]
        encodings[kind] = Encoding(first.codec, first.parent, shards, ranges)
    for p in parts:
        assert not set(p.entries) & set(entries), "parts must not share a tensor"
        entries.update(p.entries)
    kept = None
    if all(p.kept is not None for p in parts):
        kept = {k: v for p in parts for k, v in (p.kept or {}).items()}
    manifest = Manifest(
        version=version,
        parent=encodings["delta"].parent if "delta" in encodings else None,
        tensors=entries,
        encodings=encodings,
        state_digest=state_digest({k: e.digest for k, e in entries.items()}),
        created_at=time.time(),
        extra=extra,
    )
    return manifest, kept


def _ordered_map(fn: Any, names: list[str], workers: int) -> Iterator[Any]:
    """``fn`` over ``names`` on ``workers`` threads, results in order, at most ``2 * workers`` in flight."""
    if workers <= 1:
        yield from (fn(n) for n in names)
        return
    with ThreadPoolExecutor(workers, thread_name_prefix="weights-encode") as pool:
        window: list[Future] = []
        for n in names:
            window.append(pool.submit(fn, n))
            if len(window) >= 2 * workers:
                yield window.pop(0).result()
        for fut in window:
            yield fut.result()
