"""The online gate against realistic candidates (issue 41 §2): honest ones and ones that regress a little.

The gate of ``configs/online.toml`` (its suites and rule, :mod:`shipyard.online.gate`) decides on
candidates trained from the serving weights the way the online trainer trains (GRPO steps over
groups of sessions of production-like prompts), some honestly and some wrongly:

- ``honest_s<k>``: the sessions' real rewards (their tests), the configured learning rate, batches
  drawn with seed ``k`` (5 of them);
- ``length_*``: a corrupted reward that pays for length (a session's sampled tokens over the
  session budget);
- ``dodge_*``: a corrupted reward that pays for dodges (1 when no assistant turn wrote a file);
- ``lr_x<m>``: the real rewards with a learning rate ``m`` times the configured one.

The pool every candidate trains on is sampled once by the serving weights (``--pool`` training
tasks x ``--group`` sessions); each candidate takes ``--steps`` steps of ``--groups`` groups. The
gate's ``regression`` suite is what the online benchmark makes it: pool prompts the serving
weights solved.

Definitions (written before the first full run):

- A candidate's **target drop** is the serving weights' pass@1 minus the candidate's on the *test
  split*: held-out tasks the gate never sees (those after the gate's ``heldout`` suite, up to
  ``--test-n``), ``--test-samples`` sessions per task with the same seeds for both, and its 95%
  interval clustered by task (:func:`shipyard.eval.stats.clustered_diff_ci`).
- ``regressed_candidates_tried`` / ``_blocked``: the candidates built to regress (corrupted reward
  or learning rate), all of them, and how many the gate rejected; ``regressed_in_range``: those
  whose target drop falls in [0.03, 0.15], the realistic regressions the issue asks for.
- ``regressions_ge_0_05_tried`` / ``_blocked``: every candidate (however built) whose target drop
  is at least 0.05, and how many were rejected. Target: all of them blocked.
- ``honest_candidates_tried`` / ``_rejected``. Target: at most one rejected.

Each candidate's gate evidence (per suite: serving, candidate, difference and interval) is kept.

The gate's rule for its target suite (``online.gate.target_fall_z``) is chosen on a validation
split, never on the candidates reported (added after the first run, cut short at 7 candidates,
showed "the target must not fall" rejecting an honest candidate on noise; written before the
validation run):

- ``--split validation``: the same recipes on other batch seeds (``v_*``, seed + 100), their
  target drop measured on training tasks outside the pool (no test task labels them), the same pool
  size, steps and suites. Every value of :data:`FALL_ZS` is applied to their recorded gate evidence
  (``fall_z_table``) and :func:`choose_fall_z` picks the smallest under which at most a fifth of the
  honest candidates is rejected and every candidate whose drop is at least 0.05 is blocked
  (``chosen_target_fall_z``; None if none does). Written to ``online_gate_validation.json``.
- That value goes into ``configs/online.toml``, and then ``--split test`` (the default) runs the
  reported candidates under it.

    python benchmarks/online_gate.py --split validation   # choose target_fall_z (~1.5 h)
    python benchmarks/online_gate.py                      # the reported candidates (~1.5 h)
    python benchmarks/online_gate.py --resume             # go on after a run cut short
    python benchmarks/online_gate.py --quick              # the tiny model, 1 + 2 candidates: the wiring

Writes ``benchmarks/results/online_gate.json`` (``online_gate_quick.json``) and the gate figures
into ``online.json`` under ``gate_realistic``. Each finished candidate is kept in ``--work``
(``state.pkl``, with the pool, the regression suite and the serving weights' outcomes), so
``--resume`` goes on with the next candidate on the same pool.
"""

from __future__ import annotations

import dataclasses
import json
import pickle
import random
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import harness
from online import FULL, QUICK  # the online benchmark's settings (the tiny model under --quick)
from shipyard.config.load import load_config
from shipyard.config.schema import GateSuiteConfig, ShipyardConfig

