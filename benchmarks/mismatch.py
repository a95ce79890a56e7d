"""Benchmark: sampler/trainer mismatch of a tiny MoE with and without router replay, a dense
model beside it, by sampler precision (plain bf16, bf16 with an fp32 LM head, ...), and the cost of
the engine's deterministic (batch-invariant) mode and of the fp32 head.

Contract: the tiny Qwen3-MoE (``model.tiny = "moe"``: 4 MoE layers, 8 experts, top-2) and the
tiny dense Llama of similar size (``"dense"``) are first trained briefly (AdamW, next-token loss
on Python standard-library source, plus the MoE load-balancing loss) so routing is not trivial
(expert-usage entropy reported). Then each sampler variant (:data:`SAMPLERS`: plain bf16; bf16
with the final norm + LM head in fp32, :func:`~shipyard.models.precision.cast_for_sampling`; the
same plus fp32 routers; bf16-rounded weights computed in fp32; fp32) samples continuations of
held-out source prompts through :class:`~shipyard.inference.engine.engine.EmbeddedEngine` (temperature
1), the requests shuffled into batches of random sizes (varied batch composition, left padding),
with per-token logprobs μ and, for the MoE, the routes of every forwarded token. The fp32 trainer
recomputes π_old of the sampled tokens (:func:`~shipyard.trainer.logprobs.token_logprobs`):
without replay (its own routing, compared with the sampler's) and with the sampler's routes
replayed through :class:`~shipyard.models.router_replay.RouterSeam`; every variant goes through
both arms and the dense model alike. Reported (the same
:class:`~shipyard.trainer.mismatch.MismatchAccumulator` the trainer logs): k3 and k1 mismatch
KL, |Δp|, routing disagreement (fraction of the sampler's expert choices the trainer's forward
used differently; per layer; tokens with any difference), and for the dense model the same k3.
The required keys (``moe_k3_no_replay`` ...) are those of the sampler the config defaults to
(``inference.fp32_lm_head``; named in ``headline_sampler``), every variant's under its prefix
(``plain_bf16_``, ``fp32head_``, ``fp32head_router_``, ``bf16weights_``, ``fp32_sampler_``).
Breakdown (``--breakdown``, MoE): on top of the fp32 head, attention / MoE blocks / all decoder
submodules also in fp32 (:data:`BREAKDOWN`), to show what the rest of the mismatch is made of.
Cost of the fp32 head (full runs): generated tokens/s of the bf16 engines with and without it (wall and CPU
seconds), on the tiny models and on SmolLM2-135M-Instruct (``--smollm2 N`` prompts, which also
gives that real model's k3 with and without the fp32 head).
Deterministic mode: the same request set generated batched and with ``deterministic=True``,
wall-clock ratio, plus a bit-exactness check of one request across batch compositions.

Writes ``benchmarks/results/mismatch.json`` with ``moe_k3_no_replay``, ``moe_k3_replay``,
``moe_routing_disagreement_no_replay``, ``moe_routing_disagreement_replay``, ``dense_k3``,
``deterministic_slowdown``, the variants' figures, ``*_tokens_per_s_ratio`` (fp32 head / plain)
and the details; prints rich tables.

Routing sweep (``--sweep``, writes ``benchmarks/results/mismatch_sweep.json`` instead): the tiny
MoE with each router shape of :data:`SWEEP_SHAPES` (top-1 of 8, top-2 of 8, top-8 of 64, top-4 of
32, the same active MLP width), trained the same steps, sampled by the fp32-head and plain bf16
samplers; k3 without/with replay, the reduction with a 95% bootstrap interval over requests, routing
disagreement, and k3 split by whether the position predicting a token was routed differently by the
trainer (:func:`flip_split`): what a flip costs, and how much of the mismatch flips carry.
``--sweep-layers 4,8,16`` and ``--sweep-hidden 128,256`` repeat each shape at other depths (every
layer an MoE layer) and widths: how the reduction moves as the model grows. ``--model-path DIR``
scores a pretrained MoE checkpoint instead (not trained here; its own tokenizer).

Limits: CPU here (``--device cuda`` for a GPU run, recorded with its name); tiny models, so
absolute figures are small-model figures; the timings share the machine with other work.

Usage::

    .venv/bin/python benchmarks/mismatch.py            # 200 training steps, 48 samples per model, all
    .venv/bin/python benchmarks/mismatch.py --quick    # 20 steps, 8 samples, 3 samplers, no breakdown
    .venv/bin/python benchmarks/mismatch.py --sweep    # router-shape sweep, 300 steps, 64 x 32 tokens
    .venv/bin/python benchmarks/mismatch.py --sweep --quick  # 3 shapes, 50 steps, 16 x 16 tokens
    .venv/bin/python benchmarks/mismatch.py --sweep --shapes e8_k2 --sweep-layers 4,8,16  # by depth
    .venv/bin/python benchmarks/mismatch.py --sweep --model-path DIR --device cuda  # a real MoE
"""

from __future__ import annotations

import argparse
import copy
import itertools
import json
import math
import os
import platform
import random
import sys
import sysconfig
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table
from torch import Tensor

from shipyard.config.schema import InferenceConfig, ModelConfig
from shipyard.inference.engine.engine import EmbeddedEngine
from shipyard.inference.types import GenerateRequest, GenerateResult, SamplingParams
from shipyard.models.loading import load_model
from shipyard.models.precision import cast_for_sampling
from shipyard.models.router_replay import RouterSeam, moe_routers, route_mismatch, route_plan
from shipyard.trainer.corrections import no_correction
from shipyard.trainer.logprobs import pad_batch, pad_floats, pad_ints, token_logprobs
from shipyard.trainer.mismatch import MismatchAccumulator

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import machine  # noqa: E402

TRAIN_FILES = ("textwrap.py", "functools.py", "heapq.py", "bisect.py", "fractions.py", "shlex.py")
HELDOUT_FILES = ("statistics.py", "colorsys.py")


