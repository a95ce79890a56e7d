"""Benchmark: a decode step of the CPU engine's model, the model's own forward against the lean step.

Contract: one model as ``build_engine`` makes it (SmolLM2-135M from ``configs/demo.toml`` in
``--dtype`` with the engine's precision rules: bf16 with the fp32 head where the CPU has bf16
units; packed linears; ``--threads``; the tiny dense model with ``--quick``) prefills the same
left-padded chat prompts, then decodes ``--steps`` one-token steps (greedy) with the model's
forward (``model(...)``, transformers' modules) and with
:class:`~shipyard.inference.engine.lean_decode.LeanDecode`, alternating over ``--repeats`` rounds,
each from its own fresh prefill. Per path the median ms a step over the rounds; and whether the two
paths' logits were bit-identical at every step of every round (``bit_identical``; they must be).
Prints a table and writes ``benchmarks/results/lean_decode.json``: ``full_ms_per_step``,
``lean_ms_per_step``, ``speedup``, ``bit_identical``, the rows and steps.

Limits: the model's forward only (no sampling, no engine bookkeeping).

    .venv/bin/python benchmarks/lean_decode.py          # SmolLM2-135M, bf16, 16 rows, 2 threads
    .venv/bin/python benchmarks/lean_decode.py --quick  # tiny model, seconds
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

import harness

ROOT = Path(__file__).resolve().parents[1]


def prompts(tok: Any, rows: int) -> tuple[Any, Any]:
    """``rows`` chat prompts, left-padded: ids ``[B, T]`` and mask ``[B, T]``."""
    import torch

    from inference import chat_prompts

    ids = chat_prompts(tok, rows)
    width = max(len(p) for p in ids)
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    ids_BT = torch.tensor([[pad] * (width - len(p)) + p for p in ids])
    mask_BT = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in ids])
    return ids_BT, mask_BT


def decode(engine: Any, step: Any, ids_BT: Any, mask_BT: Any, steps: int) -> tuple[float, list[Any]]:
    """ms a step and every step's logits, from a fresh prefill of ``ids_BT``."""
    import torch

    from shipyard.inference.engine.kv_cache import slack_cache

    pos_BT = (mask_BT.cumsum(1) - 1).clamp(min=0)
    with torch.inference_mode():
        cache = slack_cache(engine.model.config)
        out = engine.model(
            input_ids=ids_BT, attention_mask=mask_BT, position_ids=pos_BT, cache=cache, use_cache=True
        )
        tokens_B, mask, pos_B, logits = out.logits[:, -1].argmax(-1), mask_BT, pos_BT[:, -1], []
        t0 = time.perf_counter()
        for _ in range(steps):
            mask = torch.cat([mask, torch.ones(len(tokens_B), 1, dtype=torch.long)], dim=1)
            pos_B = pos_B + 1
            logits_BV = step(engine, tokens_B, None if bool(mask.all()) else mask, pos_B, cache)
            logits.append(logits_BV)
            tokens_B = logits_BV.argmax(-1)
        return (time.perf_counter() - t0) / steps * 1e3, logits


def full_step(engine: Any, tokens_B: Any, mask_BT: Any, pos_B: Any, cache: Any) -> Any:
    out = engine.model(
        input_ids=tokens_B[:, None],
        attention_mask=mask_BT,
        position_ids=pos_B[:, None],
        cache=cache,
        use_cache=True,
    )
    return out.logits[:, -1, :].float()


def lean_step(engine: Any, tokens_B: Any, mask_BT: Any, pos_B: Any, cache: Any) -> Any:
    return engine.lean(tokens_B, mask_BT, pos_B, cache).float()


def main() -> None:
    import torch

    ap = harness.parser(__doc__)
    ap.add_argument("--dtype", default="bfloat16", help="inference.dtype (bfloat16)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=6)
    args = ap.parse_args()
    from shipyard.config.load import load_config
    from shipyard.inference.backends.embedded import build_engine

    config = ROOT / "configs" / ("tiny.toml" if args.quick else "demo.toml")
    cfg = load_config(config, [f"inference.dtype={args.dtype}", f"inference.threads={args.threads}"])
    engine, tok = build_engine(cfg)
    if engine.lean is None:
        raise ValueError(f"{config}: the lean decode step does not cover this model (see lean_decode.py)")
    ids_BT, mask_BT = prompts(tok, args.rows)
    times: dict[str, list[float]] = {"full": [], "lean": []}
    identical = True
    for _ in range(args.repeats):
        ms_full, full = decode(engine, full_step, ids_BT, mask_BT, args.steps)
        ms_lean, lean = decode(engine, lean_step, ids_BT, mask_BT, args.steps)
        times["full"].append(ms_full)
        times["lean"].append(ms_lean)
        identical &= all(torch.equal(a, b) for a, b in zip(full, lean, strict=True))
    full_ms, lean_ms = statistics.median(times["full"]), statistics.median(times["lean"])
    figures = {
        "full_ms_per_step": full_ms,
        "lean_ms_per_step": lean_ms,
        "speedup": full_ms / lean_ms,
        "bit_identical": identical,
        "rounds": times,
        "rows": args.rows,
        "steps": args.steps,
        "prompt_width": ids_BT.shape[1],
        "precision": engine.precision,
        "threads": args.threads,
    }
    harness.table(
        f"decode step, {args.rows} rows, {engine.precision['dtype']}, {args.threads} threads (median of {args.repeats})",
        {
            "model's forward": {"ms/step": full_ms},
            "lean step": {"ms/step": lean_ms, "bit-identical": identical},
        },
    )
    harness.write_results(args, "lean_decode", figures)


if __name__ == "__main__":
    main()
