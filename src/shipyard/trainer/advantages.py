"""Group-relative advantages: GRPO / Dr.GRPO / RLOO baselines, DAPO's group filter and overlong penalty.

Contract:
- :func:`group_advantages` turns one group's rewards ``r`` into advantages ``(r - b) / (std + eps)``
  or ``r - b`` (``scale_std=False``, Dr.GRPO), where the baseline ``b`` is the group mean
  (``"group_mean"``) or, for sample ``i``, the mean of the OTHER samples (``"rloo"``:
  ``r_i - mean_{j != i} r_j = G / (G - 1) * (r_i - mean)``). ``std`` is the population std
  (``correction=0``) so a group of one is well defined. A group whose rewards are all equal gets
  exact zeros (no eps-amplified rounding noise), whatever the baseline.
- :func:`overlong_penalty` is DAPO's soft overlong punishment on a session's sampled-token count
  ``L`` (eq. 13 of arXiv:2503.14476): 0 for ``L <= L_max - L_cache``,
  ``((L_max - L_cache) - L) / L_cache`` up to ``L_max``, -1 beyond.
- :func:`batch_advantages` applies the configured penalty, filter and baseline to the groups of
  one step and returns the trajectories to train on, their advantages and counters
  (``dropped_groups``, ``overlong_penalty_mean``). If the filter would drop every group, all of
  them come back with zero advantages (still counted as dropped): the step then measures the
  mismatch and changes nothing, instead of having no batch at all.
Limits: DAPO's dynamic sampling also re-samples to refill the batch; here a filtered step is just
smaller (the trainer never waits for more groups). The uniform-group test uses the raw rewards
(before the overlong penalty), i.e. all-solved / all-failed, as in DAPO.

Shape legend: G = group size, N = sessions.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import Tensor

from shipyard.agent.types import Trajectory
from shipyard.config.schema import LossConfig

Baseline = Literal["group_mean", "rloo"]


def group_advantages(
    rewards_G: Tensor, scale_std: bool = True, eps: float = 1e-6, baseline: Baseline = "group_mean"
) -> Tensor:
    """Advantages of one group: ``(r - b) / (std + eps)``, or ``r - b`` without std (see module doc)."""
    if rewards_G.dim() != 1 or rewards_G.numel() == 0:
        raise ValueError(
            f"rewards must be a non-empty 1-D tensor (one group), got shape {tuple(rewards_G.shape)}"
        )
    if eps <= 0:
        raise ValueError(f"eps must be > 0, got {eps}")
    if baseline not in ("group_mean", "rloo"):
        raise ValueError(f"baseline must be 'group_mean' or 'rloo', got {baseline!r}")
    rewards_G = rewards_G.to(torch.float32)
    if not torch.isfinite(rewards_G).all():
        raise ValueError(f"rewards must be finite, got {rewards_G.tolist()}")
    if bool((rewards_G == rewards_G[0]).all()):
        return torch.zeros_like(rewards_G)
    centered_G = rewards_G - rewards_G.mean()
    if baseline == "rloo":
        n = rewards_G.numel()
        centered_G = centered_G * (n / (n - 1))  # n >= 2 here: a group of one is uniform
    if not scale_std:
        return centered_G
    return centered_G / (rewards_G.std(correction=0) + eps)


def overlong_penalty(lengths_N: Tensor, max_tokens: int, cache_tokens: int) -> Tensor:
    """DAPO's soft overlong penalty (<= 0) for sampled-token counts ``lengths_N``."""
    if not 0 < cache_tokens < max_tokens:
        raise ValueError(
            f"need 0 < overlong_cache_tokens < overlong_max_tokens, got {cache_tokens}, {max_tokens}"
        )
    start = max_tokens - cache_tokens
    ramp_N = (start - lengths_N.to(torch.float32)) / cache_tokens
    return ramp_N.clamp(min=-1.0, max=0.0)


@dataclass
class BatchAdvantages:
    """What one step trains on: kept trajectories (in order), their advantages, and counters."""

    trajectories: list[Trajectory]
    advantages: list[float]
    stats: dict[str, float] = field(default_factory=dict)


def batch_advantages(groups: list[list[Trajectory]], cfg: LossConfig) -> BatchAdvantages:
    """Per group: overlong penalty, uniform-group filter, baseline and std scaling from ``cfg``."""
    kept: list[list[Trajectory]] = []
    kept_rewards: list[Tensor] = []
    penalties: list[float] = []
    for group in groups:
        rewards_G = torch.tensor([t.reward for t in group], dtype=torch.float32)
        if cfg.overlong_max_tokens is not None:
            lengths_G = torch.tensor([t.num_sampled() for t in group])
            penalty_G = overlong_penalty(lengths_G, cfg.overlong_max_tokens, cfg.overlong_cache_tokens)
            penalties += penalty_G.tolist()
        else:
            penalty_G = torch.zeros_like(rewards_G)
        if cfg.drop_uniform_groups and bool((rewards_G == rewards_G[0]).all()):
            continue
        kept.append(group)
        kept_rewards.append(rewards_G + penalty_G)
    stats = {"dropped_groups": float(len(groups) - len(kept))}
    if penalties:
        stats["overlong_penalty_mean"] = sum(penalties) / len(penalties)
    if groups and not kept:  # every group uniform: no gradient, but the step still runs and measures
        trajs = [t for g in groups for t in g]
        return BatchAdvantages(trajs, [0.0] * len(trajs), stats)
    trajs, advs = [], []
    for group, rewards_G in zip(kept, kept_rewards, strict=True):
        trajs += group
        advs += group_advantages(rewards_G, scale_std=cfg.use_std(), baseline=cfg.baseline).tolist()
    return BatchAdvantages(trajs, advs, stats)