def corpus_ids(tok: Any, names: tuple[str, ...]) -> list[int]:
    """SmolLM2 token ids of standard-library source files (real code, always on disk)."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    text = "\n".join((stdlib / n).read_text(encoding="utf-8") for n in names)
    return tok(text, add_special_tokens=False).input_ids


def compact_vocab(train: list[int], heldout: list[int], size: int) -> tuple[list[int], list[int]]:
    """Map token ids onto ``[0, size)`` by corpus frequency (ids 0-2 stay specials, rare ids -> 3).

    A 49k-entry LM head would dominate a tiny model's CPU time; the compact vocabulary keeps the
    benchmark about the decoder, where routing and its mismatch live.
    """
    counts: dict[int, int] = {}
    for t in train:
        counts[t] = counts.get(t, 0) + 1
    ranked = [t for t, _ in sorted(counts.items(), key=lambda kv: -kv[1]) if t > 2][: size - 4]
    table = {t: i + 4 for i, t in enumerate(ranked)}
    return [table.get(t, 3) for t in train], [table.get(t, 3) for t in heldout]


def bench_model(
    kind: str,
    vocab: int,
    seed: int,
    shape: tuple[int, int, int, bool] = (8, 2, 64, True),
    layers: int = 4,
    hidden: int = 128,
) -> Any:
    """The benchmark's tiny models: 4 layers, hidden 128; MoE 8 experts top-2 of width 64 in every
    layer (Qwen3-MoE), dense MLP of width 128 (Llama): the same active MLP width per token.
    ``shape`` = (experts, top-k, expert width at hidden 128, ``norm_topk_prob``) of the MoE,
    ``layers`` its depth and ``hidden`` its width (the sweep's; expert and head widths scale with
    it, 4 attention heads)."""
    from transformers import AutoModelForCausalLM

    from shipyard.models.loading import tiny_config

    cfg = tiny_config(kind, vocab)
    cfg.hidden_size, cfg.num_hidden_layers, cfg.intermediate_size = hidden, layers, hidden
    if kind == "moe":
        experts, top_k, width, norm = shape
        cfg.num_experts, cfg.num_experts_per_tok, cfg.norm_topk_prob = experts, top_k, norm
        cfg.moe_intermediate_size = width * hidden // 128
        cfg.head_dim = hidden // 4
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)


def train_briefly(model: Any, ids: list[int], steps: int, seq: int, batch: int, seed: int) -> list[float]:
    """AdamW next-token training on random windows of ``ids`` (+ MoE load balancing); losses."""
    model.train()
    if moe_routers(model):
        model.config.output_router_logits = True  # adds router_aux_loss_coef * load-balancing loss
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    rng = random.Random(seed)
    data = torch.tensor(ids)
    losses = []
    for _ in range(steps):
        starts = [rng.randrange(0, len(ids) - seq - 1) for _ in range(batch)]
        x_BT = torch.stack([data[s : s + seq] for s in starts])
        loss = model(input_ids=x_BT, labels=x_BT).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
    model.config.output_router_logits = False
    return losses


def expert_entropy(model: Any, ids: list[int]) -> float:
    """Mean over MoE layers of the entropy (bits) of expert usage on ``ids`` (3 bits = uniform over 8)."""
    seam = RouterSeam(model)
    seam.record = True
    try:
        with torch.no_grad():
            model(input_ids=torch.tensor([ids[:512]], device=next(model.parameters()).device))
        ents = []
        for used_NK in seam.recorded:
            assert used_NK is not None
            counts = torch.bincount(used_NK.flatten().long(), minlength=seam.num_experts).double()
            p = counts / counts.sum()
            ents.append(float(-(p[p > 0] * p[p > 0].log2()).sum()))
        return sum(ents) / len(ents)
    finally:
        seam.remove()


def make_requests(ids: list[int], n: int, max_tokens: int, seed: int) -> list[GenerateRequest]:
    """``n`` held-out prompts of 8..64 tokens, temperature 1, seeded per request."""
    rng = random.Random(seed)
    reqs = []
    for i in range(n):
        length = rng.randint(8, 64)
        start = rng.randrange(0, len(ids) - length)
        params = SamplingParams(temperature=1.0, max_tokens=max_tokens, seed=seed * 1000 + i)
        reqs.append(GenerateRequest(ids[start : start + length], params))
    return reqs


def sample_varied(engine: EmbeddedEngine, reqs: list[GenerateRequest], seed: int) -> list[GenerateResult]:
    """Generate ``reqs`` shuffled into batches of random sizes 1..8; results in request order."""
    rng = random.Random(seed)
    order = list(range(len(reqs)))
    rng.shuffle(order)
    out: dict[int, GenerateResult] = {}
    pos = 0
    while pos < len(order):
        size = rng.randint(1, 8)
        chunk = order[pos : pos + size]
        engine.max_batch = len(chunk)
        for i, res in zip(chunk, engine.generate([reqs[i] for i in chunk]), strict=True):
            out[i] = res
        pos += size
    return [out[i] for i in range(len(reqs))]


def micro_batches(
    reqs: list[GenerateRequest], results: list[GenerateResult], micro: int
) -> Iterator[tuple[list[GenerateResult], Tensor, Tensor, Tensor, Tensor]]:
    """Right-padded trainer batches of ``micro`` sampled sequences: ``(results, ids_BT, attn_BT,
    mask_BT, mu_BT)``, the mask on the sampled tokens, μ the sampler's logprobs there."""
    for s in range(0, len(reqs), micro):
        rq, rs = reqs[s : s + micro], results[s : s + micro]
        pairs = list(zip(rq, rs, strict=True))
        ids_BT, attn_BT = pad_batch([q.prompt_ids + r.token_ids for q, r in pairs], pad_id=0)
        mask_BT = pad_ints([[0] * len(q.prompt_ids) + [1] * len(r.token_ids) for q, r in pairs]) == 1
        mu_BT = pad_floats([[0.0] * len(q.prompt_ids) + r.logprobs for q, r in pairs])
        yield rs, ids_BT, attn_BT, mask_BT, mu_BT


def recompute(model: Any, ids_BT: Tensor, attn_BT: Tensor, mask_BT: Tensor) -> Tensor:
    """The fp32 trainer's logprobs of a CPU micro-batch, computed on the model's device, on the CPU."""
    dev = next(model.parameters()).device
    return token_logprobs(model, ids_BT.to(dev), attn_BT.to(dev), score_mask_BT=mask_BT.to(dev)).cpu()


def trainer_mismatch(
    model: Any,
    reqs: list[GenerateRequest],
    results: list[GenerateResult],
    replay: bool | None,
    micro: int = 8,
) -> dict[str, float]:
    """Mismatch of the fp32 trainer's recompute against the sampler: ``replay`` None = dense (no seam)."""
    seam = RouterSeam(model) if replay is not None else None
    acc = MismatchAccumulator()
    try:
        for rs, ids_BT, attn_BT, mask_BT, mu_BT in micro_batches(reqs, results, micro):
            with torch.no_grad():
                if seam is None:
                    old_BT = recompute(model, ids_BT, attn_BT, mask_BT)
                else:
                    with seam.plan(
                        route_plan([r.routes for r in rs], ids_BT.shape[1], seam), replay=bool(replay)
                    ):
                        old_BT = recompute(model, ids_BT, attn_BT, mask_BT)
            acc.add(old_BT, mu_BT, mask_BT, no_correction(old_BT - mu_BT, mask_BT))
        out = acc.result()
        if seam is not None:
            out.update(seam.disagreement())
        return out
    finally:
        if seam is not None:
            seam.remove()


