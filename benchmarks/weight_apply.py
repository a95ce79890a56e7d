"""Benchmark: a server's sparse weight update, torch advanced indexing vs the engine's numpy bit views.

Contract: a real :class:`~shipyard.inference.engine.engine.EmbeddedEngine` in bf16 (SmolLM2-135M-Instruct,
or the tiny dense model with ``--quick``) takes updates in which ``--density`` of every
parameter's elements changed, with those flat positions (what a subscriber hands it after a
delta). Two implementations of the engine's staged write alternate ``--reps`` times in one
process on the same update:

- ``torch``: the gather at staging and the scatter in the pause by torch advanced indexing
  (``t.reshape(-1)[idx]`` / ``t.view(-1)[idx] = v``), what the engine did before session 5;
- ``numpy``: the engine's own ``_take`` / ``_write`` (numpy views of the tensors' bits).

Reported: median thread CPU milliseconds of staging (``stage_weights``) and of the apply
(``apply_pending``, the inference pause), and the pause's wall clock; each update is checked
bit-exact against the target tensors. Writes ``benchmarks/results/weight_apply.json``
(``stage_ms_torch``, ``stage_ms_numpy``, ``apply_ms_torch``, ``apply_ms_numpy``, ``changed``).

Limits: CPU, one thread; thread CPU time because the machine may be shared.

Usage::

    .venv/bin/python benchmarks/weight_apply.py            # SmolLM2-135M, 1/80 of elements changed
    .venv/bin/python benchmarks/weight_apply.py --quick    # tiny model (seconds)
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

import shipyard.inference.engine.engine as engine_mod
from shipyard.config.schema import ModelConfig
from shipyard.inference.engine.engine import EmbeddedEngine
from shipyard.models.loading import load_model

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import parser, table, write_results  # noqa: E402


def torch_take(
    target_P: torch.Tensor, tensor: torch.Tensor, idx_C: torch.Tensor | None, copy: bool
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """The baseline gather: torch advanced indexing."""
    if idx_C is None:
        return None, tensor.detach().to(device=target_P.device, dtype=target_P.dtype, copy=copy)
    return idx_C, tensor.detach().reshape(-1)[idx_C].to(dtype=target_P.dtype)


def torch_write(target_P: torch.Tensor, idx_C: torch.Tensor | None, values: torch.Tensor) -> None:
    """The baseline scatter: torch advanced indexing."""
    if idx_C is None:
        target_P.copy_(values)
    else:
        target_P.view(-1)[idx_C] = values


def update(model: torch.nn.Module, density: float, seed: int) -> tuple[dict, dict]:
    """New values at ``density`` of every parameter's elements, and those flat positions."""
    rng = np.random.default_rng(seed)
    new, pos = {}, {}
    for name, p in model.named_parameters():
        n = p.numel()
        idx = np.sort(rng.choice(n, max(1, int(n * density)), replace=False))
        t = p.detach().clone()
        t.view(-1)[torch.from_numpy(idx)] += 1e-2
        new[name], pos[name] = t, idx
    return new, pos


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--density", type=float, default=1 / 80, help="fraction of elements changed")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(1)
    model, tok = load_model(ModelConfig(source="tiny") if args.quick else ModelConfig())
    model = model.to(torch.bfloat16)
    engine = EmbeddedEngine(model, tok, max_batch=1, version=0)
    live = dict(model.named_parameters())
    impls = {
        "torch": (torch_take, torch_write),
        "numpy": (engine_mod._take, engine_mod._write),
    }
    times: dict[str, dict[str, list[float]]] = {k: {"stage": [], "apply": [], "pause": []} for k in impls}
    for rep in range(args.reps):
        for name, (take, write) in impls.items():
            new, pos = update(model, args.density, seed=rep)
            engine_mod._take, engine_mod._write = take, write
            c0 = time.thread_time()
            engine.stage_weights(engine.version + 1, new, copy=False, positions=pos)
            c1 = time.thread_time()
            assert engine.apply_pending()
            c2 = time.thread_time()
            assert all(
                torch.equal(live[k].detach().view(torch.int16), t.view(torch.int16)) for k, t in new.items()
            )
            times[name]["stage"].append((c1 - c0) * 1e3)
            times[name]["apply"].append((c2 - c1) * 1e3)
            times[name]["pause"].append(engine.pauses[-1] * 1e3)
    engine_mod._take, engine_mod._write = impls["numpy"]
    med = {k: {m: statistics.median(v) for m, v in d.items()} for k, d in times.items()}
    changed = sum(len(p) for p in update(model, args.density, 0)[1].values())
    table(
        f"sparse weight update: {changed:,} changed elements, bf16, 1 thread, {args.reps} reps",
        {
            k: {"stage ms (CPU)": m["stage"], "apply ms (CPU)": m["apply"], "pause ms (wall)": m["pause"]}
            for k, m in med.items()
        },
    )
    out = {
        **{f"{m}_ms_{k}": med[k][m] for k in med for m in ("stage", "apply", "pause")},
        "changed": changed,
        "density": args.density,
        "model": "tiny" if args.quick else "SmolLM2-135M-Instruct",
        "load_avg": os.getloadavg()[0],
    }
    write_results(args, "weight_apply", out)


if __name__ == "__main__":
    main()
