"""Where does the demo's gain show? One finished demo run, its base and final versions evaluated on
the same held-out tasks (the run's own tasks and `eval.split`, from its `config.json`) greedily and
by sampling, with the paired interval of each difference.

Run it from the directory the run was started in (its `store.root` is relative):

    python benchmarks/demo_eval_modes.py runs/demo_seeds_s0 --temperatures 0 0.7

Writes `benchmarks/results/demo_eval_modes.json`: per temperature `before`, `after`, `diff`,
`ci95_low`, `ci95_high`, `up` (tasks failed before and passed after), `down` (the reverse), `n`.
`--quick` evaluates 20 tasks.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import harness


def main() -> int:
    from shipyard.config.schema import ShipyardConfig
    from shipyard.eval.command import run_eval
    from shipyard.eval.stats import paired_diff_ci

    p = harness.parser(__doc__)
    p.add_argument("run_dir", type=Path)
    p.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 0.7])
    args = p.parse_args()
    resolved = json.loads((args.run_dir / "config.json").read_text())
    name, final = resolved["run"]["name"], resolved["trainer"]["steps"]
    n = 20 if args.quick else resolved["eval"]["heldout_n"]
    rows, figures = {}, {"run": name, "versions": [0, final]}
    for temp in args.temperatures:
        passed = {}
        for version in (0, final):
            # the run's own config (its tasks and split); version 0 is the base model itself
            ev = {"temperature": temp, "version": version, "suites": ["heldout"], "heldout_n": n}
            inference = {**resolved["inference"], "threads": 2}
            cfg = ShipyardConfig.model_validate(
                {**resolved, "eval": {**resolved["eval"], **ev}, "inference": inference}
            )
            passed[version] = [float(x) for x in run_eval(cfg)["heldout"]["passed"]]
        before, after = passed[0], passed[final]
        diff, lo, hi = paired_diff_ci(before, after)
        row = {
            "before": sum(before) / n,
            "after": sum(after) / n,
            "diff": diff,
            "ci95_low": lo,
            "ci95_high": hi,
            "up": sum(1 for b, a in zip(before, after, strict=True) if a > b),
            "down": sum(1 for b, a in zip(before, after, strict=True) if a < b),
            "n": n,
        }
        rows[f"temperature {temp}"] = row
        figures[f"t{temp}"] = row
    harness.table(f"{name}: version 0 vs {final} on the same held-out tasks", rows)
    harness.write_results(args, "demo_eval_modes", figures)
    return 0


if __name__ == "__main__":
    sys.exit(main())
