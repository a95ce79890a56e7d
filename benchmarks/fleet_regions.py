"""Regions: three inference regions behind tc-limited links, one cut off for 60 s mid-run.

A run of the tiny model as separate processes in Linux network namespaces: the trainer's namespace
holds a real SeaweedFS S3 server (the origin store) and ``shipyard trainer``; each of three region
namespaces (``us``, ``eu``, ``ap``), joined to the trainer's by its own veth pair shaped with
``tc tbf`` to ``--rate-mbit``, runs ``shipyard region fleet.region=<name>`` (its entry of
``fleet.regions``: :mod:`shipyard.fleet.region`), which runs the region's ``shipyard relay``
(origin -> the region's mirror directory), ``shipyard serve`` (following the mirror) and ``shipyard
worker`` (its batches go to the origin over the link), and restarts any of them that exits with an
error after ``--restart-s``; this driver does the same for the trainer. No step is manual. Once the trainer has trained 10 steps, region ``eu``'s link is taken down for 60 s (both
ends of the veth), then brought back; the run goes on for 20 more steps and is stopped.

Figures, from the trainer's metrics and the origin store (``benchmarks/results/fleet_regions.json``
and the ``regions`` section of ``fleet.json``): per region, ``adoption_lag_p50_s`` (publication to
the region's server going live, from the adoptions its batches reported), ``staleness_p95`` (over
the groups trained: the trainer's version minus the group's oldest sampled token's), groups trained
and versions adopted; ``samples_over_bound_trained`` (trajectories trained with a token more than
``trainer.max_off_policy_steps`` versions old: the trainer's audit ``rollout/over_bound_trained``,
summed, and recomputed here from the stored batches), ``dropped_stale``, and for the cut region:
the version it held when cut, its newest version and the trainer's when the link came back, how
long it took to serve the trainer's version again (``rejoin_s``), and the groups it gave after.
Plot: adopted version per region over time against the trainer's, the partition shaded
(``docs/fleet_regions.png``).

Limits: one machine: every namespace shares its 2 cores, so the regions compete for CPU as they
would not across machines; the kernel has no ``sch_netem`` (no added round-trip time); the tiny
random model (nothing is learned: this measures versions and staleness). Needs root.

    sudo .venv/bin/python benchmarks/fleet_regions.py           # 60 s partition, ~4 min
    sudo .venv/bin/python benchmarks/fleet_regions.py --quick   # 15 s partition, 4 + 8 steps
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import harness
from chaos import _quiet, _until
from shipyard.fleet.region import Supervised
from weight_sync import Network, _sh, check_network_support

ROOT = Path(__file__).resolve().parents[1]
RUN = "regions"
REGIONS = ("us", "eu", "ap")
CUT = "eu"
S3_ENV = {"REGIONS_S3_KEY": "regions", "REGIONS_S3_SECRET": "regions"}
PLOT = ROOT / "docs" / "fleet_regions.png"


class RegionsRun:
    """The run's namespaces, store and processes under ``work``."""

    def __init__(self, args: Any, work: Path, net: Network, s3_port: int) -> None:
        self.args, self.work, self.net, self.s3_port = args, work, net, s3_port
        self.procs: dict[str, Supervised] = {}
        self.common = [
            f"run.name={RUN}",
            f'run.output_dir="{work / "runs"}"',
            "store.type=s3",
            'store.root="shipyard-regions/origin"',
            "store.key_env=REGIONS_S3_KEY",
            "store.secret_env=REGIONS_S3_SECRET",
            "store.timeout_s=10",
            "trainer.steps=100000",
            f"trainer.groups_per_step={len(REGIONS)}",
            "trainer.max_off_policy_steps=2",
            "trainer.wait_timeout_s=900",
            f"rollout.num_workers={len(REGIONS)}",
            "rollout.group_size=2",
            "rollout.concurrency=2",
            "tasks.num_generated=24",
            "weights.keep=100000",
            "relay.poll_s=0.2",
            "inference.poll_s=0.2",
            "sandbox.pool.warm=1",
            "fleet.regions=["
            + ",".join(
                f'{{name="{n}",mirror_root="{work / f"mirror-{n}"}",restart_s={args.restart_s}}}'
                for n in REGIONS
            )
            + "]",
        ]

    def cli(self, ns: str | None, command: str, *extra: str) -> list[str]:
        """The command line of a component, in namespace ``ns`` (None: this process's, the origin's)."""
        return [
            *(self.net.exec_prefix(ns) if ns else []),
            sys.executable,
            "-m",
            "shipyard.cli",
            command,
            str(ROOT / "configs/tiny.toml"),
            *self.common,
            *extra,
        ]

    def start(self) -> None:
        logs = self.work / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        r = self.args.restart_s
        origin = f'store.endpoint_url="http://127.0.0.1:{self.s3_port}"'
        self.procs["trainer"] = Supervised(
            "trainer", self.cli(None, "trainer", origin), logs / "trainer.log", r
        )
        self.procs["trainer"].start()
        _until(self._claimed, 180, "the trainer claiming the run")
        for i, name in enumerate(REGIONS):  # each region is one `shipyard region`: relay, server, worker
            store = f'store.endpoint_url="http://{self.net.ip(i)}:{self.s3_port}"'
            argv = self.cli(self.net.regions[i], "region", store, f"fleet.region={name}")
            self.procs[name] = Supervised(name, argv, logs / f"{name}-region.log", r)
            self.procs[name].start()

    def restarts(self) -> dict[str, int]:
        """Restarts per process: the trainer's by this driver, the regions' by their `shipyard region`."""
        out = {name: p.restarts for name, p in self.procs.items()}
        for name in REGIONS:
            for log in sorted((self.work / "runs" / f"region-{name}").glob("*.log")):
                out[f"{name}/{log.stem}"] = (
                    (self.work / "logs" / f"{name}-region.log")
                    .read_text()
                    .count(f"{name}/{log.stem} exited with code")
                )
        return out

    def _claimed(self) -> bool:
        return _quiet(self.origin) is not None

    def origin(self) -> Any:
        from shipyard.config.schema import StoreConfig
        from shipyard.store.run import open_run

        cfg = StoreConfig(
            type="s3",
            root="shipyard-regions/origin",
            endpoint_url=f"http://127.0.0.1:{self.s3_port}",
            key_env="REGIONS_S3_KEY",
            secret_env="REGIONS_S3_SECRET",
            timeout_s=10,
        )
        return open_run(cfg, RUN)

    def supervise(self) -> None:
        for p in self.procs.values():
            p.supervise()

    def stop(self) -> None:
        for name in [n for n in self.procs if n != "trainer"] + ["trainer"]:
            self.procs[name].stop()

    def trainer_step(self) -> int:
        return max((r["step"] for r in self.metrics() if r.get("kind") == "train"), default=0)

    def metrics(self) -> list[dict[str, Any]]:
        from shipyard.metrics.logger import read_metrics

        path = self.work / "runs" / RUN / "metrics.jsonl"
        return read_metrics(path) if path.exists() else []


