"""Supervised fine-tuning on session segments: the warm start before RL.

Contract: :func:`sft` minimises the mean negative log-likelihood of the policy's own tokens
(``loss_mask == 1``: actions, code and summaries) of every segment in ``segments``, conditioned
on the full token record (prompts and tool outputs are context, never targets), with AdamW over
the trainable parameters (``train_layers`` as in the RL trainer: the top blocks and the final
norm, 0 = all; ``bf16_decoder`` as ``trainer.bf16_decoder``: the decoder's matmuls in bf16
autocast). Segments are shuffled per epoch with ``seed`` and grouped ``micro_batch`` at a time,
one optimizer step per micro-batch, gradients clipped at ``clip``. Returns the per-epoch mean
loss (token-weighted). The same segment records RL trains on are what SFT reads, so
demonstrations made through the real harness (:mod:`shipyard.agent.demonstrate`) teach exactly
the token protocol the RL sessions use.

Limits: full-precision CPU/GPU training of what fits in memory; no packing (a micro-batch is
padded to its longest segment); no learning-rate schedule.

Shape legend: B = segments in a micro-batch, T = padded length.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence

import torch

from shipyard.agent.types import Trajectory
from shipyard.trainer.logprobs import pad_batch, pad_ints, token_logprobs
from shipyard.trainer.step import freeze_lower_layers


def sft(
    model: torch.nn.Module,
    segments: Sequence[Trajectory],
    epochs: int = 2,
    lr: float = 5e-5,
    micro_batch: int = 2,
    train_layers: int = 0,
    clip: float = 1.0,
    seed: int = 0,
    bf16_decoder: bool = False,
    on_step: Callable[[int, float], None] | None = None,
) -> list[float]:
    """Train ``model`` in place on the sampled tokens of ``segments`` (module doc); per-epoch loss."""
    if epochs < 1 or micro_batch < 1 or lr <= 0:
        raise ValueError(
            f"sft needs epochs >= 1, micro_batch >= 1 and lr > 0; got {epochs}, {micro_batch}, {lr}"
        )
    usable = [s for s in segments if any(s.loss_mask[1:])]  # the first token has no prefix to score
    if not usable:
        raise ValueError("sft: no segment has a token to learn (loss_mask is 0 after the first token)")
    freeze_lower_layers(model, train_layers)
    params = [p for p in model.parameters() if p.requires_grad]
    device = next(model.parameters()).device  # batches go where the model is (CPU or GPU)
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    order, rng, step, losses = list(range(len(usable))), random.Random(seed), 0, []
    model.train()
    for _ in range(epochs):
        rng.shuffle(order)
        total, tokens = 0.0, 0
        for start in range(0, len(order), micro_batch):
            batch = [usable[i] for i in order[start : start + micro_batch]]
            ids_BT, attn_BT = pad_batch([s.token_ids for s in batch], pad_id=0, device=device)
            mask_BT = pad_ints([s.loss_mask for s in batch], device=device).bool() & attn_BT.bool()
            logp_BT = token_logprobs(model, ids_BT, attn_BT, score_mask_BT=mask_BT, bf16_decoder=bf16_decoder)
            n = int(mask_BT[:, 1:].sum())
            loss = -logp_BT.sum() / n
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, clip)
            opt.step()
            value = loss.item()
            total, tokens, step = total + value * n, tokens + n, step + 1
            if on_step is not None:
                on_step(step, value)
        losses.append(total / tokens)
    model.eval()
    return losses
