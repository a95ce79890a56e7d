"""Store layout of versions: snapshots every K, deltas between, manifest last, cheapest paths,
fallback on missing or corrupted objects, readers never see a partial version, GC and leases."""

import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from shipyard.store import LocalStore
from shipyard.weights.leases import collect_garbage, read_records, write_record
from shipyard.weights.publisher import WeightPublisher
from shipyard.weights.states import tensor_digest
from shipyard.weights.types import (
    Encoding,
    Manifest,
    ShardEntry,
    SubscriberRecord,
    TensorEntry,
    manifest_key,
    shard_key,
)
from shipyard.weights.versions import (
    VersionReader,
    latest_version,
    load_version,
    plan_path,
    published_versions,
    reach,
    read_manifest,
    read_manifests,
)


def test_layout_snapshot_every_k_and_deltas_between(tmp_path: Path, make_chain, publish, same_state) -> None:
    states = make_chain(12)
    store = LocalStore(tmp_path)
    publish(store, states, snapshot_every=4, keep=100, shard_bytes=16_000)
    assert latest_version(store) == 11 and published_versions(store) == list(range(12))
    kinds = {v: read_manifest(store, v).kind for v in range(12)}
    assert [v for v, k in kinds.items() if k == "snapshot"] == [0, 4, 8]
    m0, m5, m8 = (read_manifest(store, v) for v in (0, 5, 8))
    assert m0.parent is None and set(m0.encodings) == {"snapshot"}
    assert m5.parent == 4 and set(m5.encodings) == {"delta"} and m5.encodings["delta"].parent == 4
    assert set(m8.encodings) == {"delta", "snapshot"} and m8.encodings["delta"].parent == 7
    # manifest: dtypes, shapes, digests of the decoded tensors, byte ranges inside listed shards
    assert m5.tensors["w"].dtype == "bfloat16" and m5.tensors["w"].shape == [256, 96]
    assert m5.tensors["w"].digest == tensor_digest(states[5]["w"])
    assert len(m8.encodings["snapshot"].shards) >= 2, "16 kB shards split the 60 kB snapshot"
    for enc in m8.encodings.values():
        for name, (idx, off, length) in enc.ranges.items():
            assert off + length <= enc.shards[idx].size, name
        for s in enc.shards:
            assert store.size(shard_key(8, s.name)) == s.size
    # the unchanged tensor costs a header; a delta is a small fraction of a snapshot
    assert m5.encodings["delta"].nbytes * 3 < m8.encodings["snapshot"].nbytes
    for v in range(12):
        assert same_state(load_version(store, v), states[v]), v


def test_plan_prefers_fewest_bytes() -> None:
    def m(v: int, delta: int | None, snap: int | None) -> Manifest:
        enc = {}
        if delta is not None:
            enc["delta"] = Encoding("sywc1-delta", v - 1, [ShardEntry("d", delta, "")], {})
        if snap is not None:
            enc["snapshot"] = Encoding("sywc1-snapshot", None, [ShardEntry("s", snap, "")], {})
        return Manifest(v, v - 1 if delta else None, {"x": TensorEntry("float32", [1], "")}, enc, "", 0.0)

    ms = {
        0: m(0, None, 1000),
        **{v: m(v, 100, None) for v in range(1, 8)},
        8: m(8, 100, 1000),
        9: m(9, 100, None),
    }

    def steps(path: list) -> list[tuple[int, str]]:
        return [(s.version, s.encoding) for s in path]

    assert steps(plan_path(ms, 7, 9)) == [(8, "delta"), (9, "delta")]
    # from version 1: deltas 2..9 cost 800 < snapshot 8 + delta 9 = 1100
    assert steps(plan_path(ms, 1, 9))[0] == (2, "delta")
    ms[5], ms[6] = m(5, 400, None), m(6, 400, None)  # deltas 2..9 now cost 1400 > 1100
    assert steps(plan_path(ms, 1, 9)) == [(8, "snapshot"), (9, "delta")]
    assert steps(plan_path(ms, None, 3)) == [(0, "snapshot"), (1, "delta"), (2, "delta"), (3, "delta")]
    assert steps(plan_path(ms, 7, 9, bad={(8, "delta")})) == [(8, "snapshot"), (9, "delta")]
    with pytest.raises(LookupError, match="version 9"):
        plan_path(ms, 7, 9, bad={(8, "delta"), (8, "snapshot")})


def _delta_shard_key(store: LocalStore, v: int) -> str:
    return shard_key(v, read_manifest(store, v).encodings["delta"].shards[0].name)