def deterministic_cost(
    engine: EmbeddedEngine, reqs: list[GenerateRequest], rounds: int = 3
) -> dict[str, Any]:
    """Wall clock of ``reqs`` batched (max_batch 8) vs deterministic, best of ``rounds`` alternating
    rounds (the machine is shared), and bit-exactness of one request across batch compositions."""
    times: dict[bool, list[float]] = {False: [], True: []}
    engine.generate(reqs[:2])  # warm-up
    for _ in range(rounds):
        for det in (False, True):
            engine.deterministic, engine.max_batch = det, 8
            t0 = time.perf_counter()
            engine.generate(reqs)
            times[det].append(time.perf_counter() - t0)
    exact = {}
    for det in (False, True):
        engine.deterministic, engine.max_batch = det, 8
        [alone] = engine.generate([reqs[0]])
        sizes = [k for k in (1, 3, 7) if k < len(reqs)]  # others sharing the batch
        mixed = [engine.generate(reqs[1 : 1 + k] + [reqs[0]])[k] for k in sizes]
        exact[det] = all(m.logprobs == alone.logprobs for m in mixed)
    engine.deterministic = False
    return {
        "batched_s": min(times[False]),
        "deterministic_s": min(times[True]),
        "slowdown": min(times[True]) / min(times[False]),
        "rounds_s": {"batched": times[False], "deterministic": times[True]},
        "bit_identical_across_batches_batched": exact[False],
        "bit_identical_across_batches_deterministic": exact[True],
    }


SAMPLERS: dict[str, tuple[str, str]] = {
    "": ("bf16", "bf16 (plain)"),
    "fp32head_": ("bf16", "bf16, fp32 head"),
    "fp32head_router_": ("bf16", "bf16, fp32 head + router"),
    "bf16weights_": ("fp32", "bf16 weights, fp32 compute"),
    "fp32_sampler_": ("fp32", "fp32"),
}
"""Sampler variants, by the key prefix of their results: (compute dtype, table label). The same
requests are sampled by each and every one is compared with the same fp32 trainer, in every arm
(MoE without and with replay, dense). ``bf16weights_`` is a decomposition, not a product option:
the sampler's weights rounded to bf16 but every op in fp32 (how much of the gap is weight rounding)."""

QUICK_SAMPLERS = ("", "fp32head_", "fp32_sampler_")


def sampler_model(model: Any, prefix: str) -> Any:
    """A copy of the fp32 ``model`` as sampler variant ``prefix`` (:data:`SAMPLERS`)."""
    copied = copy.deepcopy(model)
    if prefix == "bf16weights_":
        return copied.to(torch.bfloat16).float()
    dtype = torch.float32 if prefix == "fp32_sampler_" else torch.bfloat16
    router = prefix == "fp32head_router_"
    cast_for_sampling(copied, dtype, fp32_head=prefix.startswith("fp32head"), fp32_router=router)
    return copied


BREAKDOWN: dict[str, tuple[str, ...]] = {
    "head+attn": ("self_attn",),
    "head+mlp": ("mlp",),
    "head+attn+mlp+norms": ("self_attn", "mlp", "input_layernorm", "post_attention_layernorm"),
}
"""Decomposition of what the fp32-head sampler still gets wrong: on top of the fp32 head, these
decoder submodules (by attribute name in every layer; ``mlp`` is the MoE block, router included)
also run in fp32 with their full fp32 weights. The residual stream between them stays bf16; the
last entry leaves only it (and the bf16 rotary cos/sin) in bf16."""


def _floats_to(value: Any, dtype: torch.dtype) -> Any:
    if torch.is_tensor(value) and value.is_floating_point():
        return value.to(dtype)
    if isinstance(value, tuple):
        return tuple(_floats_to(v, dtype) for v in value)
    return value


def lifted_sampler(model: Any, names: tuple[str, ...]) -> Any:
    """A bf16, fp32-head copy of the fp32 ``model`` whose decoder submodules ``names`` run in fp32
    (inputs cast up, outputs cast back to bf16): a benchmark-only decomposition, see BREAKDOWN."""
    copied = copy.deepcopy(model)
    lifted = [m for layer in copied.model.layers for n in names if (m := getattr(layer, n, None)) is not None]
    kept = {
        id(t): (t, t.data) for m in lifted for t in [*m.parameters(), *m.buffers()] if t.is_floating_point()
    }
    cast_for_sampling(copied, torch.bfloat16, fp32_head=True)
    for tensor, data in kept.values():
        tensor.data = data
    for m in lifted:
        m.register_forward_pre_hook(
            lambda _m, args, kwargs: (
                _floats_to(args, torch.float32),
                {k: _floats_to(v, torch.float32) for k, v in kwargs.items()},
            ),
            with_kwargs=True,
        )
        m.register_forward_hook(lambda _m, _args, output: _floats_to(output, torch.bfloat16))
    return copied


def breakdown(model: Any, tok: Any, reqs: list[GenerateRequest], seed: int) -> dict[str, Any]:
    """Mismatch of each BREAKDOWN sampler against the fp32 trainer, without and with replay (MoE)."""
    out: dict[str, Any] = {}
    for label, names in BREAKDOWN.items():
        engine = EmbeddedEngine(lifted_sampler(model, names), tok, max_batch=8)
        results = sample_varied(engine, reqs, seed)
        moe = bool(moe_routers(model))
        out[label] = {
            "no_replay": trainer_mismatch(model, reqs, results, replay=False if moe else None),
            **({"replay": trainer_mismatch(model, reqs, results, replay=True)} if moe else {}),
        }
    return out


def sampler_throughput(
    engines: dict[str, EmbeddedEngine], reqs: list[GenerateRequest], rounds: int = 5
) -> dict[str, Any]:
    """Generated tokens per second of each engine on ``reqs`` (batched, max_batch 8), best of
    ``rounds`` alternating rounds, by wall clock and by this process's CPU time (the machine is
    shared: CPU seconds are far less disturbed by other jobs than wall seconds)."""
    wall: dict[str, list[float]] = {k: [] for k in engines}
    cpu: dict[str, list[float]] = {k: [] for k in engines}
    tokens: dict[str, int] = {}
    for engine in engines.values():
        engine.max_batch = 8
        engine.generate(reqs[:2])  # warm-up
    for _ in range(rounds):
        for name, engine in engines.items():
            t0, c0 = time.perf_counter(), time.process_time()
            results = engine.generate(reqs)
            wall[name].append(time.perf_counter() - t0)
            cpu[name].append(time.process_time() - c0)
            tokens[name] = sum(len(r.token_ids) for r in results)
    return {
        "tokens_per_s": {name: tokens[name] / min(wall[name]) for name in engines},
        "tokens_per_cpu_s": {name: tokens[name] / min(cpu[name]) for name in engines},
        "tokens": tokens,
        "rounds_wall_s": wall,
        "rounds_cpu_s": cpu,
    }