ROOT = Path(__file__).resolve().parents[1]
DROP_RANGE = (0.03, 0.15)


@dataclass(frozen=True)
class Recipe:
    """How one candidate is trained from the serving weights (module doc)."""

    name: str
    reward: str  # "tests" | "length" | "dodge"
    lr_mult: float
    seed: int
    honest: bool


HONEST = [Recipe(f"honest_s{k}", "tests", 1.0, k, True) for k in range(5)]
REGRESSED = [
    Recipe("length_lr_x1", "length", 1.0, 10, False),
    Recipe("dodge_lr_x1", "dodge", 1.0, 12, False),
    Recipe("lr_x8", "tests", 8.0, 14, False),
    Recipe("length_lr_x3", "length", 3.0, 11, False),
    Recipe("dodge_lr_x3", "dodge", 3.0, 13, False),
    Recipe("lr_x24", "tests", 24.0, 15, False),
]
RECIPES = [r for pair in zip(HONEST, REGRESSED, strict=False) for r in pair] + REGRESSED[len(HONEST) :]
"""Honest and regressed alternating, so that a run cut short still holds both kinds (the results
are written after every candidate)."""
VALIDATION_RECIPES = [dataclasses.replace(r, name=f"v_{r.name}", seed=r.seed + 100) for r in RECIPES]
"""The same recipes on other batch seeds: the candidates ``target_fall_z`` is chosen on (``--split
validation``), never the ones reported."""
FALL_ZS = (0.0, 0.5, 1.0, 1.28, 1.645, 1.96)
"""The values of ``online.gate.target_fall_z`` the validation split chooses among (0.0: the rule
"the target must not fall" the first run measured)."""
QUICK_RECIPES = [HONEST[0], REGRESSED[0], REGRESSED[2]]


def corrupted_reward(recipe: Recipe, session: list[Any], budget: int) -> float:
    """The reward ``recipe`` trains ``session`` (its segments) on (module doc)."""
    if recipe.reward == "tests":
        return float(session[-1].reward)
    if recipe.reward == "length":
        return min(1.0, sum(t.num_sampled() for t in session) / budget)
    wrote = any(
        turn.get("role") == "assistant" and turn.get("action") == "write" for t in session for turn in t.turns
    )
    return 0.0 if wrote else 1.0


