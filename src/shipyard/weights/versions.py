"""Read published weight versions: list them, plan the cheapest verified path, fetch and decode.

Contract:
- :func:`plan_path` picks, from the version a reader holds (or none), the sequence of encodings
  that reaches ``target`` with the fewest bytes: a newer snapshot, a chain of deltas, or a
  snapshot followed by deltas (a shortest path over the versions' parent links; edges known to be
  bad are skipped).
- :class:`VersionReader` fetches an encoding's shards (each checked against its SHA-256; through a
  resumable download cache when ``cache_dir`` is set, else parallel ranged GETs into memory),
  decodes every tensor (in ``workers`` threads) into ``out`` and checks each decoded tensor's
  digest and the state digest. Any mismatch raises ``ValueError`` naming version, tensor or shard.
- :func:`reach` follows the plan and recovers: a missing object or digest mismatch marks that
  edge bad, the plan is recomputed from the same base (``out`` is scratch until it returns), and
  the error is recorded; it gives up (``LookupError``) when no path is left.
- :func:`load_version` is ``reach`` from nothing into fresh tensors.

Limits: ``out`` must be distinct from ``base`` (the base stays intact for a retry); tensors are
CPU tensors. A tensor whose delta changes nothing and whose parent was verified is trusted
without re-hashing (``trusted_base``), which keeps a step's cost proportional to what changed.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shipyard.store.transfer import DEFAULT_CHUNK, download, fetch_bytes
from shipyard.store.types import Store
from shipyard.weights.types import (
    LATEST_HEAD_BYTES,
    LATEST_KEY,
    WEIGHTS_PREFIX,
    Encoding,
    LatestHead,
    Manifest,
    ShardEntry,
    manifest_key,
    parse_latest,
    shard_key,
    state_digest,
)


def read_head(store: Store) -> LatestHead | None:
    """LATEST's head line (None before any version): one GET of at most ``LATEST_HEAD_BYTES``."""
    try:
        data = store.get_range(LATEST_KEY, 0, LATEST_HEAD_BYTES)
    except FileNotFoundError:
        return None
    line, newline, _ = data.partition(b"\n")
    if not newline and len(data) == LATEST_HEAD_BYTES:
        raise ValueError(f"weights/LATEST: no head line in its first {LATEST_HEAD_BYTES} bytes")
    return LatestHead.parse(line)


def read_latest(store: Store, known: int | None = None) -> tuple[int | None, Manifest | None]:
    """LATEST's version and the copy of its manifest ((None, None) before any version). With
    ``known``, a poll first reads only LATEST's head line and fetches the manifest copy only
    when the version is newer than ``known`` (polls stay small however large the model)."""
    try:
        if known is not None:
            head = read_head(store)
            if head is None:
                return None, None
            if head.version <= known:
                return head.version, None
        return parse_latest(store.get(LATEST_KEY))
    except FileNotFoundError:
        return None, None


class HeadWatcher:
    """Polls LATEST's head every ``poll_s`` with up to ``in_flight`` reads overlapping, so a long
    round trip does not stretch the interval at which a new version is noticed (a read that takes
    one RTT is started every ``poll_s`` all the same). :meth:`wait_newer` returns the newest head
    seen once it is newer than a version. Costs one small GET per ``poll_s``."""

    def __init__(self, store: Store, poll_s: float, in_flight: int = 8) -> None:
        self.store, self.poll_s = store, poll_s
        self.head: LatestHead | None = None
        self.errors: list[str] = []
        self._cond = threading.Condition()
        self._slots = threading.Semaphore(in_flight)
        self._stop = threading.Event()
        self._pool = ThreadPoolExecutor(max_workers=in_flight, thread_name_prefix="latest-poll")
        self._thread = threading.Thread(target=self._tick, name="latest-watch", daemon=True)

    def start(self) -> HeadWatcher:
        self._thread.start()
        return self

    def _tick(self) -> None:
        while not self._stop.is_set():
            if self._slots.acquire(blocking=False):
                self._pool.submit(self._read)
            self._stop.wait(self.poll_s)

    def _read(self) -> None:
        try:
            head = read_head(self.store)
        except Exception as e:  # unreachable, mid-rewrite or a store failure: recorded, the next read retries
            self.errors = [*self.errors[-9:], f"{type(e).__name__}: {e}"]
            head = None
        finally:
            self._slots.release()
        if head is not None:
            self.offer(head)

    def offer(self, head: LatestHead) -> None:
        """A head learned another way (a feed's push): wakes ``wait_newer`` like a poll would."""
        with self._cond:
            if self.head is None or head.version > self.head.version:
                self.head = head
                self._cond.notify_all()

    def wait_newer(self, than: int | None, timeout_s: float) -> LatestHead | None:
        """The newest head once its version exceeds ``than`` (None: any), or None after ``timeout_s``."""

        def newer() -> bool:
            return self.head is not None and (than is None or self.head.version > than)

        with self._cond:
            self._cond.wait_for(lambda: newer() or self._stop.is_set(), timeout_s)
            return self.head if newer() else None

    def stop(self) -> None:
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
        self._thread.join(timeout=10)
        self._pool.shutdown(wait=False, cancel_futures=True)


