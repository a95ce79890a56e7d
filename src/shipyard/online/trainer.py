"""The online trainer: matured (generation, reward) records in, policy updates and candidates out.

Contract, per :meth:`OnlineTrainer.step`:
1. mature what is due (:meth:`OnlineDB.mature`), then take up to ``online.trainer.batch_size``
   rewarded generations after the trainer's cursor, in the order their rewards matured; fewer
   than ``min_batch``: no step (None);
2. drop those served by a version more than ``max_version_lag`` serving versions behind the current
   one (``online/dropped_stale``) or sampled at another temperature than ``sampling.temperature``
   (their logprobs are of another distribution: ``online/dropped_temperature``);
3. advantages against per-prompt baselines (:class:`Baselines`; RLOO / REINFORCE with a baseline,
   not GRPO groups: production prompts rarely repeat within a step), scaled by the step's std
   (``online.trainer.scale``);
4. one optimizer step with the run's loss family (:func:`shipyard.trainer.step.train_step`): each
   generation is a trajectory whose behaviour logprobs are the *logged* ones, so the off-policy
   correction (``trainer.loss.correction``: TIS, masks, ...) weighs the current policy against the
   version that actually served it, however stale;
5. checkpoint (weights, optimizer, cursor, baselines) atomically, so a restarted trainer resumes at
   the same cursor and never trains on a generation twice; every ``candidate_every`` steps publish
   the weights as candidate version ``step`` to the candidate store (never followed by servers:
   the gate decides, :mod:`shipyard.online.gate`), and also after a step that comes
   ``candidate_every_s`` seconds or more after the last candidate.

Shape legend: no tensors here; the step's tensors live in :mod:`shipyard.trainer.step`.

Limits: one process (the sharded trainer is for offline RL); the temperature filter assumes one
serving temperature per policy.
"""

from __future__ import annotations

import collections
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from shipyard.agent.types import Trajectory
from shipyard.config.schema import OnlineTrainerConfig, ShipyardConfig
from shipyard.online.database import OnlineDB, prompt_key
from shipyard.online.reward import RewardModel
from shipyard.online.types import RewardedGeneration
from shipyard.store.types import Store


def to_trajectory(item: RewardedGeneration) -> Trajectory:
    """The generation as the trainer's record: prompt then sampled tokens, loss on the sampled ones,
    their logged logprobs and versions."""
    r = item.record
    p, n = len(r.prompt_ids), len(r.token_ids)
    return Trajectory(
        task_id=r.generation_id,
        group_id=prompt_key(r.prompt_ids),
        sample_idx=0,
        token_ids=list(r.prompt_ids) + list(r.token_ids),
        loss_mask=[0] * p + [1] * n,
        logprobs=[0.0] * p + list(r.logprobs),
        versions=[r.weight_version] * p + list(r.versions),
        prompt_len=p,
        reward=item.reward,
        finish=r.finish_reason,
        session_id=r.session_id,
    )


class Baselines:
    """Per-prompt reward baselines (module doc, step 3); its state goes into the checkpoint."""

    def __init__(self, cfg: OnlineTrainerConfig, state: dict[str, Any] | None = None) -> None:
        self.cfg = cfg
        state = state or {}
        self.history: dict[str, collections.deque[float]] = {
            k: collections.deque(v, maxlen=cfg.baseline_window) for k, v in state.get("history", {}).items()
        }
        self.mean, self.count = float(state.get("mean", 0.0)), int(state.get("count", 0))

    def state(self) -> dict[str, Any]:
        return {
            "history": {k: list(v) for k, v in self.history.items()},
            "mean": self.mean,
            "count": self.count,
        }

    def advantages(self, keys: list[str], rewards: list[float]) -> tuple[list[float], dict[str, float]]:
        """(advantage per item, how many baselines came from where); then remembers the rewards."""
        by_key: dict[str, list[int]] = collections.defaultdict(list)
        for i, k in enumerate(keys):
            by_key[k].append(i)
        out, source = [], collections.Counter[str]()
        for i, (k, r) in enumerate(zip(keys, rewards, strict=True)):
            others = [rewards[j] for j in by_key[k] if j != i]
            if self.cfg.baseline == "prompt" and others:
                base, src = sum(others) / len(others), "loo"
            elif self.cfg.baseline == "prompt" and self.history.get(k):
                base, src = sum(self.history[k]) / len(self.history[k]), "history"
            elif self.count:
                base, src = self.mean, "global"
            else:  # the very first step: the other items of the step
                rest = [rewards[j] for j in range(len(rewards)) if j != i]
                base, src = (sum(rest) / len(rest) if rest else r), "step"
            out.append(r - base)
            source[src] += 1
        for k, r in zip(keys, rewards, strict=True):
            self.history.setdefault(k, collections.deque(maxlen=self.cfg.baseline_window)).append(r)
            self.count += 1
            self.mean += (r - self.mean) / min(self.count, 1000)  # running mean, then a slow EMA
        return out, {f"online/baseline_{s}": float(n) for s, n in source.items()}