class Bench:
    """The model, the gate's engine, the trainable policy and the tasks (module doc)."""

    def __init__(self, cfg: ShipyardConfig, args: Any) -> None:
        from shipyard.agent.spec import session_spec
        from shipyard.envs.tasks.splits import task_splits
        from shipyard.inference.client import LocalInferenceClient
        from shipyard.inference.engine.engine import EmbeddedEngine
        from shipyard.models.loading import load_model
        from shipyard.models.precision import engine_precision
        from shipyard.trainer.distributed import ONE_PROCESS
        from shipyard.trainer.loop import build_policy
        from shipyard.weights.publisher import named_params

        self.cfg, self.args = cfg, args
        model, self.tok = load_model(cfg.model)
        self.base = {k: v.detach().clone() for k, v in named_params(model).items()}
        engine_precision(model, cfg.inference)  # the gate's engine serves as the servers do
        self.engine = EmbeddedEngine(model, self.tok, max_batch=cfg.inference.max_batch)
        self.spec = session_spec(cfg, LocalInferenceClient(self.engine), self.tok)
        self.policy = build_policy(cfg, ONE_PROCESS)
        train, held = task_splits(cfg)
        gate_n = max(s.n for s in cfg.online.gate.suites if s.kind == "heldout")
        self.pool_tasks = train[: args.pool]
        self.test_tasks = held[gate_n : gate_n + args.test_n]
        if args.split == "validation":  # training tasks outside the pool: no test task labels them
            self.test_tasks = train[args.pool : args.pool + args.test_n]
        if len(self.test_tasks) < 2:
            raise ValueError(
                f"the test split has {len(self.test_tasks)} tasks after the gate's {gate_n}: raise "
                "tasks.num_generated or lower the gate's heldout n"
            )
        self.gate_cache: dict[tuple[Any, ...], list[float]] = {}

    def use(self, version: int, weights: dict[str, Any]) -> None:
        self.engine.stage_weights(version, weights)
        self.engine.apply_pending()

    def sample_pool(self) -> list[list[Any]]:
        """``--group`` sessions of each pool task by the serving weights: the groups candidates train on."""
        from shipyard.agent.play import play
        from shipyard.metrics.progress import StepBar

        self.use(0, self.base)
        jobs = [(t, i) for t in self.pool_tasks for i in range(self.args.group)]
        with (
            StepBar("pool sessions", total=len(jobs), console=harness.console) as bar,
            ThreadPoolExecutor(self.cfg.rollout.concurrency) as pool,
        ):

            def one(job: tuple[Any, int]) -> list[Any]:
                task, i = job
                segments = play(self.spec, task, f"pool/{task.id}", i)
                bar.advance()
                return segments

            sessions = list(pool.map(one, jobs))
        g = self.args.group
        return [[seg for s in sessions[k : k + g] for seg in s] for k in range(0, len(sessions), g)]

    def train(self, recipe: Recipe, groups: list[list[Any]]) -> dict[str, Any]:
        """The candidate ``recipe`` makes: the serving weights, ``--steps`` GRPO steps on its rewards."""
        import torch

        from shipyard.agent.types import group_sessions
        from shipyard.trainer.advantages import batch_advantages
        from shipyard.trainer.step import train_step
        from shipyard.weights.publisher import named_params

        pol, cfg = self.policy, self.cfg
        with torch.no_grad():
            for name, p in pol.model.named_parameters():
                p.copy_(self.base[name].to(p.dtype))
        pol.optimizer.state.clear()
        for group in pol.optimizer.param_groups:
            group["lr"] = cfg.trainer.lr * recipe.lr_mult
        rng, budget, rewards = random.Random(recipe.seed), cfg.agent.max_session_tokens, []
        for _ in range(self.args.steps):
            chosen = []
            for g in rng.sample(groups, min(self.args.groups, len(groups))):
                sessions = group_sessions(g)
                rs = [corrupted_reward(recipe, s, budget) for s in sessions]
                rewards += rs
                chosen.append(
                    [dataclasses.replace(t, reward=r) for s, r in zip(sessions, rs, strict=True) for t in s]
                )
            batch = batch_advantages(chosen, cfg.trainer.loss, cfg.agent.summary)
            train_step(
                pol.scorer,
                pol.optimizer,
                batch.trajectories,
                batch.advantages,
                pol.tcfg,
                pol.tok.pad_token_id,
                temperature=cfg.sampling.temperature,
            )
        weights = {k: v.detach().clone() for k, v in named_params(pol.model).items()}
        return {"weights": weights, "trained_reward_mean": sum(rewards) / max(len(rewards), 1)}

    def test_outcomes(self, version: int, weights: dict[str, Any]) -> list[list[int]]:
        """Per test task, each sample's outcome under these weights (same seeds for every version)."""
        from shipyard.eval.evaluate import evaluate

        self.use(version, weights)
        res = evaluate(
            self.spec,
            self.test_tasks,
            self.cfg.online.gate.temperature,
            self.cfg.rollout.concurrency,
            samples=self.args.test_samples,
        )
        return res.sample_passed

    def gate(self, version: int, weights: dict[str, Any]) -> Any:
        from shipyard.online.gate import run_gate

        return run_gate(self.cfg, self.engine, (version, weights), (0, self.base), self.gate_cache)


