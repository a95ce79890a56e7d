"""`shipyard midtrain`: packed next-token training on code, with the RL trainer's ranks and sharding.

It trains what the RL run trains: all parameters, or the top ``trainer.train_layers`` blocks and
the final norm (the CPU budget knob of the shipped configs).

Contract of :func:`midtrain_rank` (every rank of the group calls it;
:func:`shipyard.orchestrate.midtrain.run_midtrain` starts the group: in this process at
``trainer.world_size = 1``, as Ray actors otherwise):
- rank 0 builds (or reuses) the corpus (:mod:`shipyard.trainer.corpus`); the others wait, then load it;
- step ``s`` (1-based) trains global sequences ``(s-1)·B … s·B-1`` of a per-epoch permutation of the
  train windows (seeded with ``run.seed`` and the epoch, so a resumed run sees the same order);
  rank ``r`` takes every ``world``-th of them; the loss is the mean next-token NLL over all the
  step's tokens (each rank divides by the whole step's count, gradients are summed: the update
  equals the one-process update);
- the learning rate warms up linearly for ``warmup_steps``, then decays with a cosine to
  ``min_lr_frac · lr`` at the last step, computed from the step number (nothing to resume);
- the held-out loss (mean NLL per predicted token over the first ``heldout_seqs`` held-out windows,
  files never trained on) is measured before the first step, every ``eval_every`` steps and after
  the last;
- checkpoints (:mod:`shipyard.trainer.checkpoint`, any world size can resume them) every
  ``checkpoint_every`` steps and after the last; a restart resumes from the newest;
- at the end rank 0 writes ``<output_dir>/final`` (HF config, safetensors, tokenizer and
  ``midtrain.json``, swapped in atomically) and ``<run.results_dir>/midtrain.json``: what
  ``model.init_from`` takes;
- metrics go to ``<output_dir>/metrics.jsonl`` and TensorBoard: loss, held-out loss, lr, grad norm,
  tokens/s and, on a GPU with a known peak, MFU (:func:`flops_per_token`).
Limits: dense next-token loss over whole windows (a window may span two files, joined by the
end-of-text token, as in pretraining); no data mixing with chat data; fp8 needs torchao and a GPU
with FP8 units.

Shape legend: B = sequences in a micro-batch, T = ``midtrain.seq_len``.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import torch

from shipyard.config.schema import MidtrainConfig, ShipyardConfig
from shipyard.trainer.corpus import Corpus, build_corpus
from shipyard.trainer.distributed import Ranks, full_params
from shipyard.trainer.logprobs import TokenScorer, token_logprobs

PEAK_BF16_FLOPS = {"H100": 989.4e12, "H200": 989.4e12, "A100": 312e12, "L40S": 362e12}
"""Dense bf16 tensor-core peaks (vendor data sheets, SXM parts, no sparsity) by GPU name fragment."""


def midtrain_rank(ranks: Ranks, cfg: ShipyardConfig) -> dict[str, Any]:
    """One rank's mid-training (module doc); the report (the same on every rank)."""
    from shipyard.metrics.logger import MetricsLogger, drop_after
    from shipyard.metrics.progress import StepBar
    from shipyard.trainer.checkpoint import load_latest_checkpoint, save_checkpoint

    m, out = cfg.midtrain, Path(cfg.midtrain.output_dir)
    model, tok, scorer, bf16 = _policy(cfg, ranks)
    corpus = _corpus(m, tok, out, ranks)
    opt = torch.optim.AdamW(
        [p for p in scorer.parameters() if p.requires_grad],
        lr=m.lr,
        betas=tuple(cfg.trainer.betas),
        weight_decay=0.0,
    )
    state = load_latest_checkpoint(out / "checkpoints", scorer, opt, ranks) or {"step": 0}
    heldout_TT = corpus.heldout_seqs(m.heldout_seqs)
    eval_kw = {"micro_batch": m.micro_batch, "bf16": bf16, "ranks": ranks}
    if state["step"] == 0:
        state["heldout_loss_before"] = heldout_loss(scorer, heldout_TT, **eval_kw)
    if ranks.leader:
        drop_after(out / "metrics.jsonl", state["step"])  # the steps a crash cost are logged again below
    logger = MetricsLogger(out) if ranks.leader else None
    if logger and state["step"] == 0:
        logger.log(0, {"kind": "midtrain", "heldout_loss": state["heldout_loss_before"]})
    per_token = flops_per_token(model, m.seq_len)
    with StepBar("midtrain", total=m.steps) as bar:
        for step in range(state["step"] + 1, m.steps + 1):
            t0 = time.perf_counter()
            lr = lr_at(step, m)
            for group in opt.param_groups:
                group["lr"] = lr
            ids = step_indices(step, m.batch_seqs, corpus.num_train_seqs(), cfg.run.seed)[
                ranks.rank :: ranks.world
            ]
            stats = lm_step(scorer, opt, corpus, ids, m, bf16, ranks)
            stats.update(lr=lr, **_speed(m, time.perf_counter() - t0, per_token, cfg.trainer.device, m.fp8))
            if step % m.eval_every == 0 or step == m.steps:
                stats["heldout_loss"] = heldout_loss(scorer, heldout_TT, **eval_kw)
                state["heldout_loss_after"] = stats["heldout_loss"]
            state = {**state, "step": step}
            if step % m.checkpoint_every == 0 or step == m.steps:
                save_checkpoint(out / "checkpoints", step, scorer, opt, state, ranks=ranks)
            if logger:
                logger.log(step, {"kind": "midtrain", **stats})
            bar.update(step, f"loss {stats['loss']:.3f} lr {lr:.1e}")
    report = _report(cfg, corpus, state)
    weights = full_params(scorer, "model.")  # a collective: every rank
    if ranks.leader:
        assert logger is not None
        logger.close()
        _save_final(cfg, model, tok, weights, report)
    return report


