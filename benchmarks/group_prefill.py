"""Benchmark: a GRPO group's first turn in the engine, its shared prompt prefilled 8 times or once.

Contract: the demo's engine (`build_engine` on ``configs/demo.toml``: SmolLM2-135M, bf16, packed
linears, 1 thread; the tiny dense model with ``--quick``) samples ``--groups`` groups, one
generated task each: ``--group-size`` requests of the task's real first prompt (the function kind's
system prompt and first message through the chat template), seeded per session, the demo's
temperature and ``max_tokens``, admitted together as the rollout worker's group is. Two engines
alternate group by group: ``unshared`` without a prefix cache (``inference.prefix_cache_mb = 0``:
every row prefills the prompt, which is what a group admitted together got before the engine stored
prompts at prefill) and ``shared`` with the demo's cache (one row prefills the prompt, the others
are served from its keys/values). Per engine: ``prompt_tokens_forwarded`` (positions the prefills
forwarded: the engine's ``prefilled_tokens``), ``prefill_s`` (the engine's prefill seconds, cold
and from the cache), ``decode_s``, ``wall_s`` and ``tokens_per_s`` (sampled tokens over wall). Prints a table and writes
``benchmarks/results/group_prefill.json`` with those per engine and ``prefill_speedup``,
``wall_speedup``.

Limits: first turns only (later turns extend each session's own cached turn either way); sampled
tokens can differ between the engines by bf16 rounding, so decode work differs a little; one thread.

    .venv/bin/python benchmarks/group_prefill.py           # SmolLM2-135M, 6 groups of 8
    .venv/bin/python benchmarks/group_prefill.py --quick   # tiny model, seconds
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import harness

ROOT = Path(__file__).resolve().parents[1]
ENGINES = {"unshared": ["inference.prefix_cache_mb=0"], "shared": []}


def first_prompts(cfg: Any, tokenizer: Any, n: int) -> list[list[int]]:
    """The first prompt of ``n`` of the demo's generated tasks, as a session frames it."""
    from shipyard.agent.session import ChatFrame, first_message
    from shipyard.envs.tasks.functions import generated_tasks
    from shipyard.envs.tasks.kinds import task_kind

    frame = ChatFrame(tokenizer)
    tasks = generated_tasks(n, cfg.tasks.seed)
    return [frame.prompt_ids(first_message(t), task_kind(t.kind).system_prompt()) for t in tasks]


def run_group(engine: Any, prompt: list[int], cfg: Any, size: int, seed: int) -> dict[str, float]:
    """Sample one group on ``engine``; the counters it moved and its wall time."""
    from shipyard.inference.types import GenerateRequest, SamplingParams

    params = [
        SamplingParams(
            temperature=cfg.sampling.temperature,
            max_tokens=cfg.sampling.max_tokens,
            stop=list(cfg.sampling.stop),
            seed=seed * 1000 + i,
        )
        for i in range(size)
    ]
    before = dict(engine.stats)
    t0 = time.perf_counter()
    results = engine.generate([GenerateRequest(list(prompt), p) for p in params])
    wall = time.perf_counter() - t0
    moved = {
        k: engine.stats[k] - before[k]
        for k in ("prefill_s", "prefix_prefill_s", "decode_s", "prefilled_tokens")
    }
    return {
        "prompt_tokens_forwarded": moved["prefilled_tokens"],
        "prefill_s": moved["prefill_s"] + moved["prefix_prefill_s"],
        "decode_s": moved["decode_s"],
        "wall_s": wall,
        "sampled_tokens": sum(len(r.token_ids) for r in results),
    }


def main() -> int:
    p = harness.parser(__doc__)
    p.add_argument("--groups", type=int, default=6)
    p.add_argument("--group-size", type=int, default=8)
    args = p.parse_args()
    from shipyard.config.load import derive, load_config
    from shipyard.inference.backends.embedded import build_engine

    base = ["model.source=tiny"] if args.quick else []
    engines = {}
    for name, overrides in ENGINES.items():
        cfg = derive(load_config(str(ROOT / "configs" / "demo.toml"), base + overrides))
        engines[name] = build_engine(cfg)[0]
    tokenizer = engines["shared"].tokenizer
    groups = 2 if args.quick else args.groups
    prompts = first_prompts(cfg, tokenizer, groups + 1)
    for engine in engines.values():  # warm-up: oneDNN builds its kernels on the first forwards
        run_group(engine, prompts[-1], cfg, 2, seed=99)
    totals: dict[str, dict[str, float]] = {name: {} for name in engines}
    for g, prompt in enumerate(prompts[:groups]):
        for name, engine in engines.items():
            for k, v in run_group(engine, prompt, cfg, args.group_size, seed=g).items():
                totals[name][k] = totals[name].get(k, 0.0) + v
    rows = {
        name: {
            **t,
            "tokens_per_s": t["sampled_tokens"] / t["wall_s"],
            "prompt_len_mean": _mean_len(prompts[:groups]),
        }
        for name, t in totals.items()
    }
    harness.table(f"{groups} groups of {args.group_size}, first turn", rows)
    figures = {
        **rows,
        "groups": groups,
        "group_size": args.group_size,
        "prefill_speedup": rows["unshared"]["prefill_s"] / rows["shared"]["prefill_s"],
        "wall_speedup": rows["unshared"]["wall_s"] / rows["shared"]["wall_s"],
    }
    harness.write_results(args, "group_prefill", figures)
    return 0


def _mean_len(prompts: list[list[int]]) -> float:
    return sum(map(len, prompts)) / len(prompts)


if __name__ == "__main__":
    sys.exit(main())
