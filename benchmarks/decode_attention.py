"""Benchmark: a decode step of the CPU engine's model, transformers' SDPA against the packed decode.

Contract: one model (SmolLM2-135M in the engine's precision, as `build_engine` makes it; the tiny
dense model with ``--quick``) prefills ``--positions`` random tokens per row, then decodes
``--steps`` one-token steps with a KV cache, once with ``attn_implementation="sdpa"``
(transformers) and once with ``"shipyard_sdpa"`` (:mod:`shipyard.inference.engine.attention`), alternating
over ``--repeats`` rounds; the best round of each is kept (the machine may be shared). Cases: one
row; 12 rows of one length (no padding: transformers takes its ``enable_gqa`` path); 12 and 16 rows
with a third of them left-padded (transformers packs the heads itself). Prints a table and writes
``benchmarks/results/decode_attention.json``: per case ``sdpa_ms_per_step``,
``packed_ms_per_step``, ``speedup``, ``max_abs_logit_diff`` between the two (same inputs), and
each one's ``mean_abs_logit_err_*`` against the fp32 model (transformers' SDPA) on those inputs:
bf16 rounding differs between the two paths, its size does not.

Limits: the model's forward only (no sampling, no engine bookkeeping); threads as ``--threads``.

    .venv/bin/python benchmarks/decode_attention.py          # SmolLM2-135M, 480 positions
    .venv/bin/python benchmarks/decode_attention.py --quick  # tiny model, seconds
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import harness

ROOT = Path(__file__).resolve().parents[1]
CASES = {"1 row": (1, False), "12 rows, no padding": (12, False), "12 rows, padded": (12, True)}
CASES["16 rows, padded"] = (16, True)


def decode(model: Any, rows: int, padded: bool, positions: int, steps: int) -> tuple[float, Any]:
    """ms a decode step, and the last step's logits."""
    import torch
    from transformers import DynamicCache

    g = torch.Generator().manual_seed(0)
    vocab = model.get_input_embeddings().num_embeddings
    ids_BT = torch.randint(0, vocab, (rows, positions), generator=g)
    attn_BT = torch.ones(rows, positions, dtype=torch.long)
    if padded:
        attn_BT[: max(1, rows // 3), : positions // 16] = 0
    mask = (lambda a: a) if padded else (lambda a: None)
    with torch.inference_mode():
        cache = DynamicCache(config=model.config)
        model(input_ids=ids_BT, attention_mask=mask(attn_BT), past_key_values=cache, use_cache=True)
        pos_B = torch.full((rows,), positions - 1)
        t0 = time.perf_counter()
        for i in range(steps):
            attn_BT = torch.cat([attn_BT, torch.ones(rows, 1, dtype=torch.long)], dim=1)
            pos_B = pos_B + 1
            out = model(
                input_ids=torch.full((rows, 1), 100 + i),
                attention_mask=mask(attn_BT),
                position_ids=pos_B[:, None],
                past_key_values=cache,
                use_cache=True,
            )
        return (time.perf_counter() - t0) / steps * 1000, out.logits[:, -1].float()


def main() -> int:
    p = harness.parser(__doc__)
    p.add_argument("--positions", type=int, default=480)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    import torch

    from shipyard.config.load import load_config
    from shipyard.inference.backends.embedded import build_engine
    from shipyard.inference.engine.attention import NAME
    from shipyard.models.loading import load_model

    torch.set_num_threads(args.threads)
    cfg = load_config(str(ROOT / "configs" / "demo.toml"), ["model.source=tiny"] if args.quick else [])
    model = build_engine(cfg)[0].model
    positions, steps = (64, 4) if args.quick else (args.positions, args.steps)
    for impl in ("sdpa", NAME):  # warm-up: the first forwards build oneDNN's kernels
        model.set_attn_implementation(impl)
        decode(model, 2, True, 32, 2)
    figures: dict[str, Any] = {}
    for case, (rows, padded) in CASES.items():
        best = {"sdpa": float("inf"), NAME: float("inf")}
        logits = {}
        for _ in range(1 if args.quick else args.repeats):
            for impl in best:
                model.set_attn_implementation(impl)
                ms, logits[impl] = decode(model, rows, padded, positions, steps)
                best[impl] = min(best[impl], ms)
        figures[case] = {
            "sdpa_ms_per_step": best["sdpa"],
            "packed_ms_per_step": best[NAME],
            "speedup": best["sdpa"] / best[NAME],
            "max_abs_logit_diff": float((logits["sdpa"] - logits[NAME]).abs().max()),
        }
    model.set_attn_implementation(NAME)
    reference = load_model(cfg.model)[0]  # fp32, transformers' SDPA
    for case, (rows, padded) in CASES.items():
        exact = decode(reference, rows, padded, positions, steps)[1]
        for impl, key in (("sdpa", "mean_abs_logit_err_sdpa"), (NAME, "mean_abs_logit_err_packed")):
            model.set_attn_implementation(impl)
            figures[case][key] = float(
                (decode(model, rows, padded, positions, steps)[1] - exact).abs().mean()
            )
    model.set_attn_implementation(NAME)
    harness.table(f"decode step at {positions} positions, {args.threads} thread(s)", figures)
    harness.write_results(args, "decode_attention", {"positions": positions, "cases": figures})
    return 0


if __name__ == "__main__":
    sys.exit(main())
