"""Benchmark: static vs continuous batching vs continuous batching with the prefix cache, on agent sessions.

Contract: every mode runs an :class:`EmbeddedEngine` on the same multi-turn workload: ``--sessions``
agent sessions of ``--turns`` turns each. A session's next prompt is its previous prompt, the
tokens it sampled and a tool answer (token for token, as the agent harness builds it); each turn is
seeded and its ``max_tokens`` drawn from a long-tailed mix (most turns are short tool calls, a few
are long edits). Modes:

- ``static``: the engine's behaviour before continuous batching: turn by turn, the sessions'
  requests cut into chunks of ``max_batch``, each chunk running until its slowest row is done;
- ``continuous``: one :meth:`EmbeddedEngine.serve` loop; a session's next turn is queued the
  moment its previous one returns and joins the running batch at the next decode step;
- ``continuous+prefix``: the same with the prefix cache, so a turn forwards only its new tokens.

Each turn draws the same random numbers in every mode; its tokens match unless padding or
reused keys/values (which differ between the modes) move a logit enough to change a draw, and a
session that diverged then sees different prompts: ``same_tokens_frac`` reports the share of
turns with identical tokens. Reports generated tokens/s, wall time, prompt tokens forwarded, decode
steps, mean rows per decode step and the p50/p95 time for a session to complete (all sessions
start at t = 0). Modes alternate over ``--repeats`` rounds; the best round of each is kept. Writes
``benchmarks/results/batching.json`` with ``static_tokens_per_s``, ``continuous_tokens_per_s``,
``prefix_tokens_per_s``, ``speedup`` (continuous+prefix over static), ``continuous_speedup``,
``static_p95_s``, ``continuous_p95_s``, ``prefix_p95_s``.

Limits: CPU, fp32; the tool answers are fixed text (no sandbox), so it measures the engine alone;
``--quick`` (tiny random model) is a smoke run.

Usage::

    .venv/bin/python benchmarks/batching.py            # SmolLM2-135M, 24 sessions x 4 turns, 16 slots
    .venv/bin/python benchmarks/batching.py --quick    # under a minute
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from shipyard.config.schema import ModelConfig
from shipyard.inference.engine.engine import EmbeddedEngine
from shipyard.inference.types import GenerateRequest, GenerateResult, SamplingParams
from shipyard.models.loading import load_model

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import parser, write_results  # noqa: E402

console = Console(width=120)

TURNS = [
    "List the files in the repository and open the failing test.",
    "Fix the bug: def add(a, b): return a - b",
    "Write a function that parses 'key=value' lines into a dict.",
    "The test log says KeyError: 'user'. What do you check next?",
    "Write a SQL migration adding a NOT NULL column with a default.",
    "Summarize what you have done so far in three bullet points.",
]


TOOL = "\n[tool] exit code 1\nFAILED test_solution.py::test_case_3 - AssertionError: expected 4, got 0\n"


@dataclass
class Session:
    """One agent session of the workload: its prompt so far and the turns still to play."""

    index: int
    prompt: list[int]
    budgets: list[int]
    tool_ids: list[int]
    tokens: list[list[int]] = field(default_factory=list)
    prompted: int = 0
    """Prompt tokens of the turns played so far."""

    def request(self) -> GenerateRequest:
        turn = len(self.tokens)
        params = SamplingParams(
            temperature=1.0, top_p=0.95, max_tokens=self.budgets[turn], seed=self.index * 100 + turn
        )
        return GenerateRequest(prompt_ids=list(self.prompt), params=params)

    def advance(self, res: GenerateResult) -> bool:
        """Append a finished turn and the tool answer; True while turns remain."""
        self.tokens.append(res.token_ids)
        self.prompted += len(self.prompt)
        self.prompt = self.prompt + res.token_ids + self.tool_ids
        return len(self.tokens) < len(self.budgets)


def sessions(tok: Any, args: argparse.Namespace) -> list[Session]:
    """The workload: seeded chat sessions; a ``long_frac`` share of turns may run to ``long`` tokens."""
    rng = random.Random(0)
    tool_ids = tok.encode(TOOL, add_special_tokens=False)
    out = []
    for i in range(args.sessions):
        msgs = [{"role": "user", "content": TURNS[i % len(TURNS)]}]
        ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False)
        budgets = [
            args.long if rng.random() < args.long_frac else rng.randint(args.short // 2, args.short)
            for _ in range(args.turns)
        ]
        out.append(Session(i, list(ids), budgets, tool_ids))
    return out


def run_mode(engine: EmbeddedEngine, work: list[Session], mode: str) -> dict[str, Any]:
    """One round of ``work`` (fresh copies) in ``mode``; see the module docstring."""
    work = [Session(s.index, list(s.prompt), s.budgets, s.tool_ids) for s in work]
    before = dict(engine.stats)
    done_s: dict[int, float] = {}
    t0 = time.perf_counter()
    if mode == "static":
        live = list(work)
        while live:
            for start in range(0, len(live), engine.max_batch):
                chunk = live[start : start + engine.max_batch]
                for sess, res in zip(chunk, engine.generate([x.request() for x in chunk]), strict=True):
                    if not sess.advance(res):
                        done_s[sess.index] = time.perf_counter() - t0
            live = [x for x in live if x.index not in done_s]
    else:
        waiting = [(x.request(), _finisher(x, done_s, t0, lambda: waiting)) for x in work]

        def take(free: int, idle: bool) -> list[Any] | None:
            if not waiting and idle:
                return None
            jobs = waiting[:free]
            del waiting[:free]
            return jobs

        engine.serve(take)
    wall = time.perf_counter() - t0
    tokens = sum(len(t) for x in work for t in x.tokens)
    steps = engine.stats["decode_steps"] - before["decode_steps"]
    turns = sum(len(x.tokens) for x in work)
    lat = sorted(done_s.values())
    reused = engine.stats["prefix_tokens"] - before["prefix_tokens"]
    return {
        "tokens": tokens,
        "wall_s": round(wall, 3),
        "tokens_per_s": round(tokens / wall, 2),
        "prompt_tokens_forwarded": sum(x.prompted for x in work) - reused,
        "prompt_tokens_reused": reused,
        "decode_steps": steps,
        "rows_per_step": round((tokens - turns) / max(steps, 1), 2),
        "p50_s": round(lat[len(lat) // 2], 3),
        "p95_s": round(lat[min(len(lat) - 1, int(0.95 * len(lat)))], 3),
        "token_ids": [t for x in work for t in x.tokens],
    }


def _finisher(sess: Session, done_s: dict[int, float], t0: float, queue: Any) -> Any:
    """The callback of a session's turn: queue its next turn, or record when it finished."""

    def done(res: GenerateResult) -> None:
        if sess.advance(res):
            queue().append((sess.request(), _finisher(sess, done_s, t0, queue)))
        else:
            done_s[sess.index] = time.perf_counter() - t0

    return done


