"""The cluster-scale simulator: calibrated on this machine, checked against real runs, then asked about 1k-10k GPUs.

Three stages in one run (issue 19, item 4):

1. **Calibrate.** The engine is timed alone (:class:`EmbeddedEngine` of the run's config, batches
   of 1-16 rows, short and long prompts) and fitted as ``base + per_row * rows`` seconds per decode
   step plus a cost per prompt token (:func:`shipyard.fleet.calibrate.fit_engine`); the optimizer
   step is timed alone on one real run's groups (``cal``: ``make demo``'s shape, async, one group a
   step) and fitted against the tokens it forwards (each micro-batch padded to its longest). From ``cal``'s records come the publish time, a
   version's sync time and the engine's apply pause, and one fitted figure: how much engine and
   trainer slow each other on the same two cores (``contention``, the one value chosen to match
   ``cal``'s throughput; 0 on separate devices).
2. **Validate.** Four more real runs of other shapes (sync; two groups a step; streaming groups
   with 24 session slots; one turn of at most 96 tokens, sync), each run ``--repeats`` times (3;
   repeat ``r`` with ``run.seed=r``, the repeats interleaved so that a drift of the machine falls
   on every shape), are simulated with the calibrated speeds and each run's own sessions (tokens
   per turn, turns, environment seconds, as the workers recorded them): the simulated throughput
   after the first step (start-up excluded; the first step's wait holds process start-up the model
   does not have) against the real one. Per shape: ``sim_vs_real_throughput_rel_err`` (the mean
   over its repeats) with its spread (``rel_err_std``, ``_min``, ``_max``), and
   ``configs_within_0_15`` (shapes whose mean is within 0.15; target: at least 3). The simulator
   is frozen before validating: the results record the commit of its code (``src/shipyard/fleet``
   and this file) and whether that code differed from it (``model_dirty``).
3. **Predict.** A GPU profile (stated below; not measured here) at 1k, 3k and 10k GPUs (a quarter
   train, the rest serve; one GPU per server): sync against async with the worker's batch barrier
   (``rollout.streaming = false``) and against async with streaming groups, over the rollout
   length tail (lognormal sigma) and the staleness bound. Plot: ``docs/fleet_sim.png``.

    python benchmarks/fleet_sim.py            # SmolLM2-135M, 1 + 4x3 real runs of 8 steps (~60 min)
    python benchmarks/fleet_sim.py --quick    # tiny model, 1 + 4 runs of 4 steps, small predictions
    python benchmarks/fleet_sim.py --reuse    # simulate again from the recorded runs

Writes ``benchmarks/results/fleet_sim.json`` and the ``simulator`` section (and the top-level
``sim_vs_real_throughput_rel_err``) of ``benchmarks/results/fleet.json``.
"""

from __future__ import annotations

import json
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import harness
from shipyard.config import load_config
from shipyard.config.schema import ShipyardConfig
from shipyard.fleet import calibrate as cal
from shipyard.fleet.sim import simulate
from shipyard.fleet.types import EngineProfile, PipelineSpec, RegionSpec, TrainerProfile, Workload
from shipyard.metrics.logger import read_metrics
from shipyard.store.run import open_run

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "runs" / "fleet_sim"
RUNS: dict[str, list[str]] = {
    "cal": [],
    "sync": ["trainer.mode=sync"],
    "async_gps2": ["trainer.groups_per_step=2", "rollout.concurrency=16"],
    "async_streaming": ["rollout.streaming=true", "rollout.concurrency=24"],
    "sync_1turn": [
        "trainer.mode=sync",
        "trainer.groups_per_step=1",
        "rollout.concurrency=8",
        "agent.max_turns=1",
        "sampling.max_tokens=96",
    ],
}
SIM_SEEDS = 5
# The GPU profile of the predictions: an 8B-class dense model in bf16, one H100 per server (decode
# 15 ms a step + 0.08 ms a row: ~5k tokens/s at 128 rows; prefill 100k tokens/s); the trainer
# (a quarter of the GPUs) forwards and backwards 4,000 tokens/s per GPU; a version reaches every
# server 20 s after publication (delta shipping) and pauses it 2 s. Sessions: 2 turns, a 2,000-token
# task prompt, 300-token tool outputs, 2 s of environment per turn, turns lognormal around 800
# tokens (cut at 16k). Each server runs 2 groups of 8 a step.
GPU_ENGINE = EngineProfile(
    step_base_s=0.015, step_per_row_s=0.00008, prefill_per_token_s=1e-5, max_batch=256, apply_s=2.0
)


