"""Records of published weight versions: the store layout of snapshots and deltas.

Layout (keys in the store)::

    weights/<v:08d>/manifest.json           written last: the version exists once this does
    weights/<v:08d>/<encoding>-<i:05d>-<sha16>.bin   shards: coded tensors, back to back
    weights/LATEST                          head line: the newest version, its delta's parent and
                                            shards; then a copy of its manifest (one GET of the
                                            head tells a poller what to fetch; see LatestHead)
    weights/subscribers/<name>.json         a subscriber's adopted version and heartbeat
    adoptions/<name>/<v:08d>.json           one record per version a subscriber adopted: when, how
                                            (path, bytes, seconds, pause), and the version's
                                            publication time (what ``shipyard view`` charts)

A *version* is an integer training step (0 = the base model). Its manifest lists every tensor
(dtype, shape, digest of the decoded tensor), the digest of the whole state, the parent version,
and one or two *encodings*: ``delta`` (every tensor coded against the parent version with
:func:`~shipyard.weights.codec.encode_delta`) and/or ``snapshot`` (every tensor self-contained,
:func:`~shipyard.weights.codec.encode_snapshot`). An encoding names its codec, its shards (name,
size, SHA-256) and, per tensor, the byte range ``[shard, offset, length]`` of its blob. Shard
names carry their digest, so a shard is never overwritten with other bytes.

Readers never see a half-written version: shards are written first, then the manifest (an atomic
PUT), then ``LATEST``; garbage collection deletes a manifest before its shards.

Example::

    m = Manifest.from_bytes(store.get(manifest_key(7)))
    m.kind, m.parent, m.encodings["delta"].nbytes      # ('delta', 6, 41_913)
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

WEIGHTS_PREFIX = "weights/"
LATEST_KEY = "weights/LATEST"
SUBSCRIBERS_PREFIX = "weights/subscribers/"
ADOPTIONS_PREFIX = "adoptions/"
"""Outside ``weights/``: records accumulate (one per version per server) and garbage collection, which
lists ``weights/`` on every publish, never needs to see them."""
MANIFEST_FORMAT = 2
CODEC_DELTA = "sywc1-delta"
CODEC_SNAPSHOT = "sywc1-snapshot"
ENCODINGS = ("delta", "snapshot")


def version_dir(version: int) -> str:
    return f"{WEIGHTS_PREFIX}{version:08d}"


def manifest_key(version: int) -> str:
    return f"{version_dir(version)}/manifest.json"


def shard_key(version: int, shard: str) -> str:
    return f"{version_dir(version)}/{shard}"


def state_digest(digests: Mapping[str, str]) -> str:
    """Digest of a whole state from its per-tensor digests (order-independent)."""
    h = hashlib.sha256()
    for name in sorted(digests):
        h.update(f"{name}\0{digests[name]}\n".encode())
    return f"sha256:{h.hexdigest()}"


@dataclass
class TensorEntry:
    dtype: str
    shape: list[int]
    digest: str = ""
    """``tensor_digest`` of the decoded tensor."""


@dataclass
class ShardEntry:
    name: str
    size: int
    sha256: str


@dataclass
class Encoding:
    codec: str
    parent: int | None
    shards: list[ShardEntry]
    ranges: dict[str, list[int]]
    """tensor name -> [shard index, byte offset, byte length] of its blob."""

    @property
    def nbytes(self) -> int:
        return sum(s.size for s in self.shards)


@dataclass
class Manifest:
    version: int
    parent: int | None
    tensors: dict[str, TensorEntry]
    encodings: dict[str, Encoding]
    state_digest: str
    created_at: float
    extra: dict[str, Any] = field(default_factory=dict)
    format: int = MANIFEST_FORMAT

    @property
    def kind(self) -> str:
        """``snapshot`` when the version can be read without its parent, else ``delta``."""
        return "snapshot" if "snapshot" in self.encodings else "delta"

    @property
    def raw_bytes(self) -> int:
        """Bytes of the decoded state (what a full uncompressed copy costs)."""
        sizes = {"bfloat16": 2, "float16": 2, "float32": 4, "float8_e4m3fn": 1, "float8_e5m2": 1}
        total = 0
        for t in self.tensors.values():
            n = 1
            for d in t.shape:
                n *= d
            total += n * sizes.get(t.dtype, 4)
        return total

    def to_bytes(self) -> bytes:
        """Compact JSON, keys sorted (deterministic; without ``indent`` json uses its C encoder,
        ~10x faster on a large model's manifest, which is written on every version's critical path)."""
        return json.dumps(asdict(self), sort_keys=True, separators=(",", ":")).encode()

    @staticmethod
    def from_bytes(data: bytes, version: int | None = None) -> Manifest:
        """Parse a manifest; ``ValueError`` naming the version when it is not one this code reads."""
        try:
            d = json.loads(data)
            if d.get("format") != MANIFEST_FORMAT:
                raise ValueError(f"format {d.get('format')!r} is not {MANIFEST_FORMAT}")
            d["tensors"] = {k: TensorEntry(**v) for k, v in d["tensors"].items()}
            d["encodings"] = {
                k: Encoding(
                    codec=e["codec"],
                    parent=e["parent"],
                    shards=[ShardEntry(**s) for s in e["shards"]],
                    ranges=e["ranges"],
                )
                for k, e in d["encodings"].items()
            }
            m = Manifest(**d)
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"weights manifest of version {version}: unreadable ({e})") from e
        unknown = set(m.encodings) - set(ENCODINGS)
        if unknown or not m.encodings:
            raise ValueError(f"weights manifest of version {version}: encodings {sorted(m.encodings)}")
        return m


LATEST_HEAD_BYTES = 256
"""A poll reads this many bytes of ``weights/LATEST``: the head line, when it fits."""


@dataclass(frozen=True)
class LatestHead:
    """The first line of ``weights/LATEST``: ``<version>[ <parent> <shard>:<size> ...]``.

    ``parent`` and ``shards`` (name, size) name the version's delta encoding, listed only when the
    line fits in :data:`LATEST_HEAD_BYTES`; a reader that holds ``parent`` can start fetching the
    shards in the same round trip as the manifest (it verifies them against the manifest's
    SHA-256 before use). A bare version number is a valid head.
    """

    version: int
    parent: int | None = None
    shards: tuple[tuple[str, int], ...] = ()

    def line(self) -> str:
        if self.parent is None or not self.shards:
            return str(self.version)
        full = " ".join([str(self.version), str(self.parent), *(f"{n}:{size}" for n, size in self.shards)])
        return full if len(full) < LATEST_HEAD_BYTES else str(self.version)

    @staticmethod
    def parse(line: bytes) -> LatestHead:
        words = line.decode(errors="replace").split()
        try:
            version = int(words[0])
            parent = int(words[1]) if len(words) > 1 else None
            shards = tuple((n, int(size)) for n, _, size in (w.rpartition(":") for w in words[2:]))
        except (IndexError, ValueError) as e:
            raise ValueError(f"weights/LATEST starts with {line[:40]!r}, not a version head") from e
        return LatestHead(version, parent, shards)


def latest_head(m: Manifest) -> LatestHead:
    """The head line of ``m`` (its delta's parent and shards, when it has a delta)."""
    enc = m.encodings.get("delta")
    if enc is None:
        return LatestHead(m.version)
    return LatestHead(m.version, enc.parent, tuple((s.name, s.size) for s in enc.shards))


def latest_bytes(version: int, manifest: bytes, head: LatestHead | None = None) -> bytes:
    """The content of ``weights/LATEST``: the head line (``head``, else the bare version), then
    the manifest."""
    line = (head or LatestHead(version)).line()
    return f"{line}\n".encode() + manifest


def latest_of(m: Manifest) -> bytes:
    """``weights/LATEST`` announcing ``m``."""
    return latest_bytes(m.version, m.to_bytes(), latest_head(m))


def parse_latest(data: bytes) -> tuple[int, Manifest | None]:
    """(version, manifest) from ``weights/LATEST`` (a bare head has no manifest)."""
    head, _, rest = data.partition(b"\n")
    version = LatestHead.parse(head).version
    return version, Manifest.from_bytes(rest, version) if rest.strip() else None


@dataclass
class SubscriberRecord:
    """A subscriber's claim in the store: it serves ``version`` and renews ``heartbeat``."""

    name: str
    version: int
    heartbeat: float
    ttl_s: float

    def live(self, now: float) -> bool:
        return now - self.heartbeat < self.ttl_s

    def to_bytes(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @staticmethod
    def from_bytes(data: bytes) -> SubscriberRecord:
        return SubscriberRecord(**json.loads(data))
