"""Does `make demo` improve the model every time? The demo run once per seed, its gain on every suite.

The protocol (issue 41, `shipyard.envs.tasks.splits`): configurations are tuned on the validation
split; the headline is the test split (`eval.split = "test"` in configs/demo.toml), tasks no
configuration was chosen on, on fresh seeds never used while tuning (`--seeds`, default 100 101
102; seeds 0-4 were the tuning seeds); beside it the unseen-families suite (the
`tasks.unseen_families` families, never trained on) and HumanEval, pooled over the seeds.

Each seed is a whole `shipyard train configs/demo.toml run.seed=S` in its own process (its own Ray,
its own run directory `runs/<name>_s<S>` and store prefix), evaluated before and after on the same
test tasks (its `minutes` are the demo's, target <= 20); the run's summary gives pass@1 before and
after and the paired 95% interval of the difference. Then `shipyard eval` scores the run's version
0 and its final version on the unseen-families suite and HumanEval (outside the demo's minutes).
Pooled over the seeds, each suite's difference has a 95% interval clustered by task (every seed
samples the same tasks, so a task's pairs are not independent). `--set` adds overrides (the
ablations of docs/benchmarks.md use it with a `--name` of their own, and `eval.split=validation`
to tune); `--no-suites` skips the two suites; `--reuse` reads finished runs instead of running
them again (and makes only the runs and the suites' evaluations still missing).

    python benchmarks/demo_seeds.py                       # 3 fresh seeds (~15 + 19 min each)
    python benchmarks/demo_seeds.py --seeds 0 --no-suites --set eval.split=validation eval.heldout_n=170 \
        trainer.steps=28 --name demo_ablation_steps28     # tuning: validation only
    python benchmarks/demo_seeds.py --quick               # the wiring, on the tiny model (~2 min)

Writes `benchmarks/results/<name>.json`: `seeds`, `runs` (seed, split, before, after, diff,
ci95_low, ci95_high, minutes, steps, heldout_n, samples_per_task and each suite's
`<suite>_before/_after/_diff`), `min_ci95_low` and `test_min_ci95_low` (the split's lowest lower
bound over the seeds; target >= 0.05), `max_minutes` (target <= 20), and pooled over the seeds
`unseen_families_before/_after/_diff/_ci95_low/_ci95_high` (aim: lower bound > 0) and the same
for `humaneval_*`.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import harness
from shipyard.eval.stats import clustered_diff_ci

ROOT = Path(__file__).resolve().parents[1]
QUICK = [
    "run.eval_before_after=true",
    "eval.heldout_n=6",
    "tasks.num_generated=120",
    "tasks.test_frac=0.5",
    'eval.split="test"',
    "tasks.unseen_families=8",
    "eval.unseen_n=6",
    "eval.humaneval_n=4",
]
SUITES = ("unseen_families", "humaneval")
"""Scored by `shipyard eval` on each run's version 0 and final version, outside the demo's minutes."""


def run_seed(config: Path, name: str, seed: int, overrides: list[str], log: Path) -> None:
    args = ["train", str(config), f"run.name={name}", f"run.seed={seed}"]
    harness.shipyard([*args, f'run.results_dir="{ROOT / "runs" / name}"', *overrides], log)


def eval_suites(config: Path, name: str, steps: int, overrides: list[str]) -> None:
    """``shipyard eval`` of run ``name``'s base model (its version 0: the store keeps only recent
    versions) and its version ``steps`` on :data:`SUITES` (kept when already written)."""
    for label, version in (("v0", None), ("final", steps)):
        path = ROOT / "runs" / name / f"eval_{label}.json"
        if path.is_file() and all(
            json.loads(path.read_text()).get(s, {}).get("version") == version for s in SUITES
        ):
            continue
        args = ["eval", str(config), f"run.name={name}", f"eval.label={label}"]
        args += [f"eval.version={version}"] if version is not None else []
        args += [f"eval.suites={json.dumps(list(SUITES))}", f'run.results_dir="{ROOT / "runs" / name}"']
        harness.shipyard([*args, *overrides], Path(f"/tmp/{name}_eval_{label}.log"))


def suite_rows(name: str) -> dict[str, dict[str, Any]]:
    """Per suite: the run's version 0 and final results (task ids and per-task pass@1)."""
    v0, final = (json.loads((ROOT / "runs" / name / f"eval_{x}.json").read_text()) for x in ("v0", "final"))
    out = {}
    for suite in SUITES:
        assert v0[suite]["task_ids"] == final[suite]["task_ids"], f"{name}: {suite} scored other tasks"
        out[suite] = {
            "task_ids": v0[suite]["task_ids"],
            "before": v0[suite]["passed"],
            "after": final[suite]["passed"],
        }
    return out


