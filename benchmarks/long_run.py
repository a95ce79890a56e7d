"""The longer run: about 2 hours on 2 cores on the mixed task families, every family evaluated before
and after.

`configs/long.toml` trains SmolLM2-135M-Instruct with asynchronous GRPO on generated function
tasks of difficulty 1-4, repository tasks and database tasks. This script runs, each as its own
process:

1. ``shipyard eval configs/long.toml eval.label=long_before`` on the base model: the held-out function
   tasks (reported per difficulty too), held-out db and repo tasks, and HumanEval; none of the
   held-out tasks is ever trained on (:func:`shipyard.envs.tasks.splits.heldout_tasks`);
2. ``shipyard train configs/long.toml``;
3. the same evaluation of the final version (``eval.version=<steps> eval.label=long_after``).

Every suite gets pass@1 before and after with Wilson intervals, and the paired difference with its
95% interval (the same tasks, one seeded sample each at T = 0.7). The learning curve is the
trainer's per-step reward and solved fraction (``metrics.jsonl``), and per family the solved
fraction of the sessions trained on, read back from the run's stored rollout batches. Writes
``benchmarks/results/long_run.json`` (``families``: per family n, before, after, diff, ci95_low,
ci95_high; ``humaneval``; ``hours``; ``steps``; ``curve``) and plots ``docs/long_run.png``.
``--reuse`` skips the stages whose outputs exist (a long run interrupted after training, say).
``--train-minutes`` and ``--total-minutes`` bound the training by time (a lent GPU's session): the
training process is stopped when its time is up and the newest version it published is evaluated.

    python benchmarks/long_run.py            # SmolLM2-135M, configs/long.toml (~2.5 h with evals)
    python benchmarks/long_run.py --quick    # the wiring on the tiny model (~1 min)
    python benchmarks/long_run.py --config configs/long_gpu.toml --name long_run_gpu --total-minutes 8
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import harness
from shipyard.config import load_config
from shipyard.eval.stats import paired_diff_ci, wilson_ci

ROOT = Path(__file__).resolve().parents[1]
QUICK = [
    "model.source=tiny",
    "trainer.steps=2",
    "trainer.train_layers=0",
    "tasks.num_generated=60",
    "tasks.num_db=2",
    "tasks.num_repo=2",
    "eval.heldout_n=4",
    "eval.db_n=1",
    "eval.repo_n=1",
    "eval.humaneval_n=2",
    "sampling.max_tokens=24",
]


def compare(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """One suite before and after: pass@1 with Wilson intervals and the paired difference."""
    assert before["task_ids"] == after["task_ids"], "before and after must score the same tasks"
    b, a = [float(x) for x in before["passed"]], [float(x) for x in after["passed"]]
    diff, lo, hi = paired_diff_ci(b, a)
    n = len(b)
    rb, ra = [float(x) for x in before["rewards"]], [float(x) for x in after["rewards"]]
    rdiff, rlo, rhi = paired_diff_ci(rb, ra)
    return {
        "n": n,
        "reward_before": sum(rb) / n,  # partial credit (db: checks passed), more sensitive than pass@1
        "reward_after": sum(ra) / n,
        "reward_diff": rdiff,
        "reward_ci95": [rlo, rhi],
        "before": sum(b) / n,
        "before_ci95": list(wilson_ci(round(sum(b)), n)),
        "after": sum(a) / n,
        "after_ci95": list(wilson_ci(round(sum(a)), n)),
        "diff": diff,
        "ci95_low": lo,
        "ci95_high": hi,
    }


def by_difficulty(cfg: Any, before: dict[str, Any], after: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The held-out function suite split by the tasks' difficulty."""
    from shipyard.envs.tasks.splits import heldout_tasks

    level = {t.id: t.difficulty for t in heldout_tasks(cfg, "function", cfg.eval.heldout_n)}
    out = {}
    for d in sorted(set(level.values())):
        keep = [i for i, tid in enumerate(before["task_ids"]) if level[tid] == d]
        part = [
            {k: [s[k][i] for i in keep] for k in ("task_ids", "passed", "rewards")} for s in (before, after)
        ]
        out[f"function_d{d}"] = compare(*part)
    return out


def family(task_id: str) -> str:
    return task_id.split("-", 1)[0].replace("gen", "function")


