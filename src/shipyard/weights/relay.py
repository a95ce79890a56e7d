"""Regional relay: pull each version once from the origin store, serve the region from a mirror.

Contract: :meth:`WeightRelay.sync_once` brings the mirror store (the region's object store or
directory, which the region's inference servers subscribe to) up to the origin's LATEST. It walks
the cheapest verified path from the version it holds (:func:`~shipyard.weights.versions.plan_path`)
and, per version on the path: fetches that encoding's shards from the origin once (resumable,
checked against their SHA-256) and copies them into the mirror; decodes them into its own copy of
the state and verifies every tensor; when the version also carries a snapshot it *rebuilds* the
snapshot shards from the decoded state (the codec is deterministic) and accepts them only if
their SHA-256 equals the origin manifest's, fetching them from the origin only on a mismatch;
then writes the origin's manifest and moves the mirror's LATEST. So after the first version only
deltas cross the long-haul link, and every byte in the mirror is verified.

The relay renews a subscriber record in the origin (so the origin keeps the deltas it needs) and
collects garbage in the mirror (the region's servers hold records there). :meth:`repair` scrubs
the mirror: a shard that is missing or fails its digest is rebuilt or fetched again.

Memory: one copy of the state, decoded in place; a step that fails to decode drops it and
reloads the mirror's LATEST (verified, local). ``stats`` counts bytes fetched from the origin, snapshots
rebuilt locally and snapshots that had to be fetched.
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shipyard.store.transfer import DEFAULT_CHUNK
from shipyard.store.types import Store
from shipyard.weights.feed import FeedFollower, Push, VersionFeed
from shipyard.weights.leases import collect_garbage, write_record
from shipyard.weights.types import (
    LATEST_KEY,
    LatestHead,
    Manifest,
    ShardEntry,
    latest_bytes,
    latest_head,
    latest_of,
    manifest_key,
    shard_key,
)
from shipyard.weights.versions import (
    HeadWatcher,
    VersionReader,
    latest_version,
    load_version,
    plan_steps,
    read_latest,
    read_manifests,
)


@dataclass
class RelayStats:
    versions: int = 0
    origin_bytes: int = 0
    snapshots_rebuilt: int = 0
    snapshots_fetched: int = 0
    repaired: int = 0


class WeightRelay:
    def __init__(
        self,
        origin: Store,
        mirror: Store,
        name: str = "relay",
        cache_dir: str | Path | None = None,
        connections: int = 8,
        chunk_bytes: int = DEFAULT_CHUNK,
        workers: int = 2,
        keep: int = 2,
        lease_ttl_s: float = 120.0,
        decode_nice: int = 10,
        feed: VersionFeed | None = None,
        feed_grace_s: float = 0.25,
    ) -> None:
        self.origin, self.mirror, self.name = origin, mirror, name
        self.reader = VersionReader(
            origin, Path(cache_dir) if cache_dir else None, connections, chunk_bytes, workers
        )
        self.reader.on_shard = self._copy_shard
        self.keep, self.lease_ttl_s = keep, lease_ttl_s
        self._decoder = ThreadPoolExecutor(
            1, thread_name_prefix="relay-decode", initializer=_lower_priority, initargs=(decode_nice,)
        )
        """Decodes versions already announced: background work, niced by ``decode_nice`` so that on a
        shared machine the region's servers (decoding the same version on the critical path) come
        first."""
        self.stats = RelayStats()
        self.errors: list[str] = []
        self.log: list[dict[str, Any]] = []
        """One record per mirrored version: version, encoding fetched, wall-clock times (``sync_at``
        it was noticed, ``fetched_at`` its shards were in, ``at`` announced, ``decoded_at``), origin
        bytes."""
        self.version: int | None = None
        self.state: dict[str, Any] | None = None
        self._digests: dict[str, str] = {}
        self._mirrored: dict[int, Manifest] = {}
        self._beat = 0.0
        self._announced_at = 0.0
        self._sync_at = 0.0
        self._loaded = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._watcher: HeadWatcher | None = None
        self.feed = feed
        """The region's feed: told of every version as soon as the mirror's LATEST moved (servers
        that follow it adopt without polling the mirror)."""
        self._follower: FeedFollower | None = None
        self._pushes: dict[int, Push] = {}
        self._pushed = threading.Condition()
        self.feed_grace_s = feed_grace_s
        """With a healthy origin feed, how long a version the poll saw first waits for its push
        (LATEST moves after the push is sent, so a poll can see it while the push is on the way)
        before it is fetched from the origin instead: one wait instead of a second copy."""

    def _copy_shard(self, version: int, shard: ShardEntry, data: bytes) -> None:
        self.mirror.put(shard_key(version, shard.name), data)

    def _load_mirror(self) -> None:
        """Start from the mirror's own LATEST (verified locally; costs no origin bytes)."""
        self._loaded = True
        v = latest_version(self.mirror)
        if v is None:
            return
        try:
            self.state, self.version = load_version(self.mirror, v, self.reader.workers), v
            self._digests = {}  # verified just now, but trust is earned by the next step's hashes
        except (FileNotFoundError, ValueError, LookupError) as e:
            self.errors.append(f"mirror version {v} unreadable, starting over: {e}")

    def sync_once(self, head: LatestHead | None = None) -> list[int]:
        """Mirror every version on the path to the origin's LATEST; returns the versions written.

        ``head``: LATEST's head line when the caller just read it (:class:`HeadWatcher`); when it
        names a delta against the version held, its shards are fetched in the same round trip as
        the manifest. When a feed pushed that version (:meth:`accept`), or pushes it within
        ``feed_grace_s`` of this call seeing it, its manifest and inline shards are used and no
        shard is fetched from the origin."""
        if not self._loaded:
            self._load_mirror()
        self._sync_at = time.time()
        push = self._take_push(head.version) if head is not None else None
        if push is not None and (self.version is None or push.version > self.version):
            self.reader.provide(push.version, push.shards)  # verified against the manifest when used
            target, hint = push.version, push.manifest
        elif head is not None and (self.version is None or head.version > self.version):
            if head.parent is not None and head.parent == self.version:
                self.reader.prefetch(head.version, head.shards)
            target, hint = read_latest(self.origin)
        elif head is not None:
            target, hint = head.version, None
        else:
            target, hint = read_latest(self.origin, known=self.version)
            push = self._take_push(target) if target is not None else None
            if push is not None:  # seen by this read, sent by the feed: its shards need no fetch
                self.reader.provide(push.version, push.shards)
                hint = push.manifest
        if time.time() - self._beat > self.lease_ttl_s / 4:
            self._renew(-1 if self.version is None else self.version)
        if target is None or target == self.version:
            return []
        if hint is not None:
            self.reader.manifests[target] = hint
        bad: set[tuple[int, str]] = set()
        written: list[int] = []
        while self.version != target:
            have = self.version if self.state is not None else None
            manifests, path = plan_steps(self.reader, have, target, bad)  # LookupError: nothing left
            for step in path:
                try:
                    self._step(manifests[step.version], step.encoding)
                except (FileNotFoundError, ValueError) as e:
                    self.errors.append(f"version {step.version} {step.encoding}: {e}")
                    bad.add((step.version, step.encoding))
                    break
                written.append(step.version)
        self.reader.drop_prefetched(below=target + 1)
        self._renew(target)
        collect_garbage(self.mirror, keep=self.keep, cache=self._mirrored)
        return written

    def _renew(self, version: int) -> None:
        write_record(self.origin, self.name, version, self.lease_ttl_s)
        self._beat = time.time()

    def _step(self, m: Manifest, encoding: str) -> None:
        """Mirror one version. Its shards are fetched (verified, copied to the mirror) first; a
        version without a snapshot is announced in the mirror at once and decoded after, off the
        region's critical path (its servers verify every tensor themselves); a snapshot version is
        announced once its snapshot was rebuilt from the decoded state."""
        before = self.reader.stats.bytes_fetched
        trusted = {} if self.version is None else self._digests
        self.reader.memo = {}
        try:
            for name in (encoding, *(e for e in m.encodings if e not in (encoding, "snapshot"))):
                for shard in m.encodings[name].shards:  # the step, and a delta beside a fetched snapshot
                    self.reader.shard(m.version, shard)
            fetched_at = time.time()
            early = "snapshot" not in m.encodings or encoding == "snapshot"
            previous = self.version
            if early:
                self._announce(m)
            try:
                args = (m, encoding, self.state, self.state, trusted)
                if early:  # announced already: decoding is background work
                    self.state = self._decoder.submit(self.reader.apply, *args).result()
                else:
                    self.state = self.reader.apply(*args)
            except (FileNotFoundError, ValueError):
                self.state, self.version = None, None
                if early:
                    self._retract(m, previous)
                self._load_mirror()  # the state was decoded in place: start again from the mirror
                raise
            if not early:
                self._rebuild_snapshot(m, self.state)
                self._announce(m)
        finally:
            self.reader.memo = None
        self.version, self._digests = m.version, {k: t.digest for k, t in m.tensors.items()}
        fetched = self.reader.stats.bytes_fetched - before
        self.stats.versions += 1
        self.stats.origin_bytes += fetched
        self.log.append(
            {
                "version": m.version,
                "encoding": encoding,
                "at": self._announced_at,
                "bytes": fetched,
                "sync_at": self._sync_at,
                "fetched_at": fetched_at,
                "decoded_at": time.time(),
            }
        )

    def _announce(self, m: Manifest) -> None:
        data = m.to_bytes()
        self.mirror.put(manifest_key(m.version), data)
        self.mirror.put(LATEST_KEY, latest_bytes(m.version, data, latest_head(m)))
        self._mirrored[m.version] = m
        self._announced_at = time.time()
        if self.feed is not None:
            delta, memo = m.encodings.get("delta"), self.reader.memo or {}
            names = [s.name for s in delta.shards] if delta is not None else []
            shards = {n: memo[(m.version, n)] for n in names if (m.version, n) in memo}
            self.feed.announce(m, data, shards if len(shards) == len(names) else None)

    def accept(self, push: Push) -> None:
        """A version the origin's feed pushed: :meth:`sync_once` for its head uses it."""
        with self._pushed:
            if self.version is None or push.version > self.version:
                self._pushes = {v: p for v, p in self._pushes.items() if v > push.version - 4}
                self._pushes[push.version] = push
                self._pushed.notify_all()

    def _take_push(self, version: int) -> Push | None:
        """The push of ``version``; when it is not in yet but the feed is healthy and the version
        is new, wait up to ``feed_grace_s`` for it (the poll that saw it may have overtaken it)."""
        wait = self._follower is not None and self._follower.healthy and self.feed_grace_s > 0
        with self._pushed:
            if wait and (self.version is None or version > self.version):
                self._pushed.wait_for(lambda: version in self._pushes, timeout=self.feed_grace_s)
            return self._pushes.pop(version, None)

    def on_push(self, push: Push) -> None:
        """A feed follower's callback: accept the push and wake the thread :meth:`start` runs."""
        self.accept(push)
        if self._watcher is not None:
            self._watcher.offer(latest_head(push.manifest))

    def _retract(self, m: Manifest, previous: int | None) -> None:
        """Undo an announcement whose version failed to decode."""
        self.mirror.delete(manifest_key(m.version))
        self._mirrored.pop(m.version, None)
        if previous is not None and previous in self._mirrored:
            prev = self._mirrored[previous]
            self.mirror.put(LATEST_KEY, latest_of(prev))
        else:
            self.mirror.delete(LATEST_KEY)

    def _rebuild_snapshot(self, m: Manifest, state: dict[str, Any]) -> None:
        """Encode the snapshot shards locally; fetch from the origin only those that differ."""
        from shipyard.weights.codec import encode_snapshot

        enc = m.encodings["snapshot"]
        members: dict[int, list[tuple[int, str]]] = {}
        for name, (idx, offset, _length) in enc.ranges.items():
            members.setdefault(idx, []).append((offset, name))
        for idx, shard in enumerate(enc.shards):
            data = b"".join(encode_snapshot(state[name]) for _, name in sorted(members.get(idx, [])))
            if hashlib.sha256(data).hexdigest() == shard.sha256:
                self.mirror.put(shard_key(m.version, shard.name), data)
                self.stats.snapshots_rebuilt += 1
            else:
                self.errors.append(f"version {m.version}: rebuilt {shard.name} differs; fetching it")
                self.reader.shard(m.version, shard)
                self.stats.snapshots_fetched += 1

    def repair(self) -> list[str]:
        """Check every mirrored shard's digest; fetch again from the origin (or rebuild) the bad ones."""
        repaired = []
        for v, m in read_manifests(self.mirror).items():
            for encoding, enc in m.encodings.items():
                for shard in enc.shards:
                    key = shard_key(v, shard.name)
                    try:
                        ok = hashlib.sha256(self.mirror.get(key)).hexdigest() == shard.sha256
                    except FileNotFoundError:
                        ok = False
                    if ok:
                        continue
                    try:
                        if encoding == "snapshot" and v == self.version and self.state is not None:
                            self._rebuild_snapshot(m, self.state)
                        else:
                            self.reader.shard(v, shard)
                    except (FileNotFoundError, ValueError) as e:  # gone from the origin too
                        self.errors.append(f"repair {key}: {e}")
                        continue
                    repaired.append(key)
        self.stats.repaired += len(repaired)
        return repaired

    def start(
        self,
        poll_s: float = 0.5,
        feed_url: str | None = None,
        follower: FeedFollower | None = None,
        progress: Callable[[], None] | None = None,
    ) -> WeightRelay:
        """Follow the origin in a background thread: LATEST's head is read every ``poll_s``
        (reads overlap when the round trip is longer, see :class:`HeadWatcher`), and a new
        version is mirrored as soon as one read shows it, or as soon as the origin's feed at
        ``feed_url`` pushes it. ``follower``: a follower the caller made instead (calling
        :meth:`on_push`; the relay starts and stops it). ``progress`` is called after every round
        (a look at the head, and the sync it led to), for a watchdog."""
        self._watcher = HeadWatcher(self.origin, poll_s).start()
        if feed_url is not None and follower is None:
            follower = FeedFollower(feed_url, after=lambda: self.version, on_push=self.on_push)
        if follower is not None:
            self._follower = follower.start()

        def run() -> None:
            while not self._stop.is_set():
                head = self._watcher.wait_newer(self.version, timeout_s=max(1.0, poll_s))
                if self._stop.is_set():
                    break
                try:
                    mirrored = self.sync_once(head)
                except (OSError, ValueError, LookupError) as e:
                    self.errors.append(f"sync: {e}")
                    self._stop.wait(poll_s)
                    continue
                if head is not None and not mirrored:  # a head we cannot reach (LATEST went back): no spin
                    self._stop.wait(poll_s)
                if progress is not None:
                    progress()

        self._thread = threading.Thread(target=run, name="weight-relay", daemon=True)
        self._thread.start()
        return self

    def alive(self) -> bool:
        """Whether the background thread of :meth:`start` is still following the origin."""
        return self._thread is not None and self._thread.is_alive()

    def stop(self) -> None:
        self._stop.set()
        if self._follower is not None:
            self._follower.stop()
        if self._watcher is not None:
            self._watcher.stop()
        if self._thread is not None:
            self._thread.join(timeout=60)
        self._decoder.shutdown(wait=False)


