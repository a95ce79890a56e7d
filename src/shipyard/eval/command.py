"""`shipyard eval`: pass@1 of any weight version on HumanEval and the held-out tasks of each kind.

Contract: loads the configured base model, optionally swaps in ``eval.version`` from the store
(verified), runs the policy in an in-process embedded engine, and evaluates the suites of
``eval.suites`` with the training harness: ``eval.humaneval_n`` HumanEval problems,
``eval.heldout_n`` held-out generated tasks, ``eval.db_n`` / ``eval.repo_n`` held-out db and
repo tasks (:func:`shipyard.envs.tasks.splits.heldout_tasks`: none trained on; the generated ones
of ``eval.split``), ``eval.unseen_n`` tasks of the families training never sees (the
``unseen_families`` suite, ``tasks.unseen_families``), and the tasks of
your own files (``eval.files``, the ``files`` suite, :func:`file_tasks`). db, repo and file-suite
sessions run through an :class:`~shipyard.envs.environment.Environment` (PostgreSQL clones,
squashed repositories, anti-cheat flags) whose reward is the hidden tests alone, so pass@1 means
every hidden test or SQL check passed whatever ``rewards.weights`` says. Merges ``<label>_pass1``
(and its CI, n) into ``<results_dir>/humaneval.json``, writes every suite's result (per task:
``task_ids``, ``passed``, ``rewards``) to ``<results_dir>/eval_<label>.json`` (atomic), and returns it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rich.console import Console

from shipyard.agent.spec import session_spec
from shipyard.config.schema import RewardsConfig, ShipyardConfig
from shipyard.envs.tasks.splits import heldout_tasks, unseen_family_tasks
from shipyard.envs.types import Task
from shipyard.eval.evaluate import evaluate
from shipyard.metrics.progress import StepBar

ENV_SUITES = ("db", "repo", "files")
"""Suites whose sessions run through the environment (services, repositories, their graders)."""
SPLIT_SUITES = ("heldout", "unseen_families")
"""Suites drawn from ``eval.split`` (validation or test, :mod:`shipyard.envs.tasks.splits`)."""

console = Console()


def run_eval(cfg: ShipyardConfig) -> dict[str, Any]:
    from shipyard.envs.environment import Environment
    from shipyard.envs.tasks.humaneval import humaneval_tasks
    from shipyard.inference.client import LocalInferenceClient

    engine, tok = _engine(cfg)
    spec = session_spec(cfg, LocalInferenceClient(engine), tok)
    suites = {
        "humaneval": humaneval_tasks(cfg.eval.humaneval_n) if "humaneval" in cfg.eval.suites else [],
        "heldout": heldout_tasks(cfg, "function", cfg.eval.heldout_n) if "heldout" in cfg.eval.suites else [],
        "unseen_families": unseen_family_tasks(cfg, cfg.eval.unseen_n)
        if "unseen_families" in cfg.eval.suites
        else [],
        "db": heldout_tasks(cfg, "db", cfg.eval.db_n) if "db" in cfg.eval.suites else [],
        "repo": heldout_tasks(cfg, "repo", cfg.eval.repo_n) if "repo" in cfg.eval.suites else [],
        "files": file_tasks(cfg) if "files" in cfg.eval.suites else [],
    }
    env = Environment(cfg.sandbox, cfg.services, RewardsConfig(), cfg.anticheat)
    out: dict[str, Any] = {}
    for name, tasks in suites.items():
        if not tasks:
            continue
        # env: services stop after each suite
        k = cfg.eval.samples_per_task
        with StepBar(f"{name} ({cfg.eval.label})", total=len(tasks) * k, console=console) as bar, env:
            res = evaluate(
                spec,
                tasks,
                cfg.eval.temperature,
                cfg.rollout.concurrency,
                bar.advance,
                env=env if name in ENV_SUITES else None,
                samples=k,
            )
        lo, hi = res.ci95()
        out[name] = {
            "n": res.n,
            "samples_per_task": k,
            "pass1": res.pass_rate,
            "ci95": [lo, hi],
            "version": cfg.eval.version,
            "split": cfg.eval.split if name in SPLIT_SUITES else None,
            "task_ids": res.task_ids,
            "errors": res.errors,
            "passed": res.passed,
            "rewards": res.rewards,
            **res.extra,
        }
        console.print(
            f"{name} pass@1 ({cfg.eval.label}, version {cfg.eval.version}): {res.pass_rate:.3f} [{lo:.3f}, {hi:.3f}] n={res.n}"
        )
    if "humaneval" in out:
        _merge(Path(cfg.run.results_dir) / "humaneval.json", cfg.eval.label, out["humaneval"])
    path = Path(cfg.run.results_dir) / f"eval_{cfg.eval.label}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp")
    tmp.write_text(json.dumps(out))
    tmp.replace(path)
    return out


def file_tasks(cfg: ShipyardConfig) -> list[Task]:
    """Every task of ``eval.files`` (the ``files`` suite); ValueError for a file that ``tasks.files``
    trains on too, or a task id in two files."""
    from shipyard.envs.tasks.files import check_unique_ids, load_task_file

    trained = set(cfg.tasks.files) & set(cfg.eval.files)
    if trained:
        raise ValueError(
            f"eval.files {sorted(trained)} are also in tasks.files: the run trains on them, so their "
            "pass@1 is not held out; evaluate other files, or drop them from tasks.files"
        )
    tasks = [t for path in cfg.eval.files for t in load_task_file(path)]
    check_unique_ids(tasks, "eval.files")
    return tasks


def _engine(cfg: ShipyardConfig) -> tuple[Any, Any]:
    """An in-process engine holding ``eval.version`` of the run ``run.name`` (None or 0: the base model,
    which a run publishes as its version 0 and its store does not keep once newer versions replace it)."""
    from shipyard.inference.backends.embedded import build_engine
    from shipyard.store.run import open_run
    from shipyard.weights.snapshot import load_version

    engine, tok = build_engine(cfg)
    if cfg.eval.version:  # a version of the run named run.name, from that run's store only
        store = open_run(cfg.store, cfg.run.name)
        engine.stage_weights(cfg.eval.version, load_version(store, cfg.eval.version))
        engine.apply_pending()
    return engine, tok


def _merge(path: Path, label: str, res: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    data = json.loads(path.read_text()) if path.is_file() else {}
    data[f"{label}_pass1"] = res["pass1"]
    data[f"{label}_ci95"] = res["ci95"]
    data[f"{label}_n"] = res["n"]
    path.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
