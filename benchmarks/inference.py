"""Benchmark: batched sampling throughput of :class:`EmbeddedEngine` vs transformers ``generate``.

Contract: both systems get the same chat prompts (coding requests through the tokenizer's chat
template), the same batch size (HF left-padded), the same sampling settings (temperature, top-p,
max_tokens) and stop on EOS. Throughput counts generated tokens up to and including each row's
EOS (tokens HF computes for already-finished rows are padding and are not counted), divided by
the wall time of the whole batch. The two systems alternate over ``--repeats`` rounds after one
warm-up each; the best round of each is reported (the machine may be shared). Prints a rich
table and writes ``benchmarks/results/inference.json`` with ``engine_tokens_per_s``,
``hf_generate_tokens_per_s``, ``speedup``, ``model``, ``batch``, ``max_tokens``, ``machine``.

The comparison with vLLM, as users run both (server level over HTTP, both dtypes, 1 and 2 threads),
is ``benchmarks/inference_vllm.py``.

Limits: CPU, fp32; sampled lengths differ between the systems (different random streams), which
tokens/s normalises; ``--quick`` (batch 4, 32 tokens, one round) is a smoke run, not a figure.

Shape legend: B = batch, T = padded prompt + generated length.

Usage::

    .venv/bin/python benchmarks/inference.py            # SmolLM2-135M, batch 16, 256 tokens
    .venv/bin/python benchmarks/inference.py --quick    # under a minute
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

from shipyard.config.schema import ModelConfig
from shipyard.inference.engine.engine import EmbeddedEngine
from shipyard.inference.types import GenerateRequest, SamplingParams
from shipyard.models.loading import load_model

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import parser, table, write_results  # noqa: E402

TASKS = [
    "Write a Python function that returns the n-th Fibonacci number.",
    "Fix the bug: def add(a, b): return a - b",
    "Write a function is_palindrome(s) that ignores case and spaces.",
    "Explain what a list comprehension is, then give an example that squares even numbers.",
    "Implement binary search over a sorted list in Python and return the index or -1.",
    "Write a Python class Stack with push, pop and peek methods.",
    "Reverse the words of a sentence in Python.",
    "Write a function that counts vowels in a string.",
    "Write a function merge_sorted(a, b) that merges two sorted lists into one sorted list without using sort().",
    "How do I read a CSV file in Python and sum its second column?",
    "Write a Python function that flattens a nested list of arbitrary depth.",
    "Write a function that checks whether a number is prime.",
    "Write a unit test with pytest for a function that adds two numbers.",
    "Write a Python generator that yields the prime numbers below n.",
    "Write a function to compute the greatest common divisor of two integers.",
    "Convert a Roman numeral string to an integer in Python.",
]


def chat_prompts(tok: Any, batch: int) -> list[list[int]]:
    """``batch`` chat-templated prompts, cycling through TASKS."""
    out = []
    for i in range(batch):
        messages = [{"role": "user", "content": TASKS[i % len(TASKS)]}]
        out.append(
            list(tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"])
        )
    return out


def run_engine(
    engine: Any, prompts: list[list[int]], params: SamplingParams, seed: int
) -> tuple[int, float, int]:
    """(generated tokens, wall seconds, rows ended by EOS) of one batch through ``engine.generate``
    (the embedded engine, or the vLLM client, which sends the requests at once)."""
    reqs = [
        GenerateRequest(p, SamplingParams(params.temperature, params.top_p, params.max_tokens, [], seed + i))
        for i, p in enumerate(prompts)
    ]
    t0 = time.perf_counter()
    results = engine.generate(reqs)
    wall = time.perf_counter() - t0
    return sum(len(r.token_ids) for r in results), wall, sum(r.finish_reason == "eos" for r in results)


def run_hf(
    model: Any, prompts: list[list[int]], params: SamplingParams, eos: list[int], pad: int, seed: int
) -> tuple[int, float, int]:
    """(generated tokens up to each row's EOS, wall seconds, rows ended by EOS) of one HF batch."""
    width = max(len(p) for p in prompts)
    ids_BT = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    attn_BT = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    torch.manual_seed(seed)
    sampling: dict[str, Any] = (
        {"do_sample": True, "temperature": params.temperature, "top_p": params.top_p, "top_k": None}
        if params.temperature > 0
        else {"do_sample": False}
    )
    t0 = time.perf_counter()
    with torch.inference_mode():
        out_BT = model.generate(
            input_ids=ids_BT,
            attention_mask=attn_BT,
            max_new_tokens=params.max_tokens,
            eos_token_id=eos,
            pad_token_id=pad,
            min_new_tokens=params.max_tokens if params.ignore_eos else None,
            **sampling,
        )
    wall = time.perf_counter() - t0
    tokens, ended = 0, 0
    for row in out_BT[:, width:].tolist():
        cut = next((i + 1 for i, t in enumerate(row) if t in eos), None)
        tokens += cut if cut is not None else len(row)
        ended += cut is not None
    return tokens, wall, ended


def _args() -> argparse.Namespace:
    ap = parser(__doc__)
    ap.add_argument("--model", choices=["smollm2", "tiny"], default="smollm2")
    ap.add_argument("--batch", type=int, default=None, help="sequences per batch (default 16, quick 4)")
    ap.add_argument(
        "--max-tokens", type=int, default=None, help="tokens per sequence (default 256, quick 32)"
    )
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--top-p", type=float, default=0.95)
    ap.add_argument("--repeats", type=int, default=None, help="alternating rounds (default 2, quick 1)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch intra-op threads")
    ap.add_argument("--cache-dir", default="~/.cache/shipyard/models")
    args = ap.parse_args()
    args.batch = args.batch or (4 if args.quick else 16)
    args.max_tokens = args.max_tokens or (32 if args.quick else 256)
    args.repeats = args.repeats or (1 if args.quick else 2)
    if min(args.batch, args.max_tokens, args.repeats, args.threads) < 1:
        raise ValueError("--batch, --max-tokens, --repeats and --threads must be >= 1")
    return args


def measure(args: argparse.Namespace) -> dict[str, list[tuple[int, float, int]]]:
    """Alternating rounds of the engine and ``generate`` on the same prompts: (tokens, wall s, EOS rows)."""
    torch.set_num_threads(args.threads)
    model, tok = load_model(ModelConfig(source=args.model, cache_dir=args.cache_dir))
    own, _ = load_model(ModelConfig(source=args.model, cache_dir=args.cache_dir))
    engine = EmbeddedEngine(own, tok, max_batch=args.batch, packed=True)  # generate keeps PyTorch's linear
    eos, pad = sorted(engine.eos_ids), engine.pad_id
    prompts = chat_prompts(tok, args.batch)
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_tokens)
    warm = SamplingParams(temperature=args.temperature, top_p=args.top_p, max_tokens=4)
    run_engine(engine, prompts, warm, 0)
    run_hf(model, prompts, warm, eos, pad, 0)
    rounds: dict[str, list[tuple[int, float, int]]] = {"engine": [], "hf": []}
    for r in range(args.repeats):
        rounds["engine"].append(run_engine(engine, prompts, params, 1000 * r))
        rounds["hf"].append(run_hf(model, prompts, params, eos, pad, 1000 * r))
    return rounds


