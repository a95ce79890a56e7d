"""Long horizons: summaries trained in the loop vs truncation vs an untrained summary prompt.

The long task set (`shipyard.envs.tasks.long`, `tasks.set = "long"`) gives workspaces whose rules
are spread over modules that do not fit the policy's deliberately small context window
(`agent.max_session_tokens`), so a session has to work across several contexts. Three policies
play the same held-out long tasks with the same seeds and the same window:

- `trained_summaries`: RL-trained with self-summarization in the loop (`agent.summary.mode =
  "summarize"`, every segment gets the session's advantage), evaluated summarizing;
- `truncation`: RL-trained for the same steps with `mode = "truncate"` (at the same trigger the
  context is dropped and restarts from the task and the kept state, without a summary),
  evaluated truncating: the same training compute, no summaries;
- `prompt_summaries`: the untrained base policy asked for summaries by the same prompt.
`base_truncation` (the base policy, truncating) is reported for reference with `--base-truncation`.
With `--warm-start DIR` every policy starts from a `shipyard warmstart` policy (supervised on a
scripted expert's sessions through the same harness, `shipyard.agent.demonstrate`) instead of
the base model: then `prompt_summaries` is that warm-started policy without RL, and the two
trained conditions are RL on top of it; the warm start's report is stored under `warm_start`.
`--base-prompt` adds `base_prompt_summaries`: the pretrained model itself asked for summaries.
Each condition's evaluation is written to `<workdir>/<condition>/heldout.json` as it finishes, and
`--reuse` skips finished training runs and evaluations, so an interrupted run resumes.

Success = every hidden test passed (pass@1 of one seeded sample at the eval temperature), with
Wilson 95% intervals and paired differences over the same tasks. Writes
benchmarks/results/long_horizon.json with `n_tasks`, `context_tokens` (the window),
`success_trained_summaries`, `success_truncation`, `success_prompt_summaries`,
`max_session_tokens` (the most tokens one session processed across its contexts, trained
summaries), CIs, paired differences and per-condition summary metrics; plots the successes with
their intervals and the RL runs' reward per step to docs/long_horizon[_quick].png.

    python benchmarks/long_horizon.py --quick     # tiny random model, 2 steps, < 1 minute
    python benchmarks/long_horizon.py             # SmolLM2-135M, configs/long_horizon.toml
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from shipyard.config import load_config
from shipyard.config.schema import ShipyardConfig
from shipyard.eval.stats import paired_diff_ci

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import parser, write_results  # noqa: E402

console = Console(width=130)

QUICK = [  # tiny random model: checks the wiring end to end, the numbers mean nothing
    "tasks.set=long",
    "tasks.num_generated=24",
    "tasks.long_modules=3",
    "tasks.long_filler_lines=0",
    "agent.max_turns=4",
    "agent.max_session_tokens=512",
    "agent.summarize_at_frac=0.6",
    "agent.summary.max_tokens=24",
    "sampling.max_tokens=24",
    "run.placement=local",
]


def _cfg(args: argparse.Namespace, tmp: Path, name: str, mode: str, extra: list[str]) -> ShipyardConfig:
    base = "configs/tiny.toml" if args.quick else args.config
    overrides = [
        f"agent.summary.mode={mode}",
        f"trainer.steps={args.steps}",
        "run.eval_before_after=false",
        f'run.name="{name}"',
        f'run.output_dir="{tmp}"',
        f'store.root="{tmp / name / "store"}"',
        f"eval.heldout_n={args.n_tasks}",
        'eval.suites=["heldout"]',
        f'eval.label="{name}"',
        *(QUICK if args.quick else []),
        *extra,
    ]
    return load_config(ROOT / base, overrides)


def _evaluate(cfg: ShipyardConfig, version: int | None) -> dict[str, Any]:
    from shipyard.eval.command import run_eval

    # the evaluation runs alone: its engine takes the threads the trainer and the engine shared
    threads = cfg.inference.threads + cfg.trainer.threads
    cfg = cfg.model_copy(
        update={
            "eval": cfg.eval.model_copy(update={"version": version}),
            "inference": cfg.inference.model_copy(update={"threads": threads}),
        }
    )
    return run_eval(cfg)["heldout"]


def run(args: argparse.Namespace, tmp: Path) -> dict[str, dict[str, Any]]:
    from shipyard.orchestrate.train import train
    from shipyard.store.run import RunStoreError, open_run
    from shipyard.weights.versions import latest_version

    res: dict[str, dict[str, Any]] = {}
    for name, mode in (("trained_summaries", "summarize"), ("truncation", "truncate")):
        cfg = _cfg(args, tmp, name, mode, args.override)
        t0 = time.time()
        try:
            published = latest_version(open_run(cfg.store, cfg.run.name)) if args.reuse else None
        except RunStoreError:  # not run yet
            published = None
        if published is None or published < args.steps:
            train(cfg)  # resumes from the run's last checkpoint when one exists
        train_s = time.time() - t0
        res[name] = {**_evaluate_once(args, tmp / name, cfg, args.steps), "train_s": train_s}
    base = [("prompt_summaries", "summarize")] + [("base_truncation", "truncate")] * args.base_truncation
    for name, mode in base:
        res[name] = _evaluate_once(args, tmp / name, _cfg(args, tmp, name, mode, args.override), None)
    if args.base_prompt:  # the pretrained model itself, neither warm-started nor RL-trained
        name = "base_prompt_summaries"
        res[name] = _evaluate_once(
            args, tmp / name, _cfg(args, tmp, name, "summarize", args.user_override), None
        )
    return res


def _evaluate_once(args: argparse.Namespace, where: Path, cfg: ShipyardConfig, version: int | None) -> Any:
    """The condition's held-out result, read back with ``--reuse`` or evaluated and saved (atomic)."""
    saved = where / "heldout.json"
    if args.reuse and saved.is_file():
        return json.loads(saved.read_text())
    res = _evaluate(cfg, version)
    where.mkdir(parents=True, exist_ok=True)
    part = saved.with_suffix(".json.part")
    part.write_text(json.dumps(res))
    part.replace(saved)
    return res