def _lower_priority(nice: int) -> None:
    """Raise this thread's nice value by ``nice`` (Linux: threads are scheduled on their own and
    threads they start inherit it); a no-op where that is not possible."""
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + nice))
    except (AttributeError, OSError):
        pass


def _relay_for(cfg: Any) -> tuple[WeightRelay, VersionFeed | None]:
    """The relay of ``cfg``: the run ``run.name`` of the origin store into its region's mirror (stamped
    with the run's identity), serving its own feed when ``relay.feed_port`` is set."""
    from shipyard.store.run import mirror_run, open_run

    w, r = cfg.weights, cfg.relay
    origin = open_run(cfg.store, cfg.run.name)  # the run named run.name, and only it
    feed = None
    if r.feed_port is not None:  # the region's servers follow it (their `weights.follow_url`)
        feed = VersionFeed(w.feed_host, r.feed_port, int(w.feed_inline_mb * (1 << 20))).start()
    relay = WeightRelay(
        origin,
        mirror_run(r.mirror, origin.identity),
        name=f"relay-{r.region}",
        cache_dir=Path(w.cache_dir).expanduser() / f"relay-{r.region}" if w.cache_dir else None,
        connections=cfg.store.connections,
        chunk_bytes=int(cfg.store.part_mb * (1 << 20)),
        feed_grace_s=r.feed_grace_s,
        workers=w.workers,
        keep=w.keep,
        lease_ttl_s=w.lease_ttl_s,
        feed=feed,
    )
    return relay, feed