def enter_netns(name: str) -> None:
    """Move this process (its only thread, and every process it starts) into network namespace ``name``."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/var/run/netns/{name}", os.O_RDONLY)
    try:
        if libc.setns(fd, 0x40000000) != 0:  # CLONE_NEWNET
            raise OSError(ctypes.get_errno(), f"setns into {name} failed")
    finally:
        os.close(fd)


def link(net: Network, i: int, up: bool) -> None:
    """Both ends of region ``i``'s veth up or down (down: the region is cut off from the origin)."""
    state = "up" if up else "down"
    o, r = net.links[i]
    _sh("ip", "-n", net.origin, "link", "set", o, state)
    _sh("ip", "-n", net.regions[i], "link", "set", r, state)


def drive(run: RegionsRun, args: Any) -> dict[str, Any]:
    """Run to step ``cut_at``, cut ``CUT`` off for ``partition_s``, then run ``after_steps`` more steps
    (the run is then stopped: ``trainer.steps`` is set out of reach, so the end is not a race)."""
    i = REGIONS.index(CUT)
    _until(lambda: run.trainer_step() >= args.cut_at, 900, f"step {args.cut_at}", run.supervise)
    cut = {"at": time.time(), "trainer_step": run.trainer_step()}
    link(run.net, i, up=False)
    harness.console.print(f"cut {CUT} off at trainer step {cut['trainer_step']} for {args.partition_s:.0f} s")
    _until(
        lambda: time.time() - cut["at"] >= args.partition_s,
        args.partition_s + 60,
        "the partition",
        run.supervise,
    )
    link(run.net, i, up=True)
    cut |= {"end": time.time(), "trainer_step_at_end": run.trainer_step()}
    harness.console.print(f"{CUT} back at trainer step {cut['trainer_step_at_end']}")
    last = cut["trainer_step_at_end"] + args.after_steps
    _until(lambda: run.trainer_step() >= last, 1800, f"step {last}", run.supervise)
    return cut


