"""RL through a third-party harness (unmodified) on SmolLM2-135M-Instruct, function tasks (issue 38):
candidates tuned on the validation split, the chosen one reported on the test split.

``--config`` names the shipped config: ``mini_swe`` (mini-swe-agent, bash tool), ``agents_sdk``
(the OpenAI Agents SDK, function tools) or ``verifiers_env`` (a verifiers environment, its rubric
the reward). The protocol (``shipyard.envs.tasks.splits``; the config sets ``tasks.test_frac``):

- ``--candidate NAME [--warm-set ...] [--set ...]``: one configuration, tuned on validation. The
  warm start (``shipyard warmstart``: the scripted expert's demonstrations played through the
  harness, SFT; ``--warm-set`` overrides it) into ``runs/warm/<config>_<NAME>``, then RL from it
  (``shipyard train ... model.init_from=... eval.split=validation``, ``--set`` overrides it),
  evaluated before and after on validation in the run. Recorded in
  ``benchmarks/results/harness_tuning.json`` under ``<config>.<NAME>``: the overrides, validation
  pass@1 before/after, the paired difference and its 95% interval, and the RL run's ``minutes``
  (evaluations included; target <= 60).
- ``--report NAME [--test-n N]``: the candidate chosen on validation, scored once on the test
  split, tasks no candidate was chosen on: ``shipyard eval`` of the shipped model (base), of the warm
  start (the RL run's version 0) and of the RL run's final version, the same first ``N`` test tasks
  each (default: the config's ``eval.heldout_n``; a larger ``N`` narrows the interval and is chosen
  before the test run, never after), one seeded sample per task at the config's evaluation
  temperature, with the candidate's overrides of anything but its training (``trainer.*``,
  ``warmstart.*``). RL's gain is measured over the warm start (paired
  95% interval). Merges ``<prefix>_*`` into ``benchmarks/results/harness.json`` (``mini_swe``,
  ``agents_sdk``, ``verifiers``; for mini-swe-agent also the issue's ``minutes``, the candidate's
  RL run).

A candidate that widens the task set (``tasks.max_difficulty`` above the shipped config's when it is
tuned; that difficulty is kept in its row as ``difficulty_cut``) also gets ``by_difficulty``: the
same paired difference restricted to the scored tasks of difficulty <= the cut and to the added
ones, so a gain on the new tasks alone cannot pass as a gain on the old ones
(``validation_by_difficulty`` in the tuning row, ``<prefix>_by_difficulty`` in the report). The cut
is recorded because the shipped config may later adopt the candidate's task set.

Definitions, fixed before the runs: ``tool_call_parse_<row>`` is, over every reply of that row's
evaluation that tried a tool call (the endpoint's ``tool_call_attempts``), the fraction whose call
parsed; None where no reply tried one (a harness without tools, or a policy that never calls).

    python benchmarks/harness_rl.py --config mini_swe --candidate e1 --warm-set warmstart.epochs=1 --set trainer.steps=28
    python benchmarks/harness_rl.py --config mini_swe --report e1 --test-n 200
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from harness import parser, shipyard, table
from shipyard.config.load import load_config
from shipyard.eval.stats import paired_diff_ci

ROOT = Path(__file__).resolve().parents[1]
PREFIX = {"mini_swe": "mini_swe", "agents_sdk": "agents_sdk", "verifiers_env": "verifiers"}
"""Shipped config -> the prefix of its keys in harness.json."""
LOGS = ROOT / "runs" / "logs"


def _paths(config: str, cand: str) -> dict[str, str]:
    return {
        "warm": f"runs/warm/{config}_{cand}",
        "run": f"{config}_rl_{cand}",
        "results": f"runs/{config}_rl_{cand}_results",
    }


def tune(config: str, cand: str, warm_set: list[str], rl_set: list[str], out: Path) -> dict[str, Any]:
    """Warm start and RL of one candidate, evaluated on validation; merged into harness_tuning.json."""
    path, p = f"configs/{config}.toml", _paths(config, cand)
    if not (ROOT / p["warm"] / "warmstart.json").is_file():
        shipyard(
            ["warmstart", path, f"warmstart.output_dir={p['warm']}", *warm_set], LOGS / f"{p['run']}_warm.log"
        )
    train = [
        "train",
        path,
        f"model.init_from={p['warm']}",
        f"run.name={p['run']}",
        f"run.results_dir={p['results']}",
    ]
    shipyard([*train, 'eval.split="validation"', *rl_set], LOGS / f"{p['run']}.log")
    rl = json.loads((ROOT / p["results"] / "demo.json").read_text())
    warm = json.loads((ROOT / p["warm"] / "warmstart.json").read_text())
    assert rl["split"] == "validation", rl
    row = {
        "warm_set": warm_set,
        "rl_set": rl_set,
        "validation_n": rl["heldout_n"],
        "validation_before": rl["heldout_before"],
        "validation_after": rl["heldout_after"],
        "validation_diff": rl["heldout_diff"],
        "validation_diff_ci95_low": rl["heldout_diff_ci95_low"],
        "validation_diff_ci95_high": rl["heldout_diff_ci95_high"],
        "minutes": rl["minutes"],
        "rl_steps": rl["steps"],
        "warmstart_minutes": warm["seconds"] / 60,
    }
    shipped, tasks = load_config(path).tasks, load_config(path, rl_set).tasks
    if tasks.max_difficulty > shipped.max_difficulty:
        run_dir = ROOT / "runs" / p["run"]
        evals = [json.loads((run_dir / f"eval_{w}.json").read_text()) for w in ("before", "after")]
        row["difficulty_cut"] = shipped.max_difficulty
        row["validation_by_difficulty"] = by_difficulty(path, rl_set, shipped.max_difficulty, *evals)
    _merge(out / "harness_tuning.json", {config: {cand: row}}, deep=True)
    return row


def report(config: str, cand: str, out: Path, test_n: int | None = None) -> dict[str, Any]:
    """Base, warm start and RL of candidate ``cand`` on the first ``test_n`` tasks of the test split
    (the config's ``eval.heldout_n`` when None); the figures under the prefix."""
    path, p, pre = f"configs/{config}.toml", _paths(config, cand), PREFIX[config]
    rl = json.loads((ROOT / p["results"] / "demo.json").read_text())
    tuned = json.loads((out / "harness_tuning.json").read_text())[config][cand]
    # what the candidate changed beyond its training (sessions, sampling, tasks) holds for every row
    same = [o for o in tuned["rl_set"] if not o.startswith(("trainer.", "warmstart."))]
    common = ['eval.split="test"', 'eval.suites=["heldout"]', *same]
    common += [f"eval.heldout_n={test_n}"] if test_n else []
    runs = {
        "base": ["eval", path, *common, f"eval.label={config}_base_test", f"run.results_dir={p['results']}"],
        **{
            row: [
                "eval",
                path,
                *common,
                f"model.init_from={p['warm']}",
                f"run.name={p['run']}",
                *([f"eval.version={version}"] if version else []),  # 0: the warm start itself
                f"eval.label={row}_test",
                f"run.results_dir={p['results']}",
            ]
            for row, version in (("warm", 0), ("rl", rl["steps"]))
        },
    }
    res = {}
    for row, cmd in runs.items():
        label = next(a.split("=", 1)[1] for a in cmd if a.startswith("eval.label="))
        file = ROOT / p["results"] / f"eval_{label}.json"
        if not file.is_file():
            shipyard(cmd, LOGS / f"{p['run']}_{row}_test.log")
        res[row] = json.loads(file.read_text())["heldout"]
        if test_n and res[row]["n"] != test_n:
            raise SystemExit(
                f"{file} scored {res[row]['n']} test tasks, not --test-n {test_n}: remove it to rescore"
            )
        assert res[row]["split"] == "test" and res[row]["task_ids"] == res["base"]["task_ids"], row
    diff, lo, hi = paired_diff_ci(
        [float(x) for x in res["warm"]["passed"]], [float(x) for x in res["rl"]["passed"]]
    )
    warm = json.loads((ROOT / p["warm"] / "warmstart.json").read_text())
    got: dict[str, Any] = {
        f"{pre}_candidate": cand,
        f"{pre}_split": "test",
        f"{pre}_heldout_n": res["base"]["n"],
        f"{pre}_heldout_base": res["base"]["pass1"],
        f"{pre}_heldout_before": res["warm"]["pass1"],
        f"{pre}_heldout_after": res["rl"]["pass1"],
        f"{pre}_diff": diff,
        f"{pre}_diff_ci95_low": lo,
        f"{pre}_diff_ci95_high": hi,
        f"{pre}_minutes": rl["minutes"],
        f"{pre}_warmstart_minutes": warm["seconds"] / 60,
        f"{pre}_warmstart_demos": warm["demos_kept"],
        f"{pre}_rl_steps": rl["steps"],
    }
    for row, key in (("base", "base"), ("warm", "before"), ("rl", "after")):
        got[f"{pre}_tool_call_attempts_{key}"] = res[row].get("tool_call_attempts")
        got[f"{pre}_tool_call_parse_{key}"] = res[row].get("tool_call_parse_frac")
    if (cut := tuned.get("difficulty_cut")) is not None:
        got[f"{pre}_by_difficulty"] = by_difficulty(path, tuned["rl_set"], cut, res["warm"], res["rl"])
    if config == "mini_swe":
        got["minutes"] = rl["minutes"]  # the key for the mini-swe-agent run
    _merge(out / "harness.json", got)
    return got


def by_difficulty(
    path: str, overrides: list[str], cut: int, before: dict[str, Any], after: dict[str, Any]
) -> dict[str, dict[str, float]]:
    """The paired difference of two evaluations (``eval_*.json``) of the candidate's tasks on those
    of difficulty <= ``cut`` and on the harder ones."""
    from shipyard.envs.tasks.functions import generated_tasks

    tasks = load_config(path, overrides).tasks
    assert before["task_ids"] == after["task_ids"]
    level = {t.id: t.difficulty for t in generated_tasks(tasks.num_generated, tasks.seed)}
    out: dict[str, dict[str, float]] = {}
    for name, keep in ((f"difficulty<={cut}", lambda d: d <= cut), (f"difficulty>{cut}", lambda d: d > cut)):
        idx = [i for i, t in enumerate(before["task_ids"]) if keep(level[t])]
        b, a = [float(before["passed"][i]) for i in idx], [float(after["passed"][i]) for i in idx]
        diff, lo, hi = paired_diff_ci(b, a)
        out[name] = {"n": len(idx), "before": sum(b) / len(b), "after": sum(a) / len(a), "diff": diff}
        out[name] |= {"diff_ci95_low": lo, "diff_ci95_high": hi}
    return out


def _merge(path: Path, new: dict[str, Any], deep: bool = False) -> None:
    """Merge ``new`` into the JSON at ``path`` (one level deeper with ``deep``), atomically."""
    current = json.loads(path.read_text()) if path.exists() else {}
    for k, v in new.items():
        current[k] = {**current.get(k, {}), **v} if deep else v
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(current, indent=1) + "\n")
    tmp.replace(path)
    print(f"merged into {path}")


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--config", choices=sorted(PREFIX), default="mini_swe", help="the shipped harness config")
    what = ap.add_mutually_exclusive_group(required=True)
    what.add_argument("--candidate", help="tune this candidate on validation")
    what.add_argument("--report", help="score this candidate (chosen on validation) on the test split")
    ap.add_argument("--warm-set", nargs="*", default=[], help="dotted overrides of the warm start")
    ap.add_argument("--set", dest="rl_set", nargs="*", default=[], help="dotted overrides of the RL run")
    ap.add_argument(
        "--test-n", type=int, default=None, help="test tasks for --report (the config's eval.heldout_n)"
    )
    args = ap.parse_args()
    LOGS.mkdir(parents=True, exist_ok=True)
    if args.candidate:
        row = tune(args.config, args.candidate, args.warm_set, args.rl_set, args.out)
        split = row.pop("validation_by_difficulty", None)
        table(f"{args.config} candidate {args.candidate}: validation", {args.candidate: row})
        if split:
            table("the same on validation, by the tasks' difficulty", split)
        return
    got = report(args.config, args.report, args.out, args.test_n)
    pre = PREFIX[args.config]
    table(
        f"{args.config}, candidate {args.report}: test split pass@1 (n={got[f'{pre}_heldout_n']})",
        {
            row: {
                "pass@1": got[f"{pre}_heldout_{key}"],
                "tool-call parse": got[f"{pre}_tool_call_parse_{key}"],
            }
            for row, key in (("base", "base"), ("warm start", "before"), ("RL", "after"))
        },
    )
    if split := got.get(f"{pre}_by_difficulty"):
        table("RL - warm start on test, by the tasks' difficulty", split)


if __name__ == "__main__":
    main()