MODES = ("static", "continuous", "continuous+prefix")


def main() -> None:
    ap = parser(__doc__)  # --quick: tiny random model, 6 sessions x 3 short turns (< 1 minute)
    ap.add_argument("--sessions", type=int, default=24, help="agent sessions")
    ap.add_argument("--turns", type=int, default=4, help="turns per session")
    ap.add_argument("--batch", type=int, default=16, help="engine max_batch (slots)")
    ap.add_argument("--long-frac", type=float, default=0.2, help="share of turns allowed the long budget")
    ap.add_argument("--short", type=int, default=48, help="short turns: max_tokens in [short/2, short]")
    ap.add_argument("--long", type=int, default=192, help="long turns: max_tokens")
    ap.add_argument("--repeats", type=int, default=None, help="alternating rounds (default 2, quick 1)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch intra-op threads")
    args = ap.parse_args()
    if args.quick:
        args.sessions, args.turns, args.short, args.long, args.batch = 6, 3, 8, 24, 4
    torch.set_num_threads(args.threads)
    repeats = args.repeats or (1 if args.quick else 2)
    model_cfg = ModelConfig(source="tiny", tiny="dense") if args.quick else ModelConfig(source="smollm2")
    model, tok = load_model(model_cfg)
    engines = {
        "static": EmbeddedEngine(model, tok, max_batch=args.batch),
        "continuous": EmbeddedEngine(model, tok, max_batch=args.batch),
        "continuous+prefix": EmbeddedEngine(model, tok, max_batch=args.batch, prefix_cache_mb=2048),
    }
    work = sessions(tok, args)
    engines["static"].generate([work[0].request()])  # warm-up
    rounds: dict[str, list[dict[str, Any]]] = {m: [] for m in MODES}
    for _ in range(repeats):
        for mode in MODES:
            rounds[mode].append(run_mode(engines[mode], work, mode))
    best = {mode: max(rs, key=lambda r: r["tokens_per_s"]) for mode, rs in rounds.items()}
    report(best, rounds, args, model_cfg.source)


def report(best: dict[str, Any], rounds: dict[str, Any], args: argparse.Namespace, model: str) -> None:
    turns = args.sessions * args.turns
    title = (
        f"{model}: {args.sessions} sessions x {args.turns} turns, {args.batch} slots, {args.threads} threads"
    )
    table = Table(title=title)
    cols = ("tokens", "wall_s", "tokens_per_s", "prompt_tokens_forwarded", "decode_steps", "rows_per_step")
    for col in ("mode", *cols, "p50_s", "p95_s", "same tokens"):
        table.add_column(col.replace("_", " "))
    for mode, r in best.items():
        pairs = zip(best["static"]["token_ids"], r["token_ids"], strict=True)
        r["same_tokens_frac"] = round(sum(a == b for a, b in pairs) / turns, 3)
        table.add_row(mode, *(str(r[c]) for c in (*cols, "p50_s", "p95_s")), f"{r['same_tokens_frac']:.0%}")
    console.print(table)
    tps = {m: best[m]["tokens_per_s"] for m in MODES}
    console.print(
        f"continuous / static {tps['continuous'] / tps['static']:.2f}x; "
        f"continuous+prefix / static {tps['continuous+prefix'] / tps['static']:.2f}x tokens/s"
    )
    result = {
        "static_tokens_per_s": tps["static"],
        "continuous_tokens_per_s": tps["continuous"],
        "prefix_tokens_per_s": tps["continuous+prefix"],
        "speedup": round(tps["continuous+prefix"] / tps["static"], 3),
        "continuous_speedup": round(tps["continuous"] / tps["static"], 3),
        "static_p95_s": best["static"]["p95_s"],
        "continuous_p95_s": best["continuous"]["p95_s"],
        "prefix_p95_s": best["continuous+prefix"]["p95_s"],
        "model": model,
        **{
            k: getattr(args, k)
            for k in ("sessions", "turns", "batch", "long_frac", "short", "long", "threads")
        },
        "best": {m: {k: v for k, v in r.items() if k != "token_ids"} for m, r in best.items()},
        "rounds": {
            m: [{k: v for k, v in r.items() if k != "token_ids"} for r in rs] for m, rs in rounds.items()
        },
        "load_avg": os.getloadavg()[0],
    }
    write_results(args, "batching", result)


if __name__ == "__main__":
    main()
