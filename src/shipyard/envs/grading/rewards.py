"""Reward components and their weighted composite.

Contract: a session's reward is built from named components, each a float in [0, 1]:
``tests`` (hidden tests, or the hidden SQL checks of a db task: passed / total, after the task
kind's gating, see :mod:`.tests`), ``judge/<aspect>`` (one rubric aspect scored by an LLM judge,
see :mod:`.judge`) and ``judge`` (the mean of the aspects). :func:`composite` is the weighted
sum over ``rewards.weights``; :func:`needed` says which components the weights need, so the
judge is only called when one of its components has weight. Every component computed is kept
(``Trajectory.reward_components``), weighted or not.

A component that could not be computed (an unreachable judge, an unparseable verdict) is 0.0
and its reason is recorded in the details; it never fails the session.

Example::

    composite({"tests": 0.8, "judge": 0.2}, {"tests": 1.0, "judge": 0.5, "judge/quality": 0.5})   # 0.9
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


def needed(weights: Mapping[str, float]) -> set[str]:
    """Components with a non-zero weight; ``"judge"`` stands for every ``judge/...`` one too."""
    names = {name for name, w in weights.items() if w}
    return names | ({"judge"} if any(n.startswith("judge/") for n in names) else set())


def composite(weights: Mapping[str, float], components: Mapping[str, float]) -> float:
    """Sum of weight x component; a weighted component that is missing is an internal error."""
    missing = sorted(n for n, w in weights.items() if w and n not in components)
    assert not missing, f"components {missing} have weight but were not computed"
    return float(sum(w * components[n] for n, w in weights.items() if w))


def component_metrics(sessions: Sequence[Any]) -> dict[str, float]:
    """``reward/component/<name>``: mean of each component over the sessions that computed it."""
    seen: dict[str, list[float]] = {}
    for s in sessions:
        for name, value in s.reward_components.items():
            seen.setdefault(name, []).append(value)
    return {f"reward/component/{name}": sum(v) / len(v) for name, v in sorted(seen.items())}
