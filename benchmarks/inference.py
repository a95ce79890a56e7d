"""Benchmark: batched sampling throughput of :class:`EmbeddedEngine` vs transformers ``generate``.

Contract: both systems get the same chat prompts (coding requests through the tokenizer's chat
template), the same batch size (HF left-padded), the same sampling settings (temperature, top-p,
max_tokens) and stop on EOS. Throughput counts generated tokens up to and including each row's
EOS (tokens HF computes for already-finished rows are padding and are not counted), divided by
the wall time of the whole batch. The two systems alternate over ``--repeats`` rounds after one
warm-up each; the best round of each is reported (the machine may be shared). Prints a rich
table and writes ``benchmarks/results/inference.json`` with ``engine_tokens_per_s``,
``hf_generate_tokens_per_s``, ``speedup``, ``model``, ``batch``, ``max_tokens``, ``machine``.

Limits: CPU, fp32; sampled lengths differ between the systems (different random streams), which
tokens/s normalises; ``--quick`` (batch 4, 32 tokens, one round) is a smoke run, not a figure.

Shape legend: B = batch, T = padded prompt + generated length.

Usage::

    .venv/bin/python benchmarks/inference.py            # SmolLM2-135M, batch 16, 256 tokens
    .venv/bin/python benchmarks/inference.py --quick    # under a minute
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from shipyard.config.schema import ModelConfig
from shipyard.inference.engine import EmbeddedEngine
from shipyard.inference.types import GenerateRequest, SamplingParams
from shipyard.models.loading import load_model

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
    engine: EmbeddedEngine, prompts: list[list[int]], params: SamplingParams, seed: int
) -> tuple[int, float, int]:
    """(generated tokens, wall seconds, rows ended by EOS) of one engine batch."""
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
            **sampling,
        )
    wall = time.perf_counter() - t0
    tokens, ended = 0, 0
    for row in out_BT[:, width:].tolist():
        cut = next((i + 1 for i, t in enumerate(row) if t in eos), None)
        tokens += cut if cut is not None else len(row)
        ended += cut is not None
    return tokens, wall, ended


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="batch 4, 32 tokens, one round (< 1 minute)")
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
    ap.add_argument(
        "--out",
        default=None,
        help="default benchmarks/results/inference.json (--quick: inference_quick.json)",
    )
    args = ap.parse_args()
    args.out = args.out or f"benchmarks/results/inference{'_quick' if args.quick else ''}.json"
    batch = args.batch or (4 if args.quick else 16)
    max_tokens = args.max_tokens or (32 if args.quick else 256)
    repeats = args.repeats or (1 if args.quick else 2)
    if batch < 1 or max_tokens < 1 or repeats < 1 or args.threads < 1:
        raise ValueError("--batch, --max-tokens, --repeats and --threads must be >= 1")
    torch.set_num_threads(args.threads)

    model, tok = load_model(ModelConfig(source=args.model, cache_dir=args.cache_dir))
    engine = EmbeddedEngine(model, tok, max_batch=batch)
    eos, pad = sorted(engine.eos_ids), engine.pad_id
    prompts = chat_prompts(tok, batch)
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, max_tokens=max_tokens)
    warm = SamplingParams(temperature=args.temperature, top_p=args.top_p, max_tokens=4)
    run_engine(engine, prompts, warm, 0)
    run_hf(model, prompts, warm, eos, pad, 0)

    rounds: dict[str, list[tuple[int, float, int]]] = {"engine": [], "hf": []}
    for r in range(repeats):
        rounds["engine"].append(run_engine(engine, prompts, params, 1000 * r))
        rounds["hf"].append(run_hf(model, prompts, params, eos, pad, 1000 * r))
    best = {k: max(v, key=lambda x: x[0] / x[1]) for k, v in rounds.items()}
    tps = {k: v[0] / v[1] for k, v in best.items()}

    table = Table(
        title=f"Batched sampling, {args.model}, batch {batch}, max_tokens {max_tokens}, {args.threads} threads"
    )
    for col in ("system", "tokens", "wall s", "tokens/s", "rows ended by EOS", "rounds (tokens/s)"):
        table.add_column(col, justify="right" if col != "system" else "left")
    for key, label in (("engine", "shipyard EmbeddedEngine"), ("hf", "transformers generate")):
        toks, wall, ended = best[key]
        per_round = ", ".join(f"{t / w:.1f}" for t, w, _ in rounds[key])
        table.add_row(label, str(toks), f"{wall:.2f}", f"{tps[key]:.1f}", f"{ended}/{batch}", per_round)
    console = Console()
    console.print(table)
    speedup = tps["engine"] / tps["hf"]
    console.print(f"speedup (engine / HF): [bold]{speedup:.2f}x[/bold]")

    result = {
        "engine_tokens_per_s": round(tps["engine"], 2),
        "hf_generate_tokens_per_s": round(tps["hf"], 2),
        "speedup": round(speedup, 3),
        "model": args.model,
        "batch": batch,
        "max_tokens": max_tokens,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "threads": args.threads,
        "repeats": repeats,
        "quick": args.quick,
        "rounds": {
            k: [{"tokens": t, "wall_s": round(w, 3), "eos_rows": e} for t, w, e in v]
            for k, v in rounds.items()
        },
        "machine": f"{platform.machine()} {platform.processor() or platform.system()}, {os.cpu_count()} CPUs, "
        f"torch {torch.__version__}, python {platform.python_version()}",
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    console.print(f"wrote {out}")


if __name__ == "__main__":
    main()
