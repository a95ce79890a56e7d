"""Benchmark: the embedded engine against vLLM's CPU server, as users run them (issue 39).

What it measures, per cell of dtype (fp32, bf16) x torch threads (1, 2), in one run:

- server level: ``shipyard serve`` (the demo's config, ``inference.dtype`` and ``inference.threads``
  set to the cell) and vLLM's OpenAI server (``.venv-vllm``, ``--dtype`` the cell's, its OpenMP
  threads bound to that many cores), each sent the same 16 chat requests at once by the ``openai``
  client (16 threads), ``max_tokens`` 256, temperature 1.0, top_p 1.0. tokens/s = the completion
  tokens the servers report (``usage``) / the wall time from the first request sent to the last
  answer received.
- engine level (in-process): the embedded engine built as a server builds it (``build_engine``:
  packed linears, fp32 head in bf16) and ``transformers.generate`` (left-padded batch, the same
  dtype; its tokens counted up to each row's EOS), given the same chat-templated prompts.
- the systems run interleaved, round by round (engine, generate, shipyard server, vLLM server), so
  drift on a shared machine hits all; each system's best round is reported, every round is kept.
- the machine's limits, measured in the same run at the cell's threads: read bandwidth (the best of
  five sums over a 1 GiB tensor) and the GEMM peak in the cell's dtype (the best of oneDNN-packed
  and PyTorch's linear at 1024 x 2048 x 2048). The embedded engine's decode step is then compared to
  them: ``decode_step_over_bandwidth_bound_b1`` = (wall time per token of one request alone, 128
  tokens, prefill included) / (bytes of the weights one token reads: every parameter once, the tied
  embedding as the head in its dtype / bandwidth); ``decode_step_over_gemm_peak_b16`` = (wall time
  per step of 16 requests, 64 tokens each, sampling and bookkeeping included) / (2 x 16 x the
  linear layers' weights, head included / GEMM peak). 1.0 would be at the limit.

Figures, in ``benchmarks/results/inference_vllm.json``: ``server_<dt>_<t>t_over_vllm`` and
``engine_<dt>_<t>t_over_vllm`` (the embedded engine in-process, and ``shipyard serve``, over vLLM's
server; dt ``fp32``/``bf16``, t threads), ``decode_step_over_bandwidth_bound_b1`` and
``decode_step_over_gemm_peak_b16`` (per cell under ``cells``, the top level holding bf16 at the most
threads), every system's tokens/s and rounds under ``cells``.

Fixed lengths (``--ignore-eos``, added in session 37 before its first run): sampled lengths differ
between the systems and between rounds (different random streams; EOS ends rows at different
times: a round of 16 x 256 gave 2,888 to 3,786 tokens), and a batch that runs its longest row to
256 steps pays for every step whatever its other rows did, so tokens/s moves by +-10% with the
lengths alone. With ``--ignore-eos`` every request samples to ``--max-tokens``: ``ignore_eos`` on
the embedded engine, ``shipyard serve`` and vLLM (the same vLLM extension), ``min_new_tokens`` for
``generate`` (which forbids EOS rather than ignoring it: the same count). Every system then makes
the same 16 x 256 tokens, and tokens/s compares decode speed alone, on text past EOS that users
rarely ask for. Same keys, written to ``inference_vllm_fixed_length.json``.

Limits: without ``--ignore-eos``, sampled lengths differ between the systems, which tokens/s
normalises only in part and ``mean_completion_tokens`` shows; vLLM's in-process
engine is not measured (its server is what users run; the ``engine_`` ratios divide by it). vLLM is
skipped when ``.venv-vllm`` is missing (``make vllm``) or under ``--no-vllm``. ``--quick`` (bf16, 1
thread, 4 requests of 32 tokens, one round, no vLLM) is a smoke run, not a figure.

Usage::

    .venv/bin/python benchmarks/inference_vllm.py             # 2 dtypes x 1, 2 threads, ~30 min
    .venv/bin/python benchmarks/inference_vllm.py --cells bf16:2 --repeats 1
    .venv/bin/python benchmarks/inference_vllm.py --cells bf16:1,bf16:2 --ignore-eos  # equal lengths
    .venv/bin/python benchmarks/inference_vllm.py --set inference.fp32_lm_head=false --tag head_bf16
    .venv/bin/python benchmarks/inference_vllm.py --quick
"""

