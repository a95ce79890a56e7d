"""Benchmark: trainer and engine throughput in fp32 and bf16 on this machine, and what `auto` picks.

Contract: for each CPU condition, a fresh Python process (the kernels torch and oneDNN may use are
fixed when torch loads) measures, on one thread as the demo runs:

- trainer: tokens/s of :func:`shipyard.trainer.step.train_step` (forward, backward, AdamW) on
  synthetic sessions, ``trainer.bf16_decoder`` false vs true, the demo's top-6-block training;
- engine: generated tokens/s of an :class:`~shipyard.inference.engine.engine.EmbeddedEngine` (batched
  sampling, KV cache) with ``inference.dtype`` float32 vs bfloat16 (fp32 head);
- the choices of ``trainer.bf16_decoder = "auto"`` and ``inference.dtype = "auto"`` there;
- GFLOP/s of a 1024x1024 matmul in both dtypes (``matmul_gflops_fp32``, ``matmul_gflops_bf16``).

Conditions: ``native`` (the CPU as it is) and ``avx2`` (torch held to AVX2 kernels:
``ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2``, what a CPU without bf16 units runs).
Writes ``benchmarks/results/precision.json``: the native condition's ``cpu_capability``,
``trainer_tok_s_fp32``, ``trainer_tok_s_bf16``, ``engine_tok_s_fp32``, ``engine_tok_s_bf16``,
``auto_trainer``, ``auto_engine``, ``auto_is_fastest`` (auto picks the faster of each pair) at the
top level, every condition under ``conditions``, and ``auto_is_fastest_all``.

Limits: SmolLM2-135M-Instruct (``--quick``: the tiny dense model, fewer tokens); one timed step
and one timed generation per cell (the AVX2 bf16 cells run at ~1 GFLOP/s and take minutes).

Usage::

    .venv/bin/python benchmarks/precision.py            # SmolLM2-135M, both conditions (~10 min)
    .venv/bin/python benchmarks/precision.py --quick    # tiny model (seconds)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import parser, table, write_results  # noqa: E402

CONDITIONS = {"native": {}, "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}}
SIZES = {  # (sequences, tokens each, train_layers, prompts, prompt tokens, new tokens)
    "full": (2, 256, 6, 8, 32, 32),
    "quick": (4, 128, 0, 8, 16, 16),
}


def _model(quick: bool) -> tuple[Any, Any]:
    from shipyard.config.schema import ModelConfig
    from shipyard.models.loading import load_model

    return load_model(ModelConfig(source="tiny", tiny="dense") if quick else ModelConfig(source="smollm2"))


def _trajectories(n: int, length: int, vocab: int) -> list[Any]:
    import random

    from shipyard.agent.types import Trajectory

    rng = random.Random(0)
    prompt = length // 2
    return [
        Trajectory(
            task_id="t",
            group_id="g",
            sample_idx=i,
            token_ids=[rng.randrange(vocab) for _ in range(length)],
            loss_mask=[0] * prompt + [1] * (length - prompt),
            logprobs=[0.0] * prompt + [-2.0] * (length - prompt),
            versions=[-1] * prompt + [0] * (length - prompt),
            prompt_len=prompt,
        )
        for i in range(n)
    ]


def trainer_tok_s(quick: bool, bf16: bool) -> float:
    """Tokens/s of one train step (after a small warm-up step that builds the kernels)."""
    from shipyard.config.schema import TrainerConfig
    from shipyard.trainer.step import freeze_lower_layers, make_optimizer, train_step

    n, length, layers, *_ = SIZES["quick" if quick else "full"]
    model, tok = _model(quick)
    model.train()
    cfg = TrainerConfig(train_layers=layers, micro_batch=4, bf16_decoder=bf16)
    freeze_lower_layers(model, layers)
    opt = make_optimizer(model, cfg)
    vocab = model.get_input_embeddings().num_embeddings
    warm = _trajectories(2, 32, vocab)
    train_step(model, opt, warm, [1.0, -1.0], cfg, tok.pad_token_id)
    trajs = _trajectories(n, length, vocab)
    t0 = time.perf_counter()
    train_step(model, opt, trajs, [(-1.0) ** i for i in range(n)], cfg, tok.pad_token_id)
    return n * length / (time.perf_counter() - t0)


def engine_tok_s(quick: bool, dtype: str) -> float:
    """Generated tokens/s of a batch of prompts (after a one-token warm-up)."""
    from shipyard.config.schema import InferenceConfig
    from shipyard.inference.engine.engine import EmbeddedEngine
    from shipyard.inference.types import GenerateRequest, SamplingParams
    from shipyard.models.precision import engine_precision

    *_, prompts, prompt_len, new = SIZES["quick" if quick else "full"]
    model, tok = _model(quick)
    engine_precision(model, InferenceConfig(dtype=dtype))
    engine = EmbeddedEngine(model, tok, max_batch=prompts)
    vocab = model.get_input_embeddings().num_embeddings
    reqs = [
        GenerateRequest(
            [(7 * i + j) % (vocab - 10) + 5 for j in range(prompt_len)],
            SamplingParams(max_tokens=new, seed=i),
        )
        for i in range(prompts)
    ]
    engine.generate([GenerateRequest(reqs[0].prompt_ids[:4], SamplingParams(max_tokens=1, seed=0))])
    t0 = time.perf_counter()
    out = engine.generate(reqs)
    return sum(len(r.token_ids) for r in out) / (time.perf_counter() - t0)


def matmul_gflops(dtype: str, reps: int = 5) -> float:
    """GFLOP/s of a 1024x1024 @ 1024x1024 matmul on one thread (the kernel the rest stands on)."""
    import torch

    a = torch.randn(1024, 1024, dtype=getattr(torch, dtype))
    b = torch.randn(1024, 1024, dtype=getattr(torch, dtype))
    a @ b
    t0 = time.perf_counter()
    for _ in range(reps):
        a @ b
    return 2 * 1024**3 * reps / (time.perf_counter() - t0) / 1e9


def measure(quick: bool) -> dict[str, Any]:
    """One condition, in this process (its environment fixes the kernels)."""
    import torch

    from shipyard.models.hardware import bf16_support, resolve_bf16, resolve_dtype

    torch.set_num_threads(1)
    auto_trainer = resolve_bf16("auto", "cpu", "trainer.bf16_decoder")[0]
    auto_engine = resolve_dtype("auto", "cpu", "inference.dtype")[0] == torch.bfloat16
    out = {
        "cpu_capability": bf16_support("cpu").capability,
        "matmul_gflops_fp32": matmul_gflops("float32"),
        "matmul_gflops_bf16": matmul_gflops("bfloat16", reps=1 if quick else 3),
        "trainer_tok_s_fp32": trainer_tok_s(quick, False),
        "trainer_tok_s_bf16": trainer_tok_s(quick, True),
        "engine_tok_s_fp32": engine_tok_s(quick, "float32"),
        "engine_tok_s_bf16": engine_tok_s(quick, "bfloat16"),
        "auto_trainer": "bf16" if auto_trainer else "fp32",
        "auto_engine": "bf16" if auto_engine else "fp32",
    }
    fastest_trainer = out["trainer_tok_s_bf16"] > out["trainer_tok_s_fp32"]
    fastest_engine = out["engine_tok_s_bf16"] > out["engine_tok_s_fp32"]
    out["auto_is_fastest"] = auto_trainer == fastest_trainer and auto_engine == fastest_engine
    return out


def run_condition(name: str, env: dict[str, str], quick: bool) -> dict[str, Any]:
    base = {k: v for k, v in os.environ.items() if k not in ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA")}
    cmd = [sys.executable, __file__, "--measure", *(["--quick"] if quick else [])]
    out = subprocess.run(cmd, env={**base, **env}, capture_output=True, text=True, timeout=3600)
    if out.returncode != 0:
        raise RuntimeError(f"condition {name} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--measure", action="store_true", help="(internal) measure this process's condition")
    args = p.parse_args()
    if args.measure:
        print(json.dumps(measure(args.quick)))
        return
    conditions = {name: run_condition(name, env, args.quick) for name, env in CONDITIONS.items()}
    rows = {
        f"{name} {what}": {
            "fp32 tok/s": c[f"{what}_tok_s_fp32"],
            "bf16 tok/s": c[f"{what}_tok_s_bf16"],
            "bf16/fp32": c[f"{what}_tok_s_bf16"] / c[f"{what}_tok_s_fp32"],
            "auto": c[f"auto_{what}"],
        }
        for name, c in conditions.items()
        for what in ("trainer", "engine")
    }
    table("precision: fp32 vs bf16, one thread", rows)
    for name, c in conditions.items():
        print(
            f"{name}: {c['cpu_capability']}; matmul GFLOP/s fp32 {c['matmul_gflops_fp32']:.1f} "
            f"bf16 {c['matmul_gflops_bf16']:.1f}; auto is fastest: {c['auto_is_fastest']}"
        )
    figures = {
        **conditions["native"],
        "conditions": conditions,
        "auto_is_fastest_all": all(c["auto_is_fastest"] for c in conditions.values()),
    }
    write_results(args, "precision", figures)


if __name__ == "__main__":
    main()
