"""Benchmark: time from publishing a weight version to every region serving it, full copies vs deltas.

Contract: a trainer region and ``--regions`` inference regions run as Linux network namespaces,
each region joined to the trainer's by its own veth pair shaped with ``tc tbf`` to ``--rate-mbit``
in both directions (the long-haul link). The trainer region runs a real SeaweedFS S3 server (the
origin store) and a publisher process; each inference region runs a process with a
:class:`~shipyard.weights.relay.WeightRelay` (origin S3 over the shaped link -> the region's
mirror directory) and ``--servers`` inference servers (a real
:class:`~shipyard.inference.engine.engine.EmbeddedEngine` in bf16 each, kept current by a
:class:`~shipyard.weights.subscriber.WeightSubscriber` reading the mirror). Versions are real:
consecutive AdamW steps (fp32 master, bf16 serving) of SmolLM2-135M-Instruct, or of the tiny
dense model with ``--quick``.

By default the publisher serves a :class:`~shipyard.weights.feed.VersionFeed` per mode in the
trainer region; each relay follows it across its shaped link (pushes carry the manifest and a
small delta inline; origin polls go on every second as the fallback) and serves its region's
servers a feed of its own on loopback. ``--no-feed``: relays and servers only poll, every
``--poll-s``.

Three modes run one after the other on the same versions and network:
- ``baseline``: every version is a full snapshot (zstd of byte planes), i.e. ship the whole model;
- ``ours``: a delta against the previous version (snapshots only every ``--snapshot-every``), coded
  and uploaded by one process (the one-process trainer);
- ``sharded``: the same deltas coded and uploaded by ``--publish-ranks`` processes in parallel, each
  the share of the tensors a trainer rank owns (:func:`shipyard.trainer.distributed.rank_tensors`),
  one manifest naming all their shards written last (what a sharded trainer publishes).

Per version it records: ``sync_s`` = last server's adoption time - publish start (so it includes
encoding, upload, relay polling, the long-haul fetch, decoding, digest checks and the swap);
bytes on each long-haul link (the origin-side veth's tx counter: payload, HTTP and TCP); the
inference pause of every server (the in-place apply between decode steps); and the bound
``shipped bytes / link bandwidth + RTT``. Prints rich tables and writes
``benchmarks/results/weight_sync.json`` (``--quick``: ``weight_sync_quick.json``; keys ``sync_s``, ``bound_s``, ``pause_p50_s``,
``pause_p99_s``, ``regions`` for ours; the same under ``baseline``; per-version records).

Limits, stated in the output too: this kernel has no ``sch_netem`` (``tbf`` and ``htb`` exist), so
the round-trip time cannot be added on the wire; ``--rtt-ms`` is emulated in-process instead (each
request a region's relay makes to the origin, store GET or feed long poll, waits half an RTT
before it is sent and half an RTT before its answer is used; requests in parallel overlap their
waits, as on a real link). Everything shares this machine's CPUs, so
codec, relays and servers compete for cores, unlike separate machines. Needs root (namespaces,
veth, tc); it creates its own namespaces and links and deletes them on exit.

Usage::

    sudo .venv/bin/python benchmarks/weight_sync.py            # SmolLM2-135M, 3 regions, 1 Gbit/s
    sudo .venv/bin/python benchmarks/weight_sync.py --quick    # tiny model, 100 Mbit/s, < 1 minute
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import parser, write_results  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
KEY_ENV = {"SHIPYARD_SYNC_KEY": "shipyard", "SHIPYARD_SYNC_SECRET": "shipyard"}


def emit(**event: Any) -> None:
    print(json.dumps(event), flush=True)


def s3(endpoint: str, root: str, rtt_s: float = 0.0) -> Any:
    from shipyard.config.schema import StoreConfig
    from shipyard.store import open_store

    cfg = StoreConfig(
        type="s3",
        root=root,
        endpoint_url=endpoint,
        key_env="SHIPYARD_SYNC_KEY",
        secret_env="SHIPYARD_SYNC_SECRET",
        connections=8,
        part_mb=8,
    )
    store = open_store(cfg)
    return DelayStore(store, rtt_s) if rtt_s > 0 else store


class DelayStore:
    """A store whose every request takes one more round trip (emulated long-haul RTT): half of
    it before the request reaches the server, half before the answer reaches the caller (so a
    poll sees the state of half a round trip before it returns, as on a real link)."""

    def __init__(self, inner: Any, rtt_s: float) -> None:
        self.inner, self.rtt_s, self.stats = inner, rtt_s, inner.stats

    def __getattr__(self, name: str) -> Any:
        fn = getattr(self.inner, name)

        def delayed(*a: Any, **kw: Any) -> Any:
            time.sleep(self.rtt_s / 2)
            out = fn(*a, **kw)
            time.sleep(self.rtt_s / 2)
            return out

        return delayed


def delay_follower(url: str, after: Any, on_push: Any, rtt_s: float) -> Any:
    """A :class:`FeedFollower` across the emulated link (not started): its long poll reaches the
    origin half a round trip after it is sent, and the push comes back half a round trip after it
    is sent."""
    from shipyard.weights.feed import FeedFollower

    class DelayFollower(FeedFollower):
        def request(self, after: int) -> Any:
            time.sleep(rtt_s / 2)
            push = super().request(after)
            time.sleep(rtt_s / 2)
            return push

    return DelayFollower(url, after, on_push)


# ---------------------------------------------------------------- roles run inside namespaces


MODES = ("baseline", "ours", "sharded")


def _rank_encoder(conn: Any, args: argparse.Namespace, rank: int, world: int) -> None:
    """A publishing rank of the ``sharded`` mode: for each version asked on ``conn``, code and upload
    the tensors it owns (its own delta parent) and send back its part of the manifest."""
    from safetensors.torch import load_file

    from shipyard.trainer.distributed import rank_tensors
    from shipyard.weights.publisher import WeightPublisher

    pub = WeightPublisher(
        s3(args.endpoint, "shipyard-sync/sharded"), snapshot_every=args.snapshot_every, keep=2
    )
    while (v := conn.recv()) is not None:
        tensors = load_file(Path(args.versions_dir) / f"v{v:04d}.safetensors")
        mine = {n: tensors[n] for n in rank_tensors(tensors, world)[rank]}
        delta = pub.delta_ready(v, mine)
        conn.send(
            pub.encode(
                v, mine, delta=delta, snapshot=not delta or v % args.snapshot_every == 0, prefix=f"r{rank}-"
            )
        )


class ShardedPublisher:
    """``--publish-ranks`` encoder processes (rank 0 is this one) and the commit of one manifest."""

    def __init__(self, args: argparse.Namespace, feed: Any) -> None:
        import multiprocessing as mp

        from shipyard.weights.publisher import WeightPublisher

        self.world = args.publish_ranks
        ctx = mp.get_context("spawn")
        self.conns, self.procs = [], []
        for rank in range(1, self.world):
            here, there = ctx.Pipe()
            proc = ctx.Process(target=_rank_encoder, args=(there, args, rank, self.world), daemon=True)
            proc.start()
            self.conns.append(here)
            self.procs.append(proc)
        self.lead = WeightPublisher(
            s3(args.endpoint, "shipyard-sync/sharded"), snapshot_every=args.snapshot_every, keep=2, feed=feed
        )
        self.args = args

    def publish(self, v: int, tensors: dict[str, Any]) -> Any:
        from shipyard.trainer.distributed import rank_tensors

        for conn in self.conns:
            conn.send(v)
        mine = {n: tensors[n] for n in rank_tensors(tensors, self.world)[0]}
        delta = self.lead.delta_ready(v, mine)
        snapshot = not delta or v % self.args.snapshot_every == 0
        parts = [self.lead.encode(v, mine, delta=delta, snapshot=snapshot, prefix="r0-")]
        parts += [conn.recv() for conn in self.conns]
        return self.lead.commit(v, parts)

    @property
    def announced_at(self) -> float:
        return self.lead.announced_at


def role_publisher(args: argparse.Namespace) -> None:
    """Trainer region: one publisher per mode (its own prefix in the bucket); publishes version v
    (read from disk) each time ``<mode> <v>`` arrives on stdin."""
    from safetensors.torch import load_file

    from shipyard.weights.feed import VersionFeed
    from shipyard.weights.publisher import WeightPublisher

    modes = args.modes.split(",")
    ports = [int(p) for p in args.feed_ports.split(",")] if args.feed_ports else []
    feeds = {mode: VersionFeed("0.0.0.0", port).start() for mode, port in zip(modes, ports, strict=False)}
    pubs: dict[str, Any] = {
        mode: WeightPublisher(
            s3(args.endpoint, f"shipyard-sync/{mode}"),
            snapshot_every=args.snapshot_every,
            keep=2,
            deltas=mode == "ours",
            connections=8,
            workers=2,
            feed=feeds.get(mode),
        )
        for mode in modes
        if mode != "sharded"
    }
    if "sharded" in modes:
        pubs["sharded"] = ShardedPublisher(args, feeds.get("sharded"))
    emit(event="ready", who="publisher")
    for line in sys.stdin:
        mode, v = line.split()[0], int(line.split()[1])
        tensors = load_file(Path(args.versions_dir) / f"v{v:04d}.safetensors")
        t0 = time.time()
        m = pubs[mode].publish(v, tensors)
        enc = m.encodings["delta" if "delta" in m.encodings else "snapshot"]
        emit(
            event="published",
            mode=mode,
            v=v,
            t0=t0,
            t1=time.time(),
            latest_at=pubs[mode].announced_at,
            shipped=enc.nbytes,
            raw=m.raw_bytes,
        )


def region_mode(args: argparse.Namespace, mode: str) -> tuple[Any, list[Any]]:
    """A relay from the origin (this mode's prefix) into a local mirror, and ``servers`` engines."""
    import torch

    from shipyard.config.schema import ModelConfig
    from shipyard.inference.engine.engine import EmbeddedEngine
    from shipyard.models.loading import load_model
    from shipyard.store import LocalStore
    from shipyard.weights.feed import VersionFeed
    from shipyard.weights.relay import WeightRelay
    from shipyard.weights.subscriber import EngineSink, WeightSubscriber

    work = Path(args.work) / mode
    mirror = LocalStore(work / "mirror")
    origin = s3(args.endpoint, f"shipyard-sync/{mode}", args.rtt_ms / 1000)
    ports = (
        dict(zip(args.modes.split(","), args.feed_ports.split(","), strict=False)) if args.feed_ports else {}
    )
    feed = VersionFeed().start() if mode in ports else None  # the region's feed, on loopback
    relay = WeightRelay(origin, mirror, name=f"relay-{args.region}", connections=8, feed=feed)
    follower = None
    if mode in ports:
        host = args.endpoint.split("//")[1].rsplit(":", 1)[0]
        url = f"http://{host}:{ports[mode]}"
        follower = delay_follower(url, lambda: relay.version, relay.on_push, args.rtt_ms / 1000)
    # with a feed, polling the origin is the fallback, at the pace a deployment would use; a poll
    # that lands before the push waits feed_grace_s for it rather than fetching the version itself
    relay.start(poll_s=args.poll_s if follower is None else max(args.poll_s, 1.0), follower=follower)
    cfg = ModelConfig(source="tiny") if args.model == "tiny" else ModelConfig()
    subs = []
    for j in range(args.servers):
        model, tok = load_model(cfg)
        engine = EmbeddedEngine(model.to(torch.bfloat16), tok, max_batch=1, version=0)
        sink = EngineSink(engine)
        name = f"{args.region}-s{j}"
        sub = WeightSubscriber(mirror, sink, name=name, poll_s=args.poll_s, cache_dir=work / "cache")
        subs.append(sub.start(feed_url=feed.url if feed is not None else None))
    return relay, subs


def role_region(args: argparse.Namespace) -> None:
    """Inference region: both modes side by side; reports each relayed and adopted version."""
    import torch

    torch.set_num_threads(1)
    parts = {mode: region_mode(args, mode) for mode in args.modes.split(",")}
    emit(event="ready", who=args.region)
    done = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), done.set()), daemon=True).start()
    seen: dict[tuple[str, int], int] = {}
    while not done.wait(0.005):
        for mode, (relay, subs) in parts.items():
            for rec in relay.log[seen.get((mode, -1), 0) :]:
                emit(
                    event="relayed",
                    mode=mode,
                    region=args.region,
                    v=rec["version"],
                    t=rec["at"],
                    **{k: rec[k] for k in ("sync_at", "fetched_at", "decoded_at")},
                )
            seen[(mode, -1)] = len(relay.log)
            for j, sub in enumerate(subs):
                for rec in sub.adopted[seen.get((mode, j), 0) :]:
                    emit(
                        event="adopted",
                        mode=mode,
                        region=args.region,
                        server=j,
                        v=rec["version"],
                        t=rec["at"],
                        pause=rec["pause_s"],
                        ready_s=rec["ready_s"],
                        path=rec["path"],
                        errors=len(rec["recovered"]),
                    )
                seen[(mode, j)] = len(sub.adopted)
    errors = []
    for relay, subs in parts.values():
        relay.stop()
        for sub in subs:
            sub.stop()
        errors += relay.errors + [e for s in subs for e in s.errors]
    emit(event="bye", region=args.region, errors=errors[:5])


