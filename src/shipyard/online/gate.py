"""The evaluation gate: a candidate is promoted only when nothing regresses significantly.

Contract: :func:`run_gate` evaluates the serving weights and the candidate's on every suite of
``online.gate.suites`` with the same tasks and the same seeds (each session's seeds depend on the
task and sample, not on the weights), in one in-process engine whose weights are swapped between
the two, and compares them per suite with the paired interval
(:func:`shipyard.eval.stats.paired_diff_ci` at ``z``). A suite *regresses* when its interval lies
wholly below ``-regression_margin``. The decision is ``promote`` when no suite regresses and the
target suite did not fall (``online.gate.target_fall_z``: None, its difference is not negative; z,
``difference + z * standard error`` is not negative, the standard error read off its interval),
else ``reject`` with the reason. The
:class:`GateDecision` holds the evidence (per suite: n, serving and candidate means, difference
and interval) and is recorded by :mod:`shipyard.online.serving` whatever it says.

Suites: ``heldout`` (generated tasks never trained on, :func:`task_splits`), ``humaneval``, and
``regression`` (a task file of past production prompts whose good outcome is known, in the format
of docs/tasks.md; :func:`write_regression_suite` makes one).

Limits: the gate's cost is two evaluations per suite; on a CPU keep suites small and sample a few
times per task rather than many tasks (the paired difference averages the samples).
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shipyard.agent.spec import session_spec
from shipyard.config.schema import GateSuiteConfig, ShipyardConfig
from shipyard.envs.types import Task
from shipyard.eval.evaluate import evaluate
from shipyard.eval.stats import paired_diff_ci


@dataclass
class SuiteResult:
    name: str
    n: int
    serving: float
    candidate: float
    diff: float
    low: float
    high: float
    regressed: bool
    target: bool


@dataclass
class GateDecision:
    candidate: int
    serving: int
    promote: bool
    reason: str
    suites: list[SuiteResult] = field(default_factory=list)
    at: float = 0.0
    seconds: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def suite_tasks(cfg: ShipyardConfig, suite: GateSuiteConfig) -> list[Task]:
    from shipyard.envs.tasks.files import load_task_file
    from shipyard.envs.tasks.humaneval import humaneval_tasks
    from shipyard.envs.tasks.splits import task_splits

    if suite.kind == "heldout":
        return task_splits(cfg)[1][: suite.n]
    if suite.kind == "humaneval":
        return humaneval_tasks(suite.n)
    return load_task_file(suite.path)[: suite.n]


def decide(
    candidate: int, serving: int, results: list[SuiteResult], fall_z: float | None = None, z: float = 1.96
) -> GateDecision:
    """The gate's rule (module doc) over measured suites: ``fall_z`` is ``online.gate.target_fall_z``
    and ``z`` the width the suites' intervals were measured at (``online.gate.z``)."""
    regressed = [r.name for r in results if r.regressed]
    target = next((r for r in results if r.target), None)
    fell = target is not None and _fell(target, fall_z, z)
    if regressed:
        reason = f"significant regression on {', '.join(regressed)}"
    elif fell and target is not None and fall_z is None:
        reason = f"target suite {target.name} fell by {-target.diff:.3f} (not significant, but the target must not fall)"
    elif fell and target is not None:
        reason = f"target suite {target.name} fell by {-target.diff:.3f}, beyond {fall_z:g} standard errors"
    else:
        reason = "no significant regression" + (
            f"; target {target.name} {target.diff:+.3f}" if target else ""
        )
    return GateDecision(candidate, serving, not regressed and not fell, reason, results)


def _fell(target: SuiteResult, fall_z: float | None, z: float) -> bool:
    """Did the target fall under the rule? ``None``: any negative difference; else beyond ``fall_z``
    standard errors (the interval ``diff +- z * se`` gives ``se``)."""
    if fall_z is None:
        return target.diff < 0
    se = (target.high - target.low) / (2 * z)
    return target.diff + fall_z * se < 0


def run_gate(
    cfg: ShipyardConfig,
    engine: Any,
    candidate: tuple[int, dict[str, Any]],
    serving: tuple[int, dict[str, Any]],
    cache: dict[tuple[Any, ...], list[float]] | None = None,
) -> GateDecision:
    """Evaluate (version, weights) ``candidate`` against ``serving`` in ``engine`` (an
    :class:`~shipyard.inference.engine.engine.EmbeddedEngine` of the policy's architecture); module doc.
    ``cache`` keeps the serving version's per-task outcomes by (version, suite, tasks, samples):
    the same weights with the same seeds score the same, so the next candidate gated against the
    same serving version evaluates only itself."""
    from shipyard.inference.client import LocalInferenceClient

    t0 = time.time()
    g = cfg.online.gate
    spec = session_spec(cfg, LocalInferenceClient(engine), engine.tokenizer)
    suites = [
        (f"{s.kind}{i}" if s.kind == "regression" else s.kind, s, suite_tasks(cfg, s))
        for i, s in enumerate(g.suites)
    ]
    cache = {} if cache is None else cache
    scores: dict[str, dict[str, list[float]]] = {"serving": {}, "candidate": {}}
    for role, (version, weights) in (("serving", serving), ("candidate", candidate)):
        staged = False
        for name, suite, tasks in suites:
            key = (version, name, tuple(t.id for t in tasks), suite.samples_per_task)
            if role == "serving" and key in cache:
                scores[role][name] = cache[key]
                continue
            if not staged:
                engine.stage_weights(version, weights)
                engine.apply_pending()
                staged = True
            res = evaluate(
                spec, tasks, g.temperature, cfg.rollout.concurrency, samples=suite.samples_per_task
            )
            scores[role][name] = res.passed
            if role == "serving":
                cache[key] = res.passed
    results = []
    for name, suite, tasks in suites:
        before, after = scores["serving"][name], scores["candidate"][name]
        diff, lo, hi = paired_diff_ci(before, after, g.z)
        mean_b, mean_a = sum(before) / len(before), sum(after) / len(after)
        results.append(
            SuiteResult(
                name, len(tasks), mean_b, mean_a, diff, lo, hi, hi < -g.regression_margin, suite.target
            )
        )
    decision = decide(candidate[0], serving[0], results, g.target_fall_z, g.z)
    decision.at, decision.seconds = time.time(), time.time() - t0
    return decision


def write_regression_suite(path: Path, tasks: list[Task]) -> int:
    """Write ``tasks`` (production prompts whose good outcome is known, as tasks with hidden tests)
    as a task file for a ``regression`` suite, atomically; returns how many."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(json.dumps(t.to_json()) + "\n" for t in tasks))
    tmp.replace(path)
    return len(tasks)
