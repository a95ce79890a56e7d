"""`shipyard train`: the driver of a run — place components, evaluate, watch, evaluate, report.

Contract: starts the inference servers, evaluates the base policy on ``eval.heldout_n``
held-out tasks of ``eval.split`` (once per run directory: a resumed run reuses ``eval_before.json``), starts the
trainer and rollout workers, shows live progress until the trainer finishes, stops rollout
generation, waits for the servers to adopt the final version, evaluates again on the same
tasks (per task in ``run_dir/eval_after.json``), and writes ``run_dir/summary.json``, ``run_dir/reward.png`` and
``<results_dir>/demo.json`` (``heldout_n``, ``heldout_before``, ``heldout_after``,
``heldout_diff``, ``heldout_diff_ci95_low/high``, ``split`` (``eval.split``), ``minutes``, and each evaluation's ``extra``
as ``before_extra`` / ``after_extra``: turns, and a command harness's tool-call parse rate). Rerunning the same command after a
crash resumes the trainer from its last checkpoint.

Before any work the run claims its store (:func:`shipyard.store.run.claim_run`): its data lives
under ``<store.root>/<run.name>/``, and a store prefix that belongs to another run is refused.
The "before" evaluation scores the run's own base version 0 (a resumed run reuses its
``eval_before.json``; one resumed past version 0 without it skips the comparison and says why).
The precision each component chose for its hardware (``trainer.bf16_decoder``,
``inference.dtype``) is printed and recorded in ``summary.json`` under ``precision``.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from rich.console import Console

from shipyard.agent.spec import session_spec
from shipyard.config.schema import ShipyardConfig
from shipyard.envs.tasks.splits import heldout_tasks
from shipyard.eval.evaluate import EvalResult, evaluate
from shipyard.eval.stats import paired_diff_ci
from shipyard.metrics.logger import read_metrics
from shipyard.metrics.plot import plot_run
from shipyard.metrics.progress import RunProgress, StepBar, summarize
from shipyard.orchestrate.base import make_placement
from shipyard.rollout.types import FINISHED_KEY
from shipyard.store.run import claim_run
from shipyard.store.types import Store

console = Console()


def train(cfg: ShipyardConfig) -> dict[str, Any]:
    from shipyard.inference.backends.base import open_client
    from shipyard.models.loading import load_tokenizer

    t0 = time.time()
    run_dir = Path(cfg.run.output_dir) / cfg.run.name
    store = claim_run(cfg.store, cfg.run.name, run_dir)  # refuses another run's store, before any work
    console.print(f"run {cfg.run.name!r} (id {store.identity.run_id}): data in {store.where}", soft_wrap=True)
    (run_dir / "config.json").write_text(cfg.model_dump_json(indent=1))
    _print_precision(cfg)
    tokenizer = load_tokenizer(cfg.model)  # converts the shipped model once, before actors load it
    placement = make_placement(cfg, run_dir)
    try:
        urls = placement.start_inference()
        client = open_client(cfg, urls[0])
        spec = session_spec(cfg, client, tokenizer)
        heldout = heldout_tasks(cfg, "function", cfg.eval.heldout_n)
        before = (
            _eval_once(run_dir / "eval_before.json", spec, heldout, cfg, store)
            if cfg.run.eval_before_after
            else None
        )
        store.delete(FINISHED_KEY)  # a finished run given more steps goes on
        placement.start_training()
        _watch(placement, run_dir, cfg.trainer.steps)
        result = placement.trainer_result()
        placement.stop_workers()
        _wait_version(client, cfg.trainer.steps)
        result["precision"] = {
            "trainer": result.get("precision"),
            "inference": client.stats().get("precision"),
        }
        after = _run_eval("after", spec, heldout, cfg) if before is not None else None
        if after is not None:
            _write_json(run_dir / "eval_after.json", after.__dict__)
    finally:
        placement.stop()
    return _report(cfg, run_dir, result, before, after, t0)


def _print_precision(cfg: ShipyardConfig) -> None:
    """What ``auto`` precision resolves to on this machine (each actor decides for its own device and
    the choices are recorded in ``summary.json``)."""
    from shipyard.models.hardware import resolve_bf16, resolve_dtype

    _, trainer = resolve_bf16(cfg.trainer.bf16_decoder, cfg.trainer.device, "trainer.bf16_decoder")
    _, engine = resolve_dtype(cfg.inference.dtype, cfg.inference.device, "inference.dtype")
    console.print(f"precision: {trainer}\nprecision: {engine}", soft_wrap=True)


def _eval_once(
    path: Path, spec: Any, tasks: list[Any], cfg: ShipyardConfig, store: Store
) -> EvalResult | None:
    from shipyard.weights.versions import latest_version

    if path.is_file():
        d = json.loads(path.read_text())
        console.print(f"[dim]reusing {path} (pass@1 {sum(d['passed'])}/{len(d['passed'])})")
        if d["task_ids"] != [t.id for t in tasks]:
            raise ValueError(
                f"{path} scored other tasks than this run evaluates (eval.split={cfg.eval.split!r}, "
                f"eval.heldout_n={cfg.eval.heldout_n}): set them back, or start a new run (run.name)"
            )
        if (samples := d.get("samples", 1)) != cfg.eval.samples_per_task:
            raise ValueError(
                f"{path} holds {samples} sample(s) per task but eval.samples_per_task = "
                f"{cfg.eval.samples_per_task}: the paired comparison needs the same; set it back, or "
                f"delete {path} while the run is at version 0"
            )
        return EvalResult(
            task_ids=d["task_ids"],
            passed=d["passed"],
            rewards=d["rewards"],
            errors=d["errors"],
            samples=samples,
            sample_passed=d.get("sample_passed", []),
            extra=d.get("extra", {}),
        )
    if served := latest_version(store) or 0:  # the servers follow the newest version, not the base
        console.print(
            f"[yellow]held-out eval before: skipped: this run resumed at version {served} and "
            f"has no {path}, so its base is not what is served; score it with `shipyard eval CONFIG run.name={cfg.run.name} "
            "eval.version=0`",
            soft_wrap=True,
        )
        return None
    res = _run_eval("before", spec, tasks, cfg)
    _write_json(path, res.__dict__)
    return res


def _write_json(path: Path, data: dict[str, Any]) -> None:
    """Write ``data`` to ``path`` atomically (a reader never sees half a file)."""
    tmp = path.with_name(f"{path.name}.tmp")
    tmp.write_text(json.dumps(data))
    tmp.replace(path)


def _run_eval(label: str, spec: Any, tasks: list[Any], cfg: ShipyardConfig) -> EvalResult:
    k = cfg.eval.samples_per_task
    with StepBar(f"held-out eval ({label})", total=len(tasks) * k, console=console) as bar:
        res = evaluate(spec, tasks, cfg.eval.temperature, cfg.rollout.concurrency, bar.advance, samples=k)
    lo, hi = res.ci95()
    console.print(
        f"held-out pass@1 {label}: {res.pass_rate:.3f} [{lo:.3f}, {hi:.3f}] on {res.n} tasks x {k} sample(s)"
    )
    return res


def _watch(placement: Any, run_dir: Path, steps: int) -> None:
    done = [r["step"] for r in read_metrics(run_dir / "metrics.jsonl") if r.get("kind") == "train"]
    with RunProgress(run_dir / "metrics.jsonl", steps, max(done, default=0), console) as prog:
        while not placement.trainer_done():
            prog.refresh()
            time.sleep(1.0)


def _wait_version(client: Any, version: int, timeout_s: float = 120.0) -> None:
    deadline = time.time() + timeout_s
    while client.version() < version:
        if time.time() > deadline:
            raise TimeoutError(f"inference server did not adopt version {version} within {timeout_s:.0f} s")
        time.sleep(0.2)


def _report(
    cfg: ShipyardConfig,
    run_dir: Path,
    result: dict,
    before: EvalResult | None,
    after: EvalResult | None,
    t0: float,
) -> dict[str, Any]:
    records = read_metrics(run_dir / "metrics.jsonl")
    plot_run(run_dir / "metrics.jsonl", run_dir / "reward.png", title=f"shipyard run {cfg.run.name}")
    summary: dict[str, Any] = {
        "trainer": result,
        "run": summarize(records),
        "minutes": (time.time() - t0) / 60,
    }
    if before is not None and after is not None:
        diff, lo, hi = paired_diff_ci([float(p) for p in before.passed], [float(p) for p in after.passed])
        summary["demo"] = {
            "heldout_n": before.n,
            "split": cfg.eval.split,
            "samples_per_task": before.samples,
            "heldout_before": before.pass_rate,
            "heldout_after": after.pass_rate,
            "heldout_diff": diff,
            "heldout_diff_ci95_low": lo,
            "heldout_diff_ci95_high": hi,
            "minutes": summary["minutes"],
            "steps": cfg.trainer.steps,
            "samples_per_s": summary["run"].get("samples_per_s", 0.0),
            "before_extra": before.extra,
            "after_extra": after.extra,
        }
        results = Path(cfg.run.results_dir)
        results.mkdir(parents=True, exist_ok=True)
        (results / "demo.json").write_text(json.dumps(summary["demo"], indent=1) + "\n")
        console.print(
            f"[bold]held-out ({cfg.eval.split}) pass@1: {before.pass_rate:.3f} → {after.pass_rate:.3f} "
            f"(diff {diff:+.3f}, 95% CI [{lo:+.3f}, {hi:+.3f}], n={before.n})"
        )
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    console.print(
        f"plot: {run_dir / 'reward.png'}   metrics: {run_dir / 'metrics.jsonl'}   tensorboard: {run_dir / 'tb'}",
        soft_wrap=True,  # paths stay whole for copying
    )
    return summary