def curve(cfg: Any, run_dir: Path) -> list[dict[str, float]]:
    """Per step: the trainer's reward and solved fraction, and per family the solved fraction of
    the sessions trained on (from the stored batches of the groups each step consumed)."""
    from shipyard.metrics.logger import read_metrics
    from shipyard.rollout.types import ROLLOUT_PREFIX, RolloutBatch
    from shipyard.store.run import open_run

    store = open_run(cfg.store, cfg.run.name)
    solved: dict[str, list[float]] = {}  # group id -> first-segment rewards
    for key in store.list(ROLLOUT_PREFIX):
        for t in RolloutBatch.from_bytes(store.get(key)).trajectories:
            if t.segment_idx == 0 and t.error is None:
                solved.setdefault(t.group_id, []).append(float(t.reward >= 1.0))
    rows = []
    for r in read_metrics(run_dir / "metrics.jsonl"):
        if r.get("kind") == "consumed":
            fam: dict[str, list[float]] = {}
            for gid in r["groups"]:
                fam.setdefault(family(gid.rsplit("/", 1)[-1]), []).extend(solved.get(gid, []))
            rows.append({"step": r["step"], **{f"solved/{f}": sum(v) / len(v) for f, v in fam.items() if v}})
    train = {r["step"]: r for r in read_metrics(run_dir / "metrics.jsonl") if r.get("kind") == "train"}
    for row in rows:
        t = train.get(row["step"], {})
        row |= {
            "reward": t.get("reward/mean", float("nan")),
            "solved": t.get("reward/solved_frac", float("nan")),
        }
    return rows