def main() -> None:
    args = _args()
    rounds = measure(args)
    best = {k: max(v, key=lambda x: x[0] / x[1]) for k, v in rounds.items()}
    tps = {k: v[0] / v[1] for k, v in best.items()}
    rows = {
        label: {
            "tokens": best[key][0],
            "wall s": best[key][1],
            "tokens/s": tps[key],
            "rows ended by EOS": f"{best[key][2]}/{args.batch}",
            "rounds (tokens/s)": ", ".join(f"{t / w:.1f}" for t, w, _ in rounds[key]),
        }
        for key, label in (("engine", "shipyard EmbeddedEngine"), ("hf", "transformers generate"))
    }
    title = f"Batched sampling, {args.model}, batch {args.batch}, max_tokens {args.max_tokens}, {args.threads} threads"
    table(title, rows)
    speedup = tps["engine"] / tps["hf"]
    print(f"speedup (engine / HF): {speedup:.2f}x")
    result = {
        "engine_tokens_per_s": round(tps["engine"], 2),
        "hf_generate_tokens_per_s": round(tps["hf"], 2),
        "speedup": round(speedup, 3),
        **{
            k: getattr(args, k)
            for k in ("model", "batch", "max_tokens", "temperature", "top_p", "threads", "repeats")
        },
        "rounds": {
            k: [{"tokens": t, "wall_s": round(w, 3), "eos_rows": e} for t, w, e in v]
            for k, v in rounds.items()
        },
    }
    write_results(args, "inference", result)


if __name__ == "__main__":
    main()
