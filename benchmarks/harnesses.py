"""Harnesses side by side (issue 38): the built-in harness and the command harnesses Shipyard ships
configs for (the `openai` client agent, mini-swe-agent, the OpenAI Agents SDK, a verifiers
environment) play the same held-out function tasks on one embedded inference server over HTTP.

Definitions (fixed before the first run):
- ``sessions``: sessions played (each task once per harness, ``--concurrency`` at a time).
- ``token_exact_frac``: of every token the inference server sampled for the harness's calls (each
  ``/generate`` answer, recorded by a wrapper around the client the sessions share), the fraction
  found in a segment with loss mask 1, with the same id and a bit-identical logprob, at a
  position whose preceding segment tokens are exactly that call's prompt ids: what the trainer
  scores is what was sampled, in the context it was sampled in. Target 1.0. A session that ended
  in error (e.g. the harness crashed) has every loss mask 0 by design (none of its tokens is
  trained); its tokens count as exact when id, logprob and context are (its sessions are in
  ``finishes``). (Amended after the first run with the warm-started policy, where 6 Agents SDK
  sessions crashed and their masked tokens counted as inexact: 0.53.)
- ``retokenized_calls``: calls whose history matched no earlier sample (summed). Target 0.
- ``tool_call_parse_frac``: replies holding a tool call that parsed, over replies attempting one
  (summed over sessions; None where no reply attempted one: nothing to parse is not a rate).
- ``sessions_per_s``: sessions over the wall time of the harness's batch.
- ``endpoint_overhead_p50_ms`` / ``_p99_ms``: per call, the time spent in the session endpoint
  itself (rendering, matching the history, answering), not generating. Target p50 <= 5 ms.
- ``mean_reward``: the sessions' mean reward (no RL: the shipped model as it is, and with
  ``--warm-start`` also the warm-started policy, SFT on the expert's demonstrations through
  mini-swe-agent, ``harnesses_warm_start``).

The model is the configs' (SmolLM2-135M-Instruct, ``--quick``: the tiny random model, one task),
served by an embedded inference server in its own process (as a run's servers are: in the
benchmark's process its decode loop would hold the interpreter lock the endpoints need).
Needs ``make harnesses`` for the third-party ones (a missing virtualenv skips its row, and says
so). Writes benchmarks/results/harness.json (``harness_quick.json``) under ``harnesses.<name>``.

    python benchmarks/harnesses.py [--quick] [--tasks 8] [--concurrency 4] [--warm-start runs/warm/mini_swe]
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import socket
import statistics
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from harness import machine, parser, table, write_results

ROOT = Path(__file__).resolve().parents[1]
HARNESSES = {
    "builtin": "demo.toml",
    "tools_agent": "tools_agent.toml",
    "mini_swe": "mini_swe.toml",
    "mini_swe_tools": "mini_swe.toml",
    "agents_sdk": "agents_sdk.toml",
    "verifiers": "verifiers_env.toml",
}
"""Each harness with the shipped config whose harness and sampling it plays with (``mini_swe_tools``:
mini-swe-agent's tool-calling mode, its ``mini.yaml``, where the shipped config runs its text mode)."""


class RecordingClient:
    """The sessions' inference client, recording every sampled answer with its prompt."""

    def __init__(self, client: Any) -> None:
        self._client = client
        self.records: list[tuple[list[int], Any]] = []
        self._lock = threading.Lock()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)

    def _keep(self, requests: list[Any], results: list[Any]) -> list[Any]:
        with self._lock:
            self.records += [(r.prompt_ids, res) for r, res in zip(requests, results, strict=True)]
        return results

    def generate(self, requests: list[Any]) -> list[Any]:
        return self._keep(requests, self._client.generate(requests))

    async def agenerate(self, requests: list[Any], http: Any) -> list[Any]:
        return self._keep(requests, await self._client.agenerate(requests, http))


def token_exact(records: list[tuple[list[int], Any]], segs: list[Any]) -> tuple[int, int]:
    """(exact, sampled) tokens by the module's definition."""
    exact = total = 0
    for prompt, res in records:
        n, total = len(res.token_ids), total + len(res.token_ids)
        for seg in segs:
            p = len(prompt)
            if seg.token_ids[:p] != prompt:
                continue
            ids, lps, mask = seg.token_ids[p : p + n], seg.logprobs[p : p + n], seg.loss_mask[p : p + n]
            good = sum(
                1
                for i, lp, m, ri, rl in zip(ids, lps, mask, res.token_ids, res.logprobs, strict=False)
                if (m == 1 or seg.error is not None) and i == ri and lp == rl
            )
            if good == n:
                exact += n
                break
    return exact, total


