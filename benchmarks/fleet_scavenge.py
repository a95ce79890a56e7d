"""Scavenging: RL rollouts on a server that serves production first, driven by a diurnal trace.

One real inference server (the demo's SmolLM2-135M in bf16 where the CPU has bf16 units, packed
linears, ``--threads`` torch threads, 16 slots) answers real HTTP requests. A diurnal production
trace (:class:`shipyard.fleet.trace.DiurnalTrace`: a cosine day/night swing from ``night_rps`` to
``day_rps`` over ``--period`` seconds, ``--periods`` times, with Poisson bursts; log-normal prompts,
32-64 generated tokens) is replayed as ``production`` requests; RL demand is 16 ``scavenger``
requests always in flight (300-token prompts, 128 tokens each: what rollout workers ask). Every arm
replays the same trace:

- ``capacity``: RL alone, no production: the server's RL throughput (tokens/s) when it has nothing else;
- ``production_only``: the trace with no RL (the reference latencies);
- ``shared_fifo``: the trace with RL on a server without tiers (``inference.scavenge.enabled = false``:
  every request alike, in arrival order) - what sharing costs production without a scheduler;
- ``tiers_k<K>``: the trace with RL on a tiered server (``inference.scavenge``: preempt, at most K
  scavenger rows next to production), one arm per ``--rows``; ``tiers_k<K>_r<S>`` with
  ``resume_after_s = S`` (``--resume-after``; the default's arm has no suffix).

Per arm: production latency p50/p90/p99 (send to result), ``production_p99_ratio`` (arm p99 /
production_only p99), RL tokens generated during the trace, and two shares of what production left:
``idle_capacity_harvested_frac`` = RL tokens / (capacity tokens/s x the seconds the server had no
production request waiting or running: its idle time), and the stricter
``spare_throughput_harvested_frac`` = RL tokens / (capacity tokens/s x trace seconds - production
tokens), which also counts the slots production leaves free while it runs; preemptions; and
``rl_yield_p99_s``: per production arrival that found scavenger rows over their allowance, seconds
until the last of them left the batch.
Prints the table, plots the trace, RL throughput and production latencies over time
(``docs/fleet_scavenge.png``), and writes ``benchmarks/results/fleet_scavenge.json`` and the
``scavenging`` section of ``fleet.json`` (top level: the arm with ``inference.scavenge``'s defaults).

    python benchmarks/fleet_scavenge.py           # SmolLM2-135M, 2 days of 120 s (~17 min)
    python benchmarks/fleet_scavenge.py --day-rps 0.8   # the busier trace of the first run (81% busy)
    python benchmarks/fleet_scavenge.py --quick   # tiny model, one short day (< 1 min)
"""

from __future__ import annotations

import statistics
import threading
import time
from pathlib import Path
from typing import Any

import harness
from shipyard.config import load_config
from shipyard.config.schema import ScavengeConfig
from shipyard.fleet.trace import DiurnalTrace, ScavengerLoad, Served, replay

ROOT = Path(__file__).resolve().parents[1]
PLOT = ROOT / "docs" / "fleet_scavenge.png"


def engine(quick: bool, threads: int) -> Any:
    import torch

    from shipyard.inference.engine import EmbeddedEngine
    from shipyard.models.loading import load_model
    from shipyard.models.precision import engine_precision

    cfg = load_config(ROOT / ("configs/tiny.toml" if quick else "configs/demo.toml"), [])
    torch.set_num_threads(threads)
    model, tok = load_model(cfg.model)
    precision = engine_precision(model, cfg.inference)
    eng = EmbeddedEngine(model, tok, max_batch=16, prefix_cache_mb=512, packed=True)
    harness.console.print(f"engine: {precision}, {threads} threads, 16 slots")
    return eng


