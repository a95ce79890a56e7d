"""One policy-gradient optimizer step over a batch of trajectories, with micro-batched gradient accumulation.

Contract of :func:`train_step`:
- Exactly one ``optimizer.step()`` over all given trajectories (unless the gradient norm is not
  finite: then the step is skipped, gradients are dropped and ``skipped`` is 1.0).
- Position ``t`` of a trajectory is trained iff ``loss_mask[t] == 1``; ``loss_mask[0]`` must be
  0 (the first token has no context). ``Trajectory.logprobs`` are the sampler's μ.
- The loss is ``cfg.loss.type`` (:func:`shipyard.trainer.loss.policy_loss`) with the per-token
  weight of ``cfg.loss.correction`` (:mod:`shipyard.trainer.corrections`). Its denominators are
  those of the WHOLE step (:class:`~shipyard.trainer.loss.StepNorm`: loss tokens and sequences with
  a loss token of all trajectories, including those with zero advantage), so the micro-batch size
  changes only float rounding, not the gradient.
- π_old is the detached current logprob: this trainer does one optimizer step per batch, so
  π_old equals π_θ in value and the PPO ratio r_t is 1 (clip inactive, gradient = -w A / N for the
  token-mean types). The ratio/clip path is still the general one, so multi-epoch training only
  has to pass a π_old recomputed before the first epoch. ρ_t = π_old/μ measures the mismatch.
- ``cfg.loss.kl_coef > 0`` needs ``ref_model`` (a frozen copy of the base model; ValueError
  otherwise): its logprobs of the same tokens enter the k3 KL penalty.
- Sequences with zero advantage give no gradient (unless the KL penalty is on) but are scored for
  the mismatch metrics; a micro-batch without gradient runs without autograd.
- Gradients are clipped to ``cfg.grad_clip``; ``grad_norm`` is the norm before clipping.
- MoE router replay: given ``seam`` (a :class:`~shipyard.models.router_replay.RouterSeam` on
  ``model``) and trajectories with ``routes``, every forward compares the trainer's own expert
  choice with the sampler's (``route_disagree``, per layer, ``route_token_disagree``) and, with
  ``cfg.router_replay``, uses the sampler's experts at the recorded positions while the gate
  weights come from the trainer's router logits (so π_old, π_θ and the gradient see the sampler's
  routing and the router still learns). Positions without a route are routed freely.
- Returns floats: loss, clip_frac, kl_ref (mean k3 to the reference; 0 without KL), num_tokens,
  the mismatch metrics of :mod:`shipyard.trainer.mismatch` (k1, k3, their p99s, mean_rho, ess,
  mask_frac, tis_trunc_frac, per-probability-bucket values, ...), grad_norm, num_seqs,
  mean_adv_abs, skipped. No entropy is computed (entropy-free).
- Micro-batches: :func:`~shipyard.trainer.microbatch.plan_micro_batches` (with ``cfg.share_prefix``
  a group's sessions go together and their shared prompt runs once; ``cfg.micro_batch_tokens`` caps
  each one's padded tokens).
Limits: the caller picks the model's train/eval mode (dropout should be 0 so π matches the
sampler).

Shape legend: B = sequences in a micro-batch, T = padded length.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from shipyard.agent.types import Trajectory
from shipyard.config.schema import TrainerConfig
from shipyard.models.hardware import resolve_bf16
from shipyard.models.router_replay import RouterSeam, route_plan
from shipyard.trainer.corrections import correction_weights
from shipyard.trainer.distributed import ONE_PROCESS, Ranks, merge_rank_metrics
from shipyard.trainer.logprobs import pad_batch, pad_floats, pad_ints, token_logprobs
from shipyard.trainer.loss import StepNorm, policy_loss
from shipyard.trainer.microbatch import plan_micro_batches
from shipyard.trainer.mismatch import MismatchAccumulator
from shipyard.trainer.records import token_key


def freeze_lower_layers(model: torch.nn.Module, train_layers: int) -> int:
    """Train only the top ``train_layers`` decoder blocks and the final norm (0 = train everything).

    Frozen blocks below the lowest trainable one need no backward pass at all, which is what
    makes a CPU run affordable; the published versions still hold every parameter. Returns the
    number of trainable parameters.
    """
    layers = getattr(getattr(model, getattr(model, "base_model_prefix", ""), None), "layers", None)
    if train_layers and layers is None:
        raise ValueError(
            "trainer.train_layers needs a model with decoder blocks at model.<prefix>.layers; set it to 0"
        )
    if train_layers:
        if train_layers > len(layers):
            raise ValueError(f"trainer.train_layers={train_layers} exceeds the model's {len(layers)} layers")
        for p in model.parameters():
            p.requires_grad_(False)
        base = getattr(model, model.base_model_prefix)
        for module in [*layers[-train_layers:], getattr(base, "norm", None)]:
            if module is not None:
                for p in module.parameters():
                    p.requires_grad_(True)
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def make_optimizer(model: torch.nn.Module, cfg: TrainerConfig) -> torch.optim.AdamW:
    """AdamW over the trainable parameters; weight decay only on matrices (not norms/biases)."""
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError("the model has no trainable parameters")
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=cfg.lr, betas=tuple(cfg.betas))


def _check_batch(
    trajectories: list[Trajectory], advantages: list[float], cfg: TrainerConfig, ref_model: Any | None
) -> StepNorm:
    """Validate the batch; returns the loss denominators of the whole step."""
    if cfg.loss.kl_coef > 0 and ref_model is None:
        raise ValueError(
            f"trainer.loss.kl_coef={cfg.loss.kl_coef} > 0 needs ref_model (a frozen copy of the base model)"
        )
    if not trajectories:
        raise ValueError("train_step needs at least one trajectory")
    if len(advantages) != len(trajectories):
        raise ValueError(f"{len(advantages)} advantages for {len(trajectories)} trajectories")
    if not all(math.isfinite(a) for a in advantages):
        raise ValueError(f"advantages must be finite, got {advantages}")
    for traj in trajectories:
        if traj.loss_mask and traj.loss_mask[0] == 1:
            raise ValueError(
                f"trajectory {traj.group_id}/{traj.sample_idx}: loss_mask[0] = 1, but token 0 has no context"
            )
    tokens = [sum(1 for m in t.loss_mask if m == 1) for t in trajectories]
    if sum(tokens) == 0:
        raise ValueError("no trajectory in the batch has a loss token (loss_mask all zero); nothing to train")
    return StepNorm(tokens=sum(tokens), seqs=sum(1 for n in tokens if n), seq_tokens=cfg.loss.dr_grpo_tokens)


def _micro_batch_loss(
    model: Any,
    ref_model: Any | None,
    chunk: list[Trajectory],
    adv_B: Tensor,
    cfg: TrainerConfig,
    pad_id: int,
    norm: StepNorm,
    temperature: float,
    mismatch: MismatchAccumulator,
    seam: RouterSeam | None = None,
    prefix: int = 0,
) -> tuple[Tensor, dict[str, Tensor]]:
    device = adv_B.device
    ids_BT, attn_BT = pad_batch([t.token_ids for t in chunk], pad_id, device)
    mask_BT = pad_ints([t.loss_mask for t in chunk], 0, device) == 1
    infer_BT = pad_floats([t.logprobs for t in chunk], 0.0, device)
    score = dict(score_mask_BT=mask_BT, temperature=temperature, bf16_decoder=cfg.bf16_decoder, prefix=prefix)
    routes = [t.routes for t in chunk]
    if seam is not None and any(r is not None for r in routes):
        with seam.plan(route_plan(routes, ids_BT.shape[1], seam), replay=cfg.router_replay):
            logprobs_BT = token_logprobs(model, ids_BT, attn_BT, **score)
    else:
        logprobs_BT = token_logprobs(model, ids_BT, attn_BT, **score)
    old_BT = logprobs_BT.detach()  # π_old == π_θ in value: one optimizer step per batch
    ref_BT = None
    if cfg.loss.kl_coef > 0:
        with torch.no_grad():
            ref_BT = token_logprobs(ref_model, ids_BT, attn_BT, **score)
    low, high = cfg.loss.correction_bounds()
    corr = correction_weights(cfg.loss.correction, old_BT - infer_BT, mask_BT, low=low, high=high)
    mismatch.add(old_BT, infer_BT, mask_BT, corr)
    mismatch.keep([token_key(t) for t in chunk], old_BT, mask_BT)
    clip_low, clip_high = cfg.loss.clip_range()
    return policy_loss(
        cfg.loss.type,
        logprobs_BT,
        old_BT,
        adv_B,
        mask_BT,
        corr.weight_BT,
        clip_low=clip_low,
        clip_high=clip_high,
        norm=norm,
        ref_logprobs_BT=ref_BT,
        kl_coef=cfg.loss.kl_coef,
    )


def _resolve_precision(cfg: TrainerConfig, device: str) -> TrainerConfig:
    """``cfg`` with ``bf16_decoder = "auto"`` resolved for ``device`` (the loop resolves and records it
    once; this covers direct callers)."""
    if cfg.bf16_decoder != "auto":
        return cfg
    return cfg.model_copy(update={"bf16_decoder": resolve_bf16("auto", device, "trainer.bf16_decoder")[0]})


def train_step(
    model: Any,
    optimizer: torch.optim.Optimizer,
    trajectories: list[Trajectory],
    advantages: list[float],
    cfg: TrainerConfig,
    pad_id: int,
    *,
    temperature: float = 1.0,
    ref_model: Any | None = None,
    seam: RouterSeam | None = None,
    trainer_logprobs: dict[str, list[float]] | None = None,
    ranks: Ranks = ONE_PROCESS,
) -> dict[str, float]:
    """One optimizer step over ``trajectories`` (see module doc); returns float metrics. With
    ``trainer_logprobs`` (a dict), fills it with each trajectory's logprobs under the trainer before
    the update, at its sampled positions in order, keyed by :func:`~shipyard.trainer.records.token_key`.

    In a trainer group (``ranks.world > 1``, ``model`` sharded by
    :func:`~shipyard.trainer.distributed.shard_policy`) every rank passes the whole step's batch
    and trains its share (:func:`~shipyard.trainer.microbatch.rank_split`); every micro-batch runs
    a backward so the ranks' collectives line up; rank 0 returns the metrics of the whole step."""
    norm = _check_batch(trajectories, advantages, cfg, ref_model)
    cfg = _resolve_precision(cfg, next(model.parameters()).device.type)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    optimizer.zero_grad(set_to_none=True)
    mismatch = MismatchAccumulator(trainer_logprobs)
    if seam is not None:
        seam.reset_disagreement()
    score = {"cfg": cfg, "pad_id": pad_id, "norm": norm, "temperature": temperature, "seam": seam}
    sums = _accumulate(model, ref_model, trajectories, advantages, mismatch, ranks, score)
    grad_norm_f = clip_grad_norm(params, cfg.grad_clip)
    skipped = not math.isfinite(grad_norm_f)
    if not skipped:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    totals = {k: float(v) for k, v in ranks.sum(sums).items()}
    merge_rank_metrics(ranks, mismatch, seam)
    out = {
        "loss": totals["loss_sum"],
        "clip_frac": totals["clip_count"] / norm.tokens,
        "kl_ref": totals["kl_sum"] / norm.tokens,
        "num_tokens": float(norm.tokens),
        **mismatch.result(),
        **(seam.disagreement() if seam is not None else {}),
    }
    out.update(
        grad_norm=grad_norm_f,
        num_seqs=float(len(trajectories)),
        mean_adv_abs=sum(abs(a) for a in advantages) / len(advantages),
        skipped=float(skipped),
    )
    return out