def plot(rows: list[dict[str, float]], families: dict[str, dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 4.2))
    steps = [r["step"] for r in rows]
    window = max(1, len(rows) // 15)

    def smooth(xs: list[float]) -> list[float]:
        return [
            sum(xs[max(0, i - window + 1) : i + 1]) / len(xs[max(0, i - window + 1) : i + 1])
            for i in range(len(xs))
        ]

    ax.plot(steps, smooth([r["solved"] for r in rows]), label="all sessions", color="black")
    for f in ("function", "repo", "db"):
        pts = [(r["step"], r[f"solved/{f}"]) for r in rows if f"solved/{f}" in r]
        if pts:
            ax.plot([p[0] for p in pts], smooth([p[1] for p in pts]), label=f)
    ax.set(xlabel="step", ylabel=f"solved fraction (mean of {window} steps)", title="training sessions")
    ax.legend()
    names = list(families)
    x = range(len(names))
    bx.bar([i - 0.2 for i in x], [families[n]["before"] for n in names], 0.4, label="before")
    bx.bar([i + 0.2 for i in x], [families[n]["after"] for n in names], 0.4, label="after")
    bx.set_xticks(list(x), names, rotation=30, ha="right")
    bx.set(ylabel="held-out pass@1", title="held-out, before and after")
    bx.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    harness.console.print(f"wrote {path}")


def newest_version(cfg: Any) -> int:
    """The newest weight version the run published (a run stopped by its time budget ends between
    steps; its published versions are complete: manifests are written last)."""
    from shipyard.store.run import open_run
    from shipyard.weights.versions import published_versions

    versions = published_versions(open_run(cfg.store, cfg.run.name))
    if not versions or max(versions) == 0:
        raise SystemExit(f"run {cfg.run.name!r} published no trained version; see its train log")
    return max(versions)


def train_budget_s(args: Any, minutes: dict[str, float]) -> float | None:
    """Seconds the training may run: ``--train-minutes``, and within ``--total-minutes`` what is
    left once the evaluation after it is counted (as long as the one before, plus a fifth)."""
    budgets = [args.train_minutes * 60] if args.train_minutes else []
    if args.total_minutes:
        left = args.total_minutes * 60 - (time.time() - args.started)
        budgets.append(max(60.0, left - 1.2 * 60 * minutes.get("eval_before", 0.0) - 30))
    return min(budgets) if budgets else None


def run_stages(args: Any, config: str, overrides: list[str], cfg: Any, logs: Path) -> tuple[dict, int]:
    """Evaluate before, train (for ``--train-minutes`` at most), evaluate the version trained last."""
    results = Path(cfg.run.results_dir)
    run_dir = Path(cfg.run.output_dir) / cfg.run.name
    minutes: dict[str, float] = {}
    before = ["eval", config, *overrides, f"inference.threads={args.eval_threads}"]
    if not (args.reuse and (results / "eval_long_before.json").is_file()):
        minutes["eval_before"] = harness.shipyard(
            [*before, "eval.label=long_before"], logs / "eval_before.log"
        )
    if not (args.reuse and (run_dir / "summary.json").is_file()):
        minutes["train"] = harness.shipyard(
            ["train", config, *overrides], logs / "train.log", train_budget_s(args, minutes)
        )
    version = cfg.trainer.steps if (run_dir / "summary.json").is_file() else newest_version(cfg)
    if not (args.reuse and (results / "eval_long_after.json").is_file()):
        after = [*before, "eval.label=long_after", f"eval.version={version}"]
        minutes["eval_after"] = harness.shipyard(after, logs / "eval_after.log")
    return minutes, version


def main() -> int:
    p = harness.parser(__doc__)
    p.add_argument("--set", dest="overrides", nargs="*", default=[], help="dotted overrides")
    p.add_argument("--reuse", action="store_true", help="skip the stages whose outputs exist")
    p.add_argument("--config", default="configs/long.toml", help="the run's config (configs/long_gpu.toml)")
    p.add_argument("--name", default="long_run", help="results file benchmarks/results/<name>.json")
    p.add_argument("--train-minutes", type=float, default=None, help="stop training after this long")
    p.add_argument(
        "--total-minutes",
        type=float,
        default=None,
        help="the whole script's time: training gets what is left",
    )
    p.add_argument("--logs", type=Path, default=None, help="the stages' logs (default /tmp/<name>)")
    p.add_argument("--eval-threads", type=int, default=2, help="inference.threads of the evaluations")
    args = p.parse_args()
    args.started = time.time()
    os.chdir(ROOT)  # the config's relative paths (runs/, the store) are the repository's
    name = args.name.replace("_", "-") + ("-quick" if args.quick else "")
    overrides = [
        f"run.name={name}",
        f'run.results_dir="{ROOT / "runs" / name / "eval"}"',
        *(QUICK if args.quick else []),
        *args.overrides,
    ]
    config = str(ROOT / args.config)
    cfg = load_config(config, overrides)
    logs = args.logs or Path("/tmp") / name
    logs.mkdir(parents=True, exist_ok=True)
    minutes, version = run_stages(args, config, overrides, cfg, logs)
    report(args, cfg, overrides, minutes, version)
    return 0


def report(args: Any, cfg: Any, overrides: list[str], minutes: dict[str, float], version: int) -> None:
    """Per family and HumanEval before -> after, the learning curve, the plot and the results JSON."""
    results = Path(cfg.run.results_dir)
    run_dir = Path(cfg.run.output_dir) / cfg.run.name
    before = json.loads((results / "eval_long_before.json").read_text())
    after = json.loads((results / "eval_long_after.json").read_text())
    families = {s: compare(before[s], after[s]) for s in ("heldout", "db", "repo") if s in before}
    families = {("function" if s == "heldout" else s): v for s, v in families.items()}
    families |= by_difficulty(cfg, before["heldout"], after["heldout"])
    humaneval = compare(before["humaneval"], after["humaneval"]) if "humaneval" in before else None
    rows_ = {**families, **({"humaneval": humaneval} if humaneval else {})}
    harness.table(
        f"{cfg.run.name}: held-out pass@1 and mean reward, before -> after",
        {f: {c: v for c, v in r.items() if not isinstance(v, list)} for f, r in rows_.items()},
    )
    rows = curve(cfg, run_dir)
    plot_to = ROOT / "docs" / f"{args.name}.png" if not args.quick else Path("/tmp") / f"{args.name}.png"
    plot(rows, rows_, plot_to)
    summary = run_dir / "summary.json"
    figures = {
        "config": args.config,
        "overrides": overrides,
        "families": families,
        "humaneval": humaneval,
        "steps": version,
        "hours": json.loads(summary.read_text())["minutes"] / 60
        if summary.is_file()
        else minutes.get("train", float("nan")) / 60,  # the training run (the evaluations: stage_minutes)
        "stage_minutes": minutes,
        "curve": rows,
    }
    harness.write_results(args, args.name, figures)


if __name__ == "__main__":
    sys.exit(main())
