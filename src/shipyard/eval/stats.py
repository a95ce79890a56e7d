"""Confidence intervals for pass rates and paired before/after differences.

Contract: :func:`wilson_ci` is the Wilson score interval of a binomial proportion;
:func:`paired_diff_ci` is the normal-approximation interval of mean(after - before) over the
same tasks (per-task outcomes in {0, 1} or rewards in [0, 1]), the right test when the same
held-out tasks are evaluated twice; :func:`clustered_diff_ci` is the same mean difference with a
cluster-robust variance, for pairs that are not independent (several samples of one prompt: a
prompt's samples share its difficulty, so 78 prompts x 2 samples are not 156 independent pairs).
All return their bounds at 95% by default.
"""

from __future__ import annotations

import math


def wilson_ci(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    if n == 0:
        return (0.0, 1.0)
    p = k / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return (max(0.0, centre - half), min(1.0, centre + half))


def paired_diff_ci(before: list[float], after: list[float], z: float = 1.96) -> tuple[float, float, float]:
    """(mean difference, low, high) of after - before over paired outcomes."""
    if len(before) != len(after) or not before:
        raise ValueError(f"paired outcomes need equal, non-zero lengths (got {len(before)} and {len(after)})")
    return clustered_diff_ci(before, after, list(range(len(before))), z)  # every pair its own cluster


def clustered_diff_ci(
    before: list[float], after: list[float], clusters: list[object], z: float = 1.96
) -> tuple[float, float, float]:
    """(mean difference, low, high) of after - before over pairs grouped in ``clusters`` (one label
    per pair, e.g. the prompt it sampled): the variance of the mean is the cluster-robust
    G/(G-1) * sum over clusters of (sum of the cluster's residuals)^2 / n^2, which is
    the ordinary paired interval (:func:`paired_diff_ci`) when every pair is its own cluster."""
    if len(before) != len(after) or len(before) != len(clusters) or not before:
        raise ValueError(
            f"clustered pairs need equal, non-zero lengths (got {len(before)} before, {len(after)} "
            f"after, {len(clusters)} cluster labels)"
        )
    d = [a - b for a, b in zip(after, before, strict=True)]
    n = len(d)
    mean = sum(d) / n
    sums: dict[object, float] = {}
    for x, c in zip(d, clusters, strict=True):
        sums[c] = sums.get(c, 0.0) + (x - mean)
    g = len(sums)
    var = g / (g - 1) * sum(r * r for r in sums.values()) / (n * n) if g > 1 else 0.0
    half = z * math.sqrt(var)
    return (mean, mean - half, mean + half)
