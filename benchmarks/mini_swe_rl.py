"""RL through mini-swe-agent (unmodified, `configs/mini_swe.toml`) on SmolLM2-135M-Instruct,
function tasks, pass@1 on the held-out split (issue 38): three rows, each its own `shipyard`
process.

1. base: ``shipyard eval configs/mini_swe.toml`` (the shipped model through mini-swe-agent);
2. warm start: ``shipyard warmstart configs/mini_swe.toml`` (the scripted expert's 64 demonstrations
   played through mini-swe-agent, SFT), evaluated as the RL run's "before";
3. RL: ``shipyard train configs/mini_swe.toml model.init_from=runs/warm/mini_swe`` (20 async GRPO
   steps), evaluated "after" on the same held-out tasks. RL's gain is measured over the warm start
   (paired 95% CI of the difference), ``minutes`` is the RL run's wall time, evaluations included.

Every evaluation samples one seeded answer per task at the sampling temperature (0.7), 100 held-out
tasks never trained on (demonstrations come from the training split). ``--collect`` reads the
results of runs already made instead of running them. Merges the figures into
benchmarks/results/harness.json under ``mini_swe_*`` (``harnesses.py`` keeps them).

    python benchmarks/mini_swe_rl.py [--collect]
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from harness import parser, shipyard, table

ROOT = Path(__file__).resolve().parents[1]
RUN = "mini_swe_rl"
WARM = "runs/warm/mini_swe"
RESULTS = f"runs/{RUN}_results"
BASE = [
    "eval",
    "configs/mini_swe.toml",
    'eval.suites=["heldout"]',
    "eval.label=mini_swe_base",
    "eval.temperature=0.7",
]
TRAIN = [
    "train",
    "configs/mini_swe.toml",
    f"model.init_from={WARM}",
    f"run.name={RUN}",
    f"run.results_dir={RESULTS}",
]


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--collect", action="store_true", help="read the results of runs already made")
    args = ap.parse_args()
    logs = ROOT / "runs" / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    if not args.collect:
        shipyard(BASE, logs / "mini_swe_base.log")
        shipyard(["warmstart", "configs/mini_swe.toml"], logs / "mini_swe_warmstart.log")
        shipyard(TRAIN, logs / "mini_swe_rl.log")
    base = json.loads((ROOT / "benchmarks/results/eval_mini_swe_base.json").read_text())["heldout"]
    warm = json.loads((ROOT / WARM / "warmstart.json").read_text())
    rl = json.loads((ROOT / RESULTS / "demo.json").read_text())
    figures: dict[str, Any] = {
        "mini_swe_heldout_n": rl["heldout_n"],
        "mini_swe_heldout_base": base["pass1"],
        "mini_swe_heldout_before": rl["heldout_before"],
        "mini_swe_heldout_after": rl["heldout_after"],
        "mini_swe_diff": rl["heldout_diff"],
        "mini_swe_diff_ci95_low": rl["heldout_diff_ci95_low"],
        "mini_swe_diff_ci95_high": rl["heldout_diff_ci95_high"],
        "minutes": rl["minutes"],
        "mini_swe_warmstart_minutes": warm["seconds"] / 60,
        "mini_swe_warmstart_demos": warm["demos_kept"],
        "mini_swe_rl_steps": rl["steps"],
    }
    table(
        "mini-swe-agent: held-out pass@1",
        {
            "base": {"pass@1": base["pass1"]},
            "warm start": {"pass@1": rl["heldout_before"], "minutes": warm["seconds"] / 60},
            "RL": {"pass@1": rl["heldout_after"], "minutes": rl["minutes"]},
        },
    )
    path = args.out / "harness.json"
    current = json.loads(path.read_text()) if path.exists() else {}
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({**current, **figures}, indent=1) + "\n")
    tmp.replace(path)
    print(f"merged into {path}: {figures}")


if __name__ == "__main__":
    main()