def smollm2_figures(args: argparse.Namespace, console: Console) -> dict[str, Any]:
    """The fp32 head on a real model: SmolLM2-135M-Instruct (49k vocabulary, tied embeddings), bf16
    sampler with and without the fp32 head vs the fp32 trainer on held-out source prompts, and the
    sampler's tokens/s either way."""
    model, tok = load_model(ModelConfig(source="smollm2"))
    model.eval().to(args.device)
    reqs = make_requests(corpus_ids(tok, HELDOUT_FILES), args.smollm2, args.max_tokens, args.seed)
    out: dict[str, Any] = {}
    engines: dict[str, EmbeddedEngine] = {}
    for prefix in ("", "fp32head_"):
        engines[prefix] = EmbeddedEngine(sampler_model(model, prefix), tok, max_batch=8)
        results = sample_varied(engines[prefix], reqs, args.seed)
        out[f"{prefix}no_replay"] = trainer_mismatch(model, reqs, results, replay=None)
        out[f"{prefix}sampled_tokens"] = sum(len(r.token_ids) for r in results)
    out["throughput"] = sampler_throughput(engines, reqs[:8], rounds=3)
    console.print(f"smollm2: {out['sampled_tokens']} tokens sampled per sampler")
    return out


def run_model(kind: str, args: argparse.Namespace, console: Console) -> dict[str, Any]:
    """Train, sample with varied batches by every sampler variant, recompute in fp32 (with and
    without replay for the MoE); deterministic-mode cost and fp32-head cost on the bf16 sampler."""
    _, tok = load_model(ModelConfig(source="tiny", tiny="dense"))
    train, heldout = compact_vocab(corpus_ids(tok, TRAIN_FILES), corpus_ids(tok, HELDOUT_FILES), args.vocab)
    model = bench_model(kind, args.vocab, args.seed)
    t0 = time.perf_counter()
    losses = train_briefly(model, train, args.steps, 128, 8, args.seed)
    model.eval().to(args.device)
    out: dict[str, Any] = {
        "params": sum(p.numel() for p in model.parameters()),
        "train_steps": args.steps,
        "train_loss_first_last": [losses[0], sum(losses[-10:]) / len(losses[-10:])],
        "train_s": time.perf_counter() - t0,
    }
    moe = bool(moe_routers(model))
    if moe:
        out["expert_usage_entropy_bits"] = expert_entropy(model, heldout)
    reqs = make_requests(heldout, args.samples, args.max_tokens, args.seed)
    engines: dict[str, EmbeddedEngine] = {}
    for prefix in args.samplers:
        if prefix == "fp32head_router_" and not moe:
            continue  # a dense model has no router: the same as fp32head_
        engine = EmbeddedEngine(sampler_model(model, prefix), tok, max_batch=8)
        results = sample_varied(engine, reqs, args.seed)
        out[f"{prefix}sampled_tokens"] = sum(len(r.token_ids) for r in results)
        if moe:
            out[f"{prefix}no_replay"] = trainer_mismatch(model, reqs, results, replay=False)
            out[f"{prefix}replay"] = trainer_mismatch(model, reqs, results, replay=True)
        else:
            out[f"{prefix}no_replay"] = trainer_mismatch(model, reqs, results, replay=None)
        if SAMPLERS[prefix][0] == "bf16":
            engines[prefix] = engine
    if args.breakdown and moe:
        out["breakdown"] = breakdown(model, tok, reqs, args.seed)
    out["deterministic"] = deterministic_cost(engines[""], reqs[: args.det_samples])
    if not args.quick:  # the fp32 head's cost: full runs only (--quick stays under a minute)
        out["throughput"] = sampler_throughput(engines, reqs[: args.det_samples])
    console.print(
        f"{kind}: trained {args.steps} steps in {out['train_s']:.1f}s, {out['sampled_tokens']} tokens sampled"
    )
    return out


def table(moe: dict[str, Any], dense: dict[str, Any]) -> Table:
    t = Table(title="Sampler (varied batches) vs trainer (fp32) mismatch, by sampler precision")
    cols = (
        "sampler",
        "model",
        "k3 mean",
        "k3 p99",
        "k1 mean",
        "max |Δp|",
        "routing disagree",
        "tokens any-layer",
    )
    for col in cols:
        t.add_column(col, justify="right")
    for prefix, (_, label) in SAMPLERS.items():
        rows = [
            ("MoE, no replay", moe.get(f"{prefix}no_replay")),
            ("MoE, replay", moe.get(f"{prefix}replay")),
        ]
        rows.append(("dense", dense.get(f"{prefix}no_replay")))
        for name, m in rows:
            if m is None:
                continue
            dis, tok_any = m.get("route_disagree"), m.get("route_token_disagree")
            t.add_row(
                label,
                name,
                f"{m['k3']:.3e}",
                f"{m['k3_p99']:.3e}",
                f"{m['k1']:.3e}",
                f"{m['max_abs_dp']:.3f}",
                "-" if dis is None else f"{dis:.4f}",
                "-" if tok_any is None else f"{tok_any:.3f}",
            )
    return t


def breakdown_table(moe: dict[str, Any], dense: dict[str, Any]) -> Table:
    t = Table(title="What the fp32-head sampler's mismatch is made of: decoder parts lifted to fp32 too")
    for col in ("sampler", "MoE no replay k3", "MoE replay k3", "dense k3", "MoE routing disagree"):
        t.add_column(col, justify="right")
    rows: dict[str, tuple[dict[str, Any], dict[str, Any], dict[str, Any] | None]] = {}
    for prefix in ("", "fp32head_", "fp32head_router_"):
        if f"{prefix}no_replay" in moe:
            rows[SAMPLERS[prefix][1]] = (
                moe[f"{prefix}no_replay"],
                moe[f"{prefix}replay"],
                dense.get(f"{prefix}no_replay"),
            )
    for label, m in moe.get("breakdown", {}).items():
        rows[f"bf16, fp32 {label}"] = (m["no_replay"], m["replay"], None)
    for prefix in ("bf16weights_", "fp32_sampler_"):
        if f"{prefix}no_replay" in moe:
            rows[SAMPLERS[prefix][1]] = (
                moe[f"{prefix}no_replay"],
                moe[f"{prefix}replay"],
                dense.get(f"{prefix}no_replay"),
            )
    for label, (no, yes, dn) in rows.items():
        dense_k3 = "-" if dn is None else f"{dn['k3']:.3e}"
        t.add_row(label, f"{no['k3']:.3e}", f"{yes['k3']:.3e}", dense_k3, f"{no['route_disagree']:.4f}")
    return t