def report(res: dict[str, dict[str, Any]], cfg: ShipyardConfig, args: argparse.Namespace) -> dict[str, Any]:
    table = Table(title=f"long horizon: window {cfg.agent.max_session_tokens} tokens, {args.n_tasks} tasks")
    for col in (
        "policy",
        "success",
        "95% CI",
        "summaries/session",
        "tokens/session",
        "max tokens",
        "budget hit",
    ):
        table.add_column(col)
    for name, r in res.items():
        table.add_row(
            name,
            f"{r['pass1']:.3f}",
            f"[{r['ci95'][0]:.3f}, {r['ci95'][1]:.3f}]",
            f"{r.get('summaries_mean', 0):.2f}",
            f"{r.get('session_tokens_mean', 0):.0f}",
            f"{r.get('session_tokens_max', 0):.0f}",
            f"{r.get('hit_budget_unfinished_mean', 0):.2f}",
        )
    console.print(table)
    ts = res["trained_summaries"]
    diffs = {
        other: paired_diff_ci(res[other]["passed"], ts["passed"])
        for other in ("truncation", "prompt_summaries", "base_truncation", "base_prompt_summaries")
        if other in res
    }
    for other, (d, lo, hi) in diffs.items():
        console.print(f"trained_summaries - {other}: {d:+.3f} [{lo:+.3f}, {hi:+.3f}] (paired, 95%)")
    return {
        "n_tasks": ts["n"],
        "context_tokens": cfg.agent.max_session_tokens,
        "success_trained_summaries": ts["pass1"],
        "success_truncation": res["truncation"]["pass1"],
        "success_prompt_summaries": res["prompt_summaries"]["pass1"],
        **{f"success_{k}": res[k]["pass1"] for k in ("base_truncation", "base_prompt_summaries") if k in res},
        "max_session_tokens": ts.get("session_tokens_max", 0),
        **{f"ci95_{k}": r["ci95"] for k, r in res.items()},
        **{f"diff_vs_{k}": list(v) for k, v in diffs.items()},
        "train_steps": args.steps,
        # hf = a local directory: name it (a warm start's output, or any HF checkpoint)
        "model": "tiny" if args.quick else cfg.model.path if cfg.model.source == "hf" else cfg.model.source,
        "detail": {k: {m: v for m, v in r.items() if m not in ("passed", "rewards")} for k, r in res.items()},
    }


