"""Subscriber records and garbage collection: delete only what nobody still needs.

Contract: a subscriber (inference server or relay) writes ``weights/subscribers/<name>.json``
with the version it serves and a heartbeat; the record pins versions while
``now - heartbeat < ttl_s`` and stops pinning once the subscriber dies (no renewal). A dead record
is deleted by the next collection. :func:`needed_versions` is what must survive:

- the chain of LATEST: LATEST and its delta parents back to the newest snapshot on that chain;
- for every live subscriber at version ``a``: the delta chain from LATEST back to ``a`` (its
  cheapest way forward), so a lagging server is not pushed onto a full snapshot;
- the newest ``keep`` versions.

:func:`collect_garbage` deletes every other version, manifest first (so no reader plans through a
version whose shards are going), then its shards. Limits: heartbeats compare wall clocks of
different machines, so ``ttl_s`` must exceed their skew; a reader between listing and fetching a
version that a collection just deleted gets a missing object and re-plans
(:func:`shipyard.weights.versions.reach`).
"""

from __future__ import annotations

import time
from collections.abc import Mapping

from shipyard.store.types import Store
from shipyard.weights.types import SUBSCRIBERS_PREFIX, WEIGHTS_PREFIX, Manifest, SubscriberRecord, version_dir


def write_record(store: Store, name: str, version: int, ttl_s: float) -> SubscriberRecord:
    if not name or "/" in name:
        raise ValueError(f"subscriber name {name!r} must be non-empty without '/'")
    rec = SubscriberRecord(name, version, time.time(), ttl_s)
    store.put(f"{SUBSCRIBERS_PREFIX}{name}.json", rec.to_bytes())
    return rec


def remove_record(store: Store, name: str) -> None:
    store.delete(f"{SUBSCRIBERS_PREFIX}{name}.json")


def read_records(store: Store) -> list[SubscriberRecord]:
    out = []
    for key in store.list(SUBSCRIBERS_PREFIX):
        try:
            out.append(SubscriberRecord.from_bytes(store.get(key)))
        except (FileNotFoundError, ValueError, TypeError):
            continue
    return out


def needed_versions(
    manifests: Mapping[int, Manifest], latest: int | None, pinned: list[int], keep: int
) -> set[int]:
    """Versions to keep (see the module contract)."""
    if latest is None:
        return set(manifests)
    need = set(sorted(v for v in manifests if v <= latest)[-keep:])
    lowest_pin = min(pinned, default=latest)
    v: int | None = latest
    reached_snapshot = False
    while v is not None and v in manifests:
        need.add(v)
        m = manifests[v]
        reached_snapshot = reached_snapshot or m.kind == "snapshot"
        if reached_snapshot and v <= lowest_pin:
            break
        v = m.parent if "delta" in m.encodings else None
    need.update(v for v in manifests if v > latest)  # being published right now
    return need


def collect_garbage(
    store: Store, keep: int = 2, now: float | None = None, cache: dict[int, Manifest] | None = None
) -> list[int]:
    """Delete versions no one needs; returns them. Dead subscriber records are removed too.
    ``cache`` holds manifests already known (see :func:`~shipyard.weights.versions.read_manifests`)."""
    from shipyard.weights.versions import latest_version, read_manifests

    now = time.time() if now is None else now
    records = read_records(store)
    for rec in records:
        if not rec.live(now):
            remove_record(store, rec.name)
    pinned = [r.version for r in records if r.live(now) and r.version >= 0]  # -1: holds nothing yet
    latest = latest_version(store)
    manifests = read_manifests(store, cache=cache)
    need = needed_versions(manifests, latest, pinned, keep)
    deleted = []
    for v in sorted(set(manifests) - need):
        store.delete(f"{version_dir(v)}/manifest.json")
        for key in store.list(version_dir(v) + "/"):
            store.delete(key)
        deleted.append(v)
    for key in store.list(WEIGHTS_PREFIX):  # shards of publishes that died before their manifest
        part = key.split("/")[1]
        if part.isdigit() and latest is not None and int(part) < latest and int(part) not in manifests:
            store.delete(key)
    return deleted