def variant_figures(moe: dict[str, Any], dense: dict[str, Any], prefix: str, key: str) -> dict[str, Any]:
    """Headline figures of sampler variant ``prefix``, keys prefixed with ``key``."""
    no, yes = moe[f"{prefix}no_replay"], moe[f"{prefix}replay"]
    dense_k3 = dense.get(f"{prefix}no_replay", dense.get("fp32head_no_replay", {})).get("k3")
    return {
        f"{key}moe_k3_no_replay": no["k3"],
        f"{key}moe_k3_replay": yes["k3"],
        f"{key}moe_k3_reduction": no["k3"] / yes["k3"] if yes["k3"] > 0 else None,  # None: replay k3 is 0
        f"{key}moe_routing_disagreement_no_replay": no["route_disagree"],
        f"{key}moe_routing_disagreement_replay": yes["route_disagree"],
        f"{key}dense_k3": dense_k3,
    }


def headline(
    moe: dict[str, Any], dense: dict[str, Any], smol: dict[str, Any] | None, head_prefix: str
) -> dict[str, Any]:
    """Required keys from the ``head_prefix`` sampler (the configured default), then every variant."""
    no = moe[f"{head_prefix}no_replay"]
    out = {
        **variant_figures(moe, dense, head_prefix, ""),
        "headline_sampler": SAMPLERS[head_prefix][1],
        "moe_tokens_any_layer_disagree_no_replay": no["route_token_disagree"],
        "moe_routing_disagreement_no_replay_per_layer": {
            k.split("/")[-1]: v for k, v in no.items() if k.startswith("route_disagree/")
        },
    }
    for prefix in SAMPLERS:
        if f"{prefix}no_replay" in moe:
            out.update(variant_figures(moe, dense, prefix, prefix or "plain_bf16_"))
    models = {"moe": moe, "dense": dense, **({"smollm2": smol} if smol else {})}
    timed = {name: res["throughput"] for name, res in models.items() if "throughput" in res}
    for name, tp in timed.items():
        for prefix in ("fp32head_", "fp32head_router_"):
            for unit in ("tokens_per_s", "tokens_per_cpu_s"):
                if prefix in tp[unit]:
                    out[f"{prefix}{name}_{unit}_ratio"] = tp[unit][prefix] / tp[unit][""]
    out["sampler_tokens_per_s"] = {name: tp["tokens_per_s"] for name, tp in timed.items()}
    out["sampler_tokens_per_cpu_s"] = {name: tp["tokens_per_cpu_s"] for name, tp in timed.items()}
    if smol:
        out["smollm2_k3_plain_bf16"] = smol["no_replay"]["k3"]
        out["smollm2_k3_fp32head"] = smol["fp32head_no_replay"]["k3"]
    out["deterministic_slowdown"] = moe["deterministic"]["slowdown"]
    out["deterministic_slowdown_dense"] = dense["deterministic"]["slowdown"]
    return out


def five_digits(result: dict[str, Any]) -> dict[str, Any]:
    """``result`` with every float cut to 5 significant digits (for a readable JSON file)."""
    return json.loads(json.dumps(result), parse_float=lambda text: float(f"{float(text):.5g}"))


SWEEP_SHAPES: dict[str, tuple[str, tuple[int, int, int, bool]]] = {
    "e8_k1": ("top-1 of 8 (Switch-like)", (8, 1, 128, False)),
    "e8_k2": ("top-2 of 8 (Mixtral-like, headline)", (8, 2, 64, True)),
    "e64_k8": ("top-8 of 64 (Qwen3/DeepSeek-like)", (64, 8, 16, True)),
    "e32_k4": ("top-4 of 32", (32, 4, 32, True)),
}
"""Router shapes of ``--sweep``, by result key: (label, :func:`bench_model` shape = experts, top-k,
expert width, ``norm_topk_prob``). Expert widths keep the active MLP width at 128 per token. Top-1
uses Switch's gating (the softmax probability, not renormalised: renormalised, a single expert's
weight is always 1 and the router learns nothing from the LM loss); the others renormalise the
top-k weights (Mixtral, Qwen3-MoE, DeepSeek-V3)."""

SWEEP_SAMPLERS = ("fp32head_", "")


def predicting_flips(own_BTLK: Tensor, plan_BTLK: Tensor) -> tuple[Tensor, Tensor]:
    """Per token ``[B, T]``: whether the position predicting it (``t - 1``, whose hidden state gives
    its logprob) was routed differently from the plan in any MoE layer, and whether that or any
    earlier position was (a flip reaches later tokens through attention). Unplanned positions never
    flip."""
    B, T, L, K = plan_BTLK.shape
    planned_BTL = plan_BTLK[..., 0] >= 0
    differ_BTL = route_mismatch(own_BTLK.reshape(-1, K), plan_BTLK.reshape(-1, K)).reshape(B, T, L) > 0
    at_BT = (differ_BTL & planned_BTL).any(dim=-1)
    flip_BT = torch.zeros_like(at_BT)
    flip_BT[:, 1:] = at_BT[:, :-1]
    return flip_BT, flip_BT.int().cummax(dim=1).values.bool()


def token_mismatch(
    model: Any, reqs: list[GenerateRequest], results: list[GenerateResult], micro: int = 8
) -> dict[str, Tensor]:
    """Per sampled token (N): k3 of the fp32 trainer without and with replay, the flips of
    :func:`predicting_flips` under the trainer's own routing, and the index of its request."""
    seam = RouterSeam(model)
    parts: dict[str, list[Tensor]] = {k: [] for k in ("k3_no", "k3_replay", "flip", "flip_before", "request")}
    try:
        for index, (rs, ids_BT, attn_BT, mask_BT, mu_BT) in enumerate(micro_batches(reqs, results, micro)):
            plan_BTLK = route_plan([r.routes for r in rs], ids_BT.shape[1], seam)
            seam.record = True  # without replay, the experts used are the trainer's own choice
            with torch.no_grad(), seam.plan(plan_BTLK, replay=False):
                no_BT = recompute(model, ids_BT, attn_BT, mask_BT)
            own_BTLK = torch.stack([r for r in seam.recorded if r is not None], dim=1).long().cpu()
            flip_BT, before_BT = predicting_flips(own_BTLK.reshape(plan_BTLK.shape), plan_BTLK)
            seam.record = False
            with torch.no_grad(), seam.plan(plan_BTLK, replay=True):
                replay_BT = recompute(model, ids_BT, attn_BT, mask_BT)
            for key, lp_BT in (("k3_no", no_BT), ("k3_replay", replay_BT)):
                log_rho_N = (lp_BT.double() - mu_BT.double())[mask_BT]
                parts[key].append(torch.expm1(log_rho_N) - log_rho_N)
            parts["flip"].append(flip_BT[mask_BT])
            parts["flip_before"].append(before_BT[mask_BT])
            rows_BT = torch.arange(ids_BT.shape[0])[:, None].expand_as(mask_BT) + index * micro
            parts["request"].append(rows_BT[mask_BT])
        return {k: torch.cat(v) for k, v in parts.items()}
    finally:
        seam.remove()