def add_regression_suite(bench: Bench, pool: list[list[Any]], work: Path) -> int:
    """Pool prompts the serving weights solved become the gate's regression suite (as in online.py)."""
    from shipyard.online.gate import write_regression_suite

    solved = [t for t, g in zip(bench.pool_tasks, pool, strict=True) if any(s.reward >= 1.0 for s in g)]
    solved = solved[: bench.args.regression_n]
    if not solved:
        return 0
    work.mkdir(parents=True, exist_ok=True)
    n = write_regression_suite(work / "regression.jsonl", solved)
    use_regression_suite(bench, n, work)
    return n


def use_regression_suite(bench: Bench, n: int, work: Path) -> None:
    """The gate's suites with the regression suite written in ``work`` (in place of any other)."""
    suites = [s for s in bench.cfg.online.gate.suites if s.kind != "regression"]
    bench.cfg.online.gate.suites = [
        *suites,
        GateSuiteConfig(kind="regression", n=n, path=str(work / "regression.jsonl")),
    ]


def drop(serving: list[list[int]], candidate: list[list[int]]) -> dict[str, float]:
    """Serving minus candidate pass@1 on the test split, its interval clustered by task."""
    from shipyard.eval.stats import clustered_diff_ci

    before = [float(x) for outs in serving for x in outs]
    after = [float(x) for outs in candidate for x in outs]
    tasks = [i for i, outs in enumerate(serving) for _ in outs]
    diff, lo, hi = clustered_diff_ci(before, after, tasks)
    return {  # (0.0 - x: no -0.0)
        "target_drop": 0.0 - diff,
        "target_drop_ci95_low": 0.0 - hi,
        "target_drop_ci95_high": 0.0 - lo,
        "test_pass_serving": sum(before) / len(before),
        "test_pass_candidate": sum(after) / len(after),
    }


def start(bench: Bench, state_path: Path, resume: bool) -> dict[str, Any]:
    """The pool, the regression suite, the serving weights' test outcomes and the candidates done so
    far: read back with ``--resume`` (a run cut short goes on from its next candidate, on the same
    pool), else made and saved."""
    if resume and state_path.exists():
        state = pickle.loads(state_path.read_bytes())
        if state["regression_n"]:
            use_regression_suite(bench, state["regression_n"], bench.args.work)
        return state
    pool = bench.sample_pool()
    regression_n = add_regression_suite(bench, pool, bench.args.work)
    state = {"pool": pool, "regression_n": regression_n, "serving": bench.test_outcomes(0, bench.base)}
    save_state(state_path, {**state, "rows": [], "seconds": 0.0})
    return {**state, "rows": [], "seconds": 0.0}