def base_config(quick: bool) -> str:
    return "configs/tiny.toml" if quick else "configs/demo.toml"


MODEL_FILES = ["src/shipyard/fleet", "benchmarks/fleet_sim.py"]


def run_config(name: str, quick: bool, repeat: int = 0) -> tuple[ShipyardConfig, list[str]]:
    """Shape ``name`` of :data:`RUNS`; repeat ``r`` > 0 is its own run (``fleet_<name>_r<r>``,
    ``run.seed=r``); repeat 0 keeps the name and seed of a single run."""
    steps = 4 if quick else 8
    suffix = f"_r{repeat}" if repeat else ""
    over = [
        f'run.name="fleet_{name}{suffix}"',
        f'run.output_dir="{OUT}"',
        f'store.root="{OUT / "store"}"',
        "run.eval_before_after=false",
        f"trainer.steps={steps}",
        f"run.seed={repeat}",
        *RUNS[name],
    ]
    return load_config(ROOT / base_config(quick), over), over


def model_version() -> dict[str, Any]:
    """The commit of the simulator's code (:data:`MODEL_FILES`) and whether the files differ from it."""

    def git(*a: str) -> str:
        out = subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True, check=False)
        return out.stdout.strip() if out.returncode == 0 else ""

    return {
        "model_commit": git("log", "-1", "--format=%H", "--", *MODEL_FILES) or None,
        "model_dirty": bool(git("status", "--porcelain", "--", *MODEL_FILES)),
        "head": git("rev-parse", "HEAD") or None,
    }


def run_real(name: str, quick: bool, reuse: bool, repeat: int = 0) -> ShipyardConfig:
    """Train one real run (its own process, as a user would) unless ``reuse`` finds it finished."""
    cfg, over = run_config(name, quick, repeat)
    run_dir = OUT / cfg.run.name
    if reuse and (run_dir / "summary.json").exists():
        return cfg
    shutil.rmtree(run_dir, ignore_errors=True)
    shutil.rmtree(OUT / "store" / cfg.run.name, ignore_errors=True)
    run_dir.mkdir(parents=True)
    log = run_dir.with_suffix(".log")
    harness.console.print(
        f"[bold]{cfg.run.name}[/]: shipyard train {base_config(quick)} {' '.join(over[4:])}  (log: {log})"
    )
    t0 = time.time()
    with open(log, "w") as f:
        cmd = [sys.executable, "-m", "shipyard.cli", "train", base_config(quick), *over]
        code = subprocess.call(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT)
    if code != 0:
        raise SystemExit(f"run {name} failed with exit code {code}; see {log}")
    harness.console.print(f"{cfg.run.name}: {time.time() - t0:.0f} s")
    return cfg


