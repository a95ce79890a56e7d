"""The S3 backend against a real SeaweedFS server: objects, ranges, multipart, resumable parallel
downloads, and weight versions published, read and relayed through it."""

import os
from pathlib import Path

import pytest
import torch

from shipyard.config.schema import StoreConfig
from shipyard.store import LocalStore, open_store
from shipyard.store.transfer import download, upload
from shipyard.weights.publisher import WeightPublisher
from shipyard.weights.relay import WeightRelay
from shipyard.weights.versions import latest_version, load_version, published_versions, read_manifest


def test_objects_ranges_listing_and_multipart(s3_cfg: StoreConfig) -> None:
    store = open_store(s3_cfg)
    store.put("a/b/c.bin", b"0123456789")
    store.put("a/d.bin", b"x")
    assert store.get("a/b/c.bin") == b"0123456789" and store.size("a/b/c.bin") == 10
    assert store.get_range("a/b/c.bin", 3, 7) == b"3456"
    assert store.list("a/") == ["a/b/c.bin", "a/d.bin"] and store.list("nothing/") == []
    store.delete("a/d.bin")
    store.delete("a/d.bin")  # deleting twice is fine
    assert not store.exists("a/d.bin") and store.exists("a/b/c.bin")
    try:
        store.get("a/d.bin")
        raise AssertionError("a deleted object was read")
    except FileNotFoundError as e:
        assert "a/d.bin" in str(e)
    big = os.urandom(11 << 20)  # > 2 parts of 5 MiB: a multipart upload over 4 connections
    store.put("big.bin", big)
    assert store.size("big.bin") == len(big) and store.get("big.bin") == big
    assert store.stats.bytes_written >= len(big) + 11


def test_parallel_ranged_download_resumes_and_upload_skips_done(s3_cfg: StoreConfig, tmp_path: Path) -> None:
    store = open_store(s3_cfg)
    data = os.urandom(3 << 20)
    assert upload(store, {"o/x.bin": data, "o/y.bin": b"y" * 1000}, connections=4) == len(data) + 1000
    assert upload(store, {"o/x.bin": data, "o/y.bin": b"y" * 1000}, connections=4) == 0, (
        "resume sends nothing"
    )
    import hashlib

    sha = hashlib.sha256(data).hexdigest()
    dest = tmp_path / "x.bin"
    chunk = 256 << 10
    seen: list[int] = []

    def drop_after_five(i: int) -> None:
        seen.append(i)
        if len(seen) == 5:
            raise ConnectionError("link dropped")

    try:
        download(store, "o/x.bin", dest, sha, connections=1, chunk_bytes=chunk, on_chunk=drop_after_five)
        raise AssertionError("the transfer should have broken")
    except ConnectionError:
        pass
    assert not dest.exists()
    rep = download(store, "o/x.bin", dest, sha, connections=4, chunk_bytes=chunk)
    assert rep.chunks_resumed == 5 and rep.bytes_fetched == len(data) - 5 * chunk
    assert dest.read_bytes() == data


def test_versions_publish_load_and_relay_through_s3(s3_cfg: StoreConfig, tmp_path: Path) -> None:
    origin = open_store(s3_cfg)
    g = torch.Generator().manual_seed(0)
    w = {"w": torch.randn(512, 256, generator=g).bfloat16(), "b": torch.randn(256, generator=g)}
    states = []
    pub = WeightPublisher(origin, snapshot_every=3, keep=10, shard_bytes=64 << 10, connections=4)

    def publish(v: int) -> None:
        nonlocal w
        states.append({k: t.clone() for k, t in w.items()})
        pub.publish(v, w)
        w = {k: (t.float() + 1e-3 * torch.randn(t.shape, generator=g)).to(t.dtype) for k, t in w.items()}

    for v in range(5):
        publish(v)
    assert latest_version(origin) == 4 and published_versions(origin) == [0, 1, 2, 3, 4]
    got = load_version(origin, 4)
    assert all(torch.equal(got[k], states[4][k]) for k in got)
    mirror = LocalStore(tmp_path / "region")
    relay = WeightRelay(origin, mirror, name="relay-test", connections=4, chunk_bytes=64 << 10)
    assert relay.sync_once() == [3, 4], "an empty region starts from the newest snapshot"
    assert relay.stats.snapshots_fetched == 0 and relay.stats.snapshots_rebuilt == 0
    publish(5)
    publish(6)  # 6 % 3 == 0: the origin holds a snapshot and a delta
    before = relay.stats.origin_bytes
    assert relay.sync_once() == [5, 6]
    deltas = sum(read_manifest(origin, v).encodings["delta"].nbytes for v in (5, 6))
    assert relay.stats.origin_bytes - before == deltas, "only deltas crossed to the region"
    assert relay.stats.snapshots_rebuilt >= 1 and relay.stats.snapshots_fetched == 0
    snap = read_manifest(mirror, 6).encodings["snapshot"]
    assert all(mirror.size(f"weights/00000006/{s.name}") == s.size for s in snap.shards)
    assert published_versions(mirror) == [5, 6], "the mirror collects what its region no longer needs"
    got = load_version(mirror, 6)  # from the rebuilt snapshot alone
    assert all(torch.equal(got[k], states[6][k]) for k in states[6])