def latest_version(store: Store) -> int | None:
    return read_latest(store)[0]


def published_versions(store: Store) -> list[int]:
    out = set()
    for key in store.list(WEIGHTS_PREFIX):
        parts = key.split("/")
        if len(parts) == 3 and parts[2] == "manifest.json" and parts[1].isdigit():
            out.add(int(parts[1]))
    return sorted(out)


def read_manifest(store: Store, version: int) -> Manifest:
    return Manifest.from_bytes(store.get(manifest_key(version)), version)


def read_manifests(
    store: Store, upto: int | None = None, cache: dict[int, Manifest] | None = None, connections: int = 8
) -> dict[int, Manifest]:
    """Every readable manifest (up to ``upto``); ones deleted or unreadable meanwhile are left out.
    Manifests never change once written, so those in ``cache`` are not fetched again (missing ones
    are fetched ``connections`` at a time and added; deleted ones are dropped from it)."""
    listed = [v for v in published_versions(store) if upto is None or v <= upto]
    cache = {} if cache is None else cache
    for v in [v for v in cache if v not in listed and (upto is None or v <= upto)]:
        del cache[v]

    def one(v: int) -> None:
        try:
            cache[v] = read_manifest(store, v)
        except (FileNotFoundError, ValueError):
            return

    todo = [v for v in listed if v not in cache]
    if len(todo) > 1:
        with ThreadPoolExecutor(
            max_workers=min(connections, len(todo)), thread_name_prefix="manifests"
        ) as pool:
            list(pool.map(one, todo))
    else:
        for v in todo:
            one(v)
    return {v: cache[v] for v in listed if v in cache}


@dataclass(frozen=True)
class Step:
    """Apply ``encoding`` of ``version`` (``nbytes`` to fetch)."""

    version: int
    encoding: str
    nbytes: int


def plan_path(
    manifests: Mapping[int, Manifest],
    have: int | None,
    target: int,
    bad: set[tuple[int, str]] | frozenset[tuple[int, str]] = frozenset(),
) -> list[Step]:
    """Cheapest sequence of steps from ``have`` (None: nothing) to ``target``; ``LookupError`` if none."""
    if have == target:
        return []
    cost: dict[int, tuple[int, Step | None]] = {} if have is None else {have: (0, None)}
    for v in sorted(x for x in manifests if x <= target and x != have):
        best: tuple[int, Step] | None = None
        for name, enc in manifests[v].encodings.items():
            if (v, name) in bad:
                continue
            if name == "snapshot":
                base = 0
            elif enc.parent in cost:
                base = cost[enc.parent][0]
            else:
                continue
            if best is None or base + enc.nbytes < best[0]:
                best = (base + enc.nbytes, Step(v, name, enc.nbytes))
        if best is not None:
            cost[v] = best
    if target not in cost:
        raise LookupError(
            f"no verified path to weights version {target} from {have} (bad edges: {sorted(bad)})"
        )
    path: list[Step] = []
    v: int | None = target
    while v is not None and v != have:
        step = cost[v][1]
        assert step is not None, "only the start node has no step"
        path.append(step)
        enc = manifests[v].encodings[step.encoding]
        v = None if step.encoding == "snapshot" else enc.parent
    return path[::-1]