from __future__ import annotations

import argparse
import socket
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import ROOT, console, parser, table, write_results  # noqa: E402

DTYPES = {"fp32": "float32", "bf16": "bfloat16"}
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
Round = dict[str, Any]  # {"tokens", "wall_s", "requests", "eos"}


def _args() -> argparse.Namespace:
    ap = parser(__doc__)
    ap.add_argument("--cells", default=None, help="dtype:threads list (default fp32:1,fp32:2,bf16:1,bf16:2)")
    ap.add_argument("--requests", type=int, default=None, help="concurrent requests (default 16, quick 4)")
    ap.add_argument("--max-tokens", type=int, default=None, help="per request (default 256, quick 32)")
    ap.add_argument("--repeats", type=int, default=None, help="interleaved rounds (default 2, quick 1)")
    ap.add_argument(
        "--ignore-eos",
        action="store_true",
        help="every request samples to --max-tokens (ignore_eos; min_new_tokens for generate): tokens/s "
        "at equal lengths, written to inference_vllm_fixed_length.json",
    )
    ap.add_argument("--tag", default="", help="suffix of the results file's name, e.g. head_bf16 with --set")
    ap.add_argument("--no-vllm", action="store_true", help="skip vLLM (the ratios are then absent)")
    ap.add_argument("--config", default=str(ROOT / "configs/demo.toml"), help="the server's config")
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a dotted config override for the embedded engine and `shipyard serve` alike "
        "(e.g. inference.fp32_lm_head=false); repeatable",
    )
    args = ap.parse_args()
    args.cells = args.cells or ("bf16:1" if args.quick else "fp32:1,fp32:2,bf16:1,bf16:2")
    cells = []
    for cell in args.cells.split(","):
        dt, _, t = cell.partition(":")
        if dt not in DTYPES or not t.isdigit() or int(t) < 1:
            raise ValueError(f"--cells: {cell!r} is not <fp32|bf16>:<threads>, e.g. bf16:2")
        cells.append((dt, int(t)))
    args.cells = cells
    args.requests = args.requests or (4 if args.quick else 16)
    args.max_tokens = args.max_tokens or (32 if args.quick else 256)
    args.repeats = args.repeats or (1 if args.quick else 2)
    args.vllm = not (args.no_vllm or args.quick) and VLLM_PYTHON.is_file()
    return args


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_health(url: str, proc: subprocess.Popen, log: Path, timeout_s: float = 600) -> None:
    """Until the server at ``url`` answers ``/health``; RuntimeError naming ``log`` if it exits first."""
    from shipyard.inference.client import HttpInferenceClient

    end = time.monotonic() + timeout_s
    with HttpInferenceClient(url) as client:
        while proc.poll() is None:
            try:
                client.wait_ready(timeout_s=5)
                return
            except TimeoutError:
                if time.monotonic() > end:
                    raise TimeoutError(f"{url} not healthy within {timeout_s:.0f} s; see {log}") from None
    raise RuntimeError(f"{url}: the server exited with {proc.returncode}; see {log}")


