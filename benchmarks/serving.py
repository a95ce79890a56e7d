"""The embedded engine's OpenAI-compatible server under load, driven by the `openai` client.

Four measurements on one server (SmolLM2-135M by default; `--quick`: the tiny random model, fewer
requests):

1. load: concurrency 1, 2, 4, 8, 16, 32 (requests of 32 tokens): latency p50/p99 and tokens/s;
2. starvation: short requests (8 tokens) one after another on an idle server, then while every
   slot is kept busy with long ones (320 tokens, above the scheduler's 256-token "short" bound):
   p99 of each and their ratio (target <= 3), for our scheduler and for the baseline, plain
   arrival order (`reserved_slots=0`, what the server did before);
3. abandonment: clients that hang up mid-generation (half streaming, half not): the fraction of
   their rows the engine cancels (target 1.0);
4. shutdown: `stop()` while long requests run: seconds until stopped (target <= 10).

    python benchmarks/serving.py [--quick] [--model smollm2|tiny]

Writes `benchmarks/results/serving.json`: per-concurrency `load`, `server_p50_s`, `server_p99_s`
(at concurrency 8), `tokens_per_s` (at 32), `small_request_p99_s_idle`,
`small_request_p99_s_under_long_load`, `starvation_ratio` (and the FIFO baseline's
`fifo_starvation_ratio`), `abandoned_requests_cancelled_frac`,
`shutdown_s`.
"""

from __future__ import annotations

import contextlib
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import harness

MSG = [{"role": "user", "content": "Write a Python function that reverses a string."}]


def _p(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def load(client: Any, levels: list[int], per_level: int) -> dict[int, dict[str, float]]:
    out = {}
    for c in levels:

        def one(_: int) -> tuple[float, int]:
            t0 = time.perf_counter()
            r = client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=32, temperature=1.0)
            return time.perf_counter() - t0, r.usage.completion_tokens

        t0 = time.perf_counter()
        with ThreadPoolExecutor(c) as pool:
            got = list(pool.map(one, range(max(per_level, c))))
        wall = time.perf_counter() - t0
        lat = [g[0] for g in got]
        out[c] = {
            "p50_s": statistics.median(lat),
            "p99_s": _p(lat, 0.99),
            "tokens_per_s": sum(g[1] for g in got) / wall,
        }
    return out


def starvation(client: Any, engine: Any, n: int, long_tokens: int) -> dict[str, float]:
    def short() -> float:
        t0 = time.perf_counter()
        client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=8, temperature=1.0)
        return time.perf_counter() - t0

    idle = [short() for _ in range(n)]
    stop = threading.Event()

    def keep_busy() -> None:
        while not stop.is_set():
            client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=long_tokens, temperature=1.0)

    threads = [threading.Thread(target=keep_busy) for _ in range(engine.max_batch)]
    for t in threads:
        t.start()
    time.sleep(2.0)
    busy = [short() for _ in range(n)]
    stop.set()
    for t in threads:
        t.join()
    return {
        "small_request_p99_s_idle": _p(idle, 0.99),
        "small_request_p99_s_under_long_load": _p(busy, 0.99),
        "starvation_ratio": _p(busy, 0.99) / _p(idle, 0.99),
    }


def abandonment(url: str, engine: Any, n: int) -> float:
    import httpx

    before = engine.stats["aborted"]
    body = {"messages": MSG, "max_tokens": 2000, "temperature": 1.0}
    for i in range(n):
        if i % 2:
            with httpx.stream(
                "POST", f"{url}/v1/chat/completions", json={**body, "stream": True}, timeout=60
            ) as r:
                for k, _ in enumerate(r.iter_lines()):
                    if k > 6:
                        break
        else:
            with contextlib.suppress(httpx.ReadTimeout):
                httpx.post(f"{url}/v1/chat/completions", json=body, timeout=0.5)
    deadline = time.monotonic() + 60
    while engine.stats["aborted"] - before < n and time.monotonic() < deadline:
        time.sleep(0.1)
    return (engine.stats["aborted"] - before) / n


def shutdown(model: Any, tok: Any, n: int) -> float:
    import httpx

    from shipyard.inference.engine.engine import EmbeddedEngine
    from shipyard.inference.serving.server import InferenceServer

    server = InferenceServer(EmbeddedEngine(model, tok, max_batch=8), drain_s=5.0).start()
    body = {"messages": MSG, "max_tokens": 2000, "temperature": 1.0}
    threads = [
        threading.Thread(
            target=httpx.post,
            args=(f"{server.url}/v1/chat/completions",),
            kwargs={"json": body, "timeout": 120},
        )
        for _ in range(n)
    ]
    for t in threads:
        t.start()
    time.sleep(2.0)
    t0 = time.perf_counter()
    server.stop()
    took = time.perf_counter() - t0
    for t in threads:
        t.join()
    return took


MODEL = "policy"
LONG_TOKENS = 320
"""Long requests: above the scheduler's 256-token bound for short ones."""


def main() -> int:
    import openai
    import torch

    from shipyard.config.schema import ModelConfig
    from shipyard.inference.engine.engine import EmbeddedEngine
    from shipyard.inference.serving.server import InferenceServer
    from shipyard.models.loading import load_model

    p = harness.parser(__doc__)
    p.add_argument("--model", choices=["smollm2", "tiny"], default=None)
    args = p.parse_args()
    source = args.model or ("tiny" if args.quick else "smollm2")
    torch.set_num_threads(2)
    model, tok = load_model(ModelConfig(source=source))
    engine = EmbeddedEngine(model, tok, max_batch=8)
    levels = [1, 2, 4, 8] if args.quick else [1, 2, 4, 8, 16, 32]
    shorts = 5 if args.quick else 8
    with InferenceServer(engine, model_name=MODEL, reserved_slots=0) as fifo:  # the baseline: arrival order
        client = openai.OpenAI(base_url=f"{fifo.url}/v1", api_key="unused", max_retries=0, timeout=600)
        baseline = starvation(client, engine, shorts, LONG_TOKENS)
    with InferenceServer(engine, model_name=MODEL) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=600)
        lo = load(client, levels, 8 if args.quick else 32)
        starve = starvation(client, engine, shorts, LONG_TOKENS)
        cancelled = abandonment(server.url, engine, 4 if args.quick else 10)
    stop_s = shutdown(model, tok, 4 if args.quick else 8)
    harness.table(
        f"serving ({source}, max_batch 8, 2 threads)", {f"concurrency {c}": v for c, v in lo.items()}
    )
    figures = {
        "model": source,
        "load": {str(c): v for c, v in lo.items()},
        "server_p50_s": lo[8]["p50_s"],
        "server_p99_s": lo[8]["p99_s"],
        "tokens_per_s": lo[levels[-1]]["tokens_per_s"],
        **starve,
        "fifo_starvation_ratio": baseline["starvation_ratio"],
        "fifo_small_request_p99_s_under_long_load": baseline["small_request_p99_s_under_long_load"],
        "abandoned_requests_cancelled_frac": cancelled,
        "shutdown_s": stop_s,
    }
    harness.table(
        "fairness, abandonment, shutdown",
        {k: {"value": v} for k, v in figures.items() if k not in ("load", "model")},
    )
    harness.write_results(args, "serving", figures)
    return 0


if __name__ == "__main__":
    sys.exit(main())
