"""The trainer's per-token record: its logprobs of each trained segment, for people to compare.

Contract: :func:`write_step_logprobs` writes ``run_dir/logprobs/step-NNNNNN.json.gz`` atomically (a
temporary name, then ``os.replace``), mapping :func:`token_key` of every
segment trained at that step to its logprobs under the trainer before the update, at the
segment's sampled positions (``loss_mask == 1``) in order. :func:`read_step_logprobs` returns that
map, or ``{}`` when the step has no record (``trainer.record_logprobs = false``, a run from before
records, or a step not trained yet). Limits: one file per step, read whole (a step's segments only).

Example::

    write_step_logprobs(run_dir, 3, {"w0/00000002/0/gen-1/0#0": [-0.12, -2.3]})
    read_step_logprobs(run_dir, 3)["w0/00000002/0/gen-1/0#0"]   # [-0.12, -2.3]
"""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path

from shipyard.agent.types import Trajectory

LOGPROBS_DIR = "logprobs"


def token_key(traj: Trajectory) -> str:
    """A segment's key in the record: ``<session_id>#<segment_idx>``."""
    return f"{traj.session_id or traj.group_id + '/' + str(traj.sample_idx)}#{traj.segment_idx}"


def step_logprobs_path(run_dir: str | Path, step: int) -> Path:
    return Path(run_dir) / LOGPROBS_DIR / f"step-{step:06d}.json.gz"


def write_step_logprobs(run_dir: str | Path, step: int, tokens: dict[str, list[float]]) -> Path:
    path = step_logprobs_path(run_dir, step)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    tmp.write_bytes(gzip.compress(json.dumps(tokens, separators=(",", ":")).encode(), compresslevel=3))
    os.replace(tmp, path)
    return path


def read_step_logprobs(run_dir: str | Path, step: int) -> dict[str, list[float]]:
    path = step_logprobs_path(run_dir, step)
    try:
        return json.loads(gzip.decompress(path.read_bytes()))
    except FileNotFoundError:
        return {}
