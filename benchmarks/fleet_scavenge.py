"""Scavenging: RL rollouts on a server that serves production first, driven by a diurnal trace.

One real inference server (the demo's SmolLM2-135M in bf16 where the CPU has bf16 units, packed
linears, ``--threads`` torch threads, 16 slots) answers real HTTP requests. A diurnal production
trace (:class:`shipyard.fleet.trace.DiurnalTrace`: a cosine day/night swing from ``night_rps`` to
``day_rps`` over ``--period`` seconds, ``--periods`` times, with Poisson bursts; log-normal prompts,
32-64 generated tokens) is replayed as ``production`` requests. The RL demand (``--load``) is the
rollout worker's own sessions (``sessions``, the default since issue 41: 16 sessions of the run's
agent always in play, multi-turn, sandboxed and graded, every request a ``scavenger``, played by a
process of their own at nice 10; see :class:`SessionLoad`), or 16 random-token ``scavenger`` requests always in flight (``synthetic``:
300-token prompts, 128 tokens each, the load of the runs before it). The arms:

- ``production_only``: the trace with no RL (the reference latencies);
- ``shared_fifo``: the trace with RL on a server without tiers (``inference.scavenge.enabled = false``:
  every request alike, in arrival order) - what sharing costs production without a scheduler
  (``--no-shared`` leaves it out);
- ``tiers_k<K>``: the trace with RL on a tiered server (``inference.scavenge``: preempt, at most K
  scavenger rows next to production), one arm per ``--rows``; ``tiers_k<K>_r<S>`` with
  ``resume_after_s = S`` (``--resume-after``; the default's arm has no suffix).

Interleaved, because this 2-core VM's speed drifts as much as the effect measured (arms run one
after another differed by +-0.2 in p99 ratio from drift alone): the trace is cut into windows of
``--window`` seconds, and round k first measures the server's RL throughput alone (``capacity``,
over a window's length, ``--capacity-s``) then replays window k on every arm, in an order rotated each round (the RL load warmed up
5 s before the window's production starts; a window lasts until its last request is served). Each
arm starts with the engine's prefix cache empty: the arms replay the same production and RL prompts,
so an arm run after another would otherwise prefill them from the cache (before 2026-11-27 it did,
which favoured whichever arm ran later in a round by 1-2 s of production latency). The capacity is
the sustained rate, with the RL requests' turnover (each finished request is replaced by a fresh
one whose 300-token prompt is prefilled), as in the arms' idle time. Until 2026-11-27 it was measured
over 10 s, in which the 16 requests started together for the measurement rarely finish: a decode
rate with almost no prefills, above the sustained rate (each round's prefill share is in the JSON).

Per arm: production latency p50/p90/p99 (send to result; each with a 95% bootstrap interval over
windows, ``p50_ci95``...), ``production_p99_ratio`` (arm p99 /
production_only p99), RL tokens generated during the trace, and two shares of what production left:
``idle_capacity_harvested_frac`` = RL tokens / sum over windows of (the round's capacity tokens/s x
the seconds the server had no production request waiting or running: its idle time), and the stricter
``spare_throughput_harvested_frac`` = RL tokens / (capacity tokens/s x trace seconds - production
tokens), which also counts the slots production leaves free while it runs; preemptions; and
``rl_yield_p99_s``: per production arrival that found scavenger rows over their allowance, seconds
until the last of them left the batch. The p99 ratio and the harvest carry 95% bootstrap intervals
(windows resampled, the arm's and the reference's together).
Prints the table, plots the trace, RL throughput and production latencies over time
(``docs/fleet_scavenge.png``), and writes ``benchmarks/results/fleet_scavenge.json`` and the
``scavenging`` section of ``fleet.json`` (top level: the arm with ``inference.scavenge``'s defaults).
Each finished round is logged in ``runs/fleet_scavenge/rounds.jsonl`` (:class:`RoundLog`) as it ends,
so a run longer than a sitting is made of parts, each after the first run with ``--resume``; the
figures come from every logged round.

    python benchmarks/fleet_scavenge.py           # SmolLM2-135M, 2 days of 120 s in 8 rounds (~23 min)
    python benchmarks/fleet_scavenge.py --resume  # go on from the rounds a cut-short run logged
    python benchmarks/fleet_scavenge.py --day-rps 0.8   # the busier trace of the first run (81% busy)
    python benchmarks/fleet_scavenge.py --quick   # tiny model, one short day (< 1 min)
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import random
import statistics
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from rich.progress import track

import harness
from shipyard.config import load_config
from shipyard.config.schema import ScavengeConfig, ShipyardConfig
from shipyard.fleet.trace import Arrival, DiurnalTrace, ScavengerLoad, Served, replay, start_loops

ROOT = Path(__file__).resolve().parents[1]
PHASES = ("prefill_s", "prefix_prefill_s", "decode_s")
PLOT = ROOT / "docs" / "fleet_scavenge.png"


def engine(cfg: ShipyardConfig, threads: int) -> Any:
    import torch

    from shipyard.inference.engine.engine import EmbeddedEngine
    from shipyard.models.loading import load_model
    from shipyard.models.precision import engine_precision

    torch.set_num_threads(threads)
    model, tok = load_model(cfg.model)
    precision = engine_precision(model, cfg.inference)
    eng = EmbeddedEngine(model, tok, max_batch=16, prefix_cache_mb=512, packed=True)
    harness.console.print(f"engine: {precision}, {threads} threads, 16 slots")
    return eng


class Load(Protocol):
    """RL demand on one server: started before a window, stopped after the server is."""

    def start(self) -> Any: ...

    def stop(self) -> None: ...


LoadFactory = Callable[[str], Load]
"""A server's URL -> the RL load to put on it."""