class Arm:
    """One server (tiers or not) with an optional RL load, sampled every second while it runs."""

    def __init__(self, eng: Any, scavenge: ScavengeConfig | None, rl: bool) -> None:
        from shipyard.inference.client import HttpInferenceClient
        from shipyard.inference.server import InferenceServer

        self.server = InferenceServer(eng, scavenge=scavenge, drain_s=0.0).start()
        self.scheduler = self.server.app.state.scheduler
        self.client = HttpInferenceClient(self.server.url)
        self.load = ScavengerLoad(HttpInferenceClient(self.server.url).generate) if rl else None
        self.samples: list[tuple[float, int]] = []
        self._stop = threading.Event()

    def rl_tokens(self) -> int:
        stats = self.scheduler.tier_stats
        return stats.scavenger_tokens if self.scheduler.scavenge is not None else self.load_tokens()

    def load_tokens(self) -> int:
        return 0 if self.load is None else self.load.tokens

    def _sample(self, t0: float) -> None:
        while not self._stop.wait(1.0):
            self.samples.append((time.monotonic() - t0, self.rl_tokens()))

    def run(self, trace: DiurnalTrace | None, seconds: float, warm_s: float) -> dict[str, Any]:
        if self.load is not None:
            self.load.start()
            time.sleep(warm_s)
        t0, tok0 = time.monotonic(), self.rl_tokens()
        sampler = threading.Thread(target=self._sample, args=(t0,), daemon=True)
        sampler.start()
        served = replay(trace.arrivals(), self.client.generate, trace.seed) if trace else []
        time.sleep(max(0.0, t0 + seconds - time.monotonic()))
        wall, rl = time.monotonic() - t0, self.rl_tokens() - tok0
        self._stop.set()
        if self.load is not None:
            self.load.stop()
        self.server.stop()
        return {"served": served, "wall_s": wall, "rl_tokens": rl, "samples": self.samples}


def arm_figures(
    out: dict[str, Any], base: dict[str, Any] | None, capacity: float, stats: Any
) -> dict[str, Any]:
    """An arm's figures; ``base``: the production_only arm's (None for itself)."""
    served: list[Served] = out["served"]
    lat = sorted(s.latency_s for s in served if s.error is None)
    prod_tokens = sum(s.tokens for s in served)
    spare = capacity * out["wall_s"] - prod_tokens
    busy = stats.production_busy_s if stats is not None else base["production_busy_s"] if base else 0.0
    idle_s = out["wall_s"] - busy
    fig: dict[str, Any] = {
        "requests": len(served),
        "errors": sum(s.error is not None for s in served),
        "p50_s": _q(lat, 0.5),
        "p90_s": _q(lat, 0.9),
        "p99_s": _q(lat, 0.99),
        "production_tokens": prod_tokens,
        "rl_tokens": out["rl_tokens"],
        "rl_tok_s": out["rl_tokens"] / out["wall_s"],
        "production_busy_s": busy,
        "idle_capacity_harvested_frac": out["rl_tokens"] / (capacity * idle_s) if idle_s > 0 else 0.0,
        "spare_throughput_harvested_frac": out["rl_tokens"] / spare if spare > 0 else 0.0,
        "wall_s": out["wall_s"],
    }
    if base is not None:
        fig["production_p99_ratio"] = fig["p99_s"] / base["p99_s"]
    if stats is not None and out["rl_tokens"]:
        fig["preemptions"] = stats.preemptions
        fig["yields"] = len(stats.yields_s)
        fig["rl_yield_p50_s"] = _q(sorted(stats.yields_s), 0.5)
        fig["rl_yield_p99_s"] = _q(sorted(stats.yields_s), 0.99)
    return fig


def _q(xs: list[float], q: float) -> float:
    """The ``q`` quantile (nearest rank) of sorted ``xs``; 0 for none."""
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else 0.0