def measure_engine(cfg: ShipyardConfig, quick: bool) -> tuple[EngineProfile, list[cal.EnginePoint]]:
    """Time the run's engine alone on batches of rows and prompt lengths; fit its profile."""
    import torch

    from shipyard.inference.engine.engine import EmbeddedEngine
    from shipyard.inference.types import GenerateRequest, SamplingParams
    from shipyard.models.loading import load_model
    from shipyard.models.precision import engine_precision

    torch.set_num_threads(cfg.inference.threads)
    model, tok = load_model(cfg.model)
    engine_precision(model, cfg.inference)
    engine = EmbeddedEngine(model, tok, max_batch=cfg.inference.max_batch, version=0, prefix_cache_mb=0)
    text = "\n".join(p.read_text() for p in sorted((ROOT / "src" / "shipyard" / "fleet").glob("*.py")))
    ids = tok(text)["input_ids"] * 3  # distinct prompts for every call (no prefix cache anyway)
    shapes = [(1, 150), (2, 300), (4, 150), (4, 450), (8, 300), (8, 450), (12, 150), (16, 150), (16, 450)] * 2
    new = 8 if quick else 48
    points = []
    for i, (rows, plen) in enumerate([(2, 150), *shapes]):  # the first call warms up, not kept
        reqs = [
            GenerateRequest(
                prompt_ids=ids[37 * (i * 16 + r) : 37 * (i * 16 + r) + plen],
                params=SamplingParams(temperature=0.7, max_tokens=new, seed=r),
            )
            for r in range(rows)
        ]
        s0 = dict(engine.stats)
        t0 = time.perf_counter()
        engine.generate(reqs)
        secs = time.perf_counter() - t0
        gen = engine.stats["generated_tokens"] - s0["generated_tokens"]
        point = cal.EnginePoint(
            engine.stats["decode_steps"] - s0["decode_steps"], gen - rows, rows * plen, secs
        )
        if i:
            points.append(point)
    return cal.fit_engine(points, cfg.inference.max_batch), points


def run_records(cfg: ShipyardConfig) -> tuple[list[dict[str, Any]], Any]:
    records = read_metrics(OUT / cfg.run.name / "metrics.jsonl")
    return records, open_run(cfg.store, cfg.run.name)


def measure_trainer(cfg: ShipyardConfig, batches: list[Any]) -> list[tuple[int, float]]:
    """Time the run's optimizer step alone on the calibration run's own groups: 1, 2 and 3 groups,
    twice each after a warm-up; (padded tokens forwarded, seconds) per step."""
    from shipyard.trainer.advantages import batch_advantages
    from shipyard.trainer.distributed import ONE_PROCESS
    from shipyard.trainer.loop import build_policy
    from shipyard.trainer.step import train_step

    policy = build_policy(cfg, ONE_PROCESS)
    padded = TrainerProfile(
        0.0, 0.0, 0.0, micro_batch=cfg.trainer.micro_batch, micro_batch_tokens=cfg.trainer.micro_batch_tokens
    )
    groups = [
        sorted(g, key=lambda t: (t.sample_idx, t.segment_idx)) for b in batches for g in b.groups().values()
    ]
    points = []
    for i, n in enumerate([2, 1, 2, 3, 1, 2, 3]):  # the first one warms up, not kept
        chosen = groups[i : i + n]
        batch = batch_advantages(chosen, cfg.trainer.loss, cfg.agent.summary)
        t0 = time.perf_counter()
        train_step(
            policy.scorer,
            policy.optimizer,
            batch.trajectories,
            batch.advantages,
            cfg=policy.tcfg,
            pad_id=policy.tok.pad_token_id,
            temperature=cfg.sampling.temperature,
        )
        if i:
            lengths = [len(t.token_ids) for t in batch.trajectories]
            points.append((padded.cost_tokens(lengths), time.perf_counter() - t0))
    return points


