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
- :func:`batch_advantages` applies the configured penalty, filter, baseline and scaling
  (``trainer.loss.scale_rewards``: ``group`` std, ``batch`` std of every reward of the step, as TRL,
  or ``none``; ``std_eps`` added to the std) to the groups of one step and returns the trajectories to train on, their advantages and counters
  (``dropped_groups``, ``overlong_penalty_mean``). If the filter would drop every group, all of
  them come back with zero advantages (still counted as dropped): the step then measures the
  mismatch and changes nothing, instead of having no batch at all.
- Sessions with segments (self-summarization, :mod:`shipyard.agent.summarize`): a group is
  normalised over SESSIONS (:func:`~shipyard.agent.types.group_sessions`), not segments: one
  reward per session (every segment carries it; ValueError if they differ), the overlong penalty
  on the session's sampled tokens summed over its segments, and every segment gets its session's
  advantage. With one segment per session (summarization off, or records from before segments)
  this is exactly the per-trajectory computation. ``segment_advantage`` (``agent.summary``):

  * ``"session"``: nothing more. Every sampled token of every segment, the summary turns
    included, is credited with the session's group-relative advantage: the estimator treats a
    summarizing session as one long trajectory whose summary turns are actions (what the next
    context holds is their consequence), so it optimises the expected session reward, as without
    segments, and summaries are trained only through the reward of the whole session.
  * ``"summary_bonus"``: additionally, each summary's tokens get ``bonus_coef * (s_k - mean s)``,
    where ``s_k`` is the session's reward if the segment right after summary ``k`` ended the
    session and 0 if it had to summarize again, and the mean is over the summaries of the group
    (no bonus when they are all equal). On top of the session objective this favours summaries
    after which the policy finishes in the next context (sufficient, actionable summaries); it is
    a shaping term, not the session objective (it also disfavours summaries on tasks that need
    several contexts, relative to the group). The bonus enters as a second view of the segment
    whose loss mask keeps only the summary tokens (:func:`summary_bonus`): ``train_step`` takes
    one advantage per sequence, so this costs another forward pass of that segment, and the
    step's token/sequence denominators count the summary tokens (and the view) again.
Limits: DAPO's dynamic sampling also re-samples to refill the batch; here a filtered step is just
smaller (the trainer never waits for more groups). The uniform-group test uses the raw rewards
(before the overlong penalty), i.e. all-solved / all-failed, as in DAPO.

Shape legend: G = group size (sessions), N = sessions.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import Tensor

from shipyard.agent.types import Trajectory, group_sessions
from shipyard.config.schema import LossConfig, SummaryConfig

Baseline = Literal["group_mean", "rloo"]


def group_advantages(
    rewards_G: Tensor, scale_std: bool = True, eps: float = 1e-4, baseline: Baseline = "group_mean"
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


def batch_advantages(
    groups: list[list[Trajectory]], cfg: LossConfig, summary: SummaryConfig | None = None
) -> BatchAdvantages:
    """Per group of sessions: overlong penalty, uniform-group filter, baseline and std scaling from
    ``cfg``; each segment gets its session's advantage, plus ``summary``'s bonus views (module doc)."""
    kept: list[list[list[Trajectory]]] = []
    kept_rewards: list[Tensor] = []
    penalties: list[float] = []
    for group in groups:
        sessions = group_sessions(group)
        rewards_G = torch.tensor([_session_reward(s) for s in sessions], dtype=torch.float32)
        if cfg.overlong_max_tokens is not None:
            lengths_G = torch.tensor([sum(t.num_sampled() for t in s) for s in sessions])
            penalty_G = overlong_penalty(lengths_G, cfg.overlong_max_tokens, cfg.overlong_cache_tokens)
            penalties += penalty_G.tolist()
        else:
            penalty_G = torch.zeros_like(rewards_G)
        if cfg.drop_uniform_groups and bool((rewards_G == rewards_G[0]).all()):
            continue
        kept.append(sessions)
        kept_rewards.append(rewards_G + penalty_G)
    stats = {"dropped_groups": float(len(groups) - len(kept))}
    if penalties:
        stats["overlong_penalty_mean"] = sum(penalties) / len(penalties)
    if groups and not kept:  # every group uniform: no gradient, but the step still runs and measures
        trajs = [t for g in groups for t in g]
        return BatchAdvantages(trajs, [0.0] * len(trajs), stats)
    trajs, advs = [], []
    scaling = cfg.reward_scaling()
    batch_std = torch.cat(kept_rewards).std(correction=0) if scaling == "batch" else None
    for sessions, rewards_G in zip(kept, kept_rewards, strict=True):
        adv_G = group_advantages(rewards_G, scaling == "group", cfg.std_eps, cfg.baseline)
        if batch_std is not None:
            adv_G = adv_G / (batch_std + cfg.std_eps)
        adv_G = adv_G.tolist()
        for segments, adv in zip(sessions, adv_G, strict=True):
            trajs += segments
            advs += [adv] * len(segments)
    if summary is not None and summary.segment_advantage == "summary_bonus":
        views: list[Trajectory] = []
        bonus: list[float] = []
        for sessions in kept:
            v, b = summary_bonus(sessions, summary.bonus_coef)
            views, bonus = views + v, bonus + b
        trajs, advs = trajs + views, advs + bonus
        stats["summary_bonus_views"] = float(len(views))
        stats["summary_bonus_abs_mean"] = sum(abs(b) for b in bonus) / len(bonus) if bonus else 0.0
    return BatchAdvantages(trajs, advs, stats)


def _session_reward(segments: list[Trajectory]) -> float:
    """The reward of one session (every segment must carry the same)."""
    rewards = {t.reward for t in segments}
    if len(rewards) != 1:
        raise ValueError(
            f"session {segments[0].session_id!r}: its segments carry different rewards {sorted(rewards)}; "
            "every segment must carry the session's reward"
        )
    return segments[0].reward


def summary_bonus(sessions: list[list[Trajectory]], coef: float) -> tuple[list[Trajectory], list[float]]:
    """Summary-bonus views of one group's sessions and their advantages (see the module doc).

    For each segment ending in a summary: ``s`` = the session's reward if the next segment is the
    last one, else 0; the bonus is ``coef * (s - mean s)`` over the group's summaries, and the view is
    the segment with a loss mask on its last ``summary_tokens`` tokens only. Zero bonuses give no view.
    """
    items: list[tuple[Trajectory, float]] = []
    for segments in sessions:
        for seg, nxt in zip(segments, segments[1:], strict=False):
            if seg.ends_in_summary() and seg.summary_tokens:
                items.append((seg, 0.0 if nxt.ends_in_summary() else nxt.reward))
    signals = [s for _, s in items]
    if not items or all(s == signals[0] for s in signals):
        return [], []
    mean = sum(signals) / len(signals)
    views, bonus = [], []
    for seg, signal in items:
        if coef * (signal - mean) != 0:
            views.append(_summary_view(seg))
            bonus.append(coef * (signal - mean))
    return views, bonus


def _summary_view(seg: Trajectory) -> Trajectory:
    """``seg`` with a loss mask on its summary tokens only (its last ``summary_tokens`` tokens)."""
    n, m = len(seg.token_ids), seg.summary_tokens
    if seg.loss_mask[n - m :] != [1] * m:
        raise ValueError(
            f"segment {seg.session_id!r}#{seg.segment_idx}: its last summary_tokens={m} tokens are not "
            "all sampled (loss_mask 1); the record is not a summary-ending segment"
        )
    return dataclasses.replace(seg, loss_mask=[0] * (n - m) + [1] * m)