def scale(advantages: list[float], mode: str, eps: float) -> list[float]:
    if mode == "none" or len(advantages) < 2:
        return advantages
    m = sum(advantages) / len(advantages)
    std = math.sqrt(sum((a - m) ** 2 for a in advantages) / (len(advantages) - 1))
    return [a / (std + eps) for a in advantages]


class OnlineTrainer:
    """Steps over matured production records (module doc)."""

    def __init__(
        self,
        cfg: ShipyardConfig,
        db: OnlineDB,
        candidates: Store,
        run_dir: Path,
        serving_version: Callable[[], int],
    ) -> None:
        from shipyard.trainer.checkpoint import load_latest_checkpoint
        from shipyard.trainer.distributed import ONE_PROCESS
        from shipyard.trainer.loop import build_policy, make_publisher

        self.cfg, self.ocfg, self.db = cfg, cfg.online.trainer, db
        self.serving_version = serving_version
        self.rewards = RewardModel(cfg.online.reward)
        self.policy = build_policy(cfg, ONE_PROCESS)
        self.ckpt_root = Path(run_dir) / "online-checkpoints"
        self.state = load_latest_checkpoint(self.ckpt_root, self.policy.scorer, self.policy.optimizer) or {
            "step": 0,
            "cursor": 0,
            "baselines": {},
        }
        self.baselines = Baselines(self.ocfg, self.state["baselines"])
        self.publisher = make_publisher(cfg, candidates, with_feed=False)
        self.last_candidate_at = time.time()

    @property
    def steps(self) -> int:
        return int(self.state["step"])

    def take(self) -> tuple[list[RewardedGeneration], int, dict[str, float]] | None:
        """Steps 1-2: the usable items, the new cursor and the drop counters (None: not enough yet)."""
        self.db.mature(self.rewards, time.time())
        taken = self.db.rewarded(self.state["cursor"], self.ocfg.batch_size)
        if len(taken) < self.ocfg.min_batch:
            return None
        serving = self.serving_version()
        temp = self.cfg.sampling.temperature
        fresh = [it for _, it in taken if serving - it.record.weight_version <= self.ocfg.max_version_lag]
        usable = [it for it in fresh if abs(it.record.temperature - temp) < 1e-6]
        counts = {
            "online/dropped_stale": float(len(taken) - len(fresh)),
            "online/dropped_temperature": float(len(fresh) - len(usable)),
        }
        if usable:
            lags = [serving - it.record.weight_version for it in usable]
            counts["online/version_lag_mean"] = sum(lags) / len(lags)
        return usable, taken[-1][0], counts

    def step(self) -> dict[str, float] | None:
        """One step (module doc); its metrics, or None when too few rewards have matured."""
        from shipyard.trainer.checkpoint import save_checkpoint
        from shipyard.trainer.step import train_step

        got = self.take()
        if got is None:
            return None
        items, cursor, metrics = got
        step = self.steps + 1
        trajs = [to_trajectory(it) for it in items]
        rewards = [it.reward for it in items]
        advs, sources = self.baselines.advantages([t.group_id for t in trajs], rewards) if items else ([], {})
        advs = scale(advs, self.ocfg.scale, self.cfg.trainer.loss.std_eps)
        metrics.update(sources, **{"online/items": float(len(items)), "online/cursor": float(cursor)})
        if items:
            metrics["online/reward_mean"] = sum(rewards) / len(rewards)
        if any(a != 0 for a in advs):
            stats = train_step(
                self.policy.scorer,
                self.policy.optimizer,
                trajs,
                advs,
                self.policy.tcfg,
                self.policy.tok.pad_token_id,
                temperature=self.cfg.sampling.temperature,
            )
            metrics.update({f"train/{k}": v for k, v in stats.items()})
        self.state = {"step": step, "cursor": cursor, "baselines": self.baselines.state()}
        save_checkpoint(
            self.ckpt_root,
            step,
            self.policy.scorer,
            self.policy.optimizer,
            self.state,
            self.cfg.trainer.keep_checkpoints,
        )
        if self._candidate_due(step):
            metrics["online/candidate"] = float(self.publish_candidate(step))
        return {"step": float(step), **metrics}

    def _candidate_due(self, step: int) -> bool:
        every_s = self.ocfg.candidate_every_s
        late = every_s is not None and time.time() - self.last_candidate_at >= every_s
        return step % self.ocfg.candidate_every == 0 or late

    def publish_candidate(self, version: int) -> int:
        from shipyard.weights.publisher import named_params

        self.last_candidate_at = time.time()
        self.publisher.publish(
            version, named_params(self.policy.model), extra={"online_cursor": self.state["cursor"]}
        )
        return version

    def load_weights(self, weights: dict[str, Any]) -> None:
        """Continue from ``weights`` (the serving version, after a rejected candidate): load them and
        clear the optimizer's moments."""
        import torch

        with torch.no_grad():
            for name, p in self.policy.model.named_parameters():
                if name in weights:
                    p.copy_(weights[name].to(p.dtype))
        self.policy.optimizer.state.clear()