def calibrate_from(
    cfg: ShipyardConfig, engine: EngineProfile
) -> tuple[TrainerProfile, EngineProfile, float, list[tuple[int, float]]]:
    """From the calibration run: the trainer timed alone on its groups, its publish time, the sync
    time, the apply pause, and the host contention fitted to its throughput."""
    records, store = run_records(cfg)
    batches = cal.read_batches(store)
    points = measure_trainer(cfg, batches)
    base, per_token = cal.fit_linear([p[0] for p in points], [p[1] for p in points])
    publish_s = cal.fit_trainer(records, cal.step_tokens(records, batches)).publish_s
    trainer = TrainerProfile(
        base,
        per_token,
        publish_s,
        micro_batch=cfg.trainer.micro_batch,
        micro_batch_tokens=cfg.trainer.micro_batch_tokens,
    )
    events = [json.loads(store.get(k)) for k in store.list("adoptions/")]
    pauses = [e["pause_s"] for e in events if e["pause_s"] is not None]  # None: applied while idle
    lag = cal.sync_lag(store)
    sync_s = statistics.median(lag) if lag else 0.0
    engine = replace(engine, apply_s=statistics.median(pauses) if pauses else 0.0)
    work = cal.workload_from_batches(batches)
    target = cal.run_figures(records)["steady_samples_per_s"]

    def throughput(contention: float) -> float:
        return simulated(cfg, replace(engine, contention=contention), trainer, sync_s, work)[
            "steady_samples_per_s"
        ]

    return trainer, replace(engine, contention=cal.fit_contention(throughput, target)), sync_s, points


def simulated(
    cfg: ShipyardConfig, engine: EngineProfile, trainer: TrainerProfile, sync_s: float, work: Workload
) -> dict[str, float]:
    """The run's shape simulated with these speeds, averaged over ``SIM_SEEDS`` draws of sessions."""
    region = [RegionSpec("local", cfg.inference.num_servers, sync_s, workers_per_server=1)]
    sims = [simulate(pipeline_of(cfg), region, engine, trainer, work, seed=s) for s in range(SIM_SEEDS)]
    figs = [cal.sim_figures(r.step_end_s, r.step_samples, r.trainer_idle_s) for r in sims]
    return {k: statistics.mean(f[k] for f in figs) for k in figs[0]}


def pipeline_of(cfg: ShipyardConfig) -> PipelineSpec:
    t = cfg.trainer
    return PipelineSpec(
        mode=t.mode,
        steps=t.steps,
        groups_per_step=t.groups_per_step // cfg.rollout.num_workers,
        group_size=cfg.rollout.group_size,
        concurrency=cfg.rollout.concurrency,
        max_off_policy_steps=t.max_off_policy_steps,
        streaming=cfg.rollout.streaming,
    )


def validate(
    cfg: ShipyardConfig, engine: EngineProfile, trainer: TrainerProfile, sync_s: float
) -> dict[str, float]:
    """One real run against the simulator given that run's sessions and the calibrated speeds."""
    records, store = run_records(cfg)
    real = cal.run_figures(records)
    work = cal.workload_from_batches(cal.read_batches(store))
    sim = simulated(cfg, engine, trainer, sync_s, work)
    return {
        "real_samples_per_s": real["steady_samples_per_s"],
        "sim_samples_per_s": sim["steady_samples_per_s"],
        "rel_err": abs(sim["steady_samples_per_s"] - real["steady_samples_per_s"])
        / real["steady_samples_per_s"],
        "real_whole_samples_per_s": real["samples_per_s"],
        "sim_whole_samples_per_s": sim["samples_per_s"],
        "real_trainer_idle_frac": real["trainer_idle_frac"],
        "sim_trainer_idle_frac": sim["trainer_idle_frac"],
        "sessions_recorded": len(work.sessions),
        "env_s_mean": statistics.mean(t.env_s for s in work.sessions for t in s.turns),
    }


def predict(gpus: int, mode: str, streaming: bool, sigma: float, bound: int, steps: int) -> dict[str, float]:
    """One prediction with the GPU profile (module doc)."""
    servers = gpus * 3 // 4
    trainer = TrainerProfile(step_base_s=3.0, per_token_s=1.0 / (4000.0 * (gpus - servers)), publish_s=10.0)
    work = Workload.lognormal(
        turns=2,
        median_tokens=800,
        sigma=sigma,
        max_tokens=16384,
        prompt_tokens=2000,
        tool_tokens=300,
        env_s=2.0,
    )
    spec = PipelineSpec(mode, steps, 2, 8, 32 if streaming else 16, bound, streaming=streaming)  # type: ignore[arg-type]
    out = simulate(spec, [RegionSpec("all", servers, sync_s=20.0)], GPU_ENGINE, trainer, work)
    figs = cal.sim_figures(out.step_end_s, out.step_samples, out.trainer_idle_s)
    stale = sorted(out.staleness)
    return {
        "samples_per_s": figs["steady_samples_per_s"],
        "trainer_idle_frac": figs["trainer_idle_frac"],
        "engine_busy_frac": out.engine_busy_frac,
        "staleness_p95": float(stale[int(0.95 * (len(stale) - 1))]),
        "dropped_stale_frac": out.dropped_stale / max(out.dropped_stale + out.samples, 1),
    }