def test_seaweed_refuses_to_start_on_a_full_disk(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Below its free-space floor SeaweedFS starts but takes no write (every PUT waits, then
    fails); the server says so before starting, naming the directory."""
    import shutil

    from shipyard.store import seaweed

    real = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(seaweed.shutil, "disk_usage", lambda p: real._replace(free=300 << 20))
    server = seaweed.SeaweedServer(tmp_path / "weed")
    with pytest.raises(RuntimeError, match=r"weed: only 300 MiB free on its disk, it needs 1024 MiB"):
        server.start()
    assert server.proc is None, "nothing was started"
    assert f"-volume.minFreeSpace={seaweed.MIN_FREE >> 20}MiB" in server.command()


def test_a_server_that_never_answers_times_out_naming_the_key() -> None:
    """A real listener on loopback that accepts every connection and never answers (what a
    SeaweedFS with a full disk did to a PUT): each call fails within its deadline."""
    import socket
    import threading
    import time

    import s3fs

    from shipyard.store.fsspec_store import FsspecStore

    srv = socket.create_server(("127.0.0.1", 0))
    held: list[socket.socket] = []
    threading.Thread(target=lambda: [held.append(srv.accept()[0]) for _ in iter(int, 1)], daemon=True).start()
    endpoint = f"http://127.0.0.1:{srv.getsockname()[1]}"
    fs = s3fs.S3FileSystem(
        key="k", secret="s", client_kwargs={"endpoint_url": endpoint}, skip_instance_cache=True
    )
    store = FsspecStore(fs, "bucket/p", timeout_s=2.0)
    try:
        for call in (lambda: store.put("a/b.bin", b"x" * 100), lambda: store.get("a/b.bin")):
            t0 = time.monotonic()
            with pytest.raises(TimeoutError, match=r"'a/b.bin' under bucket/p got no answer within 2 s"):
                call()
            assert time.monotonic() - t0 < 10
        assert held, "the requests reached the silent server"
    finally:
        srv.close()
        for c in held:
            c.close()


def test_an_unreachable_server_is_an_oserror_naming_the_key(monkeypatch: pytest.MonkeyPatch) -> None:
    """Relays and subscribers retry on OSError: a store that cannot be reached must raise one
    (ConnectionError when refused, TimeoutError when the client's retries outlast the deadline),
    naming the key, never the client library's own exception."""
    import socket

    from shipyard.config.schema import StoreConfig
    from shipyard.store import open_store

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("SHIPYARD_TEST_S3_KEY", "x")
    monkeypatch.setenv("SHIPYARD_TEST_S3_SECRET", "x")
    cfg = StoreConfig(
        type="s3",
        root="nobody-home/x",
        endpoint_url=f"http://127.0.0.1:{port}",
        key_env="SHIPYARD_TEST_S3_KEY",
        secret_env="SHIPYARD_TEST_S3_SECRET",
        timeout_s=5,
    )
    with pytest.raises(OSError, match=r"store call on 'nobody-home' under nobody-home/x") as e:
        open_store(cfg)
    assert isinstance(e.value, ConnectionError | TimeoutError)