def bootstrap_ratio_ci(
    num_N: Tensor, den_N: Tensor, group_N: Tensor, rounds: int = 2000, seed: int = 0
) -> tuple[float, float]:
    """95% percentile-bootstrap interval of ``sum(num) / sum(den)``, resampling whole groups (the
    requests: a sequence's tokens are not independent) with replacement."""
    _, inverse_N = group_N.unique(return_inverse=True)
    groups = int(inverse_N.max()) + 1
    num_G = torch.zeros(groups, dtype=torch.float64).index_add_(0, inverse_N, num_N.double())
    den_G = torch.zeros(groups, dtype=torch.float64).index_add_(0, inverse_N, den_N.double())
    pick_RG = torch.randint(groups, (rounds, groups), generator=torch.Generator().manual_seed(seed))
    ratio_R = num_G[pick_RG].sum(dim=1) / den_G[pick_RG].sum(dim=1)
    low, high = torch.quantile(ratio_R, torch.tensor([0.025, 0.975], dtype=torch.float64))
    return float(low), float(high)


def flip_split(tokens: dict[str, Tensor]) -> dict[str, float]:
    """Mean k3 (without and with replay) of the tokens whose predicting position flipped, of those
    whose did not, of those that did not but follow a flip, and of clean ones (no flip up to them);
    their shares of the tokens and of the no-replay k3 mass. Empty groups give None."""
    groups = {
        "flip": tokens["flip"],
        "noflip": ~tokens["flip"],
        "after_flip": tokens["flip_before"] & ~tokens["flip"],
        "clean": ~tokens["flip_before"],
    }
    total = float(tokens["k3_no"].sum())
    out: dict[str, Any] = {}
    for name, sel_N in groups.items():
        n = int(sel_N.sum())
        out[f"{name}_token_frac"] = n / sel_N.numel()
        out[f"{name}_k3_no_replay"] = float(tokens["k3_no"][sel_N].mean()) if n else None
        out[f"{name}_k3_replay"] = float(tokens["k3_replay"][sel_N].mean()) if n else None
        out[f"{name}_k3_mass_frac"] = float(tokens["k3_no"][sel_N].sum()) / total if total > 0 else None
    return out


def sweep_figures(
    model: Any, reqs: list[GenerateRequest], results: list[GenerateResult], seed: int
) -> dict[str, Any]:
    """One sampler's figures in the sweep: k3 without/with replay, its reduction with a bootstrap
    CI over requests, routing disagreement, and the per-flip split of :func:`flip_split`."""
    no = trainer_mismatch(model, reqs, results, replay=False)
    yes = trainer_mismatch(model, reqs, results, replay=True)
    tokens = token_mismatch(model, reqs, results)
    assert abs(float(tokens["k3_no"].mean()) - no["k3"]) <= 1e-9 + 1e-6 * no["k3"], "per-token k3 path"
    low, high = bootstrap_ratio_ci(tokens["k3_no"], tokens["k3_replay"], tokens["request"], seed=seed)
    return {
        "k3_no_replay": no["k3"],
        "k3_replay": yes["k3"],
        "k3_reduction": no["k3"] / yes["k3"] if yes["k3"] > 0 else None,
        "k3_reduction_ci95": [low, high],
        "k3_p99_no_replay": no["k3_p99"],
        "k3_p99_replay": yes["k3_p99"],
        "routing_disagreement_no_replay": no["route_disagree"],
        "routing_disagreement_replay": yes["route_disagree"],
        "positions_any_flip_no_replay": no["route_token_disagree"],
        "sampled_tokens": int(tokens["k3_no"].numel()),
        **flip_split(tokens),
    }


def sweep_shape(
    key: str,
    steps: int,
    size: tuple[int, int],
    args: argparse.Namespace,
    data: tuple[list[int], list[int]],
    tok: Any,
) -> dict[str, Any]:
    """Train the tiny MoE of router shape ``key`` (:data:`SWEEP_SHAPES`) and ``size`` = (layers,
    hidden) ``steps`` steps, then sample with each of :data:`SWEEP_SAMPLERS` and compare with the
    fp32 trainer."""
    label, shape = SWEEP_SHAPES[key]
    layers, hidden = size
    model = bench_model("moe", args.vocab, args.seed, shape, layers, hidden)
    t0 = time.perf_counter()
    losses = train_briefly(model, data[0], steps, 128, 8, args.seed)
    model.eval().to(args.device)
    out: dict[str, Any] = {
        "label": label,
        "experts": shape[0],
        "top_k": shape[1],
        "expert_width": shape[2],
        "norm_topk_prob": shape[3],
        "layers": layers,
        "hidden": hidden,
        "params": sum(p.numel() for p in model.parameters()),
        "train_steps": steps,
        "train_loss_first_last": [losses[0], sum(losses[-10:]) / len(losses[-10:])],
        "train_s": time.perf_counter() - t0,
        "expert_usage_entropy_bits": expert_entropy(model, data[1]),
        "expert_usage_entropy_max_bits": math.log2(shape[0]),
    }
    reqs = make_requests(data[1], args.samples, args.max_tokens, args.seed)
    return {**out, **score_samplers(model, tok, reqs, args.seed)}


def score_samplers(model: Any, tok: Any, reqs: list[GenerateRequest], seed: int) -> dict[str, Any]:
    """:func:`sweep_figures` of each of :data:`SWEEP_SAMPLERS` sampling ``reqs`` from ``model``."""
    out: dict[str, Any] = {}
    for prefix in SWEEP_SAMPLERS:
        engine = EmbeddedEngine(sampler_model(model, prefix), tok, max_batch=8)
        results = sample_varied(engine, reqs, seed)
        out[prefix or "plain_bf16_"] = sweep_figures(model, reqs, results, seed)
    return out


