"""Version feed (real HTTP on loopback): a committed version is pushed to a relay and on to a
region's server without any store round trip; pushed bytes are verified like fetched ones; a
follower that fell behind, or a feed that is down, falls back to the store."""

import dataclasses
import threading
import time
from pathlib import Path

import pytest
import torch

from shipyard.config.schema import ModelConfig
from shipyard.inference.engine.engine import EmbeddedEngine
from shipyard.models.loading import load_model
from shipyard.store import LocalStore
from shipyard.weights.feed import FeedFollower, VersionFeed, pack_push, unpack_push
from shipyard.weights.publisher import WeightPublisher, named_params
from shipyard.weights.relay import WeightRelay
from shipyard.weights.subscriber import EngineSink, WeightSubscriber
from shipyard.weights.types import latest_head, manifest_key, shard_key


@pytest.fixture
def feed():  # type: ignore[no-untyped-def]
    f = VersionFeed(inline_max_bytes=1 << 20).start()
    yield f
    f.close()


def test_push_round_trips_and_bad_bodies_are_named(tmp_path: Path, feed: VersionFeed, make_chain) -> None:
    store = LocalStore(tmp_path)
    pub = WeightPublisher(store, feed=feed)
    states = make_chain(3)
    for v in range(3):
        pub.publish(v, states[v])
    m2 = feed.latest.manifest  # type: ignore[union-attr]
    assert m2.version == 2 and feed.latest.parent == 1  # type: ignore[union-attr]
    follower = FeedFollower(feed.url, after=lambda: None, on_push=lambda p: None)
    inline = follower.request(after=1)  # holds the parent: the delta comes along
    behind = follower.request(after=0)  # fell behind: the manifest only
    assert inline is not None and behind is not None and inline.version == behind.version == 2
    delta = m2.encodings["delta"].shards
    assert {n: d for n, d in inline.shards.items()} == {
        s.name: store.get(shard_key(2, s.name)) for s in delta
    }
    assert behind.shards == {} and behind.manifest_bytes == store.get(manifest_key(2))
    t0 = time.monotonic()
    follower.wait_s = 0.3
    assert follower.request(after=2) is None and time.monotonic() - t0 >= 0.25, "a long poll, then 204"
    body = pack_push(inline, inline=True)
    assert unpack_push(body).shards == inline.shards
    with pytest.raises(ValueError, match="header accounts for"):
        unpack_push(body + b"x")
    with pytest.raises(ValueError, match="not a version push"):
        unpack_push(b"\x00\x00\x00\x05{bad}")


def test_relay_mirrors_a_pushed_version_without_reading_the_origin(
    tmp_path: Path, feed: VersionFeed, make_chain, until
) -> None:
    states = make_chain(4)
    origin, mirror = LocalStore(tmp_path / "origin"), LocalStore(tmp_path / "region")
    pub = WeightPublisher(origin, snapshot_every=10, feed=feed)
    pub.publish(0, states[0])
    far = LocalStore(tmp_path / "origin")  # the relay's own view of the origin: its reads alone
    relay = WeightRelay(far, mirror, name="relay-eu").start(poll_s=3600.0, feed_url=feed.url)
    try:
        assert until(lambda: relay.version == 0)
        for v in (1, 2, 3):
            reads = far.stats.reads
            pub.publish(v, states[v])
            assert until(lambda v=v: relay.version == v), f"version {v} pushed, not polled (poll_s is 1 h)"
            assert far.stats.reads == reads, "manifest and shards came with the push"
            assert torch.equal(relay.state["w"], states[v]["w"])
        assert relay.stats.origin_bytes == sum(
            origin.size(shard_key(v, s.name))
            for v in (0, 1, 2, 3)
            for s in pub._manifests[v].encodings["delta" if v else "snapshot"].shards
        ), "pushed bytes count as origin bytes, once"
        assert relay._follower is not None and relay._follower.pushes == 4 and not relay.errors
    finally:
        relay.stop()


