"""Resumable trainer checkpoints: model weights, optimizer state and a JSON state, saved atomically
by every trainer rank together (``torch.distributed.checkpoint``), loadable at any world size.

Layout: ``root/step-000042/`` holds ``dcp/`` (a DCP checkpoint of ``{"model", "optim"}`` from
``get_state_dict``: each rank writes the shards it owns, one ``.metadata`` names them all) and
``meta.json`` (``{"format": 2, "step": 42, "state": {...}}``). Format-1 checkpoints (one
``model.safetensors`` + ``optimizer.pt``, written before the trainer was sharded) still load in a
one-process trainer.

Contract:
- :func:`save_checkpoint` is called by every rank. Rank 0 makes a fresh temporary directory inside
  ``root``; all ranks write their shards into it (fsynced by DCP); rank 0 then writes ``meta.json``
  last, fsyncs, ``os.replace``s the directory to ``step-NNNNNN`` (an existing one of the same step is
  moved aside first), fsyncs ``root`` and keeps the newest ``keep`` complete checkpoints. A crash
  at any moment (on any rank) leaves the previous checkpoints and at most a ``.tmp-*`` directory
  that the next save removes.
- :func:`load_latest_checkpoint` (every rank) restores the newest complete checkpoint (readable
  ``meta.json``) into ``model`` and ``optimizer`` in place, resharding to this world size, and
  returns its state with ``"step"``; None when there is none. Parameters and optimizer state
  round-trip bit-exactly. A checkpoint whose tensors do not fit the model is a ValueError naming it.
Limits: one trainer group per ``root``; every rank must see ``root`` (one machine, or a shared file
system across nodes); ``state`` must be JSON-serialisable; global RNG states are not saved (the step
uses no randomness).

Shape legend: none; this module moves whole state dicts and names no shaped tensors.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import tempfile
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_model
from torch.distributed.checkpoint.api import CheckpointException

from shipyard.trainer.distributed import ONE_PROCESS, Ranks

log = logging.getLogger(__name__)

FORMAT = 2
LEGACY_FORMAT = 1
_STEP_RE = re.compile(r"^step-(\d{6,})$")
_TMP_PREFIX = ".tmp-"
_OLD_PREFIX = ".old-"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _complete_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """(step, dir) of every checkpoint with meta.json, oldest first."""
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        match = _STEP_RE.match(child.name)
        if match and child.is_dir() and (child / "meta.json").is_file():
            found.append((int(match.group(1)), child))
    return sorted(found)


def _meta_json(step: int, state: dict[str, Any]) -> str:
    if "step" in state and state["step"] != step:
        raise ValueError(f"state['step']={state['step']!r} contradicts the checkpoint step {step}")
    try:
        return json.dumps({"format": FORMAT, "step": step, "state": state}, indent=1, sort_keys=True)
    except (TypeError, ValueError) as e:
        raise ValueError(f"checkpoint state must be JSON-serialisable: {e}") from e


def save_checkpoint(
    root: Path,
    step: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    state: dict[str, Any],
    keep: int = 2,
    ranks: Ranks = ONE_PROCESS,
) -> Path:
    """Atomically write ``root/step-{step:06d}/`` with every rank and prune to the newest ``keep``;
    returns its path."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    if step < 0:
        raise ValueError(f"checkpoint step must be >= 0, got {step}")
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    meta = _meta_json(step, state)
    root = Path(root)
    tmp = Path(ranks.broadcast(str(_fresh_tmp(root, step)) if ranks.leader else None))
    final = root / f"step-{step:06d}"
    try:
        model_sd, optim_sd = get_state_dict(model, optimizer)
        with _one_process_quiet(ranks):
            dcp.save(
                {"model": model_sd, "optim": optim_sd}, checkpoint_id=tmp / "dcp", no_dist=ranks.world == 1
            )
        if ranks.leader:
            with open(tmp / "meta.json", "w") as f:
                f.write(meta)
                f.flush()
                os.fsync(f.fileno())
            _fsync_dir(tmp)
            _move_into_place(tmp, final)
            _prune(root, keep)
    except BaseException:
        if ranks.leader:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    ranks.barrier()  # no rank goes on (publishes, exits) before the checkpoint is in place
    return final