def pooled(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Pass@1 before, after and the difference over every seed's pairs, its interval clustered by task."""
    before = [float(p) for r in rows for p in r["before"]]
    after = [float(p) for r in rows for p in r["after"]]
    diff, lo, hi = clustered_diff_ci(before, after, [t for r in rows for t in r["task_ids"]])
    n = len(before)
    return {
        "before": sum(before) / n,
        "after": sum(after) / n,
        "diff": diff,
        "ci95_low": lo,
        "ci95_high": hi,
        "pairs": n,
    }


def read_run(name: str, seed: int) -> dict[str, Any]:
    path = ROOT / "runs" / name / "summary.json"
    try:
        demo = json.loads(path.read_text())["demo"]
    except (FileNotFoundError, KeyError) as e:
        raise SystemExit(f"{path}: no finished demo summary ({e!r}); run without --reuse") from None
    return {
        "seed": seed,
        "split": demo.get("split", "validation"),
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
    p.add_argument("--seeds", type=int, nargs="+", default=[100, 101, 102], help="fresh: 0-4 were tuned on")
    p.add_argument("--no-suites", action="store_true", help="skip the unseen-families and HumanEval suites")
    p.add_argument("--set", dest="overrides", nargs="*", default=[], help="dotted overrides for every run")
    p.add_argument("--name", default="demo_seeds", help="results name and run-name prefix")
    p.add_argument("--reuse", action="store_true", help="read finished runs, make only what is missing")
    args = p.parse_args()
    config = ROOT / ("configs/tiny.toml" if args.quick else "configs/demo.toml")
    overrides = (QUICK if args.quick else []) + args.overrides
    name = f"{args.name}_quick" if args.quick else args.name
    if not args.no_suites and any(o.replace('"', "") == "eval.split=validation" for o in overrides):
        raise SystemExit(
            "tuning on validation: add --no-suites (the suites are scored on test, for the headline)"
        )
    runs, suites = [], []
    for seed in args.seeds:
        run_name = f"{name}_s{seed}"
        if not (args.reuse and (ROOT / "runs" / run_name / "summary.json").is_file()):
            run_seed(config, run_name, seed, overrides, Path(f"/tmp/{run_name}.log"))
        runs.append(read_run(run_name, seed))
        if not args.no_suites:
            eval_suites(config, run_name, int(runs[-1]["steps"]), overrides)
            suites.append(suite_rows(run_name))
            for suite, row in suites[-1].items():
                p1 = pooled([row])
                runs[-1].update({f"{suite}_{k}": p1[k] for k in ("before", "after", "diff")})
    shown = (
        "split",
        "before",
        "after",
        "diff",
        "ci95_low",
        "ci95_high",
        "minutes",
        *(f"{s}_diff" for s in SUITES),
    )
    rows = {f"seed {r['seed']}": {k: r[k] for k in shown if k in r} for r in runs}
    harness.table(f"{name}: pass@1 before -> after, per seed", rows)
    figures: dict[str, Any] = {
        "config": str(config.relative_to(ROOT)),
        "overrides": overrides,
        "seeds": args.seeds,
        "runs": runs,
        "min_ci95_low": min(r["ci95_low"] for r in runs),
        "max_minutes": max(r["minutes"] for r in runs),
    }
    if all(r["split"] == "test" for r in runs):
        figures["test_min_ci95_low"] = figures["min_ci95_low"]
    for suite in SUITES if suites else ():
        p1 = pooled([s[suite] for s in suites])
        figures.update({f"{suite}_{k}": v for k, v in p1.items()})
    if suites:
        harness.table(
            f"{name}: pooled over seeds {args.seeds}", {s: pooled([x[s] for x in suites]) for s in SUITES}
        )
    harness.write_results(args, args.name, figures)
    return 0


if __name__ == "__main__":
    sys.exit(main())