def audit(run: RegionsRun, cut: dict[str, Any], bound: int) -> dict[str, Any]:
    """Per-region figures from the metrics and the origin store (module doc)."""
    from shipyard.rollout.types import RolloutBatch

    store = run.origin()
    batches = [RolloutBatch.from_bytes(store.get(k)) for k in store.list("rollouts/")]
    region_of = {gid: b.region for b in batches for gid in b.groups()}
    oldest = {
        gid: min(t.min_version() for t in g if t.num_sampled())
        for b in batches
        for gid, g in b.groups().items()
    }
    records = run.metrics()
    consumed = {r["step"]: r["groups"] for r in records if r.get("kind") == "consumed"}
    trained = [(step, gid) for step, gids in sorted(consumed.items()) for gid in gids]
    stale = {
        name: sorted(step - 1 - oldest[gid] for step, gid in trained if region_of[gid] == name)
        for name in REGIONS
    }
    over = sum(step - 1 - oldest[gid] > bound for step, gid in trained)
    adoptions = {(a["server"], a["version"]): {**a, "region": b.region} for b in batches for a in b.adoptions}
    per_region: dict[str, Any] = {}
    for name in REGIONS:
        ev = sorted((a for a in adoptions.values() if a["region"] == name), key=lambda a: a["at"])
        lags = sorted(a["at"] - a["published_at"] for a in ev if a.get("published_at") is not None)
        per_region[name] = {
            "groups_trained": len(stale[name]),
            "staleness_p95": _q(stale[name], 0.95),
            "staleness_max": max(stale[name], default=0),
            "adoption_lag_p50_s": _q(lags, 0.5),
            "adoption_lag_p95_s": _q(lags, 0.95),
            "versions_adopted": len(ev),
            "adoptions": [(a["at"], a["version"]) for a in ev],
        }
    train = [r for r in records if r.get("kind") == "train"]
    steps_at = [(r["time"], r["step"]) for r in train if "time" in r]
    return {
        "regions": per_region,
        "samples_over_bound_trained": int(sum(r.get("rollout/over_bound_trained", 0) for r in train)),
        "samples_over_bound_trained_recomputed": over,
        "dropped_stale": int(sum(r.get("rollout/dropped_stale", 0) for r in train)),
        "steps": len(train),
        "trainer_steps_at": steps_at,
        "partition": _rejoin(cut, per_region[CUT], trained, region_of, steps_at),
    }


def _rejoin(
    cut: dict[str, Any], region: dict[str, Any], trained: list, region_of: dict, steps_at: list
) -> dict:
    """How the cut region came back: versions held, time to serve the trainer's version again."""
    held = max((v for t, v in region["adoptions"] if t <= cut["at"]), default=0)
    at_end = max((v for t, v in region["adoptions"] if t <= cut["end"]), default=0)
    caught = next(
        (t for t, v in region["adoptions"] if t > cut["end"] and v >= _trainer_version(steps_at, t) - 1), None
    )
    after = [
        gid for step, gid in trained if region_of[gid] == CUT and _step_time(steps_at, step) > cut["end"]
    ]
    return {
        "region": CUT,
        "seconds": cut["end"] - cut["at"],
        "trainer_step_at_cut": cut["trainer_step"],
        "trainer_step_at_end": cut["trainer_step_at_end"],
        "version_held_at_cut": held,
        "version_at_end": at_end,
        "rejoin_s": None if caught is None else caught - cut["end"],
        "steps_during_cut": cut["trainer_step_at_end"] - cut["trainer_step"],
        "longest_step_gap_during_cut_s": _longest_gap(steps_at, cut["at"], cut["end"]),
        "groups_trained_after": len(after),
        "rejoined": caught is not None and len(after) > 0,
    }