def predictions(quick: bool) -> dict[str, Any]:
    """Async over sync at scale (sigma 1, bound 2) and over the tail and the bound (the smallest scale)."""
    steps = 4 if quick else 6
    scales = [100, 300] if quick else [1000, 3000, 10000]
    sigmas, bounds = [0.25, 0.5, 1.0, 1.5], [1, 2, 4]

    def trio(gpus: int, sigma: float, bound: int, sync: dict[str, float] | None = None) -> dict[str, Any]:
        sync = sync or predict(gpus, "sync", False, sigma, bound, steps)
        barrier = predict(gpus, "async", False, sigma, bound, steps)
        stream = predict(gpus, "async", True, sigma, bound, steps)
        return {
            "gpus": gpus,
            "sigma": sigma,
            "bound": bound,
            "sync": sync,
            "async_barrier": barrier,
            "async_streaming": stream,
            "speedup_barrier": barrier["samples_per_s"] / sync["samples_per_s"],
            "speedup_streaming": stream["samples_per_s"] / sync["samples_per_s"],
        }

    scale = []
    for gpus in scales:
        scale.append(trio(gpus, 1.0, 2))
        harness.console.print(f"predicted {gpus} GPUs: {scale[-1]['speedup_streaming']:.2f}x streaming")
    tail = []
    for sigma in sigmas:
        sync = predict(scales[0], "sync", False, sigma, 1, steps)  # sync never uses the bound
        tail += [trio(scales[0], sigma, b, sync) for b in bounds]
    return {"scale": scale, "tail": tail, "steps": steps}