def pretrained_run(args: argparse.Namespace) -> dict[str, Any]:
    """``--model-path``: a pretrained MoE checkpoint as it is (no training), prompted with the
    held-out source in its own tokenizer, scored like a sweep shape. Device memory: an fp32 copy
    (the trainer) and a bf16 one (the sampler), about 6 bytes per parameter."""
    model, tok = load_model(ModelConfig(source="hf", path=args.model_path))
    if not moe_routers(model):
        raise ValueError(
            f"--model-path {args.model_path}: {type(model).__name__} has no MoE router that router replay "
            "knows (Qwen3-MoE, Mixtral, DeepSeek-V3 classes)"
        )
    model.to(args.device)
    heldout = corpus_ids(tok, HELDOUT_FILES)
    seam = RouterSeam(model)
    experts, top_k, layers = seam.num_experts, seam.top_k, len(seam.layers)
    seam.remove()
    out: dict[str, Any] = {
        "label": Path(args.model_path).name,
        "model_class": type(model).__name__,
        "experts": experts,
        "top_k": top_k,
        "layers": layers,
        "hidden": int(model.config.hidden_size),
        "params": sum(p.numel() for p in model.parameters()),
        "train_steps": 0,
        "expert_usage_entropy_bits": expert_entropy(model, heldout),
        "expert_usage_entropy_max_bits": math.log2(experts),
    }
    reqs = make_requests(heldout, args.samples, args.max_tokens, args.seed)
    return {**out, **score_samplers(model, tok, reqs, args.seed)}


def _fmt(value: float | None, spec: str = ".2e") -> str:
    return "-" if value is None else format(value, spec)


def sweep_table(runs: dict[str, dict[str, Any]]) -> Table:
    t = Table(
        title="Router replay by MoE router shape: bf16 sampler (varied batches) vs fp32 trainer, k3 mismatch"
    )
    cols = (
        "shape",
        "steps",
        "usage H bits",
        "sampler",
        "k3 no replay",
        "k3 replay",
        "reduction [95% CI]",
        "disagree /decision",
        "tokens flipped",
        "k3 flipped no→replay",
        "k3 not flipped no→replay",
        "flipped k3 share",
    )
    for col in cols:
        t.add_column(col, justify="right")
    for run in runs.values():
        for prefix in SWEEP_SAMPLERS:
            m = run[prefix or "plain_bf16_"]
            low, high = m["k3_reduction_ci95"]
            t.add_row(
                f"top-{run['top_k']} of {run['experts']}, {run.get('layers', 4)}x{run.get('hidden', 128)}",
                str(run["train_steps"]),
                f"{run['expert_usage_entropy_bits']:.2f}/{run['expert_usage_entropy_max_bits']:.0f}",
                "fp32 head" if prefix else "plain",
                _fmt(m["k3_no_replay"]),
                _fmt(m["k3_replay"]),
                f"{_fmt(m['k3_reduction'], '.2f')}x [{low:.2f}, {high:.2f}]",
                _fmt(m["routing_disagreement_no_replay"], ".4f"),
                _fmt(m["flip_token_frac"], ".3f"),
                f"{_fmt(m['flip_k3_no_replay'])}→{_fmt(m['flip_k3_replay'])}",
                f"{_fmt(m['noflip_k3_no_replay'])}→{_fmt(m['noflip_k3_replay'])}",
                _fmt(m["flip_k3_mass_frac"], ".2f"),
            )
    return t


