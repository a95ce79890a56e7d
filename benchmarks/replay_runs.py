"""Side-by-side curves of two RL runs of an MoE policy, with and without router replay.

Contract: reads ``<run>/metrics.jsonl`` of both runs (the trainer's ``kind == "train"`` records),
plots per step the mean reward, the mismatch k3 (``mismatch/k3``) and the routing disagreement
the trainer's forward used (``mismatch/route_disagree``) and its own router's (``mismatch/
route_own_disagree``) into one PNG, and writes the per-step series and their means to a JSON
file. The runs are produced by the train driver with the same seeds (each name keeps its own
data under ``runs/store/<run.name>/``)::

    shipyard train configs/tiny_moe.toml run.name=moe_replay trainer.router_replay=true
    shipyard train configs/tiny_moe.toml run.name=moe_noreplay trainer.router_replay=false
    .venv/bin/python benchmarks/replay_runs.py runs/moe_replay runs/moe_noreplay

Limits: plots whatever steps each run logged (a run still going is drawn as far as it got).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from shipyard.metrics.logger import read_metrics

KEYS = ("reward/mean", "mismatch/k3", "mismatch/route_disagree", "mismatch/route_own_disagree")


def run_series(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Per-key ``(step, value)`` points of a run's train records."""
    records = [r for r in read_metrics(run_dir / "metrics.jsonl") if r.get("kind") == "train"]
    return {k: [(r["step"], float(r[k])) for r in records if k in r] for k in KEYS}


def plot(runs: dict[str, dict[str, list[tuple[int, float]]]], out_png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [
        ("mean reward", ["reward/mean"]),
        ("mismatch k3 (sampler vs trainer)", ["mismatch/k3"]),
        ("routing disagreement", ["mismatch/route_disagree", "mismatch/route_own_disagree"]),
    ]
    fig, axes = plt.subplots(1, 3, figsize=(14, 3.8))
    for ax, (title, keys) in zip(axes, panels, strict=True):
        for name, series in runs.items():
            for key in keys:
                pts = series[key]
                if pts:
                    own = key.endswith("own_disagree")
                    label = f"{name}: {'own router' if own else 'used'}" if len(keys) > 1 else name
                    ax.plot(
                        [p[0] for p in pts],
                        [p[1] for p in pts],
                        marker="o",
                        ms=3,
                        ls="--" if own else "-",
                        label=label,
                    )
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png, dpi=110)
    plt.close(fig)


def summary(runs: dict[str, dict[str, list[tuple[int, float]]]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, series in runs.items():
        out[name] = {
            "steps": len(series["mismatch/k3"]),
            **{
                f"mean_{k.replace('/', '_')}": (sum(v for _, v in s) / len(s) if s else None)
                for k, s in series.items()
            },
            "series": {k: s for k, s in series.items()},
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("replay_run", type=Path)
    ap.add_argument("baseline_run", type=Path)
    ap.add_argument("--png", type=Path, default=Path("docs/router_replay.png"))
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/router_replay_runs.json"))
    args = ap.parse_args()
    for run in (args.replay_run, args.baseline_run):
        if not (run / "metrics.jsonl").is_file():
            raise ValueError(
                f"{run} has no metrics.jsonl; pass the run directories of two finished train runs"
            )
    runs = {"replay": run_series(args.replay_run), "no replay": run_series(args.baseline_run)}
    plot(runs, args.png)
    result = summary(runs)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    for name, s in result.items():
        print(name, {k: v for k, v in s.items() if k != "series"})
    print(f"wrote {args.png} and {args.out}")


if __name__ == "__main__":
    main()