def run_harness(cfg: Any, server_url: str, tok: Any, tasks: list[Any], conc: int) -> dict[str, Any]:
    from shipyard.agent.play import play
    from shipyard.agent.spec import session_spec
    from shipyard.inference.client import HttpInferenceClient

    client = RecordingClient(HttpInferenceClient(server_url, timeout_s=300))
    spec = session_spec(cfg, client, tok)
    t0 = time.monotonic()
    with ThreadPoolExecutor(conc) as pool:
        played = list(pool.map(lambda it: play(spec, it[1], f"bench-{it[0]}", 0), enumerate(tasks)))
    wall = time.monotonic() - t0
    segs = [s for session in played for s in session]
    exact, sampled = token_exact(client.records, segs)
    firsts = [session[0] for session in played]
    m = [s.metrics for s in firsts]
    overhead = [ms for x in m for ms in x.get("overhead_ms", [])]
    attempts = sum(x.get("tool_call_attempts", 0) for x in m)
    parsed = sum(round(x.get("tool_call_parse_frac", 1.0) * x.get("tool_call_attempts", 0)) for x in m)
    finishes: dict[str, int] = {}
    for s in firsts:
        finishes[s.finish] = finishes.get(s.finish, 0) + 1
    return {
        "sessions": len(played),
        "calls": len(client.records),
        "token_exact_frac": exact / sampled if sampled else 1.0,
        "sampled_tokens": sampled,
        "retokenized_calls": sum(x.get("retokenized_calls", 0) for x in m),
        "tool_call_parse_frac": parsed / attempts if attempts else None,
        "tool_call_attempts": attempts,
        "sessions_per_s": len(played) / wall,
        "endpoint_overhead_p50_ms": _pct(overhead, 50),
        "endpoint_overhead_p99_ms": _pct(overhead, 99),
        "mean_reward": statistics.fmean(s.reward for s in firsts),
        "finishes": finishes,
    }


def _serve(overrides: list[str], port: int) -> None:
    """The benchmark's inference server (configs/demo.toml's engine), in a child process."""
    from shipyard.config import load_config
    from shipyard.inference.backends.embedded import build_engine
    from shipyard.inference.serving.server import InferenceServer

    engine, _ = build_engine(load_config(str(ROOT / "configs/demo.toml"), overrides))
    with InferenceServer(engine, port=port):
        threading.Event().wait()


@contextlib.contextmanager
def served(overrides: list[str]) -> Iterator[str]:
    """The URL of :func:`_serve` in a child process, ready; the process is ended on exit."""
    import httpx

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = multiprocessing.get_context("spawn").Process(target=_serve, args=(overrides, port), daemon=True)
    proc.start()
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                httpx.get(f"{url}/version", timeout=2).raise_for_status()
                break
            except httpx.HTTPError:
                if not proc.is_alive() or time.monotonic() > deadline:
                    raise RuntimeError("the benchmark's inference server did not start") from None
                time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        proc.join(30)


def _pct(xs: list[float], q: int) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q / 100 * (len(xs) - 1)))]


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--tasks", type=int, default=8, help="held-out tasks per harness")
    ap.add_argument("--concurrency", type=int, default=4, help="sessions played at once")
    ap.add_argument(
        "--warm-start",
        default="",
        help="also play every harness with this policy (a `shipyard warmstart` output directory, "
        "e.g. runs/warm/mini_swe): rows under harnesses_warm_start",
    )
    args = ap.parse_args()
    os.chdir(ROOT)  # the configs' paths are relative to the repository
    from shipyard.config import load_config
    from shipyard.envs.tasks.splits import heldout_tasks
    from shipyard.models.loading import load_tokenizer

    quick = ["model.source=tiny", "model.tiny=dense"] if args.quick else []
    n = 1 if args.quick else args.tasks
    base = load_config(str(ROOT / "configs/demo.toml"), quick)
    tasks = heldout_tasks(base, "function", n)
    tok = load_tokenizer(base.model)
    policies = {"harnesses": quick}
    if args.warm_start:
        policies["harnesses_warm_start"] = [*quick, f"model.init_from={args.warm_start}"]
    out: dict[str, Any] = {"model": base.model.source, "warm_start": args.warm_start or None}
    for key, overrides in policies.items():
        rows: dict[str, dict[str, Any]] = {}
        with served(overrides) as url:
            for name, config in HARNESSES.items():
                cfg = load_config(str(ROOT / "configs" / config), quick)
                if name == "mini_swe_tools":
                    tools = cfg.harness.command.replace("mini_text.yaml", "mini.yaml")
                    cfg = cfg.model_copy(
                        update={"harness": cfg.harness.model_copy(update={"command": tools})}
                    )
                if cfg.harness.venv and not os.path.isdir(cfg.harness.venv):
                    print(f"skipped {name}: {cfg.harness.venv} is missing (`make harnesses` builds it)")
                    continue
                rows[name] = run_harness(cfg, url, tok, tasks, args.concurrency)
                print(key, name, rows[name])
        table(key, {k: {c: v for c, v in r.items() if c != "finishes"} for k, r in rows.items()})
        out[key] = rows
    path = args.out / f"harness{'_quick' if args.quick else ''}.json"
    old = json.loads(path.read_text()) if path.exists() else {}
    rl_keys = ("mini_swe_", "agents_sdk_", "verifiers_")  # harness_rl.py's rows
    kept = {k: v for k, v in old.items() if k.startswith(rl_keys) or k == "minutes"}
    write_results(args, "harness", {**kept, **out, "tasks": [t.id for t in tasks], "machine": machine()})


if __name__ == "__main__":
    main()