def plot(pred: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    tail = pred["tail"]
    for bound in sorted({t["bound"] for t in tail}):
        rows = [t for t in tail if t["bound"] == bound]
        xs = [t["sigma"] for t in rows]
        a.plot(xs, [t["speedup_streaming"] for t in rows], "o-", label=f"streaming, bound {bound}")
        a.plot(xs, [t["speedup_barrier"] for t in rows], "x--", label=f"batch barrier, bound {bound}")
    a.set_xlabel("rollout length tail (lognormal sigma)")
    a.set_ylabel("async samples/s over sync")
    a.set_title(f"{tail[0]['gpus']} GPUs")
    a.legend(fontsize=7)
    scale = pred["scale"]
    xs = [s["gpus"] for s in scale]
    b.plot(xs, [s["speedup_streaming"] for s in scale], "o-", label="async, streaming groups")
    b.plot(xs, [s["speedup_barrier"] for s in scale], "x--", label="async, batch barrier")
    b.set_xscale("log")
    b.set_xlabel("GPUs (3/4 serve, 1/4 train)")
    b.set_ylabel("async samples/s over sync")
    b.set_title("sigma 1.0, staleness bound 2")
    b.axhspan(2.0, 3.0, color="0.9", label="verl / AReaL reported 2-3x")
    b.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    harness.console.print(f"wrote {path}")


def summarize(runs: list[dict[str, float]]) -> dict[str, Any]:
    """One shape's repeats: each run's figures, the mean relative error and its spread."""
    errs = [r["rel_err"] for r in runs]
    return {
        "rel_err_mean": statistics.mean(errs),
        "rel_err_std": statistics.stdev(errs) if len(errs) > 1 else 0.0,
        "rel_err_min": min(errs),
        "rel_err_max": max(errs),
        "real_samples_per_s_mean": statistics.mean(r["real_samples_per_s"] for r in runs),
        "sim_samples_per_s_mean": statistics.mean(r["sim_samples_per_s"] for r in runs),
        "repeats": len(runs),
        "runs": runs,
    }


def main() -> None:
    ap = harness.parser(__doc__)
    ap.add_argument("--reuse", action="store_true", help="simulate the recorded runs again (no new runs)")
    ap.add_argument("--repeats", type=int, default=None, help="real runs per validation shape (3; --quick 1)")
    args = ap.parse_args()
    repeats = args.repeats or (1 if args.quick else 3)
    if repeats < 1:
        raise ValueError(f"--repeats must be at least 1, got {repeats}")
    frozen = model_version()
    harness.console.print(f"simulator frozen at {frozen['model_commit']} (dirty: {frozen['model_dirty']})")
    cfg0, _ = run_config("cal", args.quick)
    engine, points = measure_engine(cfg0, args.quick)
    harness.console.print(f"engine: {engine} (fit error {cal.engine_fit_error(engine, points):.1%})")
    cal_cfg = run_real("cal", args.quick, args.reuse)
    shapes = [n for n in RUNS if n != "cal"]
    cfgs = {(n, r): run_real(n, args.quick, args.reuse, r) for r in range(repeats) for n in shapes}
    trainer, engine, sync_s, trainer_points = calibrate_from(cal_cfg, engine)
    harness.console.print(
        f"trainer: {trainer}; sync {sync_s:.2f} s; apply pause {engine.apply_s:.3f} s; contention {engine.contention:.2f}"
    )
    checks = {
        n: summarize([validate(cfgs[n, r], engine, trainer, sync_s) for r in range(repeats)]) for n in shapes
    }
    harness.table(
        f"simulator against real runs (samples/s after the first step; mean of {repeats} runs)",
        {
            n: {
                "real": c["real_samples_per_s_mean"],
                "sim": c["sim_samples_per_s_mean"],
                "rel_err": c["rel_err_mean"],
                "std": c["rel_err_std"],
                "min": c["rel_err_min"],
                "max": c["rel_err_max"],
            }
            for n, c in checks.items()
        },
    )
    pred = predictions(args.quick)
    rows = {
        f"{s['gpus']} GPUs": {
            "sync": s["sync"]["samples_per_s"],
            "barrier x": s["speedup_barrier"],
            "streaming x": s["speedup_streaming"],
        }
        for s in pred["scale"]
    }
    harness.table("predicted async over sync (sigma 1.0, bound 2)", rows)
    plot(pred, ROOT / "docs" / f"fleet_sim{'_quick' if args.quick else ''}.png")
    figures = {
        "sim_vs_real_throughput_rel_err": {n: c["rel_err_mean"] for n, c in checks.items()},
        "sim_vs_real_rel_err_std": {n: c["rel_err_std"] for n, c in checks.items()},
        "configs_within_0_15": sum(c["rel_err_mean"] <= 0.15 for c in checks.values()),
        "runs_within_0_15": sum(r["rel_err"] <= 0.15 for c in checks.values() for r in c["runs"]),
        "validation_runs": repeats * len(checks),
        **frozen,
        "validation": checks,
        "calibration": {
            "engine": engine.__dict__,
            "engine_points": [p.__dict__ for p in points],
            "engine_fit_max_rel_err": cal.engine_fit_error(engine, points),
            "trainer": trainer.__dict__,
            "trainer_points": trainer_points,
            "sync_s": sync_s,
            "run": "cal",
        },
        "predictions": pred,
        "gpu_profile": {"engine": GPU_ENGINE.__dict__, "train_tok_s_per_gpu": 4000, "sync_s": 20.0},
    }
    harness.write_results(args, "fleet_sim", figures)
    top = ("sim_vs_real_throughput_rel_err", "sim_vs_real_rel_err_std", "configs_within_0_15", "model_commit")
    harness.merge_fleet(args, "simulator", figures, {k: figures[k] for k in top})


if __name__ == "__main__":
    main()