class SessionLoad:
    """The rollout worker's own sessions as the RL load: ``concurrency`` sessions of the run's agent
    always in play (``shipyard.agent.session.run_session``: multi-turn, each in its bubblewrap
    sandbox, graded by the task's hidden tests), training tasks in turn, every request sent as a
    ``scavenger`` by the worker's client. Between turns a session runs its command and, at its end,
    its grading, so the load keeps fewer than ``concurrency`` rows in the engine at times, as a
    worker does. It runs in a :class:`SessionPlayer` process of its own, as a rollout worker does
    (in the server's process its threads took the server's GIL). ``counts``: sessions ended, of them
    crashed (shared with the parent)."""

    def __init__(
        self, cfg: ShipyardConfig, url: str, counts: Any, tok: Any, tasks: list[Any], concurrency: int = 16
    ) -> None:
        from shipyard.agent.spec import session_spec
        from shipyard.inference.client import HttpInferenceClient

        self.spec = session_spec(cfg, HttpInferenceClient(url, priority="scavenger"), tok)
        self.tasks, self.concurrency, self.counts = tasks, concurrency, counts
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def start(self) -> SessionLoad:
        self._threads = start_loops(self._loop, self.concurrency, "session-load")
        return self

    def _loop(self, k: int) -> None:
        from shipyard.agent.session import run_session

        n = 0
        while not self._stop.is_set():
            task = self.tasks[(k * 7919 + n) % len(self.tasks)]
            segments = run_session(self.spec, task, f"load-{k}-{n}", 0)
            n += 1
            with self.counts.get_lock():
                self.counts[0] += 1
                self.counts[1] += any(seg.finish == "error" for seg in segments)

    def stop(self) -> None:
        self._stop.set()
        for th in self._threads:
            th.join(120)


def _player(cfg: ShipyardConfig, conn: Any, counts: Any) -> None:
    """The :class:`SessionPlayer` process: at nice 10 (it shares this machine's two cores with the
    server, where a deployment runs its workers elsewhere), a :class:`SessionLoad` per ``start``."""
    from shipyard.envs.tasks.splits import task_splits
    from shipyard.models.loading import load_tokenizer

    os.nice(10)
    tok, tasks = load_tokenizer(cfg.model), task_splits(cfg)[0]
    load: SessionLoad | None = None
    while True:
        cmd, url = conn.recv()
        if cmd == "start":
            counts[0] = counts[1] = 0
            load = SessionLoad(cfg, url, counts, tok, tasks).start()
        elif cmd == "stop":
            if load is not None:
                load.stop()
            conn.send("stopped")
        else:
            return


class SessionPlayer:
    """One process, started once, that plays :class:`SessionLoad` against each window's server."""

    def __init__(self, cfg: ShipyardConfig) -> None:
        import multiprocessing

        ctx = multiprocessing.get_context("spawn")
        self.counts = ctx.Array("q", 2)
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(
            target=_player, args=(cfg, child, self.counts), name="session-player", daemon=True
        )
        self.proc.start()

    def load(self, url: str) -> RemoteSessions:
        return RemoteSessions(self, url)

    def close(self) -> None:
        self.conn.send(("exit", None))
        self.proc.join(30)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(10)