# ---------------------------------------------------------------- network namespaces


class Network:
    """Namespaces ``<tag>o`` (trainer) and ``<tag>r<i>`` (regions), veth pairs shaped by tbf."""

    def __init__(self, regions: int, rate_mbit: float) -> None:
        tag = f"sy{os.getpid() % 100000}"
        self.origin = f"{tag}o"
        self.regions = [f"{tag}r{i}" for i in range(regions)]
        self.rate_mbit = rate_mbit
        self.links = [(f"{tag}o{i}", f"{tag}r{i}") for i in range(regions)]

    def ip(self, i: int) -> str:
        return f"10.77.{i}.1"

    def exec_prefix(self, ns: str) -> list[str]:
        return ["ip", "netns", "exec", ns]

    def up(self) -> None:
        burst = max(64 << 10, int(self.rate_mbit * 1e6 / 8 / 250))
        tbf = ["tbf", "rate", f"{self.rate_mbit}mbit", "burst", str(burst), "latency", "100ms"]
        for ns in [self.origin, *self.regions]:
            _sh("ip", "netns", "add", ns)
            _sh("ip", "-n", ns, "link", "set", "lo", "up")
        for i, (o, r) in enumerate(self.links):
            _sh(
                "ip",
                "link",
                "add",
                o,
                "netns",
                self.origin,
                "type",
                "veth",
                "peer",
                "name",
                r,
                "netns",
                self.regions[i],
            )
            _sh("ip", "-n", self.origin, "addr", "add", f"{self.ip(i)}/30", "dev", o)
            _sh("ip", "-n", self.regions[i], "addr", "add", f"10.77.{i}.2/30", "dev", r)
            for ns, dev in ((self.origin, o), (self.regions[i], r)):
                _sh("ip", "-n", ns, "link", "set", dev, "up")
                _sh("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", *tbf)

    def tx_bytes(self, i: int) -> int:
        out = subprocess.run(
            [*self.exec_prefix(self.origin), "cat", f"/sys/class/net/{self.links[i][0]}/statistics/tx_bytes"],
            capture_output=True,
            text=True,
            check=True,
        )
        return int(out.stdout)

    def down(self) -> None:
        for ns in [self.origin, *self.regions]:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False)


