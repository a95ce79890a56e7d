"""Plots of a run: reward, staleness and mismatch against the training step.

Contract: ``plot_run(metrics_jsonl, out_png)`` draws three panels from the trainer's records
(keys ``reward/mean``, ``staleness/mean`` and ``staleness/max``, ``mismatch/k3``) and writes a
PNG; missing keys leave their panel empty rather than failing. Uses matplotlib's Agg backend.
"""

from __future__ import annotations

from pathlib import Path

from shipyard.metrics.logger import read_metrics


def _series(records: list[dict], key: str) -> tuple[list[int], list[float]]:
    pts = [(r["step"], r[key]) for r in records if key in r]
    return [p[0] for p in pts], [p[1] for p in pts]


def plot_run(metrics_jsonl: str | Path, out_png: str | Path, title: str = "") -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = [r for r in read_metrics(metrics_jsonl) if r.get("kind") == "train"]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    panels = [
        ("reward", [("reward/mean", "mean reward")]),
        ("staleness (versions)", [("staleness/mean", "mean"), ("staleness/max", "max")]),
        ("mismatch k3", [("mismatch/k3", "k3")]),
    ]
    for ax, (name, keys) in zip(axes, panels, strict=True):
        for key, label in keys:
            xs, ys = _series(records, key)
            if xs:
                ax.plot(xs, ys, marker="o", ms=3, label=label, alpha=0.5 if key == "reward/mean" else 1.0)
            if key == "reward/mean" and len(ys) >= 3:
                w = min(5, len(ys))
                smooth = [
                    sum(ys[max(0, i - w + 1) : i + 1]) / len(ys[max(0, i - w + 1) : i + 1])
                    for i in range(len(ys))
                ]
                ax.plot(xs, smooth, lw=2, label=f"mean of last {w}")
                ax.legend()
        ax.set_title(name)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if len(keys) > 1:
            ax.legend()
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    out = Path(out_png)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