@dataclass
class ReadStats:
    """Bytes fetched (new, and found in the resumable cache) and seconds spent, per reader."""

    bytes_fetched: int = 0
    shards: int = 0
    fetch_s: float = 0.0
    decode_s: float = 0.0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)


class VersionReader:
    """Fetch and decode versions from one store (see the module contract)."""

    def __init__(
        self,
        store: Store,
        cache_dir: Path | None = None,
        connections: int = 8,
        chunk_bytes: int = DEFAULT_CHUNK,
        workers: int = 2,
    ) -> None:
        self.store = store
        self.cache_dir = cache_dir
        self.connections = connections
        self.chunk_bytes = chunk_bytes
        self.workers = workers
        self.stats = ReadStats()
        self.manifests: dict[int, Manifest] = {}
        self.memo: dict[tuple[int, str], bytes] | None = None
        """When set, shards fetched are kept here and served from it (a relay reads a step twice)."""
        """Manifests seen so far (immutable once written), so a poll costs LATEST and the shards."""
        self.on_shard: Callable[[int, ShardEntry, bytes], None] | None = None
        """Called with every verified shard (a relay copies it into its mirror)."""
        self.indexes: dict[str, Any] = {}
        """Per tensor, the :class:`~shipyard.weights.order.MinorityIndex` of the last state this
        reader decoded (version ``index_version``): the next delta against it skips a pass."""
        self.index_version: int | None = None
        self._prefetched: dict[tuple[int, str], Future[bytes]] = {}
        self._prefetch_pool: ThreadPoolExecutor | None = None

    def prefetch(self, version: int, shards: Sequence[tuple[str, int]]) -> None:
        """Start fetching shards (name, size) of ``version`` in the background, before their
        manifest is known; :meth:`shard` verifies them against it and refetches on a mismatch."""
        if self._prefetch_pool is None:
            self._prefetch_pool = ThreadPoolExecutor(self.connections, thread_name_prefix="prefetch")
        for name, size in shards:
            if (version, name) not in self._prefetched:
                key = shard_key(version, name)
                self._prefetched[(version, name)] = self._prefetch_pool.submit(
                    fetch_bytes, self.store, key, size, self.connections, self.chunk_bytes
                )

    def provide(self, version: int, shards: Mapping[str, bytes]) -> None:
        """Shards of ``version`` that arrived another way (a feed's push): :meth:`shard` takes them
        like prefetched ones, verified against the manifest (a mismatch is fetched again)."""
        for name, data in shards.items():
            done: Future[bytes] = Future()
            done.set_result(data)
            self._prefetched[(version, name)] = done

    def drop_prefetched(self, below: int) -> None:
        """Forget prefetched shards of versions older than ``below``."""
        for key in [k for k in self._prefetched if k[0] < below]:
            self._prefetched.pop(key).cancel()

    def _take_prefetched(self, version: int, shard: ShardEntry) -> bytes | None:
        fut = self._prefetched.pop((version, shard.name), None)
        if fut is None:
            return None
        try:
            data = fut.result()
        except (OSError, ValueError):
            return None
        with self.stats.lock:
            self.stats.bytes_fetched += len(data)
        return data if len(data) == shard.size and _sha256(data) == shard.sha256 else None

    def shard(self, version: int, shard: ShardEntry) -> bytes:
        """The verified bytes of one shard."""
        key = shard_key(version, shard.name)
        if self.memo is not None and (version, shard.name) in self.memo:
            return self.memo[(version, shard.name)]
        t0 = time.perf_counter()
        if (data := self._take_prefetched(version, shard)) is not None:
            fetched = 0  # counted when taken
        elif self.cache_dir is not None:
            dest = self.cache_dir / f"{version:08d}" / shard.name
            rep = download(
                self.store, key, dest, shard.sha256, shard.size, self.connections, self.chunk_bytes
            )
            data, fetched = dest.read_bytes(), rep.bytes_fetched
        else:
            data = fetch_bytes(self.store, key, shard.size, self.connections, self.chunk_bytes)
            fetched = len(data)
            got = _sha256(data)
            if got != shard.sha256:
                raise ValueError(
                    f"store object {key!r}: sha256 {got[:12]} != expected {shard.sha256[:12]} (corrupted)"
                )
        with self.stats.lock:
            self.stats.bytes_fetched += fetched
            self.stats.shards += 1
            self.stats.fetch_s += time.perf_counter() - t0
        if self.on_shard is not None:
            self.on_shard(version, shard, data)
        if self.memo is not None:
            self.memo[(version, shard.name)] = data
        return data

    def apply(
        self,
        manifest: Manifest,
        encoding: str,
        base: Mapping[str, Any] | None,
        out: dict[str, Any] | None,
        base_digests: Mapping[str, str] | None = None,
        positions: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """Decode ``encoding`` of ``manifest`` (deltas against ``base``) into ``out`` (None: new
        tensors); every tensor verified. Returns the decoded state by name. ``positions``, when
        given, receives each tensor's changed flat indices (None for a snapshot: all of it)."""
        enc = manifest.encodings[encoding]
        names = set(manifest.tensors)
        if set(enc.ranges) != names or (encoding == "delta" and (base is None or set(base) != names)):
            raise ValueError(f"weights version {manifest.version}: {encoding} does not cover its tensors")
        if state_digest({k: t.digest for k, t in manifest.tensors.items()}) != manifest.state_digest:
            raise ValueError(
                f"weights version {manifest.version}: tensor digests do not give the state digest"
            )
        if encoding != "delta" or self.index_version != enc.parent:
            self.indexes.clear()  # they describe another state than this step's base
        self.index_version = None
        result: dict[str, Any] = {}
        try:
            for idx, shard in enumerate(enc.shards):
                data = self.shard(manifest.version, shard)
                members = [n for n, r in enc.ranges.items() if r[0] == idx]
                t0 = time.perf_counter()
                result.update(
                    _decode_many(
                        manifest,
                        enc,
                        encoding,
                        data,
                        members,
                        base,
                        out,
                        base_digests or {},
                        self.workers,
                        self.indexes,
                        positions,
                    )
                )
                with self.stats.lock:
                    self.stats.decode_s += time.perf_counter() - t0
        except BaseException:
            self.indexes.clear()
            raise
        self.index_version = manifest.version
        return result

    def clear_cache(self, below: int) -> None:
        """Drop cached shards of versions older than ``below``."""
        if self.cache_dir is None or not self.cache_dir.is_dir():
            return
        for d in self.cache_dir.iterdir():
            if d.name.isdigit() and int(d.name) < below:
                for f in d.iterdir():
                    f.unlink(missing_ok=True)
                d.rmdir()


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _decode_many(
    manifest: Manifest,
    enc: Encoding,
    encoding: str,
    data: bytes,
    members: list[str],
    base: Mapping[str, Any] | None,
    out: dict[str, Any] | None,
    base_digests: Mapping[str, str],
    workers: int,
    indexes: dict[str, Any],
    positions: dict[str, Any] | None,
) -> dict[str, Any]:
    from shipyard.weights.codec import apply_delta, decode_snapshot
    from shipyard.weights.states import digest_matches, indexes_for

    index = indexes_for(members, indexes)

    view = memoryview(data)

    def one(name: str) -> tuple[str, Any]:
        _, offset, length = enc.ranges[name]
        blob = bytes(view[offset : offset + length])
        entry = manifest.tensors[name]
        target = None if out is None else out[name]
        if encoding == "delta":
            assert base is not None
            t, changed = apply_delta(base[name], blob, out=target, index=index[name])
            if positions is not None:
                positions[name] = changed
            if changed.size == 0 and base_digests.get(name) == entry.digest:
                return name, t  # the verified parent, copied bit for bit
        else:
            if positions is not None:
                positions[name] = None
            t = decode_snapshot(blob)
            if target is not None:
                target.copy_(t)
                t = target
        if list(t.shape) != entry.shape or str(t.dtype).removeprefix("torch.") != entry.dtype:
            raise ValueError(
                f"weights version {manifest.version} tensor {name!r}: decoded {t.dtype} {tuple(t.shape)}"
            )
        if not digest_matches(t, entry.digest):
            raise ValueError(
                f"weights version {manifest.version} tensor {name!r}: digest mismatch after {encoding}"
            )
        return name, t

    if workers == 1 or len(members) < 2:
        return dict(one(n) for n in members)
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="weights-decode") as pool:
        return dict(pool.map(one, members))