class RemoteSessions:
    """The :class:`Load` of one window: the player's sessions against ``url``."""

    def __init__(self, player: SessionPlayer, url: str) -> None:
        self.player, self.url = player, url

    def start(self) -> RemoteSessions:
        self.player.conn.send(("start", self.url))
        return self

    def played(self) -> tuple[int, int]:
        """Sessions ended so far in this window, and of them crashed."""
        return int(self.player.counts[0]), int(self.player.counts[1])

    def stop(self) -> None:
        self.player.conn.send(("stop", None))
        if not self.player.conn.poll(300):
            raise RuntimeError("the session player did not stop its sessions within 300 s")
        self.player.conn.recv()


def load_factory(kind: str, player: SessionPlayer | None) -> LoadFactory:
    """``sessions``: the ``player``'s :class:`SessionLoad`; ``synthetic``: 16 random-token scavenger
    requests always in flight (300-token prompts, 128 tokens out; the RL load before issue 41)."""
    from shipyard.inference.client import HttpInferenceClient

    if kind == "sessions":
        assert player is not None
        return player.load
    return lambda url: ScavengerLoad(HttpInferenceClient(url).generate)


class Arm:
    """One server (tiers or not) with an optional RL load over one window of the trace."""

    def __init__(self, eng: Any, scavenge: ScavengeConfig | None, load: LoadFactory | None) -> None:
        from shipyard.inference.client import HttpInferenceClient
        from shipyard.inference.serving.server import InferenceServer

        self.eng = eng
        if eng.prefix is not None:  # every arm starts cold: the windows replay the same prompts
            eng.prefix.clear()
        self.server = InferenceServer(eng, scavenge=scavenge, drain_s=0.0).start()
        self.scheduler = self.server.app.state.scheduler
        self.client = HttpInferenceClient(self.server.url)
        self.load = load(self.server.url) if load is not None else None

    def run(self, arrivals: list[Arrival], seconds: float, warm_s: float, offset: float, seed: int) -> Window:
        """Replay ``arrivals`` (timed from this window's start) with the RL load, if any, already
        running for ``warm_s``; the window lasts ``seconds`` or until its last request is served.
        RL tokens: every token the engine sampled in the window less the production requests'
        (all of which start and finish inside it) and the discarded one of each prompt piece, so a
        row still running at the end counts what it sampled, not nothing."""
        if self.load is not None:
            self.load.start()
            time.sleep(warm_s)
        tiers = self.scheduler.tier_stats  # each prompt piece samples one discarded token
        t0, eng0, tiers0 = time.monotonic(), dict(self.eng.stats), tiers.as_dict()
        served = replay(arrivals, self.client.generate, seed)
        time.sleep(max(0.0, t0 + seconds - time.monotonic()))
        wall = time.monotonic() - t0
        eng = {k: v - eng0[k] for k, v in self.eng.stats.items()}
        tier = {k: v - tiers0[k] for k, v in tiers.as_dict().items() if not isinstance(v, list)}
        played = self.load.played() if isinstance(self.load, RemoteSessions) else (0, 0)
        self.server.stop()  # first: the load's requests then fail at once (sessions end as crashed)
        if self.load is not None:
            self.load.stop()
        on = self.scheduler.scavenge is not None
        return Window(
            served=[dataclasses.replace(x, sent=x.sent + offset) for x in served],
            start_s=offset,
            wall_s=wall,
            rl_tokens=int(eng["generated_tokens"])
            - sum(x.tokens for x in served)
            - int(tier["prefill_chunks"]),
            busy_s=tiers.production_busy_s if on else None,
            preemptions=tiers.preemptions if on else 0,
            yields_s=list(tiers.yields_s) if on else [],
            phases_s={k: eng[k] for k in PHASES} | {k: tier[k] for k in ("resume_wait_s", "quiet_periods")},
            rl_sessions=played[0],
            rl_sessions_crashed=played[1],
        )