def run_relay(
    cfg: Any,
    max_s: float | None = None,
    stop: threading.Event | None = None,
    progress: Callable[[], None] | None = None,
) -> WeightRelay:
    """``shipyard relay CONFIG``: mirror ``cfg.store`` (origin) into ``cfg.relay.mirror`` until
    interrupted (or for ``max_s`` seconds, or until ``stop`` is set), printing each version as it lands;
    ``progress`` as in :meth:`WeightRelay.start`."""
    from rich.console import Console

    console = Console()
    r = cfg.relay
    relay, feed = _relay_for(cfg)
    console.print(f"relay {r.region}: {relay.origin.where} -> {relay.mirror.where} (Ctrl-C stops)")
    if feed is not None:
        console.print(f"region feed at {feed.url}")
    t_end = None if max_s is None else time.monotonic() + max_s
    shown = errors = 0
    try:
        try:  # one sync at least, however short ``max_s``
            relay.sync_once()
        except (OSError, ValueError, LookupError) as e:
            console.print(f"[yellow]sync failed, retrying: {e}")
        relay.start(r.poll_s, r.feed_url, progress=progress)
        while True:
            for rec in relay.log[shown:]:
                console.print(
                    f"version {rec['version']} mirrored ({relay.stats.origin_bytes} origin bytes so far)"
                )
            shown = len(relay.log)
            for err in relay.errors[errors:]:
                console.print(f"[yellow]{err}")
            errors = len(relay.errors)
            if not relay.alive():  # an error it cannot retry: exit, so a supervisor starts it again
                raise RuntimeError(
                    f"relay {r.region}: its sync thread died; last errors: {relay.errors[-3:]}"
                )
            if (t_end is not None and time.monotonic() >= t_end) or (stop is not None and stop.is_set()):
                break
            time.sleep(0.05)
    except KeyboardInterrupt:
        pass
    finally:
        relay.stop()
        if feed is not None:
            feed.close()
    return relay