@dataclass
class Reached:
    """Outcome of :func:`reach`: the state, the steps taken, errors recovered from."""

    state: dict[str, Any]
    path: list[Step]
    errors: list[str]
    changed: set[str]
    positions: dict[str, Any]
    """Per tensor, the flat indices where the result differs from the base (int64 array), or None
    where the whole tensor must be taken (a snapshot step, or no base)."""


def _merge_positions(acc: dict[str, Any], step: dict[str, Any]) -> None:
    """Fold one step's changed positions into those of the path so far (None: all)."""
    import numpy as np

    for name, pos in step.items():
        if name not in acc:
            acc[name] = pos
        elif acc[name] is None or pos is None:
            acc[name] = None
        else:
            acc[name] = np.union1d(acc[name], pos)


def reach(
    reader: VersionReader,
    target: int,
    base_version: int | None,
    base: Mapping[str, Any] | None,
    out: dict[str, Any] | None,
    trusted_base: bool = False,
    hint: Manifest | None = None,
    pristine: Mapping[str, Any] | None = None,
) -> Reached:
    """Bring ``base`` (at ``base_version``) to ``target`` along the cheapest path, recovering from
    bad edges; see the module contract. ``out`` receives the result (None: fresh tensors);
    ``hint`` is the target's manifest when the caller has it (the copy in LATEST). ``out`` may be
    ``base`` itself (decode in place, no copy of the untouched elements) when ``pristine`` holds
    the same version elsewhere: after a failure the retry starts from ``pristine``."""
    bad: set[tuple[int, str]] = set()
    errors: list[str] = []
    if hint is not None and hint.version == target:
        reader.manifests[target] = hint
    while True:
        have = base_version if base is not None else None
        manifests, path = plan_steps(reader, have, target, bad)
        base_digests = (
            {k: t.digest for k, t in manifests[have].tensors.items()}
            if trusted_base and have in manifests
            else {}
        )
        state: Mapping[str, Any] | None = base
        step = None
        positions: dict[str, Any] = {}
        try:
            for step in path:
                m = manifests[step.version]
                step_positions: dict[str, Any] = {}
                state = reader.apply(m, step.encoding, state, out, base_digests, step_positions)
                _merge_positions(positions, step_positions)
                base_digests = {k: t.digest for k, t in m.tensors.items()}
                if out is None:
                    out = dict(state)
            final = manifests[target]
            prev = manifests.get(have) if have is not None else None
            if prev is None or not path or path[0].encoding == "snapshot":
                changed = set(final.tensors)  # the base was not used: every tensor is new
            else:
                changed = {k for k, t in final.tensors.items() if prev.tensors.get(k, t).digest != t.digest}
            return Reached(dict(state or {}), path, errors, changed, positions)
        except (FileNotFoundError, ValueError) as e:
            assert step is not None
            errors.append(f"version {step.version} {step.encoding}: {e}")
            bad.add((step.version, step.encoding))
            if base is out and base is not None:
                if pristine is None:
                    raise ValueError(
                        f"{errors[-1]}; the base was decoded in place and cannot be retried"
                    ) from e
                base = pristine