@contextmanager
def _one_process_quiet(ranks: Ranks) -> Iterator[None]:
    """DCP warns that it runs in one process whenever no process group exists; for the one-process
    trainer that is the intended mode, so that one warning is not shown."""
    with warnings.catch_warnings():
        if ranks.world == 1:
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _fresh_tmp(root: Path, step: int) -> Path:
    """A new temporary checkpoint directory in ``root``, after removing those of crashed saves."""
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.glob(f"{_TMP_PREFIX}*"):
        shutil.rmtree(stale, ignore_errors=True)
    return Path(tempfile.mkdtemp(prefix=f"{_TMP_PREFIX}step-{step:06d}-", dir=root))


def _move_into_place(tmp: Path, final: Path) -> None:
    """``os.replace`` tmp -> final; an existing final is moved aside first and removed after."""
    old = None
    if final.exists():
        old = final.with_name(f"{_OLD_PREFIX}{final.name}")
        if old.exists():
            shutil.rmtree(old)
        os.replace(final, old)
    os.replace(tmp, final)
    _fsync_dir(final.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _prune(root: Path, keep: int) -> None:
    complete = _complete_checkpoints(root)
    for _, path in complete[: max(0, len(complete) - keep)]:
        shutil.rmtree(path, ignore_errors=True)


def _read_meta(path: Path) -> dict[str, Any] | None:
    try:
        meta = json.loads((path / "meta.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        log.warning("ignoring checkpoint %s: unreadable meta.json (%s)", path, e)
        return None
    if (
        not isinstance(meta, dict)
        or meta.get("format") not in (FORMAT, LEGACY_FORMAT)
        or not isinstance(meta.get("state"), dict)
    ):
        log.warning("ignoring checkpoint %s: meta.json is not a format-%d checkpoint", path, FORMAT)
        return None
    return meta


def _newest(root: Path) -> tuple[int, Path, dict[str, Any]] | None:
    for step, path in reversed(_complete_checkpoints(root)):
        meta = _read_meta(path)
        if meta is not None:
            return step, path, meta
    return None


def load_latest_checkpoint(
    root: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, ranks: Ranks = ONE_PROCESS
) -> dict[str, Any] | None:
    """Restore the newest complete checkpoint under ``root`` in place (every rank); its state with
    ``"step"``, or None."""
    found = ranks.broadcast(_newest(Path(root)) if ranks.leader else None)  # rank 0 decides which
    if found is None:
        return None
    step, path, meta = found
    try:
        if meta["format"] == LEGACY_FORMAT:
            _load_legacy(path, model, optimizer, ranks)
        else:
            _load_dcp(path, model, optimizer, ranks)
    except (RuntimeError, KeyError, CheckpointException) as e:
        raise ValueError(
            f"checkpoint {path} does not fit this model ({e}); it was written by a run of another model: "
            "give this run another run.name, or move the checkpoints directory away"
        ) from e
    return {**meta["state"], "step": step}


def _load_dcp(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, ranks: Ranks) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer)
    both = {"model": model_sd, "optim": optim_sd}
    with _one_process_quiet(ranks):
        dcp.load(both, checkpoint_id=path / "dcp", no_dist=ranks.world == 1)
    set_state_dict(model, optimizer, model_state_dict=both["model"], optim_state_dict=both["optim"])


def _load_legacy(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, ranks: Ranks) -> None:
    """A format-1 checkpoint (safetensors + ``optimizer.pt``) into an unsharded trainer."""
    if ranks.world > 1:
        raise ValueError(
            f"checkpoint {path} is format 1 (written by a one-process trainer before sharding); "
            "resume it with trainer.world_size = 1 once, then any world size can resume"
        )
    device = next(model.parameters()).device
    load_model(model, str(path / "model.safetensors"), strict=True, device=str(device))
    # CPU first: load_state_dict moves moments to the params' device and keeps "step" where the
    # optimizer expects it (a CUDA "step" breaks non-capturable Adam).
    opt_state = torch.load(path / "optimizer.pt", map_location="cpu", weights_only=True)
    optimizer.load_state_dict(opt_state)