def _policy(cfg: ShipyardConfig, ranks: Ranks) -> tuple[Any, Any, TokenScorer, bool]:
    """(model, tokenizer, scorer — FP8, compiled and sharded as configured —, bf16 decoder?)."""
    from shipyard.models.hardware import resolve_bf16
    from shipyard.models.loading import load_model
    from shipyard.trainer.distributed import decoder_blocks, shard_policy
    from shipyard.trainer.step import freeze_lower_layers

    torch.set_num_threads(cfg.trainer.threads)
    torch.manual_seed(cfg.run.seed)
    model, tok = load_model(cfg.model)
    model = model.to(cfg.trainer.device).train()
    if cfg.trainer.device == "cuda" and cfg.midtrain.tf32:
        torch.backends.cuda.matmul.allow_tf32 = True  # this process only trains: no RL logprobs here
    freeze_lower_layers(model, cfg.trainer.train_layers)
    bf16 = resolve_bf16(cfg.trainer.bf16_decoder, cfg.trainer.device, "trainer.bf16_decoder")[0]
    if cfg.midtrain.fp8:
        _to_fp8(model)
    if cfg.midtrain.compile:
        for block in decoder_blocks(model):
            block.compile()
    scorer = TokenScorer(model)
    if ranks.world > 1:
        shard_policy(scorer, cfg.trainer.fsdp, bf16=bf16)
    return model, tok, scorer, bf16


def _to_fp8(model: Any) -> None:
    """Decoder-block linears to torchao's ``Float8Linear`` (dynamic tensor-wise scales)."""
    try:
        from torchao.float8 import convert_to_float8_training
    except ImportError as e:
        raise ValueError("midtrain.fp8 = true needs torchao (pip install torchao)") from e

    def blocks_only(module: torch.nn.Module, fqn: str) -> bool:
        dims_ok = module.in_features % 16 == 0 and module.out_features % 16 == 0
        return ".layers." in f".{fqn}" and dims_ok

    convert_to_float8_training(model, module_filter_fn=blocks_only)


def _corpus(m: MidtrainConfig, tok: Any, out: Path, ranks: Ranks) -> Corpus:
    """Rank 0 builds the corpus; the others load it after (a shared ``output_dir``)."""
    corpus = build_corpus(m, tok, out / "corpus") if ranks.leader else None
    ranks.barrier()
    return corpus or build_corpus(m, tok, out / "corpus")


def lr_at(step: int, m: MidtrainConfig) -> float:
    """Linear warm-up over ``warmup_steps``, then cosine from ``lr`` to ``min_lr_frac · lr`` at ``steps``."""
    if step <= m.warmup_steps:
        return m.lr * step / max(m.warmup_steps, 1)
    progress = (step - m.warmup_steps) / max(m.steps - m.warmup_steps, 1)
    return m.lr * (m.min_lr_frac + (1 - m.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * progress)))


def step_indices(step: int, batch: int, n: int, seed: int) -> list[int]:
    """Train-window indices of ``step`` (1-based): positions ``(step-1)·batch …`` of the per-epoch
    permutations of ``n`` windows (epoch ``e`` shuffled with ``seed + e``)."""
    out, perms = [], {}
    for pos in range((step - 1) * batch, step * batch):
        epoch = pos // n
        if epoch not in perms:
            perms[epoch] = np.random.default_rng(seed + epoch).permutation(n)
        out.append(int(perms[epoch][pos % n]))
    return out


def _nll_sum(scorer: TokenScorer, ids_BT: torch.Tensor, bf16: bool) -> torch.Tensor:
    """Summed next-token NLL of the windows ``ids_BT`` (every position but the first is predicted)."""
    attn_BT = torch.ones_like(ids_BT)
    return -token_logprobs(scorer, ids_BT, attn_BT, bf16_decoder=bf16).sum()