@dataclasses.dataclass
class Window:
    """One arm over one window of the trace."""

    served: list[Served]
    start_s: float
    """Where the window starts on the trace's clock."""
    wall_s: float
    rl_tokens: int
    busy_s: float | None
    """Seconds with production waiting or running (tiered servers count it; None without tiers)."""
    preemptions: int
    yields_s: list[float]
    capacity: float = 0.0
    """RL tokens/s of the server alone, measured in this window's round."""
    capacity_prefill_share: float = 0.0
    """The share of the capacity measurement's engine time spent in prefills (RL requests' turnover)."""
    phases_s: dict[str, float] = dataclasses.field(default_factory=dict)
    """The engine's seconds in cold prefills, prefix-cache prefills and decode steps in the window,
    and the scheduler's quiet periods and resume waits (where the idle capacity went)."""
    rl_sessions: int = 0
    """Sessions of a :class:`SessionLoad` that ended within the window (0 for the synthetic load)."""
    rl_sessions_crashed: int = 0
    """Of those, the ones that ended in an error (before the window's end stopped the server)."""


def windows(trace: DiurnalTrace, window_s: float) -> list[list[Arrival]]:
    """The trace cut into windows of ``window_s`` seconds, each window's arrivals timed from its start."""
    out: list[list[Arrival]] = [[] for _ in range(math.ceil(trace.duration_s / window_s))]
    for a in trace.arrivals():
        k = int(a.t // window_s)
        out[k].append(dataclasses.replace(a, t=a.t - k * window_s))
    return out


def idle_s(w: Window, base: Window) -> float:
    """The window's seconds without production work (a server without tiers: the reference's)."""
    return w.wall_s - (w.busy_s if w.busy_s is not None else base.busy_s or 0.0)


def pooled(ws: list[Window], base: list[Window], pick: list[int]) -> tuple[float, float]:
    """p99 production latency and idle capacity harvested over the windows ``pick``."""
    lat = sorted(x.latency_s for k in pick for x in ws[k].served if x.error is None)
    rl = sum(ws[k].rl_tokens for k in pick)
    cap = sum(ws[k].capacity * idle_s(ws[k], base[k]) for k in pick)
    return _q(lat, 0.99), (rl / cap if cap > 0 else 0.0)


def arm_figures(ws: list[Window], base: list[Window] | None, seed: int = 0) -> dict[str, Any]:
    """An arm's figures over all windows; ``base``: the production_only arm's windows (None for
    itself). Intervals: 95% bootstrap over windows, the arm and the reference resampled together."""
    served = [x for w in ws for x in w.served]
    lat = sorted(x.latency_s for x in served if x.error is None)
    ref = base or ws
    wall = sum(w.wall_s for w in ws)
    prod_tokens = sum(x.tokens for x in served)
    spare = sum(w.capacity * w.wall_s for w in ws) - prod_tokens
    rl = sum(w.rl_tokens for w in ws)
    every = list(range(len(ws)))
    fig: dict[str, Any] = {
        "requests": len(served),
        "errors": sum(x.error is not None for x in served),
        "p50_s": _q(lat, 0.5),
        "p90_s": _q(lat, 0.9),
        "p99_s": _q(lat, 0.99),
        "production_tokens": prod_tokens,
        "rl_tokens": rl,
        "rl_tok_s": rl / wall,
        "rl_sessions": sum(w.rl_sessions for w in ws),
        "rl_sessions_crashed": sum(w.rl_sessions_crashed for w in ws),
        "production_busy_s": sum(w.wall_s - idle_s(w, r) for w, r in zip(ws, ref, strict=True)),
        "idle_capacity_harvested_frac": pooled(ws, ref, every)[1],
        "spare_throughput_harvested_frac": rl / spare if spare > 0 else 0.0,
        "wall_s": wall,
    }
    rng = random.Random(seed)
    picks = [[rng.randrange(len(ws)) for _ in ws] for _ in range(2000)]
    for q in (0.5, 0.9, 0.99):  # resampled by window: a window's requests share its load and its minute
        boot = sorted(
            _q(sorted(x.latency_s for k in p for x in ws[k].served if x.error is None), q) for p in picks
        )
        fig[f"p{round(q * 100)}_ci95"] = [_q(boot, 0.025), _q(boot, 0.975)]
    if base is not None:
        fig["production_p99_ratio"] = fig["p99_s"] / _q(
            sorted(x.latency_s for w in base for x in w.served if x.error is None), 0.99
        )
        ratios = sorted(pooled(ws, base, p)[0] / max(pooled(base, base, p)[0], 1e-9) for p in picks)
        fig["production_p99_ratio_ci95"] = [_q(ratios, 0.025), _q(ratios, 0.975)]
    if rl:
        harvested = sorted(pooled(ws, ref, p)[1] for p in picks)
        fig["idle_capacity_harvested_ci95"] = [_q(harvested, 0.025), _q(harvested, 0.975)]
    fig["idle_lost"] = idle_lost(ws, ref)
    yields = sorted(y for w in ws for y in w.yields_s)
    if any(w.busy_s is not None for w in ws) and rl:
        fig["preemptions"] = sum(w.preemptions for w in ws)
        fig["yields"] = len(yields)
        fig["rl_yield_p50_s"] = _q(yields, 0.5)
        fig["rl_yield_p99_s"] = _q(yields, 0.99)
    return fig


def idle_lost(ws: list[Window], ref: list[Window]) -> dict[str, float]:
    """Where the idle capacity went: ``lost_s`` = idle seconds less the seconds the RL tokens would
    take at the round's capacity; of it, ``resume_wait_s`` (idle before scavenger rows came back)
    and ``prefix_prefill_s`` (resumed rows' prefills from the cache: a single-turn RL load has no other
    prefix hits); engine phase seconds summed over the windows; ``quiet_periods``."""
    lost = sum(
        idle_s(w, r) - (w.rl_tokens / w.capacity if w.capacity else 0.0) for w, r in zip(ws, ref, strict=True)
    )
    out = {"lost_s": lost, "idle_s": sum(idle_s(w, r) for w, r in zip(ws, ref, strict=True))}
    for k in (*PHASES, "resume_wait_s", "quiet_periods"):
        out[k] = sum(w.phases_s.get(k, 0.0) for w in ws)
    return out


def _q(xs: list[float], q: float) -> float:
    """The ``q`` quantile (nearest rank) of sorted ``xs``; 0 for none."""
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else 0.0


def plot(trace: DiurnalTrace, arms: dict[str, list[Window]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(10, 6.5), sharex=True)
    bursts = trace.bursts()
    ts = [i * trace.duration_s / 600 for i in range(601)]
    ax1.plot(ts, [trace.rate(t, bursts) for t in ts], color="black", label="production requests/s (trace)")
    ax1.set_ylabel("production req/s")
    ax1b = ax1.twinx()
    for name, ws in arms.items():
        if name == "production_only":
            continue
        ax1b.step(
            [w.start_s for w in ws] + [ws[-1].start_s + ws[-1].wall_s],
            [w.rl_tokens / w.wall_s for w in ws] + [ws[-1].rl_tokens / ws[-1].wall_s],
            where="post",
            label=f"RL tokens/s, {name}",
        )
    ax1b.set_ylabel("RL tokens/s (per window)")
    ax1.legend(loc="upper left", fontsize=8)
    ax1b.legend(loc="upper right", fontsize=8)
    for name, ws in arms.items():
        served = [x for w in ws for x in w.served]
        ax2.scatter([x.sent for x in served], [x.latency_s for x in served], s=6, label=name)
    ax2.set_ylabel("production latency (s)")
    ax2.set_xlabel("seconds into the trace (arms interleaved window by window)")
    ax2.legend(fontsize=8)
    fig.suptitle("scavenging: production first, RL in the idle capacity")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def arm_settings(args: Any) -> dict[str, tuple[ScavengeConfig | None, bool]]:
    """Each arm's server (tiers or not) and whether RL runs on it."""
    arms: dict[str, tuple[ScavengeConfig | None, bool]] = {
        "production_only": (ScavengeConfig(enabled=True), False)
    }
    if not args.no_shared:
        arms["shared_fifo"] = (None, True)
    default_resume = ScavengeConfig().resume_after_s
    for k in args.rows:
        for r in args.resume_after:
            name = f"tiers_k{k}" + ("" if r == default_resume else f"_r{r:g}")
            arms[name] = (ScavengeConfig(enabled=True, rows_with_production=k, resume_after_s=r), True)
    return arms


class RoundLog:
    """Each finished round's windows, one JSON line each, appended as the round ends; ``--resume``
    reads them back, so a run cut short (a session's end, a crash) goes on from its next round. The
    first line is the run's design: a log of another design is refused, not mixed in."""

    def __init__(self, path: Path, design: dict[str, Any], resume: bool) -> None:
        self.path, self.rounds = path, []
        if resume and path.exists():
            lines = path.read_text().splitlines()
            head = json.loads(lines[0]) if lines else {}
            if head != design:
                diff = sorted(k for k in {*head, *design} if head.get(k) != design.get(k))
                raise ValueError(
                    f"--resume: {path} was written by another design (differs in {', '.join(diff)}); "
                    "run with the same options, or without --resume to start over"
                )
            for line in lines[1:]:
                try:
                    self.rounds.append({n: _window(w) for n, w in json.loads(line)["windows"].items()})
                except json.JSONDecodeError:  # a line cut by a crash: that round runs again
                    break
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("w") as f:
            f.write(json.dumps(design) + "\n")
            for ws in self.rounds:
                f.write(json.dumps({"windows": {n: dataclasses.asdict(w) for n, w in ws.items()}}) + "\n")

    def append(self, ws: dict[str, Window]) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps({"windows": {n: dataclasses.asdict(w) for n, w in ws.items()}}) + "\n")
            f.flush()
            os.fsync(f.fileno())
        self.rounds.append(ws)


def _window(d: dict[str, Any]) -> Window:
    return Window(**{**d, "served": [Served(**x) for x in d["served"]]})


def run_arms(
    args: Any, eng: Any, trace: DiurnalTrace, load: LoadFactory, log: RoundLog
) -> dict[str, list[Window]]:
    """Round k replays window k of the trace on every arm, in an order rotated each round, after
    measuring the server's RL capacity alone; so a drift of the machine's speed lands on every arm
    alike and each window's harvest is counted against the capacity of its own round. Rounds already
    in ``log`` (``--resume``) are not run again."""
    settings = arm_settings(args)
    names = list(settings)
    parts = windows(trace, args.window)
    Arm(eng, ScavengeConfig(enabled=True), load).run([], args.capacity_s, args.warm_s, 0.0, 0)  # warm-up
    for k, arrivals in enumerate(track(parts, "rounds", console=harness.console)):
        if k < len(log.rounds):
            continue
        cap = Arm(eng, ScavengeConfig(enabled=True), load).run([], args.capacity_s, args.warm_s, 0.0, 0)
        capacity = cap.rl_tokens / cap.wall_s
        busy = sum(cap.phases_s[phase] for phase in PHASES)
        prefill_share = (busy - cap.phases_s["decode_s"]) / busy if busy else 0.0
        done: dict[str, Window] = {}
        for name in names[k % len(names) :] + names[: k % len(names)]:
            scavenge, rl = settings[name]
            w = Arm(eng, scavenge, load if rl else None).run(
                arrivals, args.window, args.warm_s, k * args.window, trace.seed * 1000 + k
            )
            w.capacity, w.capacity_prefill_share = capacity, prefill_share
            done[name] = w
        log.append(done)
        harness.console.print(f"round {k + 1}/{len(parts)}: capacity {capacity:.0f} RL tokens/s")
    return {name: [ws[name] for ws in log.rounds] for name in names}


def _args() -> Any:
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
        "--capacity-s",
        type=float,
        default=None,
        help="seconds of each round's capacity measurement (a window's)",
    )
    ap.add_argument(
        "--window", type=float, default=None, help="seconds of trace per arm per round (30; quick 6)"
    )
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
    ap.add_argument(
        "--night-rps", type=float, default=0.05, help="production requests/s at the night's trough (0.05)"
    )
    ap.add_argument(
        "--gen-tokens", type=int, nargs="+", default=None, help="tokens a production request asks (32 48 64)"
    )
    ap.add_argument(
        "--load",
        choices=("sessions", "synthetic"),
        default="sessions",
        help="the RL load: the rollout worker's sessions (default) or random-token requests",
    )
    ap.add_argument("--resume", action="store_true", help="go on from the rounds the last run logged")
    ap.add_argument("--no-shared", action="store_true", help="no shared_fifo arm (sharing without tiers)")
    args = ap.parse_args()
    args.rows = args.rows or ([0] if args.quick else [0, 4])
    args.resume_after = args.resume_after or [ScavengeConfig().resume_after_s]
    args.warm_s = 1.0 if args.quick else 5.0
    args.window = args.window or (6.0 if args.quick else 30.0)
    args.capacity_s = args.capacity_s or args.window
    return args