class ShipyardServer:
    """``shipyard serve`` on the cell's dtype and threads, serving the base model from a scratch store."""

    def __init__(self, config: str, dtype: str, threads: int, work: Path, overrides: list[str]) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = work / f"shipyard-serve-{dtype}-{threads}.log"
        argv = [
            sys.executable,
            "-m",
            "shipyard.cli",
            "serve",
            config,
            f"inference.dtype={DTYPES[dtype]}",
            f"inference.threads={threads}",
            f"inference.port={self.port}",
            'run.name="bench-inference"',
            f'store.root="{work / "store"}"',
            f'run.output_dir="{work / "runs"}"',
            *overrides,
        ]
        self.proc = subprocess.Popen(argv, cwd=ROOT, stdout=self.log.open("w"), stderr=subprocess.STDOUT)
        _wait_health(self.url, self.proc, self.log)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def start_vllm(dtype: str, threads: int, work: Path) -> Any:
    from shipyard.inference.backends.vllm_server import VllmProcess
    from shipyard.models.loading import smollm2_dir

    env = {"VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}"}
    proc = VllmProcess(
        VLLM_PYTHON,
        smollm2_dir("~/.cache/shipyard/models"),
        work / f"vllm-{dtype}-{threads}.log",
        served_name="smollm2",
        dtype=DTYPES[dtype],
        max_model_len=2048,
        env=env,
    )
    proc.start().wait_ready(900)
    return proc


def openai_round(
    url: str, messages: list[list[dict[str, str]]], max_tokens: int, seed: int, ignore_eos: bool = False
) -> Round:
    """All chat requests at once through the ``openai`` client; tokens from each answer's ``usage``."""
    from openai import OpenAI

    client = OpenAI(base_url=f"{url}/v1", api_key="bench", timeout=1800, max_retries=0)
    model = client.models.list().data[0].id

    def one(i: int) -> Any:
        return client.chat.completions.create(
            model=model,
            messages=messages[i],
            max_tokens=max_tokens,
            temperature=1.0,
            top_p=1.0,
            seed=seed + i,
            extra_body={"ignore_eos": True} if ignore_eos else None,
        )

    t0 = time.perf_counter()
    with ThreadPoolExecutor(len(messages)) as pool:
        answers = list(pool.map(one, range(len(messages))))
    wall = time.perf_counter() - t0
    client.close()
    tokens = sum(a.usage.completion_tokens for a in answers)
    eos = sum(a.choices[0].finish_reason == "stop" for a in answers)
    return {"tokens": tokens, "wall_s": round(wall, 3), "requests": len(answers), "eos": eos}


def engine_round(
    engine: Any, prompts: list[list[int]], max_tokens: int, seed: int, ignore_eos: bool = False
) -> Round:
    from shipyard.inference.types import GenerateRequest, SamplingParams

    reqs = [
        GenerateRequest(p, SamplingParams(1.0, 1.0, max_tokens, [], seed + i, ignore_eos=ignore_eos))
        for i, p in enumerate(prompts)
    ]
    t0 = time.perf_counter()
    results = engine.generate(reqs)
    wall = time.perf_counter() - t0
    return {
        "tokens": sum(len(r.token_ids) for r in results),
        "wall_s": round(wall, 3),
        "requests": len(results),
        "eos": sum(r.finish_reason == "eos" for r in results),
        "steps": max(len(r.token_ids) for r in results),
    }


def hf_round(
    model: Any,
    prompts: list[list[int]],
    max_tokens: int,
    eos: list[int],
    pad: int,
    seed: int,
    ignore_eos: bool = False,
) -> Round:
    from inference import run_hf
    from shipyard.inference.types import SamplingParams

    params = SamplingParams(1.0, 1.0, max_tokens, ignore_eos=ignore_eos)
    tokens, wall, ended = run_hf(model, prompts, params, eos, pad, seed)
    return {"tokens": tokens, "wall_s": round(wall, 3), "requests": len(prompts), "eos": ended}