def test_missing_delta_falls_back_to_snapshot(tmp_path: Path, make_chain, publish, same_state) -> None:
    states = make_chain(11)
    store = LocalStore(tmp_path)
    publish(store, states, snapshot_every=8, keep=100)
    store.delete(_delta_shard_key(store, 6))
    reader = VersionReader(store, tmp_path / "cache")
    got = reach(reader, 10, 5, states[5], {k: torch.empty_like(t) for k, t in states[5].items()})
    assert same_state(got.state, states[10])
    assert [(s.version, s.encoding) for s in got.path] == [(8, "snapshot"), (9, "delta"), (10, "delta")]
    assert len(got.errors) == 1 and "version 6 delta" in got.errors[0] and "not found" in got.errors[0]
    assert got.changed == {"w", "b", "frozen"}, "a snapshot path replaces every tensor"


def test_corrupted_shard_is_detected_and_the_path_recovers(
    tmp_path: Path, make_chain, publish, same_state
) -> None:
    states = make_chain(10)
    store = LocalStore(tmp_path)
    publish(store, states, snapshot_every=8, keep=100)
    key = _delta_shard_key(store, 6)
    data = bytearray(store.get(key))
    data[len(data) // 2] ^= 0x01
    store.put(key, bytes(data))  # bit rot at rest: same size, wrong bytes
    base = {k: t.clone() for k, t in states[5].items()}
    out = {k: torch.empty_like(t) for k, t in base.items()}
    got = reach(VersionReader(store, tmp_path / "cache"), 9, 5, base, out)
    assert len(got.errors) == 1 and "sha256" in got.errors[0] and "corrupted" in got.errors[0]
    assert [(s.version, s.encoding) for s in got.path] == [(8, "snapshot"), (9, "delta")]
    assert same_state(got.state, states[9]) and same_state(base, states[5]), "the base is never written"
    assert not (tmp_path / "cache" / "00000006").exists() or not any(
        (tmp_path / "cache" / "00000006").iterdir()
    )


def test_wrong_base_is_caught_by_digests_and_recovered(
    tmp_path: Path, make_chain, publish, same_state
) -> None:
    states = make_chain(6)
    store = LocalStore(tmp_path)
    publish(store, states, snapshot_every=4, keep=100)
    wrong = {k: t.clone() for k, t in states[2].items()}
    wrong["frozen"][0, 0] += 1  # the server claims version 2 but one weight differs
    got = reach(VersionReader(store), 5, 2, wrong, {k: torch.empty_like(t) for k, t in wrong.items()})
    assert same_state(got.state, states[5]) and "digest mismatch" in got.errors[0]
    assert got.path[0].encoding == "snapshot" and got.changed == {"w", "b", "frozen"}


def test_reader_never_observes_a_partial_version(tmp_path: Path, make_chain, same_state) -> None:
    states = make_chain(25, seed=3)
    digests = {v: {k: tensor_digest(t) for k, t in s.items()} for v, s in enumerate(states)}
    store = LocalStore(tmp_path)
    pub = WeightPublisher(store, snapshot_every=5, keep=1000, shard_bytes=8_000)
    stop = threading.Event()
    seen: list[int] = []
    read = threading.Condition()  # notified after each version the reader has read
    failures: list[str] = []

    def reader() -> None:
        while not stop.is_set():
            v = latest_version(store)
            for listed in published_versions(store):  # every listed version is complete
                m = read_manifest(store, listed)
                for enc in m.encodings.values():
                    missing = [s.name for s in enc.shards if not store.exists(shard_key(listed, s.name))]
                    if missing:
                        failures.append(f"version {listed} listed without {missing}")
            if v is None:
                continue
            got = load_version(store, v)
            if {k: tensor_digest(t) for k, t in got.items()} != digests[v]:
                failures.append(f"version {v} read with other bytes")
            with read:
                seen.append(v)
                read.notify_all()

    t = threading.Thread(target=reader)
    t.start()

    def reader_reached(v: int) -> None:  # the reader has read version v or later
        with read:
            read.wait_for(lambda: bool(seen) and seen[-1] >= v, timeout=60)

    for v, s in enumerate(states):
        pub.publish(v, s)
        if v % 8 == 0:  # the reader reads while the next versions are being written, and sees several
            reader_reached(v)
    reader_reached(len(states) - 1)
    stop.set()
    t.join()
    assert not failures, failures[:3]
    assert len(set(seen)) >= 3, f"reader saw too few versions to mean anything: {sorted(set(seen))}"


def test_gc_keeps_what_live_subscribers_need(tmp_path: Path, make_chain, same_state) -> None:
    states = make_chain(13)
    store = LocalStore(tmp_path)
    pub = WeightPublisher(store, snapshot_every=5, keep=1)
    write_record(store, "server-a", 3, ttl_s=600)  # live, lagging at version 3
    dead = SubscriberRecord("server-dead", 1, heartbeat=time.time() - 10_000, ttl_s=600)
    store.put("weights/subscribers/server-dead.json", dead.to_bytes())  # stopped renewing long ago
    for v, s in enumerate(states):
        pub.publish(v, s)
    kept = published_versions(store)
    assert kept == list(range(3, 13)), kept  # 3..12: server-a's delta chain; 0..2 collected
    assert [r.name for r in read_records(store)] == ["server-a"], "the dead record is removed"
    no_snapshots = {(v, "snapshot") for v in range(13)}
    deltas = plan_path(read_manifests(store), 3, 12, bad=no_snapshots)  # server-a's delta chain is whole
    assert [s.version for s in deltas] == list(range(4, 13))
    got = reach(
        VersionReader(store), 12, 3, states[3], {k: torch.empty_like(t) for k, t in states[3].items()}
    )
    assert same_state(got.state, states[12]) and not got.errors
    write_record(store, "server-a", 12, ttl_s=600)  # caught up: only LATEST's chain stays
    collect_garbage(store, keep=1)
    assert published_versions(store) == [10, 11, 12]
    assert not [k for k in store.list("weights/") if k.split("/")[1] in {"00000003", "00000009"}]


def test_restarted_publisher_continues_with_deltas(tmp_path: Path, make_chain, same_state) -> None:
    states = make_chain(5)
    store = LocalStore(tmp_path)
    first = WeightPublisher(store, snapshot_every=100, keep=100)
    for v in range(3):
        first.publish(v, states[v])
    again = WeightPublisher(store, snapshot_every=100, keep=100)  # a new process after a crash
    m = again.publish(3, states[3])
    assert m.kind == "delta" and m.parent == 2
    again.publish(4, states[4])
    assert same_state(load_version(store, 4), states[4])
    assert store.get(manifest_key(4)) == again.store.get(manifest_key(4))


def test_hundred_versions_through_the_store_replay_to_the_same_digest(tmp_path: Path, same_state) -> None:
    g = torch.Generator().manual_seed(5)
    master = torch.randn(128, 64, generator=g)
    store = LocalStore(tmp_path)
    pub = WeightPublisher(store, snapshot_every=25, keep=1000)
    first = last = None
    for v in range(100):
        state = {"w": master.bfloat16(), "b": master[0].clone()}
        m = pub.publish(v, state)
        first = first or {k: t.clone() for k, t in state.items()}
        last = state
        master = master + 1e-4 * torch.randn(master.shape, generator=g)
    manifests = read_manifests(store)
    deltas_only = plan_path(manifests, 0, 99, bad={(v, "snapshot") for v in range(1, 100)})
    assert [s.version for s in deltas_only] == list(range(1, 100))
    out = {k: torch.empty_like(t) for k, t in first.items()}
    replayed = reach(VersionReader(store), 99, 0, first, out)  # the cheapest: snapshot 75 + 24 deltas
    assert [s.encoding for s in replayed.path] == ["snapshot"] + ["delta"] * 24
    assert same_state(replayed.state, last) and m.state_digest == manifests[99].state_digest
    state = {k: t.clone() for k, t in first.items()}
    reader = VersionReader(store)
    for step in deltas_only:  # all 99 deltas applied in place, one after the other
        state = reader.apply(manifests[step.version], "delta", state, state)
    assert same_state(state, last)


KILLED_PUBLISHER = """
import os, signal, sys, torch
from shipyard.store import LocalStore
from shipyard.weights.publisher import WeightPublisher

class DiesAfterThreeShards(LocalStore):
    def put(self, key, data):
        super().put(key, data)
        if "/delta-" in key and sum("/delta-" in k for k in self.list("weights/")) == 3:
            os.kill(os.getpid(), signal.SIGKILL)

states = torch.load(sys.argv[2])
pub = WeightPublisher(DiesAfterThreeShards(sys.argv[1]), snapshot_every=100, shard_bytes=4_000, connections=1)
pub.publish(1, states[1])
"""


def test_killed_publish_resumes_without_resending_shards(tmp_path: Path, same_state) -> None:
    g = torch.Generator().manual_seed(7)
    base = {f"layer{i}": torch.randn(64, 64, generator=g) for i in range(12)}
    states = [
        {k: (t + d * 1e-2 * torch.randn(t.shape, generator=g)).bfloat16() for k, t in base.items()}
        for d in (0, 1)
    ]
    WeightPublisher(LocalStore(tmp_path / "store"), snapshot_every=100).publish(0, states[0])
    torch.save(states, tmp_path / "states.pt")
    proc = subprocess.run(
        [sys.executable, "-c", KILLED_PUBLISHER, str(tmp_path / "store"), str(tmp_path / "states.pt")]
    )
    assert proc.returncode == -9
    store = LocalStore(tmp_path / "store")
    assert latest_version(store) == 0 and not store.exists(manifest_key(1)), "no partial version is visible"
    m = WeightPublisher(store, snapshot_every=100, shard_bytes=4_000).publish(1, states[1])
    shards = m.encodings["delta"].shards
    assert len(shards) > 3
    resent = store.stats.bytes_written - len(store.get(manifest_key(1))) - len(store.get("weights/LATEST"))
    assert resent == sum(s.size for s in shards[3:]), "the 3 shards stored before the kill are not sent again"
    assert same_state(load_version(store, 1), states[1])