def _longest_gap(steps_at: list, start: float, end: float) -> float:
    """The longest wait between consecutive trainer steps over [start, end] (a stalled trainer's)."""
    times = sorted(ts for ts, _ in steps_at)
    edges = [start, *(t for t in times if start < t < end), end]
    before = [t for t in times if t <= start]
    after = [t for t in times if t >= end]
    if before:
        edges[0] = before[-1]
    if after:
        edges[-1] = after[0]
    return max(b - a for a, b in zip(edges, edges[1:], strict=False))


def _trainer_version(steps_at: list, t: float) -> int:
    return max((s for ts, s in steps_at if ts <= t), default=0)


def _step_time(steps_at: list, step: int) -> float:
    return next((ts for ts, s in steps_at if s == step), float("inf"))


def _q(xs: list[float], q: float) -> float:
    return float(xs[min(len(xs) - 1, int(q * len(xs)))]) if xs else 0.0


def plot(fig: dict[str, Any], cut: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t0 = min(t for t, _ in fig["trainer_steps_at"])
    ax = plt.figure(figsize=(9, 4.5)).gca()
    ax.step(
        [t - t0 for t, _ in fig["trainer_steps_at"]],
        [s for _, s in fig["trainer_steps_at"]],
        where="post",
        color="black",
        label="trainer version",
    )
    for name, r in fig["regions"].items():
        ax.step(
            [t - t0 for t, _ in r["adoptions"]],
            [v for _, v in r["adoptions"]],
            where="post",
            label=f"{name}: served version",
        )
    ax.axvspan(cut["at"] - t0, cut["end"] - t0, color="red", alpha=0.12, label=f"{CUT} cut off")
    ax.set_xlabel("seconds")
    ax.set_ylabel("weights version")
    ax.legend(fontsize=8)
    ax.set_title("three regions adopting versions at their own pace; one partitioned and rejoining")
    path.parent.mkdir(parents=True, exist_ok=True)
    ax.figure.tight_layout()
    ax.figure.savefig(path, dpi=110)
    plt.close(ax.figure)


def main() -> None:
    ap = harness.parser(__doc__)
    ap.add_argument("--rate-mbit", type=float, default=100.0, help="each region's link (tbf), both ways")
    ap.add_argument("--restart-s", type=float, default=5.0, help="the supervisor's wait before a restart")
    args = ap.parse_args()
    args.cut_at, args.partition_s, args.after_steps = (4, 15.0, 8) if args.quick else (10, 60.0, 20)
    why = check_network_support()
    if why is not None:
        raise SystemExit(f"fleet_regions: network namespaces with tc are required here: {why}")
    from shipyard.store.seaweed import SeaweedServer

    os.environ.update(S3_ENV)
    work = Path(tempfile.mkdtemp(prefix="shipyard-regions-"))
    net = Network(len(REGIONS), args.rate_mbit)
    run: RegionsRun | None = None
    try:
        net.up()
        enter_netns(net.origin)  # this driver, the S3 server and the trainer live in the origin's namespace
        with SeaweedServer(work / "s3", host="127.0.0.1", bind="0.0.0.0") as sw:
            run = RegionsRun(args, work, net, sw.ports["s3.port"])
            run.start()
            cut = drive(run, args)
            run.stop()
            fig = audit(run, cut, bound=2)
    finally:
        if run is not None:
            run.stop()
        net.down()
    restarts = run.restarts()
    rows = {name: {k: v for k, v in r.items() if k != "adoptions"} for name, r in fig["regions"].items()}
    harness.table(f"regions ({args.rate_mbit:g} Mbit/s links; {CUT} cut off {args.partition_s:.0f} s)", rows)
    harness.console.print(
        {
            k: fig[k]
            for k in (
                "samples_over_bound_trained",
                "samples_over_bound_trained_recomputed",
                "dropped_stale",
                "partition",
            )
        }
    )
    plot(fig, cut, PLOT if not args.quick else args.out / "fleet_regions_quick.png")
    figures = {**fig, "restarts": restarts, "rate_mbit": args.rate_mbit, "regions_count": len(REGIONS)}
    harness.write_results(args, "fleet_regions", figures)
    per = {
        n: {k: r[k] for k in ("adoption_lag_p50_s", "staleness_p95", "groups_trained")}
        for n, r in fig["regions"].items()
    }
    section = {
        "regions": len(per),
        "per_region": per,
        **{k: fig[k] for k in ("samples_over_bound_trained", "partition")},
    }
    harness.merge_fleet(args, "regions", section, {})
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
