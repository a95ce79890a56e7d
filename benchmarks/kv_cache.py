"""Benchmark: the engine's KV cache, transformers' ``torch.cat`` a step against buffers with slack.

Contract: the demo's engine (SmolLM2-135M in the engine's precision, as `build_engine` makes it from
`configs/demo.toml`; the tiny dense model with ``--quick``), two measurements, each run with
``kv_slack = 0`` (transformers' ``DynamicLayer``: every decode step copies every layer's cache) and
with ``kv_slack = 64`` (:mod:`shipyard.inference.engine.kv_cache`), alternating over ``--repeats`` rounds and
keeping each one's best (the machine may be shared):

- ``steps``: the model's decode step alone, ``--steps`` steps after a prefill of ``--positions``
  random tokens, at 1, 8 and 16 rows: ``cat_ms_per_step``, ``slack_ms_per_step``, ``speedup``;
- ``generate``: the engine's ``generate`` on a GRPO-shaped batch (``--groups`` prompts of about
  ``--positions`` tokens, ``--group-size`` seeded samples each, ``--max-tokens`` at temperature 1):
  ``cat_tokens_per_s``, ``slack_tokens_per_s``, ``speedup``, and ``identical`` (every token and
  logprob equal bit for bit between the two).

Prints a table and writes ``benchmarks/results/kv_cache.json``.
Limits: CPU threads as ``inference.threads`` in the demo config; the forward and the engine's
bookkeeping, not the HTTP server.

    .venv/bin/python benchmarks/kv_cache.py          # SmolLM2-135M, 480 positions
    .venv/bin/python benchmarks/kv_cache.py --quick  # tiny model, seconds
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import harness

ROOT = Path(__file__).resolve().parents[1]


def decode_ms(model: Any, slack: int, rows: int, positions: int, steps: int) -> float:
    """ms a decode step of ``rows`` rows after a prefill of ``positions`` tokens."""
    import torch

    from shipyard.inference.engine.kv_cache import slack_cache

    g = torch.Generator().manual_seed(0)
    ids_BT = torch.randint(0, model.get_input_embeddings().num_embeddings, (rows, positions), generator=g)
    with torch.inference_mode():
        cache = slack_cache(model.config, slack)
        model(input_ids=ids_BT, past_key_values=cache, use_cache=True, logits_to_keep=1)
        pos_B = torch.full((rows,), positions - 1)
        t0 = time.perf_counter()
        for i in range(steps):
            pos_B = pos_B + 1
            model(
                input_ids=torch.full((rows, 1), 100 + i),
                position_ids=pos_B[:, None],
                past_key_values=cache,
                use_cache=True,
            )
        return (time.perf_counter() - t0) / steps * 1000


def generate(engine: Any, slack: int, args: Any, positions: int) -> tuple[float, list[Any]]:
    """tokens/s of one ``generate`` of the GRPO-shaped batch, and its results."""
    from shipyard.inference.types import GenerateRequest, SamplingParams

    vocab = int(engine.model.get_input_embeddings().num_embeddings)
    reqs = [
        GenerateRequest(
            [3 + (11 * i + 101 * g) % (vocab - 3) for i in range(positions + 7 * g)],
            SamplingParams(temperature=1.0, max_tokens=args.max_tokens, seed=g * 100 + s),
        )
        for g in range(args.groups)
        for s in range(args.group_size)
    ]
    engine.kv_slack = slack
    t0 = time.perf_counter()
    results = engine.generate(reqs)
    return sum(len(r.token_ids) for r in results) / (time.perf_counter() - t0), results


def main() -> int:
    p = harness.parser(__doc__)
    p.add_argument("--positions", type=int, default=480)
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--groups", type=int, default=2)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=192)
    args = p.parse_args()
    from shipyard.config.load import load_config
    from shipyard.inference.backends.embedded import build_engine
    from shipyard.inference.engine.kv_cache import SLACK

    cfg = load_config(str(ROOT / "configs" / "demo.toml"), ["model.source=tiny"] if args.quick else [])
    engine = build_engine(cfg)[0]
    if args.quick:
        args.positions, args.steps, args.repeats, args.max_tokens = 64, 16, 1, 24
    figures: dict[str, Any] = {}
    for rows in (1, 8, 16):
        best = {0: float("inf"), SLACK: float("inf")}
        for _ in range(args.repeats):
            for slack in best:
                best[slack] = min(
                    best[slack], decode_ms(engine.model, slack, rows, args.positions, args.steps)
                )
        figures[f"step, {rows} rows"] = {
            "cat_ms_per_step": best[0],
            "slack_ms_per_step": best[SLACK],
            "speedup": best[0] / best[SLACK],
        }
    speed = {0: 0.0, SLACK: 0.0}
    results: dict[int, list[Any]] = {}
    for _ in range(args.repeats):
        for slack in speed:
            tps, results[slack] = generate(engine, slack, args, args.positions)
            speed[slack] = max(speed[slack], tps)
    identical = all(
        a.token_ids == b.token_ids and a.logprobs == b.logprobs
        for a, b in zip(results[0], results[SLACK], strict=True)
    )
    figures[f"generate, {args.groups}x{args.group_size} rows"] = {
        "cat_tokens_per_s": speed[0],
        "slack_tokens_per_s": speed[SLACK],
        "speedup": speed[SLACK] / speed[0],
        "identical": identical,
    }
    harness.table(f"KV cache at {args.positions} positions, slack {SLACK}", figures)
    harness.write_results(
        args,
        "kv_cache",
        {"positions": args.positions, "slack": SLACK, "precision": engine.precision, "cases": figures},
    )
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
