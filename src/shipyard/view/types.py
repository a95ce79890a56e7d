"""Records of ``shipyard view``: one row per rollout (a whole session), the filters a person asks.

A rollout is one agent session of the run: its segments (one per context) live in one rollout
batch of the run's store. A row is what the list shows and filters on; the full session (turns,
tokens, diff, grade) is read from the batch when it is opened (:mod:`shipyard.view.run`).

Example::

    q = RolloutQuery(kind="gen", min_reward=0.5, flagged=False, sort="-reward", offset=0, limit=50)
    page = reader.rollouts(q)       # {"total": ..., "rows": [RolloutRow.to_json(), ...], ...}
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from typing import Any, Literal

SORT_KEYS = ("created", "step", "version", "reward", "length", "staleness", "turns")


def task_family(task_id: str) -> str:
    """The task's family as its id names it: ``gen-00267`` -> ``gen``, ``repo-3`` -> ``repo``."""
    m = re.match(r"[A-Za-z_]+", task_id)
    return m.group(0).rstrip("_") if m else "task"


@dataclass
class RolloutRow:
    id: str
    """The session id (``<worker>/<seq>/<group>/<task>/<sample>``): stable across reloads."""
    key: str
    """The rollout batch holding it (store key)."""
    positions: list[int]
    """Indices of its segments in the batch's trajectories, in segment order."""
    task_id: str
    family: str
    group_id: str
    sample_idx: int
    worker: str
    created_at: float
    reward: float
    flags: list[str]
    finish: str
    error: bool
    length: int
    """Tokens over all segments."""
    sampled: int
    """Sampled (trained) tokens over all segments."""
    turns: int
    segments: int
    version_min: int
    version_max: int
    step: int | None = None
    """The trainer step that trained it (None: not trained, e.g. dropped or not consumed yet)."""
    staleness: int | None = None
    """Versions between the policy that trained it and the oldest that sampled it."""

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        del d["key"], d["positions"]
        return d


@dataclass
class RolloutQuery:
    """Filters and a page of the rollout list; every filter is optional."""

    step: int | None = None
    version: int | None = None
    family: str | None = None
    task_id: str | None = None
    min_reward: float | None = None
    max_reward: float | None = None
    flagged: bool | None = None
    trained: bool | None = None
    min_length: int | None = None
    max_length: int | None = None
    min_staleness: int | None = None
    sort: str = "-created"
    offset: int = 0
    limit: int = 50

    def __post_init__(self) -> None:
        if self.sort.lstrip("-") not in SORT_KEYS:
            raise ValueError(
                f"sort={self.sort!r}: use one of {', '.join(SORT_KEYS)} (prefix '-' for descending)"
            )
        if self.offset < 0 or not 1 <= self.limit <= 1000:
            raise ValueError(f"offset={self.offset}, limit={self.limit}: offset >= 0 and 1 <= limit <= 1000")

    def accepts(self, r: RolloutRow) -> bool:
        checks = [
            (self.step, lambda v: r.step == v),
            (self.version, lambda v: r.version_min <= v <= r.version_max),
            (self.family, lambda v: r.family == v),
            (self.task_id, lambda v: r.task_id == v),
            (self.min_reward, lambda v: r.reward >= v),
            (self.max_reward, lambda v: r.reward <= v),
            (self.flagged, lambda v: bool(r.flags) == v),
            (self.trained, lambda v: (r.step is not None) == v),
            (self.min_length, lambda v: r.length >= v),
            (self.max_length, lambda v: r.length <= v),
            (self.min_staleness, lambda v: r.staleness is not None and r.staleness >= v),
        ]
        return all(value is None or test(value) for value, test in checks)

    def value(self, r: RolloutRow) -> float | None:
        """``r``'s value of the sort field (None where it has none, e.g. the step of an untrained row)."""
        name = self.sort.lstrip("-")
        value = {"created": r.created_at, "version": r.version_max}.get(name, getattr(r, name, None))
        return None if value is None else float(value)

    def descending(self) -> bool:
        return self.sort.startswith("-")


Status = Literal["starting", "running", "finished", "stopped"]
