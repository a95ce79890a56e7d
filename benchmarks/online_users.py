"""The simulated user population of `benchmarks/online.py` (issue 18), written for the benchmark.

Each :class:`User` has hidden preferences over a coding answer, as weights over three features
measured on the answer itself:

- ``tests``: the answer's code passes the task's hidden tests (graded for real, in the sandbox);
- ``doc``: the task's function carries a docstring (``ast.get_docstring``);
- ``short``: the answer is at most ``short_tokens`` tokens.

Its *satisfaction* with an answer is the weighted mean of the features, in [0, 1]; nobody sees it,
the benchmark measures it. What users do is what a product sees (:meth:`User.react`): with
probability ``p_silent`` nothing at all; otherwise, when the answer holds code, they apply the edit
and run the tests (``tests`` +1/-1, with probability ``p_run``), keep or revert the edit depending on
their satisfaction (``edit``, with ``p_edit``), give a thumb with probability ``p_thumb`` from a noisy
read of their satisfaction (``thumb_noise``), write a dissatisfied follow-up when very unhappy, and
abandon the session when nothing usable came (``abandoned``). A dodge (no code) is rarely judged:
only thumbs, sometimes polite.

The population is drawn from a seed, so two runs with the same seed meet the same users.
"""

from __future__ import annotations

import ast
import random
from dataclasses import dataclass
from typing import Any

from shipyard.agent.actions import parse_action
from shipyard.config.schema import SandboxConfig
from shipyard.envs.grading.grader import grade
from shipyard.envs.types import Task


@dataclass
class User:
    uid: str
    w_tests: float
    w_doc: float
    w_short: float
    short_tokens: int
    p_silent: float
    p_run: float
    p_edit: float
    p_thumb: float
    thumb_noise: float

    def satisfaction(self, feats: dict[str, float]) -> float:
        w = self.w_tests + self.w_doc + self.w_short
        return (self.w_tests * feats["tests"] + self.w_doc * feats["doc"] + self.w_short * feats["short"]) / w

    def react(self, feats: dict[str, float], has_code: bool, rng: random.Random) -> list[tuple[str, float]]:
        """The signals this user sends about one answer (module doc): (kind, value) pairs."""
        if rng.random() < self.p_silent:
            return []
        sat = self.satisfaction(feats)
        out: list[tuple[str, float]] = []
        if not has_code:
            if rng.random() < self.p_thumb * 0.5:
                out.append(("thumb", 1.0 if rng.random() < 0.4 else -1.0))  # sometimes polite
            return out
        if rng.random() < self.p_run:
            out.append(("tests", 1.0 if feats["tests"] else -1.0))
        if rng.random() < self.p_edit:
            out.append(("edit", 1.0 if sat >= 0.5 else -1.0))
        if rng.random() < self.p_thumb:
            out.append(("thumb", 1.0 if sat + rng.gauss(0, self.thumb_noise) >= 0.5 else -1.0))
        if sat < 0.25 and rng.random() < 0.3:
            out.append(("followup", -1.0))
        return out


def population(n: int, seed: int) -> list[User]:
    rng = random.Random(seed)
    return [
        User(
            uid=f"user{i:03d}",
            w_tests=rng.uniform(0.6, 1.0),
            w_doc=rng.uniform(0.0, 0.8),
            w_short=rng.uniform(0.0, 0.5),
            short_tokens=rng.choice([60, 80, 100]),
            p_silent=rng.uniform(0.05, 0.3),
            p_run=rng.uniform(0.5, 0.9),
            p_edit=rng.uniform(0.4, 0.9),
            p_thumb=rng.uniform(0.2, 0.6),
            thumb_noise=rng.uniform(0.1, 0.3),
        )
        for i in range(n)
    ]


def features(
    task: Task, text: str, n_tokens: int, short_tokens: int, sandbox: SandboxConfig
) -> tuple[dict[str, float], bool]:
    """(the answer's features, whether it holds code): real grading of the code it writes."""
    action = parse_action(text, task.kind)
    if action.kind != "write" or not action.content.strip():
        return {"tests": 0.0, "doc": 0.0, "short": float(n_tokens <= short_tokens)}, False
    files = {**task.files, action.path or "solution.py": action.content}
    passed = grade(task, files, sandbox).reward >= 1.0
    return {
        "tests": float(passed),
        "doc": float(_has_doc(action.content, task.entry_point)),
        "short": float(n_tokens <= short_tokens),
    }, True


def _has_doc(code: str, entry: str) -> bool:
    try:
        tree = ast.parse(code)
    except SyntaxError:
        return False
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and (node.name == entry or not entry):
            return ast.get_docstring(node) is not None
    return False


def summary(users: list[User]) -> dict[str, Any]:
    """The population's shape, for the results file."""
    n = len(users)
    mean = {
        k: sum(getattr(u, k) for u in users) / n
        for k in ("w_tests", "w_doc", "w_short", "p_silent", "p_thumb")
    }
    return {"users": n, **{f"mean_{k}": round(v, 3) for k, v in mean.items()}}