def plot(res: dict[str, dict[str, Any]], tmp: Path, title: str, out_png: Path) -> None:
    """Success of every condition with its 95% interval, and the two RL runs' reward per step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from shipyard.metrics.logger import read_metrics

    fig, (bars, curves) = plt.subplots(1, 2, figsize=(12, 3.8))
    names = list(res)
    rates = [res[n]["pass1"] for n in names]
    lo = [r - res[n]["ci95"][0] for n, r in zip(names, rates, strict=True)]
    hi = [res[n]["ci95"][1] - r for n, r in zip(names, rates, strict=True)]
    bars.barh(names, rates, xerr=[lo, hi], capsize=4, color="tab:blue", alpha=0.7)
    bars.set_xlim(0, 1)
    bars.set_xlabel(f"held-out success (n = {res[names[0]]['n']}, Wilson 95%)")
    bars.invert_yaxis()
    for name in ("trained_summaries", "truncation"):
        records = [r for r in read_metrics(tmp / name / "metrics.jsonl") if r.get("kind") == "train"]
        curves.plot([r["step"] for r in records], [r["reward/mean"] for r in records], marker="o", label=name)
    curves.set_xlabel("RL step")
    curves.set_ylabel("mean reward of the step's group")
    curves.legend()
    fig.suptitle(title)
    fig.tight_layout()
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = parser(__doc__)  # --quick: tiny random model, 2 steps (< 1 minute)
    ap.add_argument("--config", default="configs/long_horizon.toml")
    ap.add_argument("--steps", type=int, default=None, help="trainer steps per trained policy")
    ap.add_argument("--n-tasks", type=int, default=None, help="held-out long tasks evaluated")
    ap.add_argument(
        "--workdir", default=None, help="keep runs here (default: runs/long_horizon[_quick][_warm])"
    )
    ap.add_argument("--reuse", action="store_true", help="evaluate finished runs in --workdir again")
    ap.add_argument("--base-truncation", action="store_true", help="also evaluate the base policy truncating")
    ap.add_argument(
        "--base-prompt",
        action="store_true",
        help="with --warm-start: also evaluate the pretrained model (no warm start, no RL) summarizing",
    )
    ap.add_argument("--override", action="append", default=[], help="dotted config override (repeatable)")
    ap.add_argument(
        "--warm-start",
        default=None,
        help="every policy starts from this `shipyard warmstart` directory (model.source=hf)",
    )
    args = ap.parse_args()
    args.user_override = list(args.override)
    if args.base_prompt and not args.warm_start:
        raise SystemExit("--base-prompt needs --warm-start (without it, prompt_summaries is the base model)")
    if args.warm_start:
        if not (Path(args.warm_start) / "warmstart.json").is_file():
            raise SystemExit(
                f"--warm-start {args.warm_start}: no warmstart.json; run `shipyard warmstart` first"
            )
        args.override = ["model.source=hf", f'model.path="{Path(args.warm_start).resolve()}"', *args.override]
    args.steps = args.steps or (2 if args.quick else 12)
    args.n_tasks = args.n_tasks or (6 if args.quick else 60)
    default = "runs/long_horizon" + ("_quick" if args.quick else "") + ("_warm" if args.warm_start else "")
    tmp = Path(args.workdir or ROOT / default)  # a warm-started run never resumes a base run's checkpoints
    t0 = time.time()
    res = run(args, tmp)
    out = report(res, _cfg(args, tmp, "report", "summarize", args.override), args)
    out["minutes"] = (time.time() - t0) / 60
    if args.warm_start:
        out["warm_start"] = json.loads((Path(args.warm_start) / "warmstart.json").read_text())
    written = write_results(args, "long_horizon", out)
    png = ROOT / ("docs/long_horizon" + ("_quick" if args.quick else "") + ".png")
    title = f"long tasks, {out['context_tokens']}-token window, {args.steps} RL steps"
    plot(res, tmp, title, png)
    console.print(f"wrote {written} and {png} ({out['minutes']:.1f} min)")


if __name__ == "__main__":
    main()
