"""Benchmark: sampler/trainer mismatch of a tiny MoE with and without router replay, a dense
model beside it, by sampler precision (plain bf16, bf16 with an fp32 LM head, ...), and the cost of
the engine's deterministic (batch-invariant) mode and of the fp32 head.

Contract: the tiny Qwen3-MoE (``model.tiny = "moe"``: 4 MoE layers, 8 experts, top-2) and the
tiny dense Llama of similar size (``"dense"``) are first trained briefly (AdamW, next-token loss
on Python standard-library source, plus the MoE load-balancing loss) so routing is not trivial
(expert-usage entropy reported). Then each sampler variant (:data:`SAMPLERS`: plain bf16; bf16
with the final norm + LM head in fp32, :func:`~shipyard.models.precision.cast_for_sampling`; the
same plus fp32 routers; bf16-rounded weights computed in fp32; fp32) samples continuations of
held-out source prompts through :class:`~shipyard.inference.engine.EmbeddedEngine` (temperature
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

Limits: CPU here (``--device cuda`` for a GPU run, recorded with its name); tiny models, so
absolute figures are small-model figures; the timings share the machine with other work.

Usage::

    .venv/bin/python benchmarks/mismatch.py            # 200 training steps, 48 samples per model, all
    .venv/bin/python benchmarks/mismatch.py --quick    # 20 steps, 8 samples, 3 samplers, no breakdown
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import random
import sysconfig
import time
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from shipyard.config.schema import InferenceConfig, ModelConfig
from shipyard.inference.engine import EmbeddedEngine
from shipyard.inference.types import GenerateRequest, GenerateResult, SamplingParams
from shipyard.models.loading import load_model
from shipyard.models.precision import cast_for_sampling
from shipyard.models.router_replay import RouterSeam, moe_routers, route_plan
from shipyard.trainer.corrections import no_correction
from shipyard.trainer.logprobs import pad_batch, pad_floats, pad_ints, token_logprobs
from shipyard.trainer.mismatch import MismatchAccumulator

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


def bench_model(kind: str, vocab: int, seed: int) -> Any:
    """The benchmark's tiny models: 4 layers, hidden 128; MoE 8 experts top-2 of width 64 in every
    layer (Qwen3-MoE), dense MLP of width 128 (Llama): the same active MLP width per token."""
    from transformers import AutoModelForCausalLM

    from shipyard.models.loading import tiny_config

    cfg = tiny_config(kind, vocab)
    cfg.hidden_size, cfg.num_hidden_layers, cfg.intermediate_size = 128, 4, 128
    if kind == "moe":
        cfg.moe_intermediate_size, cfg.head_dim = 64, 32
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
            model(input_ids=torch.tensor([ids[:512]]))
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
        for s in range(0, len(reqs), micro):
            rq, rs = reqs[s : s + micro], results[s : s + micro]
            seqs = [q.prompt_ids + r.token_ids for q, r in zip(rq, rs, strict=True)]
            ids_BT, attn_BT = pad_batch(seqs, pad_id=0)
            mask_BT = (
                pad_ints(
                    [[0] * len(q.prompt_ids) + [1] * len(r.token_ids) for q, r in zip(rq, rs, strict=True)]
                )
                == 1
            )
            mu_BT = pad_floats([[0.0] * len(q.prompt_ids) + r.logprobs for q, r in zip(rq, rs, strict=True)])
            with torch.no_grad():
                if seam is None:
                    old_BT = token_logprobs(model, ids_BT, attn_BT, score_mask_BT=mask_BT)
                else:
                    with seam.plan(
                        route_plan([r.routes for r in rs], ids_BT.shape[1], seam), replay=bool(replay)
                    ):
                        old_BT = token_logprobs(model, ids_BT, attn_BT, score_mask_BT=mask_BT)
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


def main() -> None:
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
    ap.add_argument("--out", default="benchmarks/results/mismatch.json")
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
    args = ap.parse_args()
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
        "machine": f"{device}, {os.cpu_count()} CPUs, {args.threads} threads, torch {torch.__version__}, "
        f"python {platform.python_version()}, load avg {os.getloadavg()[0]:.1f}",
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(five_digits(result), indent=1) + "\n")
    tmp.replace(out)
    console.print(f"wrote {out}")


if __name__ == "__main__":
    main()