def lm_step(
    scorer: TokenScorer, opt: Any, corpus: Corpus, ids: list[int], m: MidtrainConfig, bf16: bool, ranks: Ranks
) -> dict[str, float]:
    """One optimizer step on this rank's windows ``ids``; the step's mean loss and grad norm."""
    from shipyard.trainer.step import clip_grad_norm

    device = next(scorer.parameters()).device
    count = m.batch_seqs * (m.seq_len - 1)  # predicted tokens of the whole step, all ranks
    opt.zero_grad(set_to_none=True)
    total = torch.zeros((), dtype=torch.float64)
    for start in range(0, len(ids), m.micro_batch):
        rows = np.stack([corpus.train_seq(i) for i in ids[start : start + m.micro_batch]])
        ids_BT = torch.from_numpy(rows).long().to(device)
        loss = _nll_sum(scorer, ids_BT, bf16) / count
        loss.backward()
        total += loss.detach().double().cpu()
    grad_norm = clip_grad_norm([p for p in scorer.parameters() if p.requires_grad], 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return {"loss": float(ranks.sum({"loss": total})["loss"]), "grad_norm": grad_norm}


@torch.no_grad()
def heldout_loss(
    scorer: TokenScorer, windows_ST: np.ndarray, micro_batch: int, bf16: bool, ranks: Ranks
) -> float:
    """Mean next-token NLL over the held-out windows, split over ranks (equal forward counts: a rank
    short of windows scores a zero-weight one)."""
    device = next(scorer.parameters()).device
    mine = list(range(ranks.rank, len(windows_ST), ranks.world))
    passes = math.ceil(math.ceil(len(windows_ST) / ranks.world) / micro_batch)
    total = torch.zeros((), dtype=torch.float64)
    for k in range(passes):
        rows = mine[k * micro_batch : (k + 1) * micro_batch]
        ids_BT = torch.from_numpy(windows_ST[rows or [0]]).long().to(device)
        nll = _nll_sum(scorer, ids_BT, bf16).double().cpu()
        total += nll if rows else 0.0
    total = ranks.sum({"nll": total})["nll"]
    return float(total) / (len(windows_ST) * (windows_ST.shape[1] - 1))


def flops_per_token(model: Any, seq_len: int) -> float:
    """Training FLOPs per token, ``6·N + 12·L·d·T`` (PaLM, appendix B): N the parameters of the
    matmuls (decoder blocks and LM head; the embedding lookup is not a matmul), L layers, d the
    hidden size, T the sequence length (the attention scores and mixing, no causal discount)."""
    c = model.config
    embed = model.get_input_embeddings().weight.numel()
    head = model.get_output_embeddings().weight
    n = sum(p.numel() for p in model.parameters()) - embed + (head.numel() if head is not None else 0)
    return 6.0 * n + 12.0 * c.num_hidden_layers * c.hidden_size * seq_len


def _speed(m: MidtrainConfig, seconds: float, per_token: float, device: str, fp8: bool) -> dict[str, float]:
    tokens_s = m.batch_seqs * m.seq_len / seconds
    out = {"step_s": seconds, "tokens_per_s": tokens_s}
    if device == "cuda":
        name = torch.cuda.get_device_name()
        peak = next((v for k, v in PEAK_BF16_FLOPS.items() if k in name), None)
        if peak:
            out["mfu"] = tokens_s * per_token / peak  # against the bf16 peak, FP8 runs included
    return out


def _report(cfg: ShipyardConfig, corpus: Corpus, state: dict[str, Any]) -> dict[str, Any]:
    m = cfg.midtrain
    return {
        "corpus_tokens": corpus.info["train_tokens"],
        "heldout_tokens": corpus.info["heldout_tokens"],
        "corpus_files": corpus.info["files_distinct"],
        "heldout_files": corpus.info["files_heldout"],
        "steps": m.steps,
        "tokens_trained": m.steps * m.batch_seqs * m.seq_len,
        "heldout_code_loss_before": state.get("heldout_loss_before"),
        "heldout_code_loss_after": state.get("heldout_loss_after"),
        "world_size": cfg.trainer.world_size,
        "device": cfg.trainer.device,
        "fp8": m.fp8,
    }


def _save_final(
    cfg: ShipyardConfig, model: Any, tok: Any, weights: dict[str, Any], report: dict[str, Any]
) -> None:
    """``<output_dir>/final`` (HF directory + ``midtrain.json``) swapped in atomically, and the report
    in ``run.results_dir``."""
    from transformers import AutoModelForCausalLM

    out = Path(cfg.midtrain.output_dir) / "final"
    plain = AutoModelForCausalLM.from_config(model.config, dtype=torch.float32)
    plain.load_state_dict(weights, strict=False)  # tied copies are not in ``weights``
    tmp = out.with_name(f".final-{uuid.uuid4().hex[:12]}")
    tmp.mkdir(parents=True)
    plain.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    (tmp / "midtrain.json").write_text(json.dumps(report, indent=1))
    old = out.with_name(f".final-old-{os.getpid()}")
    if out.exists():
        os.replace(out, old)
    os.replace(tmp, out)
    shutil.rmtree(old, ignore_errors=True)
    results = Path(cfg.run.results_dir)
    results.mkdir(parents=True, exist_ok=True)
    (results / "midtrain.json").write_text(json.dumps(report, indent=1))