def _accumulate(
    model: Any,
    ref_model: Any | None,
    trajectories: list[Trajectory],
    advantages: list[float],
    mismatch: MismatchAccumulator,
    ranks: Ranks,
    score: dict[str, Any],
) -> dict[str, Tensor]:
    """Forward and backward over this rank's micro-batches (gradients accumulate); the loss sums."""
    cfg: TrainerConfig = score["cfg"]
    device = next(model.parameters()).device
    sums = {k: torch.zeros((), dtype=torch.float64) for k in ("loss_sum", "clip_count", "kl_sum")}
    replay = score["seam"] is not None and any(t.routes is not None for t in trajectories)
    share = cfg.share_prefix and not replay  # a route plan is per [B, T] row of one forward
    plan = plan_micro_batches(
        trajectories, ranks.world, ranks.rank, cfg.micro_batch, share, cfg.micro_batch_tokens
    )
    shortest = min(trajectories, key=lambda t: len(t.token_ids))
    for idx, prefix in plan:
        filler = not idx  # this rank has no sequence left: a zero-weight pass keeps FSDP in step
        chunk = [trajectories[i] for i in idx] if idx else [shortest]
        adv_B = torch.tensor([advantages[i] for i in idx] or [0.0], dtype=torch.float32, device=device)
        needs_grad = ranks.world > 1 or bool((adv_B != 0).any()) or cfg.loss.kl_coef > 0
        with torch.set_grad_enabled(needs_grad):
            loss, metrics = _micro_batch_loss(
                model,
                ref_model,
                chunk,
                adv_B,
                cfg,
                score["pad_id"],
                score["norm"],
                score["temperature"],
                MismatchAccumulator() if filler else mismatch,
                None if filler else score["seam"],
                prefix,
            )
        if needs_grad and loss.requires_grad:
            (loss * 0.0 if filler else loss).backward()
        if not filler:
            for key in sums:
                sums[key] = sums[key] + metrics[key].detach().double().cpu()
    return sums


def clip_grad_norm(params: list[Tensor], max_norm: float) -> float:
    """Clip the global gradient norm (sharded gradients included); the norm before clipping."""
    if not params:
        return 0.0
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
