"""RL through a third-party harness (unmodified) on SmolLM2-135M-Instruct, function tasks, pass@1
on the held-out split (issue 38): three rows per harness, each its own `shipyard` process.

``--config`` names the shipped config: ``mini_swe`` (mini-swe-agent, bash tool), ``agents_sdk``
(the OpenAI Agents SDK, function tools) or ``verifiers_env`` (a verifiers environment, its rubric
the reward).

1. base: ``shipyard eval configs/<config>.toml`` (the shipped model through the harness);
2. warm start: ``shipyard warmstart configs/<config>.toml`` (the scripted expert's demonstrations
   played through the harness, SFT), evaluated as the RL run's "before";
3. RL: ``shipyard train configs/<config>.toml model.init_from=runs/warm/<config>`` (the config's
   async GRPO steps), evaluated "after" on the same held-out tasks. RL's gain is measured over the
   warm start (paired 95% CI of the difference); ``minutes`` is the RL run's wall time, evaluations
   included.

Every evaluation samples one seeded answer per task at the sampling temperature (0.7) on the
config's ``eval.heldout_n`` held-out tasks, never trained on (demonstrations come from the training
split). Definitions, fixed before the runs: ``tool_call_parse_<row>`` is, over every reply of that
row's evaluation that tried a tool call (the endpoint's ``tool_call_attempts``), the fraction whose
call parsed; None where no reply tried one (a harness without tools, or a policy that never calls).
``--collect`` reads the results of runs already made instead of running them. Merges the figures
into benchmarks/results/harness.json under ``<prefix>_*`` (``mini_swe``, ``agents_sdk``,
``verifiers``; ``harnesses.py`` keeps them), and for mini-swe-agent also the issue's ``minutes``.

    python benchmarks/harness_rl.py --config mini_swe [--collect]
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from harness import parser, shipyard, table

ROOT = Path(__file__).resolve().parents[1]
PREFIX = {"mini_swe": "mini_swe", "agents_sdk": "agents_sdk", "verifiers_env": "verifiers"}
"""Shipped config -> the prefix of its keys in harness.json."""


def commands(config: str) -> dict[str, list[str]]:
    """The three rows' ``shipyard`` commands for ``configs/<config>.toml``."""
    path = f"configs/{config}.toml"
    base = ["eval", path, 'eval.suites=["heldout"]', f"eval.label={config}_base", "eval.temperature=0.7"]
    train = [
        "train",
        path,
        f"model.init_from=runs/warm/{config}",
        f"run.name={config}_rl",
        f"run.results_dir=runs/{config}_rl_results",
    ]
    return {"base": base, "warmstart": ["warmstart", path], "rl": train}


def figures(config: str) -> dict[str, Any]:
    """The rows of ``config``'s runs, read from their results, under its prefix."""
    p = PREFIX[config]
    base = json.loads((ROOT / f"benchmarks/results/eval_{config}_base.json").read_text())["heldout"]
    warm = json.loads((ROOT / f"runs/warm/{config}/warmstart.json").read_text())
    rl = json.loads((ROOT / f"runs/{config}_rl_results/demo.json").read_text())
    out: dict[str, Any] = {
        f"{p}_heldout_n": rl["heldout_n"],
        f"{p}_heldout_base": base["pass1"],
        f"{p}_heldout_before": rl["heldout_before"],
        f"{p}_heldout_after": rl["heldout_after"],
        f"{p}_diff": rl["heldout_diff"],
        f"{p}_diff_ci95_low": rl["heldout_diff_ci95_low"],
        f"{p}_diff_ci95_high": rl["heldout_diff_ci95_high"],
        f"{p}_minutes": rl["minutes"],
        f"{p}_warmstart_minutes": warm["seconds"] / 60,
        f"{p}_warmstart_demos": warm["demos_kept"],
        f"{p}_rl_steps": rl["steps"],
    }
    for row, extra in (("base", base), ("before", rl.get("before_extra")), ("after", rl.get("after_extra"))):
        extra = extra or {}
        out[f"{p}_tool_call_attempts_{row}"] = extra.get("tool_call_attempts")
        out[f"{p}_tool_call_parse_{row}"] = extra.get("tool_call_parse_frac")
    if config == "mini_swe":
        out["minutes"] = rl["minutes"]  # the key for the mini-swe-agent run
    return out


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--config", choices=sorted(PREFIX), default="mini_swe", help="the shipped harness config")
    ap.add_argument("--collect", action="store_true", help="read the results of runs already made")
    args = ap.parse_args()
    logs = ROOT / "runs" / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    if not args.collect:
        for row, cmd in commands(args.config).items():
            shipyard(cmd, logs / f"{args.config}_{row}.log")
    got = figures(args.config)
    p = PREFIX[args.config]
    table(
        f"{args.config}: held-out pass@1 (n={got[f'{p}_heldout_n']})",
        {
            row: {
                "pass@1": got[f"{p}_heldout_{key}"],
                "tool-call parse": got[f"{p}_tool_call_parse_{key}"],
                "minutes": minutes,
            }
            for row, key, minutes in (
                ("base", "base", None),
                ("warm start", "before", got[f"{p}_warmstart_minutes"]),
                ("RL", "after", got[f"{p}_minutes"]),
            )
        },
    )
    path = args.out / "harness.json"
    current = json.loads(path.read_text()) if path.exists() else {}
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({**current, **got}, indent=1) + "\n")
    tmp.replace(path)
    print(f"merged into {path}: {got}")


if __name__ == "__main__":
    main()
