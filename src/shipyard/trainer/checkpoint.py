"""Resumable trainer checkpoints: model weights, optimizer state and a JSON state, saved atomically.

Layout: ``root/step-000042/`` holds ``model.safetensors`` (shared/tied tensors stored once, via
``safetensors.torch.save_model``), ``optimizer.pt`` (``optimizer.state_dict()``, ``torch.save``)
and ``meta.json`` (``{"format": 1, "step": 42, "state": {...}}``).

Contract:
- :func:`save_checkpoint` writes everything into a fresh temporary directory inside ``root``,
  fsyncs every file, writes ``meta.json`` last, fsyncs the directory, then ``os.replace``s it to
  ``step-NNNNNN`` (replacing an existing checkpoint of the same step via a move-aside), fsyncs
  ``root`` and keeps only the newest ``keep`` complete checkpoints. A crash at any moment leaves
  either the old set of checkpoints or the new one, plus at most a ``.tmp-*`` directory that
  the next save removes (re-saving an existing step: a crash between its two renames leaves
  that step only as ``.old-step-*``, which loading skips in favour of the previous one).
- :func:`load_latest_checkpoint` restores the newest complete checkpoint (one with a readable
  ``meta.json``) into ``model`` and ``optimizer`` in place and returns its state with ``"step"``;
  None when there is none. Parameters and optimizer state round-trip bit-exactly.
Limits: one writer per ``root``; ``state`` must be JSON-serialisable (the caller's RNG seeds,
consumed rollout keys, counters); global RNG states are not saved (the step uses no randomness).

Shape legend: none; this module moves whole state dicts and names no shaped tensors.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_model, save_model

log = logging.getLogger(__name__)

FORMAT = 1
_STEP_RE = re.compile(r"^step-(\d{6,})$")
_TMP_PREFIX = ".tmp-"
_OLD_PREFIX = ".old-"


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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
) -> Path:
    """Atomically write ``root/step-{step:06d}/`` and prune to the newest ``keep``; returns its path."""
    if step < 0:
        raise ValueError(f"checkpoint step must be >= 0, got {step}")
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    meta = _meta_json(step, state)
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.glob(f"{_TMP_PREFIX}*"):
        shutil.rmtree(stale, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(prefix=f"{_TMP_PREFIX}step-{step:06d}-", dir=root))
    try:
        save_model(model, str(tmp / "model.safetensors"))
        _fsync_file(tmp / "model.safetensors")
        torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
        _fsync_file(tmp / "optimizer.pt")
        with open(tmp / "meta.json", "w") as f:
            f.write(meta)
            f.flush()
            os.fsync(f.fileno())
        _fsync_dir(tmp)
        final = root / f"step-{step:06d}"
        _move_into_place(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _prune(root, keep)
    return final


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
    if not isinstance(meta, dict) or meta.get("format") != FORMAT or not isinstance(meta.get("state"), dict):
        log.warning("ignoring checkpoint %s: meta.json is not a format-%d checkpoint", path, FORMAT)
        return None
    return meta


def load_latest_checkpoint(
    root: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> dict[str, Any] | None:
    """Restore the newest complete checkpoint under ``root`` in place; its state with ``"step"``, or None."""
    for step, path in reversed(_complete_checkpoints(Path(root))):
        meta = _read_meta(path)
        if meta is None:
            continue
        device = next(model.parameters()).device
        load_model(model, str(path / "model.safetensors"), strict=True, device=str(device))
        # CPU first: load_state_dict moves moments to the params' device and keeps "step" where the
        # optimizer expects it (a CUDA "step" breaks non-capturable Adam).
        opt_state = torch.load(path / "optimizer.pt", map_location="cpu", weights_only=True)
        optimizer.load_state_dict(opt_state)
        return {**meta["state"], "step": step}
    return None
