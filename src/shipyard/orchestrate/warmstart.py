"""`shipyard warmstart`: demonstrations, supervised fine-tuning, an HF directory RL starts from.

Contract: :func:`run_warmstart` plays the first ``warmstart.demos`` training tasks with the
scripted expert (:func:`shipyard.agent.demonstrate.demonstrations`, this config's harness,
sandboxes and grader), trains the configured policy on the passing sessions' segments
(:func:`shipyard.trainer.sft.sft`, top ``trainer.train_layers`` blocks), and writes the result to
``warmstart.output_dir`` atomically (a sibling temporary directory renamed into place, the
report ``warmstart.json`` inside it last): config, safetensors and tokenizer, loadable with
``model.source = "hf"`` and ``model.path`` = that directory. Returns the report: demonstrations
played and kept, segments and tokens trained on, the loss of every epoch, seconds.

Limits: long tasks (``tasks.set = "long"``: the expert reads their rules) with the built-in harness,
or function tasks with a command harness (the expert writes the reference through its tools,
:class:`~shipyard.agent.demonstrate.FunctionToolExpert`); one process.
"""

from __future__ import annotations

import json
import os
import shutil
import time
import uuid
from pathlib import Path
from typing import Any

from shipyard.config.schema import ShipyardConfig
from shipyard.metrics.progress import StepBar


def run_warmstart(cfg: ShipyardConfig) -> dict[str, Any]:
    import torch

    from shipyard.agent.demonstrate import demonstrations, expert_for
    from shipyard.agent.spec import session_spec
    from shipyard.envs.tasks.splits import task_splits
    from shipyard.models.hardware import resolve_bf16
    from shipyard.models.loading import load_model
    from shipyard.trainer.sft import sft

    if cfg.tasks.set != "long" and cfg.harness.type != "command":
        raise ValueError(
            "warmstart demonstrations need tasks.set = 'long' (the built-in harness) or a command "
            f'harness (harness.type = "command", function tasks); got tasks.set = {cfg.tasks.set!r} '
            f"and harness.type = {cfg.harness.type!r}"
        )
    torch.manual_seed(cfg.run.seed)
    torch.set_num_threads(cfg.trainer.threads)
    t0 = time.perf_counter()
    model, tok = load_model(cfg.model)
    train_tasks, _ = task_splits(cfg)
    ws = cfg.warmstart
    tasks = train_tasks[: ws.demos]
    if not tasks:
        raise ValueError("warmstart: the training split is empty; raise tasks.num_generated")
    first = expert_for(tasks[0], tok, cfg.agent.summary.instruction)  # one per task, see demonstrations
    spec = session_spec(cfg, first, tok)
    with StepBar("demonstrations", total=len(tasks)) as bar:
        sessions = demonstrations(spec, tasks, on_session=bar.update)
    if not sessions:
        raise ValueError(
            "warmstart: no demonstration passed its hidden tests; check the tasks and the harness"
        )
    segments = [seg for s in sessions for seg in s]
    steps = ws.epochs * -(-len(segments) // ws.micro_batch)
    with StepBar("warm start (sft)", total=steps) as bar:
        losses = sft(
            model,
            segments,
            epochs=ws.epochs,
            lr=ws.lr,
            micro_batch=ws.micro_batch,
            train_layers=cfg.trainer.train_layers,
            seed=cfg.run.seed,
            bf16_decoder=resolve_bf16(cfg.trainer.bf16_decoder, "cpu", "trainer.bf16_decoder")[0],
            on_step=lambda step, loss: bar.update(step, f"loss {loss:.3f}"),
        )
    report = {
        "demos_played": len(tasks),
        "demos_kept": len(sessions),
        "segments": len(segments),
        "trained_tokens": sum(sum(s.loss_mask) for s in segments),
        "segments_per_session": len(segments) / len(sessions),
        "epoch_loss": losses,
        "seconds": time.perf_counter() - t0,
    }
    _save(model, tok, Path(ws.output_dir), report)
    return report


def _save(model: Any, tok: Any, out: Path, report: dict[str, Any]) -> None:
    """Write the policy and the report into a temporary sibling, then swap it into ``out``."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}-{uuid.uuid4().hex[:12]}")
    tmp.mkdir()  # the umask's mode, as `out` itself would get (mkdtemp's is 0700)
    try:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        (tmp / "warmstart.json").write_text(json.dumps(report, indent=1))
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # no half-written temporary left beside ``out``
        raise
    old = out.with_name(f".{out.name}-old-{os.getpid()}")
    if out.exists():
        os.replace(out, old)
    os.replace(tmp, out)
    shutil.rmtree(old, ignore_errors=True)