def _trace(args: Any) -> DiurnalTrace:
    shape: dict[str, Any] = {"night_rps": args.night_rps, "day_rps": args.day_rps}
    if args.quick:
        shape = {"night_rps": 0.5, "day_rps": 4.0, "burst_rps": 6.0, "burst_s": 1.0}
    if args.gen_tokens:
        shape["gen_tokens"] = tuple(args.gen_tokens)
    return DiurnalTrace(
        period_s=args.period or (12.0 if args.quick else 120.0),
        periods=args.periods or (1 if args.quick else 2),
        **shape,
    )


def main() -> None:
    args = _args()
    trace = _trace(args)
    cfg = load_config(ROOT / ("configs/tiny.toml" if args.quick else "configs/demo.toml"), [])
    design = {
        "trace": {**dataclasses.asdict(trace), "gen_tokens": list(trace.gen_tokens)},
        "arms": list(arm_settings(args)),
        "window_s": args.window,
        "capacity_s": args.capacity_s,
        "warm_s": args.warm_s,
        "load": args.load,
        "load_process": "own" if args.load == "sessions" else "server's",
        "threads": args.threads,
        "quick": args.quick,
    }
    log = RoundLog(
        ROOT / "runs" / f"fleet_scavenge{'_quick' if args.quick else ''}" / "rounds.jsonl",
        design,
        args.resume,
    )
    eng = engine(cfg, args.threads)
    player = SessionPlayer(cfg) if args.load == "sessions" else None
    try:
        outs = run_arms(args, eng, trace, load_factory(args.load, player), log)
    finally:
        if player is not None:
            player.close()
    base = outs["production_only"]
    arms = {name: arm_figures(ws, None if name == "production_only" else base) for name, ws in outs.items()}
    capacities = [w.capacity for w in base]
    harness.table(
        f"production first, RL in the idle capacity (capacity {min(capacities):.0f}-{max(capacities):.0f} "
        "RL tokens/s across rounds)",
        {n: {c: v for c, v in a.items() if not isinstance(v, list | dict)} for n, a in arms.items()},
    )
    harness.table(
        "where the idle capacity went (seconds summed over the windows; lost = idle - RL tokens / capacity)",
        {n: a["idle_lost"] for n, a in arms.items() if a.get("rl_tokens")},
    )
    plot(trace, outs, PLOT if not args.quick else args.out / "fleet_scavenge_quick.png")
    default = f"tiers_k{ScavengeConfig().rows_with_production}"
    headline = arms.get(default, arms[f"tiers_k{args.rows[0]}"])
    figures = {
        "trace": {**trace.__dict__, "requests": len(trace.arrivals()), "bursts": len(trace.bursts())},
        "design": {
            "window_s": args.window,
            "rounds": len(base),
            "capacity_s_per_round": args.capacity_s,
            "capacity_note": "sustained RL rate over a window's length, with request turnover (before 2026-11-27: 10 s)",
            "warm_s": args.warm_s,
            "load": args.load,
            "note": "arms interleaved window by window, order rotated each round; intervals: "
            "95% bootstrap over windows",
        },
        "capacity_rl_tok_s": statistics.fmean(capacities),
        "capacity_rl_tok_s_per_round": capacities,
        "capacity_prefill_share_per_round": [w.capacity_prefill_share for w in base],
        "server": {"threads": args.threads, "max_batch": 16, "quick_model": args.quick},
        "arms": arms,
        "headline_arm": default if default in arms else f"tiers_k{args.rows[0]}",
        "production_p99_ratio": headline["production_p99_ratio"],
        "production_p99_ratio_ci95": headline["production_p99_ratio_ci95"],
        "idle_capacity_harvested_frac": headline["idle_capacity_harvested_frac"],
        "idle_capacity_harvested_ci95": headline["idle_capacity_harvested_ci95"],
        "rl_yield_p99_s": headline["rl_yield_p99_s"],
    }
    harness.write_results(args, "fleet_scavenge", figures)
    top = ("production_p99_ratio", "idle_capacity_harvested_frac", "rl_yield_p99_s")
    harness.merge_fleet(args, "scavenging", figures, {k: figures[k] for k in top})


if __name__ == "__main__":
    main()