def test_a_corrupted_push_is_refetched_from_the_store(tmp_path: Path, feed: VersionFeed, make_chain) -> None:
    states = make_chain(2)
    origin, mirror = LocalStore(tmp_path / "origin"), LocalStore(tmp_path / "region")
    pub = WeightPublisher(origin, feed=feed)
    pub.publish(0, states[0])
    relay = WeightRelay(origin, mirror, name="relay-x")
    assert relay.sync_once() == [0]
    pub.publish(1, states[1])
    good = feed.latest
    assert good is not None and good.shards
    bad = {n: bytes([d[0] ^ 1]) + d[1:] for n, d in good.shards.items()}
    relay.accept(dataclasses.replace(good, shards=bad))
    fetched = relay.reader.stats.bytes_fetched
    assert relay.sync_once(latest_head(good.manifest)) == [1]
    assert torch.equal(relay.state["w"], states[1]["w"])
    size = sum(len(d) for d in good.shards.values())
    assert relay.reader.stats.bytes_fetched - fetched == 2 * size, "the bad push, then the store's copy"
    assert all(mirror.get(shard_key(1, n)) == d for n, d in good.shards.items())


def test_a_follower_that_came_to_hold_the_parent_while_waiting_gets_the_delta(
    tmp_path: Path, feed: VersionFeed, make_chain, until
) -> None:
    """At start a long poll names no version; if the follower holds the parent by the time the
    push comes, it asks again at once and gets the delta inline instead of the manifest alone."""
    states = make_chain(2)
    origin = LocalStore(tmp_path)
    pub = WeightPublisher(origin)
    pub.publish(0, states[0])
    pub.publish(1, states[1])
    held: list[int | None] = [None]
    got: list = []
    follower = FeedFollower(feed.url, after=lambda: held[0], on_push=got.append).start()
    try:
        assert until(lambda: follower.healthy)  # its long poll says after=-1
        held[0] = 0  # e.g. version 0 adopted by polling the store meanwhile
        m1 = pub._manifests[1]
        shards = {s.name: origin.get(shard_key(1, s.name)) for s in m1.encodings["delta"].shards}
        feed.announce(m1, m1.to_bytes(), shards)
        assert until(lambda: len(got) == 1)
        assert got[0].version == 1 and got[0].shards == shards, "the delta came inline"
        assert feed.served == 2, "the manifest-only answer, then the same version asked for again"
    finally:
        follower.stop()