def machine_limits(dtype: str) -> dict[str, float]:
    """Read bandwidth (GB/s) and GEMM peak (GFLOP/s, the cell's dtype) at torch's current threads."""
    import torch

    def best(fn: Any, n: int = 5) -> float:
        fn()
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return min(times)

    big = torch.ones(1 << 28)  # 1 GiB of fp32, far larger than any cache
    bandwidth = big.numel() * 4 / best(big.sum) / 1e9
    del big
    dt = getattr(torch, DTYPES[dtype])
    x, w = torch.randn(1024, 2048).to(dt), torch.randn(2048, 2048).to(dt)
    packed = torch.ops.mkldnn._reorder_linear_weight(w, None)
    flops = 2 * 1024 * 2048 * 2048
    gemm = max(
        flops / best(lambda: torch.nn.functional.linear(x, w)),
        flops / best(lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")),
    )
    return {"read_bandwidth_gb_s": bandwidth, "gemm_peak_gflop_s": gemm / 1e9}


def model_sizes(model: Any) -> dict[str, float]:
    """Bytes of the weights one decoded token reads (each parameter storage once) and the linear
    layers' weight count (the FLOPs of a token are twice that, attention aside)."""
    seen: dict[int, int] = {}
    for p in model.parameters():
        seen[p.data_ptr()] = p.numel() * p.element_size()
    linear = sum(
        m.weight.numel() for m in model.modules() if hasattr(m, "in_features") and hasattr(m, "weight")
    )
    return {"weight_bytes": float(sum(seen.values())), "linear_params": float(linear)}


def decode_steps(
    engine: Any, prompts: list[list[int]], sizes: dict[str, float], limits: dict[str, float]
) -> dict[str, Any]:
    """The embedded engine's decode step against the bandwidth bound (1 row) and GEMM peak (16 rows)."""
    one = min(
        (engine_round(engine, prompts[:1], 128, 7) for _ in range(2)), key=lambda r: r["wall_s"] / r["tokens"]
    )
    step_b1 = one["wall_s"] / one["tokens"]
    bound_b1 = sizes["weight_bytes"] / (limits["read_bandwidth_gb_s"] * 1e9)
    rows = min(16, len(prompts))
    full = min((engine_round(engine, prompts[:rows], 64, 11) for _ in range(2)), key=lambda r: r["wall_s"])
    step_b16 = full["wall_s"] / full["steps"]
    bound_b16 = 2 * rows * sizes["linear_params"] / (limits["gemm_peak_gflop_s"] * 1e9)
    return {
        "decode_step_b1_ms": step_b1 * 1e3,
        "bandwidth_bound_b1_ms": bound_b1 * 1e3,
        "decode_step_over_bandwidth_bound_b1": step_b1 / bound_b1,
        "decode_step_b16_ms": step_b16 * 1e3,
        "gemm_bound_b16_ms": bound_b16 * 1e3,
        "decode_step_over_gemm_peak_b16": step_b16 / bound_b16,
        "b16_rows": rows,
        "b16_rows_ended_by_eos": full["eos"],
    }


def run_cell(args: argparse.Namespace, dt: str, threads: int, work: Path) -> dict[str, Any]:
    """Every system at one dtype and thread count, interleaved; the cell's figures."""
    import torch

    from inference import TASKS, chat_prompts
    from shipyard.config.load import load_config
    from shipyard.inference.backends.embedded import build_engine
    from shipyard.models.loading import load_model

    cfg = load_config(
        args.config, [f"inference.dtype={DTYPES[dt]}", f"inference.threads={threads}", *args.set]
    )
    engine, tok = build_engine(cfg)  # sets torch's threads to the cell's
    hf_model = load_model(cfg.model)[0].to(getattr(torch, DTYPES[dt]))
    eos, pad = sorted(engine.eos_ids), engine.pad_id
    prompts = chat_prompts(tok, args.requests)
    messages = [[{"role": "user", "content": TASKS[i % len(TASKS)]}] for i in range(args.requests)]
    servers: dict[str, Any] = {"shipyard_server": ShipyardServer(args.config, dt, threads, work, args.set)}
    try:
        if args.vllm:
            servers["vllm_server"] = start_vllm(dt, threads, work)
        fixed = args.ignore_eos
        systems = {
            "embedded_engine": lambda n, s: engine_round(engine, prompts, n, s, fixed),
            "hf_generate": lambda n, s: hf_round(hf_model, prompts, n, eos, pad, s, fixed),
            **{
                name: (lambda n, s, u=srv.url: openai_round(u, messages, n, s, fixed))
                for name, srv in servers.items()
            },
        }
        for fn in systems.values():
            fn(4, 0)  # warm-up
        rounds: dict[str, list[Round]] = {name: [] for name in systems}
        for r in range(args.repeats):
            for name, fn in systems.items():
                rounds[name].append(fn(args.max_tokens, 1000 * (r + 1)))
                console.print(f"{dt} {threads}t round {r + 1}: {name} {rounds[name][-1]}")
    finally:
        for srv in servers.values():
            srv.stop()
    limits = machine_limits(dt)
    steps = decode_steps(engine, prompts, model_sizes(engine.model), limits)
    tps = {name: max(x["tokens"] / x["wall_s"] for x in rs) for name, rs in rounds.items()}
    cell: dict[str, Any] = {
        "tokens_per_s": tps,
        "mean_completion_tokens": {
            n: sum(x["tokens"] for x in rs) / sum(x["requests"] for x in rs) for n, rs in rounds.items()
        },
        "rounds": rounds,
        **limits,
        **steps,
    }
    if "vllm_server" in tps:
        cell["engine_over_vllm"] = tps["embedded_engine"] / tps["vllm_server"]
        cell["server_over_vllm"] = tps["shipyard_server"] / tps["vllm_server"]
    return cell


def main() -> None:
    args = _args()
    if not args.vllm and not (args.quick or args.no_vllm):
        console.print(f"[yellow]{VLLM_PYTHON} is missing (`make vllm`): vLLM is skipped[/]")
    out: dict[str, Any] = {
        "model": "smollm2",
        "requests": args.requests,
        "max_tokens": args.max_tokens,
        "repeats": args.repeats,
        "ignore_eos": args.ignore_eos,
        "overrides": args.set,
        "cells": {},
    }
    with tempfile.TemporaryDirectory(prefix="shipyard-bench-inference-") as tmp:
        for dt, threads in args.cells:
            cell = run_cell(args, dt, threads, Path(tmp))
            out["cells"][f"{dt}_{threads}t"] = cell
            for level in ("engine", "server"):
                if f"{level}_over_vllm" in cell:
                    out[f"{level}_{dt}_{threads}t_over_vllm"] = cell[f"{level}_over_vllm"]
            table(
                f"{dt}, {threads} threads: tokens/s (best of {args.repeats} rounds)",
                {
                    n: {"tokens/s": v, "mean tokens": cell["mean_completion_tokens"][n]}
                    for n, v in cell["tokens_per_s"].items()
                },
            )
    top = max((k for k in out["cells"]), key=lambda k: (k.startswith("bf16"), int(k.split("_")[1][:-1])))
    for key in ("decode_step_over_bandwidth_bound_b1", "decode_step_over_gemm_peak_b16"):
        out[key] = out["cells"][top][key]
    out["limits_cell"] = top
    table(
        "embedded engine against the machine's limits",
        {
            k: {
                m: c[m]
                for m in (
                    "decode_step_b1_ms",
                    "bandwidth_bound_b1_ms",
                    "decode_step_b16_ms",
                    "gemm_bound_b16_ms",
                    "read_bandwidth_gb_s",
                    "gemm_peak_gflop_s",
                )
            }
            for k, c in out["cells"].items()
        },
    )
    name = (
        "inference_vllm" + ("_fixed_length" if args.ignore_eos else "") + (f"_{args.tag}" if args.tag else "")
    )
    write_results(args, name, out)


if __name__ == "__main__":
    main()