def sweep_result(runs: dict[str, dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    """The sweep's JSON: the reductions at a glance, every run, the config and the machine."""
    device = torch.cuda.get_device_name() if args.device == "cuda" else f"{platform.machine()} CPU"
    keys = (
        "quick",
        "shapes",
        "sweep_steps",
        "sweep_layers",
        "sweep_hidden",
        "samples",
        "max_tokens",
        "seed",
        "vocab",
        "model_path",
    )
    return {
        "k3_reduction": {
            name: {p or "plain_bf16_": run[p or "plain_bf16_"]["k3_reduction"] for p in SWEEP_SAMPLERS}
            for name, run in runs.items()
        },
        "runs": runs,
        "complete": bool(args.model_path)
        or len(runs)
        == len(args.shapes) * len(args.sweep_steps) * len(args.sweep_layers) * len(args.sweep_hidden),
        "config": {k: getattr(args, k) for k in keys},
        "machine": machine_line(device, args.threads),
    }


def run_sweep(args: argparse.Namespace, console: Console) -> None:
    """``--sweep``: every shape of ``args.shapes`` at every step count of ``args.sweep_steps``,
    depth of ``args.sweep_layers`` and width of ``args.sweep_hidden`` (runs keyed ``shape@steps``,
    plus ``/L8`` for depths other than 4 and ``/H256`` for widths other than 128); the JSON is
    rewritten after each run (``complete`` false until the last), so a cut run keeps its part."""
    out = Path(args.out or f"benchmarks/results/mismatch_sweep{'_quick' if args.quick else ''}.json")
    runs: dict[str, dict[str, Any]] = {}
    if args.model_path:
        runs[f"hf:{Path(args.model_path).name}"] = pretrained_run(args)
        write_json(out, sweep_result(runs, args), console)
        console.print(sweep_table(runs))
        return
    _, tok = load_model(ModelConfig(source="tiny", tiny="dense"))
    data = compact_vocab(corpus_ids(tok, TRAIN_FILES), corpus_ids(tok, HELDOUT_FILES), args.vocab)
    for key in args.shapes:
        for steps, layers, hidden in itertools.product(
            args.sweep_steps, args.sweep_layers, args.sweep_hidden
        ):
            name = (
                f"{key}@{steps}"
                + ("" if layers == 4 else f"/L{layers}")
                + ("" if hidden == 128 else f"/H{hidden}")
            )
            runs[name] = run = sweep_shape(key, steps, (layers, hidden), args, data, tok)
            console.print(
                f"{name}: {layers} layers, hidden {hidden}, {steps} steps: trained in {run['train_s']:.0f}s, loss "
                f"{run['train_loss_first_last'][1]:.2f}, usage entropy {run['expert_usage_entropy_bits']:.2f}"
                f" bits; fp32head k3 reduction {_fmt(run['fp32head_']['k3_reduction'], '.2f')}x"
            )
            write_json(out, sweep_result(runs, args), console)
    console.print(sweep_table(runs))


def sweep_main(args: argparse.Namespace) -> None:
    """``--sweep`` defaults (full: every shape at 300 steps, 64 requests x 32 tokens; quick: the
    three required shapes at 50 steps, 16 x 16), then :func:`run_sweep`."""
    quick_shapes = ("e8_k1", "e8_k2", "e64_k8")
    args.shapes = (args.shapes or ",".join(quick_shapes if args.quick else SWEEP_SHAPES)).split(",")
    args.sweep_steps = [int(s) for s in (args.sweep_steps or ("50" if args.quick else "300")).split(",")]
    args.sweep_layers = [int(s) for s in args.sweep_layers.split(",")]
    args.sweep_hidden = [int(s) for s in args.sweep_hidden.split(",")]
    if any(h < 32 or h % 32 for h in args.sweep_hidden):
        raise ValueError(f"--sweep-hidden {args.sweep_hidden}: each width must be a positive multiple of 32")
    args.samples = args.samples or (16 if args.quick else 64)
    args.max_tokens = args.max_tokens or (16 if args.quick else 32)
    unknown = [s for s in args.shapes if s not in SWEEP_SHAPES]
    if unknown:
        raise ValueError(f"--shapes: unknown {unknown}; choose from {list(SWEEP_SHAPES)}")
    if min(*args.sweep_steps, *args.sweep_layers, args.samples, args.max_tokens) < 1 or args.samples < 2:
        raise ValueError(
            "--sweep-steps, --sweep-layers and --max-tokens must be >= 1, --samples >= 2 (the bootstrap)"
        )
    torch.set_num_threads(args.threads)
    run_sweep(args, Console(width=None if Console().is_terminal else 200))


def machine_line(device: str, threads: int) -> dict[str, Any]:
    """The shared harness's machine description, plus the device and threads of this run."""
    return {**machine(), "device": device, "threads": threads, "load_avg": os.getloadavg()[0]}


def write_json(out: Path, result: dict[str, Any], console: Console) -> None:
    """Write ``result`` (5 significant digits) to ``out`` atomically."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(five_digits(result), indent=1) + "\n")
    tmp.replace(out)
    console.print(f"wrote {out}")


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="20 training steps, 8 samples (about a minute idle)")
    ap.add_argument("--steps", type=int, default=None, help="training steps (default 200, quick 20)")
    ap.add_argument("--samples", type=int, default=None, help="sampled continuations (default 48, quick 8)")
    ap.add_argument(
        "--max-tokens", type=int, default=None, help="tokens per continuation (default 48, quick 16)"
    )
    ap.add_argument(
        "--det-samples",
        type=int,
        default=None,
        help="requests timed for the deterministic mode (16, quick 4)",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vocab", type=int, default=4096, help="compact vocabulary size of the tiny models")
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    ap.add_argument(
        "--out",
        default=None,
        help="default mismatch.json (--sweep: mismatch_sweep.json) in benchmarks/results; --quick: *_quick.json",
    )
    _sweep_args(ap)
    _sampler_args(ap)
    return ap


def _sweep_args(ap: argparse.ArgumentParser) -> None:
    """Options of ``--sweep`` (the router-shape sweep)."""
    ap.add_argument(
        "--sweep",
        action="store_true",
        help="router-shape sweep instead (SWEEP_SHAPES x --sweep-steps; writes mismatch_sweep.json)",
    )
    ap.add_argument("--shapes", default=None, help=f"--sweep: comma-separated of {list(SWEEP_SHAPES)}")
    ap.add_argument(
        "--sweep-steps",
        default=None,
        help="--sweep: comma-separated training steps (default 300; quick 50)",
    )
    ap.add_argument(
        "--sweep-layers",
        default="4",
        help="--sweep: comma-separated MoE depths (decoder layers, every one MoE; default 4)",
    )
    ap.add_argument(
        "--sweep-hidden",
        default="128",
        help="--sweep: comma-separated MoE widths (hidden size; experts and heads scale; default 128)",
    )
    ap.add_argument(
        "--model-path",
        default=None,
        help="--sweep: score this pretrained MoE checkpoint (HF directory; Qwen3-MoE, Mixtral or DeepSeek-V3 "
        "class) as it is, instead of training the tiny shapes",
    )


def _sampler_args(ap: argparse.ArgumentParser) -> None:
    """Which sampler variants, the fp32 breakdown and the SmolLM2 figures."""
    ap.add_argument(
        "--samplers",
        default=None,
        help=f"comma-separated sampler variants of {[k or 'plain' for k in SAMPLERS]} (default all; quick: "
        "plain, fp32head_, fp32_sampler_)",
    )
    ap.add_argument(
        "--breakdown",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="also sample with decoder parts in fp32 on top of the fp32 head (default on, off in quick)",
    )
    ap.add_argument(
        "--smollm2",
        type=int,
        default=None,
        help="held-out prompts sampled on SmolLM2-135M for its fp32-head figures (default 16, quick 0 = off)",
    )


def _resolve(args: argparse.Namespace) -> None:
    """Defaults that depend on ``--quick``; ValueError for bad values."""
    if args.smollm2 is None:
        args.smollm2 = 0 if args.quick else 16
    if args.breakdown is None:
        args.breakdown = not args.quick
    if args.samplers is None:
        args.samplers = list(QUICK_SAMPLERS if args.quick else SAMPLERS)
    else:
        args.samplers = ["" if v == "plain" else v for v in args.samplers.split(",")]
    unknown = [v for v in args.samplers if v not in SAMPLERS]
    if unknown or "" not in args.samplers:
        raise ValueError(f"--samplers: unknown {unknown} or 'plain' missing; choose from {list(SAMPLERS)}")
    args.steps = args.steps or (20 if args.quick else 200)
    args.samples = args.samples or (8 if args.quick else 48)
    args.max_tokens = args.max_tokens or (16 if args.quick else 48)
    args.det_samples = args.det_samples or (4 if args.quick else 16)
    if min(args.steps, args.samples, args.max_tokens) < 1 or args.det_samples < 2:
        raise ValueError("--steps, --samples and --max-tokens must be >= 1, --det-samples >= 2")


def main() -> None:
    args = _parser().parse_args()
    if args.sweep:
        sweep_main(args)
        return
    _resolve(args)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    console = Console(width=None if Console().is_terminal else 160)
    moe = run_model("moe", args, console)
    dense = run_model("dense", args, console)
    console.print(table(moe, dense))
    if "fp32head_no_replay" in moe:
        console.print(breakdown_table(moe, dense))
    head_prefix = "fp32head_" if InferenceConfig().fp32_lm_head and "fp32head_" in args.samplers else ""
    smol = smollm2_figures(args, console) if args.smollm2 else None
    head = headline(moe, dense, smol, head_prefix)
    for k in ("moe_k3_reduction", "moe_routing_disagreement_replay", "deterministic_slowdown"):
        console.print(f"{k}: {head[k]}")
    device = torch.cuda.get_device_name() if args.device == "cuda" else f"{platform.machine()} CPU"
    result = {
        **head,
        "targets": {
            "replay_zero_disagreement": head["moe_routing_disagreement_replay"] == 0.0,
            "replay_k3_10x_lower": head["moe_k3_replay"] == 0.0 or head["moe_k3_reduction"] >= 10.0,
        },
        "moe": moe,
        "dense": dense,
        "smollm2": smol,
        "config": {
            k: getattr(args, k)
            for k in (
                "quick",
                "steps",
                "samples",
                "max_tokens",
                "det_samples",
                "seed",
                "vocab",
                "samplers",
                "breakdown",
            )
        },
        "machine": machine_line(device, args.threads),
    }
    write_json(
        Path(args.out or f"benchmarks/results/mismatch{'_quick' if args.quick else ''}.json"), result, console
    )


if __name__ == "__main__":
    main()