class _ShardReads(LocalStore):
    """The relay's view of the origin, logging which shard objects it read and counting its reads
    of ``weights/LATEST``."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.shard_keys: list[str] = []
        self.latest_reads = 0

    def get(self, key: str) -> bytes:
        if key.endswith(".bin"):
            self.shard_keys.append(key)
        if key.endswith("LATEST"):
            self.latest_reads += 1
        return super().get(key)

    def get_range(self, key: str, start: int, end: int) -> bytes:
        if key.endswith(".bin"):
            self.shard_keys.append(key)
        if key.endswith("LATEST"):
            self.latest_reads += 1
        return super().get_range(key, start, end)


class _LatePush:
    """Version 0 held by a relay on a shard-logging view of the origin; :meth:`commit` publishes
    version 1 without telling the feed (LATEST moves first), :meth:`push` then announces it."""

    def __init__(self, tmp_path: Path, make_chain, grace_s: float) -> None:  # type: ignore[no-untyped-def]
        self.states = make_chain(2)
        self.origin = LocalStore(tmp_path / "origin")
        self.pub = WeightPublisher(self.origin)
        self.pub.publish(0, self.states[0])
        self.far = _ShardReads(tmp_path / "origin")
        self.relay = WeightRelay(
            self.far, LocalStore(tmp_path / "region"), name="relay-z", feed_grace_s=grace_s
        )
        assert self.relay.sync_once() == [0]  # held before its follower asks: a push of 1 carries the delta

    def commit(self) -> None:
        self.far.shard_keys.clear()
        self.pub.publish(1, self.states[1])
        self.far.latest_reads = 0  # every read of LATEST from now on sees version 1

    def push(self, feed: VersionFeed) -> None:
        m1 = self.pub._manifests[1]
        shards = {s.name: self.origin.get(shard_key(1, s.name)) for s in m1.encodings["delta"].shards}
        feed.announce(m1, m1.to_bytes(), shards)


@pytest.mark.parametrize("grace_s", [60.0, 0.0])
def test_a_push_overtaken_by_the_poll_is_waited_for_not_refetched(
    tmp_path: Path, feed: VersionFeed, make_chain, grace_s: float, until
) -> None:
    late = _LatePush(tmp_path, make_chain, grace_s)
    relay = late.relay.start(poll_s=0.02, feed_url=feed.url)
    try:
        assert until(lambda: relay._follower is not None and relay._follower.healthy)
        late.commit()
        if grace_s:  # the poll sees version 1; its push is still "on the way": the relay waits for it
            assert until(lambda: late.far.latest_reads >= 2)
            assert relay.version == 0 and late.far.shard_keys == [], "waiting for the push"
        else:
            assert until(lambda: relay.version == 1), "fetched at once"
        late.push(feed)
        assert until(lambda: relay.version == 1)
        assert torch.equal(relay.state["w"], late.states[1]["w"]) and not relay.errors
        if grace_s:
            assert late.far.shard_keys == [], (
                "the relay waited for the push instead of fetching a second copy"
            )
        else:
            assert late.far.shard_keys, "without a grace the poll's version is fetched from the origin"
    finally:
        relay.stop()


def test_a_plain_sync_that_reads_latest_first_takes_the_push_too(
    tmp_path: Path, feed: VersionFeed, make_chain, until
) -> None:
    """The relay thread's periodic sync (no head from the watcher) reads LATEST itself; a version
    it finds that way also waits for the push rather than being fetched a second time."""
    late = _LatePush(tmp_path, make_chain, grace_s=60.0)
    relay = late.relay
    relay._follower = FeedFollower(feed.url, after=lambda: relay.version, on_push=relay.accept).start()
    try:
        assert until(lambda: relay._follower is not None and relay._follower.healthy)
        late.commit()
        timer = threading.Timer(0.3, late.push, (feed,))
        timer.start()
        assert relay.sync_once() == [1]
        assert late.far.shard_keys == [] and torch.equal(relay.state["w"], late.states[1]["w"])
        timer.join()
    finally:
        relay._follower.stop()


def test_feed_down_falls_back_to_polling(tmp_path: Path, make_chain, until) -> None:
    dead = VersionFeed().start()
    url = dead.url
    dead.close()
    states = make_chain(2)
    origin, mirror = LocalStore(tmp_path / "origin"), LocalStore(tmp_path / "region")
    pub = WeightPublisher(origin)
    pub.publish(0, states[0])
    relay = WeightRelay(origin, mirror, name="relay-y").start(poll_s=0.05, feed_url=url)
    try:
        pub.publish(1, states[1])
        assert until(lambda: relay.version == 1)
        assert relay._follower is not None and relay._follower.errors, "the dead feed was noticed"
    finally:
        relay.stop()
    assert not relay.alive(), "stop() returned with the sync thread still running (the dead feed held it)"


def test_trainer_to_relay_to_server_by_push(tmp_path: Path, feed: VersionFeed, until) -> None:
    """Publisher -> origin feed -> relay -> the region's feed -> an engine's subscriber, with
    every poll an hour apart: each version is served bit for bit, through pushes alone."""
    torch.manual_seed(0)
    trainer, _ = load_model(ModelConfig(source="tiny"))
    served, tok = load_model(ModelConfig(source="tiny"))
    engine = EmbeddedEngine(served.to(torch.bfloat16), tok, max_batch=1, version=0)
    origin, mirror = LocalStore(tmp_path / "origin"), LocalStore(tmp_path / "region")
    pub = WeightPublisher(origin, feed=feed, dtype=torch.bfloat16)
    pub.publish(0, named_params(trainer))
    region_feed = VersionFeed().start()
    relay = WeightRelay(origin, mirror, name="relay-eu", feed=region_feed).start(3600.0, feed.url)
    sub = WeightSubscriber(mirror, EngineSink(engine), name="s0", poll_s=3600.0)
    sub.start(feed_url=region_feed.url)
    opt = torch.optim.AdamW(trainer.parameters(), lr=1e-4)
    try:
        assert until(lambda: relay.version == 0)
        for v in (1, 2):
            ids = torch.randint(0, trainer.config.vocab_size, (2, 10))
            trainer(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()
            pub.publish(v, named_params(trainer))
            assert until(lambda v=v: engine.version == v), f"version {v} reached the engine by push"
            # the engine swaps first, the subscriber then records the adoption
            assert until(lambda v=v: bool(sub.adopted) and sub.adopted[-1]["version"] == v)
            assert sub.adopted[-1]["path"] == [f"{v}:delta"]
            for k, t in named_params(trainer).items():
                assert torch.equal(named_params(served)[k], t.detach().bfloat16()), k
        assert region_feed.served >= 2 and not sub.errors
    finally:
        sub.stop()
        relay.stop()
        region_feed.close()