def _sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True)


def check_network_support() -> str | None:
    """Why namespaces + tbf cannot be used here, or None when they can."""
    if os.geteuid() != 0:
        return "needs root (network namespaces, veth pairs, tc)"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "needs iproute2 (`ip`, `tc`)"
    probe = subprocess.run(
        [
            "unshare",
            "-n",
            "sh",
            "-c",
            "ip link add name sya type veth peer name syb && tc qdisc add dev sya root tbf "
            "rate 100mbit burst 64k latency 50ms",
        ],
        capture_output=True,
        text=True,
    )
    return None if probe.returncode == 0 else f"veth + tbf unavailable: {probe.stderr.strip()}"


# ---------------------------------------------------------------- driver


class Proc:
    """A role process: JSON events from its stdout into a shared queue, commands to its stdin."""

    def __init__(self, name: str, cmd: list[str], events: queue.Queue, log: Path) -> None:
        self.name = name
        with open(log, "w") as err:  # the child keeps its own descriptor
            self.p = subprocess.Popen(
                cmd,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
                env={**os.environ, **KEY_ENV, "PYTHONUNBUFFERED": "1"},
                start_new_session=True,
            )
        threading.Thread(target=self._pump, args=(events,), daemon=True).start()

    def _pump(self, events: queue.Queue) -> None:
        assert self.p.stdout is not None
        for line in self.p.stdout:
            if line.startswith("{"):
                events.put(json.loads(line))

    def send(self, text: str) -> None:
        assert self.p.stdin is not None
        self.p.stdin.write(text + "\n")
        self.p.stdin.flush()

    def close(self, timeout_s: float = 60) -> None:
        if self.p.stdin is not None and not self.p.stdin.closed:
            self.p.stdin.close()
        try:
            self.p.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.p.pid, 9)
            self.p.wait()