def plan_steps(
    reader: VersionReader, have: int | None, target: int, bad: set[tuple[int, str]]
) -> tuple[dict[int, Manifest], list[Step]]:
    """Manifests and the cheapest path. A reader that follows every version knows the one or two
    deltas it needs from manifests it has seen, so it plans without listing the store; otherwise
    (or after a failure) it lists and fetches the manifests it lacks. ``LookupError`` if no path."""
    if not bad:
        known = {v: m for v, m in reader.manifests.items() if v <= target}
        try:
            path = plan_path(known, have, target)
            if len(path) <= 2 and all(s.encoding == "delta" for s in path):
                return known, path
        except LookupError:
            pass
    manifests = read_manifests(reader.store, target, reader.manifests, reader.connections)
    return manifests, plan_path(manifests, have, target, bad)


def load_version(store: Store, version: int, workers: int = 2) -> dict[str, Any]:
    """Tensors of ``version``, verified (snapshot plus deltas as the cheapest path needs)."""
    return reach(VersionReader(store, workers=workers), version, None, None, None).state


__all__ = [
    "Reached",
    "Step",
    "VersionReader",
    "latest_version",
    "load_version",
    "plan_path",
    "published_versions",
    "read_manifest",
    "read_latest",
    "read_manifests",
    "reach",
]
