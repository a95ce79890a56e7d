"""Benchmark: lossless delta weight shipping on real consecutive training versions.

Contract: a policy is trained with AdamW (fp32 master weights) on next-token loss over short
code snippets written below, a different mini-batch each step; after every step the bf16 serving
copy (``p.to(torch.bfloat16)``) is a version. Each consecutive pair is shipped with
:mod:`shipyard.weights.codec` and, side by side, with what RL stacks ship today: zstd of the
full weights, XOR + zstd (slime / SkyRL / NeMo-RL style), and ZipNN (full and its XOR delta
mode) when it is installed. Every step is checked bit-exact (decoded == new version) and the
whole chain is replayed from version 0 to the final per-tensor digests.

Reported per step (step 1 changes far more than later ones, so the chain figures are medians
over steps 2..N): compression ratio (bf16 bytes / shipped bytes), fraction of weights
unchanged, encode and decode+apply GB/s per core (model bytes / CPU seconds of the one thread
doing the work, ``workers=1``; apply writes into the live serving tensors in place; sender and
receiver carry their :class:`~shipyard.weights.order.MinorityIndex` along the chain, as the
publisher and subscribers do, so step 1 also pays for building them), and the
order-0 entropy bound, plain and conditioned on the parent's exponent. After each chain the
last step is also coded with ``--workers`` threads (wall clock). Prints rich tables and writes
``benchmarks/results/weight_codec.json``: top-level figures for the main model (keys such as
``ratio_lr1e-6``, ``encode_GBps_per_core``; chain medians), ``step1``, ``targets``, and every
chain's per-step records under ``chains``.

Limits: CPU only; per-core speeds use thread CPU time because the machine may be shared (the
wall-clock figures are printed beside them); slow baselines run on some steps only: full-weight
zstd and ZipNN full on the first and last step, ZipNN delta also on every 5th step.

Shape legend: none (tensors are handled whole).

Usage::

    .venv/bin/python benchmarks/weight_codec.py            # SmolLM2-135M + tiny MoE, 20-step chains
    .venv/bin/python benchmarks/weight_codec.py --quick    # tiny models, 5 steps, under a minute
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import zstandard
from rich.console import Console
from rich.table import Table

from shipyard.config.schema import ModelConfig
from shipyard.models.loading import load_model
from shipyard.weights.codec import describe_blob
from shipyard.weights.order import MinorityIndex
from shipyard.weights.states import decode_state, encode_state, entropy_bound, tensor_digest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import parser, write_results  # noqa: E402

SNIPPETS = [
    "def add(a, b):\n    return a + b\n",
    "def fib(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, x):\n        self.items.append(x)\n",
    "import os\n\nfor name in sorted(os.listdir('.')):\n    print(name)\n",
    "def is_prime(n):\n    if n < 2:\n        return False\n    return all(n % d for d in range(2, int(n ** 0.5) + 1))\n",
    "with open('data.csv') as f:\n    total = sum(float(line.split(',')[1]) for line in f)\nprint(total)\n",
    "def reverse_words(s):\n    return ' '.join(reversed(s.split()))\n",
    "squares = [x * x for x in range(10) if x % 2 == 0]\nprint(squares)\n",
    "def binary_search(xs, t):\n    lo, hi = 0, len(xs) - 1\n    while lo <= hi:\n        mid = (lo + hi) // 2\n"
    "        if xs[mid] == t:\n            return mid\n        lo, hi = (mid + 1, hi) if xs[mid] < t else (lo, mid - 1)\n"
    "    return -1\n",
    "def count_vowels(s):\n    return sum(c in 'aeiou' for c in s.lower())\n",
    "from collections import Counter\n\nwords = 'the cat and the hat'.split()\nprint(Counter(words).most_common(2))\n",
    "def gcd(a, b):\n    while b:\n        a, b = b, a % b\n    return a\n",
    "def flatten(xs):\n    for x in xs:\n        if isinstance(x, list):\n            yield from flatten(x)\n        else:\n            yield x\n",
    "import json\n\nconfig = json.loads('{\"lr\": 1e-6, \"steps\": 20}')\nprint(config['lr'])\n",
    "def merge(a, b):\n    out, i, j = [], 0, 0\n    while i < len(a) and j < len(b):\n"
    "        if a[i] <= b[j]:\n            out.append(a[i]); i += 1\n        else:\n            out.append(b[j]); j += 1\n"
    "    return out + a[i:] + b[j:]\n",
    "def test_add():\n    assert add(2, 3) == 5\n    assert add(-1, 1) == 0\n",
]


@dataclass
class StepResult:
    step: int
    unchanged: float
    codec_bytes: int
    ratio: float
    xor_zstd_ratio: float
    bound: float
    bound_conditioned: float
    encode_GBps_per_core: float
    apply_GBps_per_core: float
    encode_wall_GBps: float
    apply_wall_GBps: float
    xor_zstd_encode_GBps_per_core: float
    bit_exact: bool
    schemes: dict[str, int]
    zipnn_delta_ratio: float | None = None
    full_zstd_ratio: float | None = None
    zipnn_full_ratio: float | None = None


@dataclass
class ChainResult:
    model: str
    lr: float
    params: int
    model_bytes: int
    steps: list[StepResult] = field(default_factory=list)
    replay_digests_match: bool = False
    parallel: dict[str, float] = field(default_factory=dict)
    wall_s: float = 0.0

    def median(self, key: str) -> float:
        vals = [getattr(s, key) for s in self.steps[1:] if getattr(s, key) is not None]
        return statistics.median(vals) if vals else float("nan")


# ---------------------------------------------------------------- training


def serving_copy(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().to(torch.bfloat16) for n, p in model.named_parameters()}


def batches(tok: Any, batch: int, max_len: int) -> Iterator[dict[str, torch.Tensor]]:
    """Endless mini-batches of ``batch`` snippets, a different slice of the pool each step."""
    i = 0
    while True:
        texts = [SNIPPETS[(i + k) % len(SNIPPETS)] for k in range(batch)]
        i += batch
        enc = tok(texts, return_tensors="pt", padding=True, truncation=True, max_length=max_len)
        labels = enc["input_ids"].masked_fill(enc["attention_mask"] == 0, -100)
        yield {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"], "labels": labels}


def train_versions(
    cfg: ModelConfig, lr: float, steps: int, batch: int, max_len: int, threads: int
) -> Iterator[dict[str, torch.Tensor]]:
    """Version 0 (the loaded weights) and then the serving copy after each AdamW step."""
    torch.manual_seed(0)
    model, tok = load_model(cfg)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    data = batches(tok, batch, max_len)
    yield serving_copy(model)
    for _ in range(steps):
        torch.set_num_threads(threads)
        loss = model(**next(data)).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        yield serving_copy(model)


# ---------------------------------------------------------------- measurements


def timed(fn: Callable[[], Any]) -> tuple[Any, float, float]:
    """(result, thread CPU seconds, wall seconds) of ``fn()`` run on this thread."""
    c0, w0 = time.thread_time(), time.perf_counter()
    out = fn()
    return out, time.thread_time() - c0, time.perf_counter() - w0


def raw_bits(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().view(torch.int16).numpy()


def xor_zstd(prev: dict[str, torch.Tensor], cur: dict[str, torch.Tensor]) -> int:
    """Bytes of the XOR + zstd-1 delta, tensor by tensor."""
    z = zstandard.ZstdCompressor(level=1)
    return sum(len(z.compress(np.bitwise_xor(raw_bits(prev[k]), raw_bits(cur[k])))) for k in cur)


def full_zstd(cur: dict[str, torch.Tensor]) -> int:
    z = zstandard.ZstdCompressor(level=1)
    return sum(len(z.compress(raw_bits(t))) for t in cur.values())


def zipnn_status() -> tuple[bool, str]:
    try:
        import zipnn  # noqa: F401
    except ImportError:
        return False, "zipnn not installed (it declares torch as a dependency; install with pip --no-deps)"
    return True, (
        "zipnn 0.5.4 with bytearray_dtype='bfloat16' did not round-trip bf16 bytes here; measured with "
        "'float16' (the same 2-byte grouping), which does; its delta mode is XOR then Huffman"
    )


def zipnn_sizes(
    prev: dict[str, torch.Tensor], cur: dict[str, torch.Tensor], full: bool
) -> tuple[int, int | None]:
    """(XOR-delta bytes, full bytes or None) with ZipNN, each verified to round-trip."""
    from zipnn import ZipNN

    old = b"".join(raw_bits(prev[k]).tobytes() for k in cur)
    new = b"".join(raw_bits(cur[k]).tobytes() for k in cur)
    delta = ZipNN(input_format="byte", bytearray_dtype="float16", threads=1, delta_compressed_type="byte")
    blob = delta.compress(new, delta_second_data=old)
    if bytes(delta.decompress(blob, delta_second_data=old)) != new:
        raise RuntimeError("zipnn delta did not round-trip")
    if not full:
        return len(blob), None
    plain = ZipNN(input_format="byte", bytearray_dtype="float16", threads=1)
    whole = plain.compress(new)
    if bytes(plain.decompress(whole)) != new:
        raise RuntimeError("zipnn did not round-trip")
    return len(blob), len(whole)


def bits_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(a[k].view(torch.int16), b[k].view(torch.int16)) for k in b)


def measure_step(
    step: int,
    prev: dict[str, torch.Tensor],
    cur: dict[str, torch.Tensor],
    live: dict[str, torch.Tensor],
    heavy: bool,
    with_zipnn: bool,
    indexes: tuple[dict[str, MinorityIndex], dict[str, MinorityIndex]],
) -> tuple[StepResult, dict[str, bytes]]:
    """Ship ``prev -> cur`` with the codec (applied into ``live``, which holds ``prev``) and baselines.
    ``indexes``: the sender's and the receiver's minority indexes, carried along the chain as the
    publisher and a subscriber carry them."""
    raw = sum(t.numel() * 2 for t in cur.values())
    torch.set_num_threads(1)
    sent, received = indexes
    blobs, enc_cpu, enc_wall = timed(lambda: encode_state(prev, cur, workers=1, indexes=sent))
    _, app_cpu, app_wall = timed(lambda: decode_state(live, blobs, workers=1, out=live, indexes=received))
    xor_bytes, xor_cpu, _ = timed(lambda: xor_zstd(prev, cur))
    infos = [describe_blob(b) for b in blobs.values()]
    shipped = sum(i["total_bytes"] for i in infos)
    schemes: dict[str, int] = {}
    for i in infos:
        key = f"{i['pos_scheme']}/{i['val_scheme']}{'+split' if i['split_exp'] else ''}"
        schemes[key] = schemes.get(key, 0) + 1
    result = StepResult(
        step=step,
        unchanged=1 - sum(i["changed"] for i in infos) / (raw / 2),
        codec_bytes=shipped,
        ratio=raw / shipped,
        xor_zstd_ratio=raw / xor_bytes,
        bound=entropy_bound(prev, cur),
        bound_conditioned=entropy_bound(prev, cur, conditioned=True),
        encode_GBps_per_core=raw / enc_cpu / 1e9,
        apply_GBps_per_core=raw / app_cpu / 1e9,
        encode_wall_GBps=raw / enc_wall / 1e9,
        apply_wall_GBps=raw / app_wall / 1e9,
        xor_zstd_encode_GBps_per_core=raw / xor_cpu / 1e9,
        bit_exact=bits_equal(live, cur),
        schemes=schemes,
    )
    if heavy:
        result.full_zstd_ratio = raw / full_zstd(cur)
    if with_zipnn:
        delta, whole = zipnn_sizes(prev, cur, full=heavy)
        result.zipnn_delta_ratio = raw / delta
        result.zipnn_full_ratio = None if whole is None else raw / whole
    return result, blobs


def measure_parallel(
    prev: dict[str, torch.Tensor], cur: dict[str, torch.Tensor], workers: int
) -> dict[str, float]:
    """Wall-clock GB/s of encode_state / decode_state+apply with ``workers`` threads, and per core."""
    raw = sum(t.numel() * 2 for t in cur.values())
    live = {k: v.clone() for k, v in prev.items()}
    blobs, _, enc_wall = timed(lambda: encode_state(prev, cur, workers=workers))
    _, _, app_wall = timed(lambda: decode_state(live, blobs, workers=workers, out=live))
    if not bits_equal(live, cur):
        raise RuntimeError("parallel decode+apply is not bit-exact")
    return {
        "workers": workers,
        "encode_wall_GBps": raw / enc_wall / 1e9,
        "apply_wall_GBps": raw / app_wall / 1e9,
        "encode_wall_GBps_per_core": raw / enc_wall / 1e9 / workers,
        "apply_wall_GBps_per_core": raw / app_wall / 1e9 / workers,
    }


def run_chain(
    cfg: ModelConfig, name: str, lr: float, args: argparse.Namespace, with_zipnn: bool
) -> ChainResult:
    """Train ``args.steps`` steps at ``lr``, measuring every consecutive pair, then replay the chain."""
    t0 = time.perf_counter()
    versions = train_versions(cfg, lr, args.steps, args.batch, args.max_len, args.threads)
    first = next(versions)
    origin = {k: v.clone() for k, v in first.items()}
    live = {k: v.clone() for k, v in first.items()}
    chain = ChainResult(
        name, lr, sum(t.numel() for t in first.values()), sum(t.numel() * 2 for t in first.values())
    )
    prev, all_blobs, before = first, [], first
    indexes: tuple[dict[str, MinorityIndex], dict[str, MinorityIndex]] = ({}, {})
    for step, cur in enumerate(versions, start=1):
        heavy = step in (1, args.steps)
        zipnn_now = with_zipnn and (heavy or (step % 5 == 0 and not args.quick))
        result, blobs = measure_step(step, prev, cur, live, heavy, zipnn_now, indexes)
        chain.steps.append(result)
        all_blobs.append(blobs)
        before, prev = prev, cur
    for blobs in all_blobs:
        decode_state(origin, blobs, workers=args.workers, out=origin)
    chain.replay_digests_match = {k: tensor_digest(v) for k, v in origin.items()} == {
        k: tensor_digest(v) for k, v in prev.items()
    }
    chain.parallel = measure_parallel(before, prev, args.workers)
    chain.wall_s = time.perf_counter() - t0
    return chain


# ---------------------------------------------------------------- report


def fmt(x: float | None, digits: int = 1) -> str:
    return "-" if x is None or x != x else f"{x:,.{digits}f}"


def step_table(chain: ChainResult) -> Table:
    table = Table(
        title=f"{chain.model}, AdamW lr {chain.lr:g}: per step ({chain.model_bytes / 1e6:.0f} MB bf16)"
    )
    cols = ["step", "unchanged %", "codec x", "XOR+zstd x", "ZipNN delta x", "bound x", "bound|exp x"]
    cols += ["enc GB/s/core", "apply GB/s/core", "exact", "schemes"]
    for c in cols:
        table.add_column(c, justify="left" if c == "schemes" else "right")
    for s in chain.steps:
        schemes = ", ".join(f"{k}:{v}" for k, v in sorted(s.schemes.items(), key=lambda kv: -kv[1])[:3])
        table.add_row(
            str(s.step),
            f"{100 * s.unchanged:.3f}",
            fmt(s.ratio),
            fmt(s.xor_zstd_ratio),
            fmt(s.zipnn_delta_ratio, 2),
            fmt(s.bound),
            fmt(s.bound_conditioned),
            fmt(s.encode_GBps_per_core, 2),
            fmt(s.apply_GBps_per_core, 2),
            "yes" if s.bit_exact else "NO",
            schemes,
        )
    return table


def summary_table(chains: list[ChainResult]) -> Table:
    workers = chains[0].parallel.get("workers", 1) if chains else 1
    table = Table(
        title=f"Summary: step 1 and chain medians over steps 2..N (parallel = last step, {workers} threads, wall)"
    )
    cols = ["model", "lr", "steps", "step-1 x", "codec x", "XOR+zstd x", "codec/XOR", "ZipNN delta x"]
    cols += ["full zstd x", "ZipNN full x", "bound x", "bound|exp x", "unchanged %", "enc GB/s/core"]
    cols += ["apply GB/s/core", "enc wall GB/s", "apply wall GB/s", "parallel enc/apply", "replay ok"]
    for c in cols:
        table.add_column(c, justify="left" if c == "model" else "right")
    for c in chains:
        full = [s.full_zstd_ratio for s in c.steps if s.full_zstd_ratio]
        zfull = [s.zipnn_full_ratio for s in c.steps if s.zipnn_full_ratio]
        table.add_row(
            c.model,
            f"{c.lr:g}",
            str(len(c.steps)),
            fmt(c.steps[0].ratio),
            fmt(c.median("ratio")),
            fmt(c.median("xor_zstd_ratio")),
            fmt(c.median("ratio") / c.median("xor_zstd_ratio"), 2),
            fmt(c.median("zipnn_delta_ratio"), 2),
            fmt(statistics.median(full), 2) if full else "-",
            fmt(statistics.median(zfull), 2) if zfull else "-",
            fmt(c.median("bound")),
            fmt(c.median("bound_conditioned")),
            f"{100 * c.median('unchanged'):.3f}",
            fmt(c.median("encode_GBps_per_core"), 2),
            fmt(c.median("apply_GBps_per_core"), 2),
            fmt(c.median("encode_wall_GBps"), 2),
            fmt(c.median("apply_wall_GBps"), 2),
            f"{fmt(c.parallel['encode_wall_GBps'], 2)} / {fmt(c.parallel['apply_wall_GBps'], 2)}",
            "yes" if c.replay_digests_match and all(s.bit_exact for s in c.steps) else "NO",
        )
    return table


TARGETS = [
    ("ratio_lr1e-6", 100.0, "codec ratio at lr 1e-6 (chain median)"),
    ("codec_over_xor_lr1e-6", 1.5, "codec ratio / XOR+zstd ratio at lr 1e-6"),
    ("ratio_lr1e-5", 20.0, "codec ratio at lr 1e-5 (chain median)"),
    ("encode_GBps_per_core", 1.0, "encode GB/s per core at lr 1e-6"),
    ("decode_apply_GBps_per_core", 2.0, "decode+apply GB/s per core at lr 1e-6"),
]


def lr_tag(lr: float) -> str:
    """``1e-06`` -> ``1e-6`` (the JSON keys' spelling)."""
    return re.sub(r"e([+-])0*(\d)", r"e\1\2", f"{lr:g}")


def headline(chains: list[ChainResult], model: str) -> dict[str, Any]:
    """The JSON's top-level figures for ``model``: chain medians (steps 2..N) and step-1 values."""
    by_lr = {lr_tag(c.lr): c for c in chains if c.model == model}
    out: dict[str, Any] = {"model": model, "step1": {}}
    for lr, c in by_lr.items():
        s1 = c.steps[0]
        out[f"ratio_lr{lr}"] = c.median("ratio")
        out[f"xor_zstd_ratio_lr{lr}"] = c.median("xor_zstd_ratio")
        out[f"codec_over_xor_lr{lr}"] = c.median("ratio") / c.median("xor_zstd_ratio")
        out[f"entropy_bound_lr{lr}"] = c.median("bound")
        out[f"entropy_bound_conditioned_lr{lr}"] = c.median("bound_conditioned")
        out[f"zipnn_delta_ratio_lr{lr}"] = c.median("zipnn_delta_ratio")
        out[f"unchanged_lr{lr}"] = c.median("unchanged")
        out[f"encode_GBps_per_core_lr{lr}"] = c.median("encode_GBps_per_core")
        out[f"decode_apply_GBps_per_core_lr{lr}"] = c.median("apply_GBps_per_core")
        out[f"parallel_lr{lr}"] = c.parallel
        out["step1"].update(
            {
                f"ratio_lr{lr}": s1.ratio,
                f"xor_zstd_ratio_lr{lr}": s1.xor_zstd_ratio,
                f"entropy_bound_lr{lr}": s1.bound,
                f"unchanged_lr{lr}": s1.unchanged,
                f"encode_GBps_per_core_lr{lr}": s1.encode_GBps_per_core,
                f"decode_apply_GBps_per_core_lr{lr}": s1.apply_GBps_per_core,
            }
        )
    out["encode_GBps_per_core"] = out.get("encode_GBps_per_core_lr1e-6", float("nan"))
    out["decode_apply_GBps_per_core"] = out.get("decode_apply_GBps_per_core_lr1e-6", float("nan"))
    full = [s.full_zstd_ratio for c in by_lr.values() for s in c.steps if s.full_zstd_ratio]
    zfull = [s.zipnn_full_ratio for c in by_lr.values() for s in c.steps if s.zipnn_full_ratio]
    out["full_zstd_ratio"] = statistics.median(full) if full else None
    out["zipnn_full_ratio"] = statistics.median(zfull) if zfull else None
    return out


def check_targets(head: dict[str, Any], console: Console) -> dict[str, Any]:
    verdicts = {}
    for key, target, what in TARGETS:
        got = head.get(key, float("nan"))
        met = got >= target
        verdicts[key] = {"target": target, "measured": round(got, 3), "met": met}
        note = "met" if met else f"MISSED by {target - got:.3g} ({100 * (1 - got / target):.0f}% short)"
        console.print(f"  {what}: {got:.2f} (target >= {target:g}) -> {note}")
    return verdicts


def rounded(x: Any) -> Any:
    if isinstance(x, float):
        return round(x, 4) if x == x else None
    if isinstance(x, dict):
        return {k: rounded(v) for k, v in x.items()}
    if isinstance(x, list):
        return [rounded(v) for v in x]
    return x


def _args() -> argparse.Namespace:
    ap = parser(__doc__)
    ap.add_argument("--steps", type=int, default=None, help="optimizer steps per chain (default 20, quick 5)")
    ap.add_argument("--batch", type=int, default=2, help="snippets per step")
    ap.add_argument("--max-len", type=int, default=64, help="tokens per snippet")
    ap.add_argument("--lrs", default="1e-6,1e-5", help="comma-separated learning rates")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch threads for training")
    ap.add_argument(
        "--workers", type=int, default=os.cpu_count() or 1, help="codec threads for the parallel measurement"
    )
    ap.add_argument("--no-zipnn", action="store_true", help="skip the ZipNN baseline")
    args = ap.parse_args()
    args.steps = args.steps or (5 if args.quick else 20)
    if args.steps < 2 or min(args.batch, args.threads, args.workers) < 1 or args.max_len < 2:
        raise ValueError("--steps and --max-len must be >= 2; --batch, --threads and --workers >= 1")
    return args


def main() -> None:
    args = _args()
    zipnn_ok, zipnn_note = zipnn_status()
    with_zipnn = zipnn_ok and not args.no_zipnn
    models = [("tiny-dense", ModelConfig(source="tiny")) if args.quick else ("SmolLM2-135M", ModelConfig())]
    models.append(("tiny-moe", ModelConfig(source="tiny", tiny="moe")))
    console = Console(width=None if Console().is_terminal else 200)
    console.print(f"ZipNN: {'measured' if with_zipnn else 'skipped'} - {zipnn_note}")
    chains = []
    for name, cfg in models:
        for lr in (float(x) for x in args.lrs.split(",")):
            chains.append(run_chain(cfg, name, lr, args, with_zipnn))
            console.print(step_table(chains[-1]))
    console.print(summary_table(chains))
    head = headline(chains, models[0][0])
    scope = (
        "quick mode: tiny random models; the targets are set for SmolLM2" if args.quick else "SmolLM2-135M"
    )
    console.print(f"Targets ({scope}):")
    result = {
        **head,
        "targets": check_targets(head, console),
        "zipnn": {"measured": with_zipnn, "note": zipnn_note},
        "other_models": {name: headline(chains, name) for name, _ in models[1:]},
        "chains": [asdict(c) for c in chains],
        "config": {k: getattr(args, k) for k in ("steps", "batch", "max_len", "lrs", "threads", "workers")},
        "speed_note": "GB/s per core = bf16 model bytes / CPU seconds of the single thread doing the work "
        "(workers=1); apply = decode into the live tensors in place",
        "versions": f"numpy {np.__version__}, zstandard {zstandard.__version__}; load avg {os.getloadavg()[0]:.1f}",
    }
    write_results(args, "weight_codec", rounded(result))


if __name__ == "__main__":
    main()
