"""Does `make demo` improve the model every time? The demo run once per seed, its held-out gain each time.

Each seed is a whole `shipyard train configs/demo.toml run.seed=S` in its own process (its own Ray,
its own run directory `runs/<name>_s<S>` and store prefix), evaluated before and after on the same
held-out tasks (never trained on); the run's summary gives pass@1 before and after and the paired
95% interval of the difference. `--set` adds overrides (the ablations of docs/benchmarks.md use it
with a `--name` of their own); `--reuse` reads finished runs instead of running them again.

    python benchmarks/demo_seeds.py                       # 3 seeds of the demo (~18 min each)
    python benchmarks/demo_seeds.py --seeds 0 --set trainer.steps=28 --name demo_ablation_steps28
    python benchmarks/demo_seeds.py --quick               # the wiring, on the tiny model (~1 min)

Writes `benchmarks/results/<name>.json`: `runs` (seed, before, after, diff, ci95_low, ci95_high,
minutes, steps, heldout_n, samples_per_task), `min_ci95_low` (target >= 0.05) and `max_minutes` (target <= 20).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import harness

ROOT = Path(__file__).resolve().parents[1]
QUICK = ["run.eval_before_after=true", "eval.heldout_n=8", "tasks.num_generated=60"]


def run_seed(config: Path, name: str, seed: int, overrides: list[str], log: Path) -> None:
    args = ["train", str(config), f"run.name={name}", f"run.seed={seed}"]
    harness.shipyard([*args, f'run.results_dir="{ROOT / "runs" / name}"', *overrides], log)


def read_run(name: str, seed: int) -> dict[str, float | int]:
    path = ROOT / "runs" / name / "summary.json"
    try:
        demo = json.loads(path.read_text())["demo"]
    except (FileNotFoundError, KeyError) as e:
        raise SystemExit(f"{path}: no finished demo summary ({e!r}); run without --reuse") from None
    return {
        "seed": seed,
        "before": demo["heldout_before"],
        "after": demo["heldout_after"],
        "diff": demo["heldout_diff"],
        "ci95_low": demo["heldout_diff_ci95_low"],
        "ci95_high": demo["heldout_diff_ci95_high"],
        "minutes": demo["minutes"],
        "steps": demo["steps"],
        "heldout_n": demo["heldout_n"],
        "samples_per_task": demo.get("samples_per_task", 1),
    }


def main() -> int:
    p = harness.parser(__doc__)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--set", dest="overrides", nargs="*", default=[], help="dotted overrides for every run")
    p.add_argument("--name", default="demo_seeds", help="results name and run-name prefix")
    p.add_argument("--reuse", action="store_true", help="read finished runs instead of running them")
    args = p.parse_args()
    config = ROOT / ("configs/tiny.toml" if args.quick else "configs/demo.toml")
    overrides = (QUICK if args.quick else []) + args.overrides
    name = f"{args.name}_quick" if args.quick else args.name
    runs = []
    for seed in args.seeds:
        run_name = f"{name}_s{seed}"
        if not args.reuse:
            run_seed(config, run_name, seed, overrides, Path(f"/tmp/{run_name}.log"))
        runs.append(read_run(run_name, seed))
    rows = {f"seed {r['seed']}": {k: v for k, v in r.items() if k != "seed"} for r in runs}
    harness.table(f"{name}: held-out pass@1 before -> after, per seed", rows)
    figures = {
        "config": str(config.relative_to(ROOT)),
        "overrides": overrides,
        "runs": runs,
        "min_ci95_low": min(r["ci95_low"] for r in runs),
        "max_minutes": max(r["minutes"] for r in runs),
    }
    harness.write_results(args, args.name, figures)
    return 0


if __name__ == "__main__":
    sys.exit(main())