def plot(trace: DiurnalTrace, outs: dict[str, dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(10, 6.5), sharex=True)
    bursts = trace.bursts()
    ts = [i * trace.duration_s / 600 for i in range(601)]
    ax1.plot(ts, [trace.rate(t, bursts) for t in ts], color="black", label="production requests/s (trace)")
    ax1.set_ylabel("production req/s")
    ax1b = ax1.twinx()
    for name, out in outs.items():
        if name in ("capacity", "production_only") or not out["samples"]:
            continue
        (t, n) = zip(*out["samples"], strict=True)
        rate = [(n[i] - n[i - 1]) / (t[i] - t[i - 1]) for i in range(1, len(t))]
        ax1b.plot(t[1:], _smooth(rate), label=f"RL tokens/s, {name}")
    ax1b.set_ylabel("RL tokens/s (5 s mean)")
    ax1.legend(loc="upper left", fontsize=8)
    ax1b.legend(loc="upper right", fontsize=8)
    for name, out in outs.items():
        if name == "capacity":
            continue
        served = out["served"]
        ax2.scatter([s.sent for s in served], [s.latency_s for s in served], s=6, label=name)
    ax2.set_ylabel("production latency (s)")
    ax2.set_xlabel("seconds into the trace")
    ax2.legend(fontsize=8)
    fig.suptitle("scavenging: production first, RL in the idle capacity")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _smooth(xs: list[float], k: int = 5) -> list[float]:
    return [statistics.fmean(xs[max(0, i - k + 1) : i + 1]) for i in range(len(xs))]


def run_arms(args: Any, eng: Any, trace: DiurnalTrace) -> dict[str, dict[str, Any]]:
    """Every arm, one after another, on the same engine and trace."""
    outs: dict[str, dict[str, Any]] = {}
    stats: dict[str, Any] = {}
    harness.console.print(f"capacity: RL alone for {args.capacity_s:.0f} s")
    outs["capacity"] = Arm(eng, ScavengeConfig(enabled=True), rl=True).run(None, args.capacity_s, args.warm_s)
    arms: list[tuple[str, ScavengeConfig | None, bool]] = [
        ("production_only", ScavengeConfig(enabled=True), False),
        ("shared_fifo", None, True),
    ]
    default_resume = ScavengeConfig().resume_after_s
    arms += [
        (
            f"tiers_k{k}" + ("" if r == default_resume else f"_r{r:g}"),
            ScavengeConfig(enabled=True, rows_with_production=k, resume_after_s=r),
            True,
        )
        for k in args.rows
        for r in args.resume_after
    ]
    for name, scavenge, rl in arms:
        harness.console.print(f"{name}: the trace ({trace.duration_s:.0f} s){' with RL' if rl else ''}")
        arm = Arm(eng, scavenge, rl)
        outs[name] = arm.run(trace, trace.duration_s, args.warm_s)
        stats[name] = arm.scheduler.tier_stats if scavenge is not None else None
    outs["_stats"] = stats  # type: ignore[assignment]
    return outs


def main() -> None:
    ap = harness.parser(__doc__)
    ap.add_argument(
        "--period", type=float, default=None, help="seconds of one compressed day (120; quick 12)"
    )
    ap.add_argument("--periods", type=int, default=None, help="days replayed (2; quick 1)")
    ap.add_argument(
        "--rows", type=int, nargs="+", default=None, help="rows_with_production per tiers arm (0 4)"
    )
    ap.add_argument("--threads", type=int, default=2, help="torch threads of the server")
    ap.add_argument(
        "--resume-after",
        type=float,
        nargs="+",
        default=None,
        help="inference.scavenge.resume_after_s per tiers arm (the default's)",
    )
    ap.add_argument(
        "--day-rps",
        type=float,
        default=0.45,
        help="production requests/s at the day's peak (0.45: the server busy about half the trace, "
        "a fleet sized for its peak; 0.8 keeps it busy 81%%)",
    )
    args = ap.parse_args()
    args.rows = args.rows or ([0] if args.quick else [0, 4])
    args.resume_after = args.resume_after or [ScavengeConfig().resume_after_s]
    args.capacity_s = 6.0 if args.quick else 60.0
    args.warm_s = 1.0 if args.quick else 5.0
    trace = DiurnalTrace(
        period_s=args.period or (12.0 if args.quick else 120.0),
        periods=args.periods or (1 if args.quick else 2),
        **(
            {"night_rps": 0.5, "day_rps": 4.0, "burst_rps": 6.0, "burst_s": 1.0}
            if args.quick
            else {"day_rps": args.day_rps}
        ),
    )
    eng = engine(args.quick, args.threads)
    outs = run_arms(args, eng, trace)
    stats = outs.pop("_stats")
    cap = outs["capacity"]
    capacity = cap["rl_tokens"] / cap["wall_s"]
    base = arm_figures(outs["production_only"], None, capacity, stats["production_only"])
    arms = {"production_only": base}
    for name in outs:
        if name not in ("capacity", "production_only"):
            arms[name] = arm_figures(outs[name], base, capacity, stats[name])
    harness.table(f"production first, RL in the idle capacity (capacity {capacity:.0f} RL tokens/s)", arms)
    plot(trace, outs, PLOT if not args.quick else args.out / "fleet_scavenge_quick.png")
    default = f"tiers_k{ScavengeConfig().rows_with_production}"
    headline = arms.get(default, arms[f"tiers_k{args.rows[0]}"])
    figures = {
        "trace": {**trace.__dict__, "requests": len(trace.arrivals()), "bursts": len(trace.bursts())},
        "capacity_rl_tok_s": capacity,
        "server": {"threads": args.threads, "max_batch": 16, "quick_model": args.quick},
        "arms": arms,
        "headline_arm": default if default in arms else f"tiers_k{args.rows[0]}",
        "production_p99_ratio": headline["production_p99_ratio"],
        "idle_capacity_harvested_frac": headline["idle_capacity_harvested_frac"],
        "rl_yield_p99_s": headline["rl_yield_p99_s"],
    }
    harness.write_results(args, "fleet_scavenge", figures)
    top = ("production_p99_ratio", "idle_capacity_harvested_frac", "rl_yield_p99_s")
    harness.merge_fleet(args, "scavenging", figures, {k: figures[k] for k in top})


if __name__ == "__main__":
    main()