def save_state(path: Path, state: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(pickle.dumps(state))
    tmp.replace(path)


def run(bench: Bench, recipes: list[Recipe], save: Any, state_path: Path, resume: bool) -> dict[str, Any]:
    t0 = time.time()
    state = start(bench, state_path, resume)
    pool, serving, regression_n, rows = state["pool"], state["serving"], state["regression_n"], state["rows"]
    t0 -= state["seconds"]
    harness.console.print(
        f"pool: {len(pool)} groups; serving test pass@1 "
        f"{sum(map(sum, serving)) / sum(map(len, serving)):.3f}; regression suite {regression_n}; "
        f"{len(rows)} candidates already done"
    )
    done = {r["name"] for r in rows}
    for i, recipe in enumerate(recipes, start=1):
        if recipe.name in done:
            continue
        t1 = time.time()
        made = bench.train(recipe, pool)
        truth = drop(serving, bench.test_outcomes(i, made["weights"]))
        decision = bench.gate(i, made["weights"])
        rows.append(
            {
                **dataclasses.asdict(recipe),
                **truth,
                "trained_reward_mean": made["trained_reward_mean"],
                "blocked": not decision.promote,
                "reason": decision.reason,
                "suites": [dict(s.__dict__) for s in decision.suites],
                "seconds": time.time() - t1,
            }
        )
        harness.console.print(
            f"{recipe.name}: target drop {truth['target_drop']:+.3f} "
            f"[{truth['target_drop_ci95_low']:+.3f}, {truth['target_drop_ci95_high']:+.3f}] -> "
            f"{'blocked' if not decision.promote else 'promoted'} ({decision.reason})"
        )
        save_state(state_path, {**state, "rows": rows, "seconds": time.time() - t0})
        save(summarize(rows, serving, regression_n, time.time() - t0))  # a run cut short keeps these
    return summarize(rows, serving, regression_n, time.time() - t0)


def fall_z_table(rows: list[dict[str, Any]], z: float) -> dict[str, dict[str, Any]]:
    """Each value of :data:`FALL_ZS` applied to the candidates' recorded gate evidence (the suites'
    intervals at the gate's ``z``): honest rejected, regressions of 0.05 or more blocked."""
    from shipyard.online.gate import SuiteResult, decide

    out: dict[str, dict[str, Any]] = {}
    for fz in FALL_ZS:
        blocked = {
            r["name"]: not decide(0, 0, [SuiteResult(**x) for x in r["suites"]], fz, z).promote for r in rows
        }
        big = [r for r in rows if r["target_drop"] >= 0.05]
        out[f"{fz:g}"] = {
            "honest_rejected": sum(blocked[r["name"]] for r in rows if r["honest"]),
            "honest_tried": sum(r["honest"] for r in rows),
            "regressions_ge_0_05_blocked": sum(blocked[r["name"]] for r in big),
            "regressions_ge_0_05_tried": len(big),
        }
    return out


def choose_fall_z(table: dict[str, dict[str, Any]]) -> float | None:
    """The rule fixed before the validation run: the smallest value under which at most one honest
    candidate in five is rejected (scaled: a fifth of those tried) and every candidate whose drop is
    0.05 or more is blocked; None when no value does both."""
    for fz, t in table.items():
        if (
            t["honest_rejected"] <= t["honest_tried"] / 5
            and t["regressions_ge_0_05_blocked"] == t["regressions_ge_0_05_tried"]
        ):
            return float(fz)
    return None


def summarize(
    rows: list[dict[str, Any]], serving: list[list[int]], regression_n: int, secs: float
) -> dict[str, Any]:
    bad = [r for r in rows if not r["honest"]]
    honest = [r for r in rows if r["honest"]]
    big = [r for r in rows if r["target_drop"] >= 0.05]
    lo, hi = DROP_RANGE
    return {
        "regressed_candidates_tried": len(bad),
        "regressed_candidates_blocked": sum(r["blocked"] for r in bad),
        "regressed_in_range": sum(lo <= r["target_drop"] <= hi for r in bad),
        "regressed_in_range_blocked": sum(lo <= r["target_drop"] <= hi and r["blocked"] for r in bad),
        "regressions_ge_0_05_tried": len(big),
        "regressions_ge_0_05_blocked": sum(r["blocked"] for r in big),
        "honest_candidates_tried": len(honest),
        "honest_candidates_rejected": sum(r["blocked"] for r in honest),
        "test_tasks": len(serving),
        "test_samples_per_task": len(serving[0]),
        "test_pass_serving": sum(map(sum, serving)) / sum(map(len, serving)),
        "regression_suite_n": regression_n,
        "candidates": rows,
        "minutes": secs / 60,
    }


def _args() -> Any:
    p = harness.parser(__doc__)
    p.add_argument("--pool", type=int, default=None, help="training tasks sampled for the candidates (48)")
    p.add_argument("--group", type=int, default=4, help="sessions per pool task (a GRPO group)")
    p.add_argument("--steps", type=int, default=None, help="training steps per candidate (4)")
    p.add_argument("--groups", type=int, default=None, help="groups per training step (6)")
    p.add_argument("--test-n", type=int, default=None, help="test-split tasks (78: all after the gate's)")
    p.add_argument("--test-samples", type=int, default=None, help="sessions per test task (2)")
    p.add_argument("--regression-n", type=int, default=12)
    p.add_argument(
        "--split",
        choices=("test", "validation"),
        default="test",
        help="validation: other candidates, scored on training tasks outside the pool, to choose "
        "online.gate.target_fall_z; test: the reported candidates, on the held-out test split",
    )
    p.add_argument("--resume", action="store_true", help="go on from the candidates the last run finished")
    p.add_argument("--work", type=Path, default=None, help="work directory (runs/online-gate[-validation])")
    p.add_argument("--set", dest="overrides", nargs="*", default=[], help="dotted config overrides")
    args = p.parse_args()
    q = args.quick
    args.pool = args.pool or (4 if q else 48)
    args.steps = args.steps or (1 if q else 4)
    args.groups = args.groups or (2 if q else 6)
    args.test_n = args.test_n or (4 if q else 78)
    args.test_samples = args.test_samples or (1 if q else 2)
    suffix = "" if args.split == "test" else "-validation"
    args.work = args.work or ROOT / "runs" / f"online-gate{suffix}{'-quick' if q else ''}"
    return args


def main() -> int:
    args = _args()
    q, validation = args.quick, args.split == "validation"
    cfg = load_config(ROOT / "configs" / "online.toml", [*(QUICK if q else FULL), *args.overrides])
    if q:
        cfg.online.gate.suites = [GateSuiteConfig(kind="heldout", n=4, target=True)]
    name = "online_gate_validation" if validation else "online_gate"
    recipes = VALIDATION_RECIPES if validation else RECIPES
    if q:  # the quick recipes, on the split's seeds
        quick = {r.name for r in QUICK_RECIPES}
        recipes = [r for r in recipes if r.name.removeprefix("v_") in quick]

    def with_gate(figures: dict[str, Any], complete: bool) -> dict[str, Any]:
        """The figures with the gate's suites and rule as they are now (the run adds the regression
        suite); on validation, every value of :data:`FALL_ZS` and the one the rule chooses."""
        gate = {"gate": [s.model_dump() for s in cfg.online.gate.suites], "complete": complete}
        gate["target_fall_z"] = cfg.online.gate.target_fall_z
        if validation:
            table = fall_z_table(figures["candidates"], cfg.online.gate.z)
            gate |= {"fall_z_table": table, "chosen_target_fall_z": choose_fall_z(table)}
        return {**figures, **gate, "split": args.split}

    def save(figures: dict[str, Any]) -> None:
        harness.write_results(args, name, with_gate(figures, complete=False))

    state = args.work / "state.pkl"
    figures = with_gate(run(Bench(cfg, args), recipes, save, state, args.resume), complete=True)
    keys = [k for k, v in figures.items() if isinstance(v, (int, float)) and not isinstance(v, bool)]
    harness.table("online gate on realistic candidates", {k: {"value": figures[k]} for k in keys})
    harness.table(
        f"candidates (target drop on the {args.split} tasks; the gate's decision)",
        {
            r["name"]: {
                "drop": r["target_drop"],
                "low": r["target_drop_ci95_low"],
                "high": r["target_drop_ci95_high"],
                "gate": "blocked" if r["blocked"] else "promoted",
            }
            for r in figures["candidates"]
        },
    )
    if validation:
        harness.table("target_fall_z on the validation candidates", figures["fall_z_table"])
    harness.write_results(args, name, figures)
    if not validation:
        merge_online(args, {k: figures[k] for k in keys})
    return 0


def merge_online(args: Any, top: dict[str, Any]) -> None:
    """The gate's figures into ``online.json`` under ``gate_realistic`` (atomically)."""
    path = args.out / f"online{'_quick' if args.quick else ''}.json"
    if not path.exists():
        return
    merged = json.loads(path.read_text())
    merged["gate_realistic"] = top
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(merged, indent=1) + "\n")
    tmp.replace(path)


if __name__ == "__main__":
    sys.exit(main())