def wait_events(events: queue.Queue, want: Any, timeout_s: float, got: list[dict]) -> None:
    """Collect events into ``got`` until ``want(got)`` holds; ``RuntimeError`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not want(got):
        left = deadline - time.monotonic()
        if left <= 0:
            raise RuntimeError(f"timed out waiting; last events: {got[-5:]}")
        try:
            got.append(events.get(timeout=min(left, 1.0)))
        except queue.Empty:
            continue


def make_versions(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """Train the model ``--versions`` AdamW steps and save each bf16 serving copy."""
    import torch
    from safetensors.torch import save_file

    sys.path.insert(0, str(Path(__file__).parent))
    from shipyard.config.schema import ModelConfig
    from weight_codec import train_versions

    cfg = ModelConfig(source="tiny") if args.model == "tiny" else ModelConfig()
    out.mkdir(parents=True, exist_ok=True)
    raw = 0
    for v, state in enumerate(train_versions(cfg, args.lr, args.versions, 2, 64, os.cpu_count() or 1)):
        save_file({k: t.contiguous() for k, t in state.items()}, out / f"v{v:04d}.safetensors")
        raw = sum(t.numel() * t.element_size() for t in state.values())
    torch.set_num_threads(os.cpu_count() or 1)
    return {"model": args.model, "raw_bytes": raw, "lr": args.lr}


def start_roles(
    args: argparse.Namespace, net: Network, port: int, work: Path, events: queue.Queue, sw_ports: set[int]
) -> list[Proc]:
    """The publisher (trainer namespace) and one region process per region namespace."""
    me = [sys.executable, str(Path(__file__).resolve())]
    common = ["--model", args.model, "--poll-s", str(args.poll_s), "--modes", args.modes]
    if not args.no_feed:  # the origin namespace is new: only SeaweedFS listens there
        free = [p for p in range(18700, 18800) if p not in sw_ports]
        common += ["--feed-ports", ",".join(str(free[i]) for i in range(len(args.modes.split(","))))]
    pub_args = ["--role", "publisher", "--endpoint", f"http://127.0.0.1:{port}"]
    pub_args += ["--versions-dir", str(work / "versions"), "--snapshot-every", str(args.snapshot_every)]
    pub_args += ["--publish-ranks", str(args.publish_ranks)]
    procs = [
        Proc("publisher", [*net.exec_prefix(net.origin), *me, *pub_args, *common], events, work / "pub.log")
    ]
    for i, ns in enumerate(net.regions):
        reg_args = ["--role", "region", "--region", f"r{i}", "--endpoint", f"http://{net.ip(i)}:{port}"]
        reg_args += [
            "--work",
            str(work / f"r{i}"),
            "--servers",
            str(args.servers),
            "--rtt-ms",
            str(args.rtt_ms),
        ]
        procs.append(Proc(ns, [*net.exec_prefix(ns), *me, *reg_args, *common], events, work / f"r{i}.log"))
    return procs


def count(got: list[dict], event: str, mode: str | None = None, v: int | None = None, start: int = 0) -> int:
    return sum(
        e["event"] == event and (mode is None or e.get("mode") == mode) and (v is None or e.get("v") == v)
        for e in got[start:]
    )


def run_mode(
    mode: str,
    args: argparse.Namespace,
    net: Network,
    pub: Proc,
    events: queue.Queue,
    got: list[dict],
    console: Console,
) -> dict:
    """Version 0 is published and relayed everywhere (not timed), then each of versions 1..N is
    published and timed until every server serves it."""
    n_reg, n_srv = len(net.regions), len(net.regions) * args.servers
    pub.send(f"{mode} 0")
    wait_events(events, lambda g: count(g, "relayed", mode, 0) == n_reg, 900, got)
    records = []
    for v in range(1, args.versions + 1):
        tx0 = [net.tx_bytes(i) for i in range(n_reg)]
        start = len(got)
        pub.send(f"{mode} {v}")
        wait_events(
            events,
            lambda g, v=v, start=start: (
                count(g, "adopted", mode, v, start) == n_srv and count(g, "relayed", mode, v, start) == n_reg
            ),  # a relay logs after its (niced) decode
            600,
            got,
        )
        time.sleep(0.2)  # the last acknowledgements drain from the links
        link = [net.tx_bytes(i) - tx0[i] for i in range(n_reg)]
        new = [e for e in got[start:] if e.get("mode") == mode]
        records.append(version_record(v, new, link, args))
        console.print(
            f"{mode} v{v}: sync {records[-1]['sync_s']:.3f} s, bound {records[-1]['bound_s']:.3f} s"
        )
    return {"versions": records, **summary(records)}


def run_all(
    args: argparse.Namespace, net: Network, port: int, work: Path, console: Console, sw_ports: set[int]
) -> dict[str, dict]:
    events: queue.Queue = queue.Queue()
    procs = start_roles(args, net, port, work, events, sw_ports)
    got: list[dict] = []
    try:
        wait_events(events, lambda g: count(g, "ready") == len(procs), 900, got)
        results = {
            mode: run_mode(mode, args, net, procs[0], events, got, console) for mode in args.modes.split(",")
        }
    finally:
        for p in procs:
            p.close()
    for e in got + [events.get() for _ in range(events.qsize())]:
        if e["event"] == "bye" and e["errors"]:
            console.print(f"[yellow]{e['region']} recovered from: {e['errors']}")
    return results


def version_record(v: int, new: list[dict], link_bytes: list[int], args: argparse.Namespace) -> dict:
    published = next(e for e in new if e["event"] == "published" and e["v"] == v)
    adopted = [e for e in new if e["event"] == "adopted" and e["v"] == v]
    relayed = [e for e in new if e["event"] == "relayed" and e["v"] == v]
    rate = args.rate_mbit * 1e6 / 8
    return {
        "version": v,
        "kind": "snapshot" if "snapshot" in " ".join(x for e in adopted for x in e["path"]) else "delta",
        "shipped_bytes": published["shipped"],
        "raw_bytes": published["raw"],
        "publish_s": published["t1"] - published["t0"],
        "relay_s": max(e["t"] for e in relayed) - published["t0"] if relayed else None,
        "sync_s": max(e["t"] for e in adopted) - published["t0"],
        "after_publish_s": max(e["t"] for e in adopted) - published["t1"],
        "bound_s": published["shipped"] / rate + args.rtt_ms / 1000,
        "link_bytes": link_bytes,
        "pauses_s": [e["pause"] for e in adopted if e["pause"] is not None],
        "ready_s": [round(e["ready_s"], 4) for e in adopted],
        "latest_s": published["latest_at"] - published["t0"],
        "relay_phases_s": {
            k: [round(e[k] - published["t0"], 4) for e in relayed]
            for k in ("sync_at", "fetched_at", "t", "decoded_at")
        },
        "paths": sorted({" ".join(e["path"]) for e in adopted}),
        "recovered": sum(e["errors"] for e in adopted),
    }


def summary(records: list[dict]) -> dict:
    pauses = sorted(p for r in records for p in r["pauses_s"])
    p99 = pauses[min(len(pauses) - 1, int(0.99 * len(pauses)))] if pauses else None
    return {
        "sync_s": statistics.median(r["sync_s"] for r in records),
        "sync_max_s": max(r["sync_s"] for r in records),
        "publish_s": statistics.median(r["publish_s"] for r in records),
        "after_publish_s": statistics.median(r["after_publish_s"] for r in records),
        "bound_s": statistics.median(r["bound_s"] for r in records),
        "shipped_bytes": statistics.median(r["shipped_bytes"] for r in records),
        "link_bytes_per_region": statistics.median(b for r in records for b in r["link_bytes"]),
        "pause_p50_s": statistics.median(pauses) if pauses else None,
        "pause_p99_s": p99,
    }


def table(results: dict[str, dict], args: argparse.Namespace) -> Table:
    t = Table(
        title=f"weight sync: {args.regions} regions x {args.servers} servers, {args.rate_mbit:g} Mbit/s "
        f"links (tbf), RTT {args.rtt_ms:g} ms (emulated in-process)"
    )
    for col in (
        "mode",
        "shipped MB",
        "link MB/region",
        "sync s (median)",
        "sync s (max)",
        "publish s",
        "after publish s",
        "bound s",
        "sync / bound",
        "pause p50 ms",
        "pause p99 ms",
    ):
        t.add_column(col, justify="right")
    for mode, r in results.items():
        t.add_row(
            mode,
            f"{r['shipped_bytes'] / 1e6:.3f}",
            f"{r['link_bytes_per_region'] / 1e6:.3f}",
            f"{r['sync_s']:.3f}",
            f"{r['sync_max_s']:.3f}",
            f"{r['publish_s']:.3f}",
            f"{r['after_publish_s']:.3f}",
            f"{r['bound_s']:.3f}",
            f"{r['sync_s'] / r['bound_s']:.2f}",
            f"{(r['pause_p50_s'] or 0) * 1e3:.1f}",
            f"{(r['pause_p99_s'] or 0) * 1e3:.1f}",
        )
    return t


def parse_args() -> argparse.Namespace:
    ap = parser(__doc__)  # --quick: tiny model, 3 versions, 100 Mbit/s (< 1 minute)
    ap.add_argument("--regions", type=int, default=3)
    ap.add_argument("--servers", type=int, default=1, help="inference servers per region")
    ap.add_argument("--versions", type=int, default=None, help="versions shipped (default 5, quick 3)")
    ap.add_argument("--rate-mbit", type=float, default=None, help="link rate (default 1000, quick 100)")
    ap.add_argument("--rtt-ms", type=float, default=100.0, help="long-haul round trip (emulated in-process)")
    ap.add_argument("--lr", type=float, default=1e-6)
    ap.add_argument("--snapshot-every", type=int, default=10)
    ap.add_argument("--publish-ranks", type=int, default=2, help="encoder processes of the sharded mode")
    ap.add_argument("--poll-s", type=float, default=0.02)
    ap.add_argument(
        "--modes", default=",".join(MODES), help="modes run, comma-separated (both for the results)"
    )
    ap.add_argument(
        "--no-feed",
        action="store_true",
        help="relays and servers only poll (no version feed pushing each version as it is committed)",
    )
    ap.add_argument("--role", choices=["main", "publisher", "region"], default="main", help="internal")
    internal_args = (
        "--endpoint",
        "--root",
        "--mode",
        "--model",
        "--versions-dir",
        "--region",
        "--work",
        "--feed-ports",
    )
    for internal in internal_args:
        ap.add_argument(internal, help="internal (set by the driver for its role processes)")
    args = ap.parse_args()
    if args.role == "main":
        args.versions = args.versions or (3 if args.quick else 5)
        args.rate_mbit = args.rate_mbit or (100.0 if args.quick else 1000.0)
        args.model = args.model or ("tiny" if args.quick else "smollm2")
        if min(args.regions, args.servers, args.versions) < 1 or args.rate_mbit <= 0 or args.rtt_ms < 0:
            raise ValueError("--regions, --servers, --versions must be >= 1, --rate-mbit > 0, --rtt-ms >= 0")
    return args


def results_json(results: dict[str, dict], args: argparse.Namespace, info: dict) -> dict:
    ours, base = results["ours"], results["baseline"]
    keys = (
        "quick",
        "versions",
        "rate_mbit",
        "rtt_ms",
        "lr",
        "snapshot_every",
        "poll_s",
        "servers",
        "no_feed",
    )
    return {
        **{k: ours[k] for k in ("sync_s", "bound_s", "pause_p50_s", "pause_p99_s")},
        "regions": args.regions,
        "servers_per_region": args.servers,
        "sync_over_bound": ours["sync_s"] / ours["bound_s"],
        "speedup_vs_baseline": base["sync_s"] / ours["sync_s"],
        "sharded_publish_sync_s": results["sharded"]["sync_s"],
        "sharded_publish_s": results["sharded"]["publish_s"],
        "single_publish_s": ours["publish_s"],
        "publish_ranks": args.publish_ranks,
        "link_bytes_per_region": ours["link_bytes_per_region"],
        "baseline": {k: v for k, v in base.items() if k != "versions"},
        "ours": {k: v for k, v in ours.items() if k != "versions"},
        "sharded": {k: v for k, v in results["sharded"].items() if k != "versions"},
        "per_version": {m: results[m]["versions"] for m in MODES},
        "config": {**{k: getattr(args, k) for k in keys}, **info},
        "network": "veth pairs between network namespaces, tc tbf at rate_mbit both ways; RTT emulated "
        "in-process (sch_netem is not available in this kernel); all processes share one machine's CPUs",
        "load_avg": os.getloadavg()[0],
    }


def main() -> None:
    args = parse_args()
    if args.role == "publisher":
        return role_publisher(args)
    if args.role == "region":
        return role_region(args)
    why = check_network_support()
    if why is not None:
        raise SystemExit(f"weight_sync: network namespaces with tc are required here: {why}")
    from shipyard.store.seaweed import SeaweedServer

    console = Console(width=None if Console().is_terminal else 200)
    work = Path(tempfile.mkdtemp(prefix="shipyard-weight-sync-"))
    net = Network(args.regions, args.rate_mbit)
    results: dict[str, dict] = {}
    try:
        console.print(f"training {args.versions} versions of {args.model} (lr {args.lr:g}) ...")
        info = make_versions(args, work / "versions")
        net.up()
        origin = net.exec_prefix(net.origin)
        with SeaweedServer(work / "seaweed", host="127.0.0.1", bind="0.0.0.0", prefix=origin) as sw:
            results = run_all(args, net, sw.ports["s3.port"], work, console, set(sw.ports.values()))
    finally:
        net.down()
    console.print(table(results, args))
    if set(results) == set(MODES):
        write_results(args, "weight_sync", results_json(results, args, info))
    else:  # a run of one mode (development) writes its raw records only
        write_results(
            args,
            "weight_sync_partial",
            {"partial": results, "config": {k: str(v) for k, v in vars(args).items()}},
        )
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
