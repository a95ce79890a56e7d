"""Synchronous vs asynchronous RL on the same workload: samples/s and trainer idle share.

Runs the real pipeline twice (trainer, inference server, rollout workers; `local` placement so
both runs share one process's start-up costs), once with `trainer.mode = "sync"` (batch k is
sampled with version k, so generation waits for the trainer and the trainer waits for
generation) and once with `"async"` (generation runs up to `max_off_policy_steps` ahead).
Prints a table and writes benchmarks/results/pipeline.json with `async_samples_per_s`,
`sync_samples_per_s`, `async_trainer_idle_frac`, `sync_trainer_idle_frac`.

    python benchmarks/pipeline.py --quick            # tiny model, < 1 minute
    python benchmarks/pipeline.py                    # SmolLM2-135M, a few minutes per mode
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from shipyard.config import load_config
from shipyard.metrics.logger import read_metrics
from shipyard.metrics.progress import summarize

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import parser, table, write_results  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def run_mode(mode: str, args: argparse.Namespace, tmp: Path) -> dict[str, float]:
    from shipyard.orchestrate.train import train

    base = "configs/tiny.toml" if args.quick else "configs/demo.toml"
    overrides = [
        f"trainer.mode={mode}",
        f"trainer.steps={args.steps}",
        "run.placement=local",
        "run.eval_before_after=false",
        f'run.name="{mode}"',
        f'run.output_dir="{tmp}"',
        f'store.root="{tmp / mode / "store"}"',
    ]
    if not args.quick:
        overrides += ["sampling.max_tokens=96", "agent.max_turns=1"]
    cfg = load_config(ROOT / base, overrides)
    t0 = time.time()
    train(cfg)
    out = summarize(read_metrics(tmp / mode / "metrics.jsonl"))
    out["wall_s"] = time.time() - t0
    return out


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--steps", type=int, default=None, help="trainer steps per mode (default 6, quick 4)")
    args = ap.parse_args()
    args.steps = args.steps or (4 if args.quick else 6)
    res = {}
    with tempfile.TemporaryDirectory() as d:
        for mode in ("sync", "async"):
            res[mode] = run_mode(mode, args, Path(d))
    rows = {
        mode: {
            "samples/s": r["samples_per_s"],
            "sampled tok/s": r["tokens_per_s"],
            "trainer idle": f"{100 * r['trainer_idle_frac']:.0f}%",
            "dropped stale": r["dropped_stale"],
            "wall s": r["wall_s"],
        }
        for mode, r in res.items()
    }
    table(f"pipeline: {'tiny' if args.quick else 'SmolLM2-135M'}, {args.steps} steps per mode", rows)
    out = {
        "async_samples_per_s": res["async"]["samples_per_s"],
        "sync_samples_per_s": res["sync"]["samples_per_s"],
        "async_trainer_idle_frac": res["async"]["trainer_idle_frac"],
        "sync_trainer_idle_frac": res["sync"]["trainer_idle_frac"],
        "speedup": res["async"]["samples_per_s"] / max(res["sync"]["samples_per_s"], 1e-9),
        "steps": args.steps,
        "model": "tiny" if args.quick else "smollm2-135m",
        "detail": res,
    }
    write_results(args, "pipeline", out)


if __name__ == "__main__":
    main()
