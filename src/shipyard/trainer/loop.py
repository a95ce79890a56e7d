"""The trainer process: consume rollouts as they arrive, step, checkpoint, publish the next version.

Contract, per step ``s`` (1-based; version ``s`` is the weights after step ``s``, version 0 the
base model):
1. take ``groups_per_step`` groups from ``rollouts/`` (dropping and counting stale ones),
2. advantages per group (:func:`batch_advantages`: ``trainer.loss`` baseline, std scaling, DAPO
   filter and overlong penalty, over sessions; ``agent.summary.segment_advantage`` for summarizing
   sessions' segments), one optimizer step (:func:`train_step`; with
   ``trainer.loss.kl_coef > 0`` against a frozen copy of the base model loaded at start),
3. save a resumable checkpoint (weights, optimizer, consumed group ids) — before publishing,
4. publish version ``s`` (a delta against ``s - 1``, a snapshot every ``weights.snapshot_every``;
   shards, manifest, LATEST), log metrics, and write ``control/progress.json`` (the version and,
   per worker, the groups finished with: the workers pace on it).
A restart loads the newest complete checkpoint and re-publishes its version if the crash came
between 3 and 4, so no published version is lost and no group is trained on twice. At the end it
writes ``control/finished`` so rollout workers stop.

A sharded trainer (``trainer.world_size > 1``) runs this on every rank: rank 0 reads the feed and
broadcasts the step's groups, every rank trains its share of the sequences
(:mod:`shipyard.trainer.distributed`), all write the checkpoint together (DCP), every rank codes
and uploads its share of the version, and rank 0 writes the manifest, the metrics and the end.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from shipyard.agent.summarize import rollout_summary_metrics
from shipyard.config.schema import ShipyardConfig
from shipyard.envs.grading.anticheat import hack_metrics
from shipyard.envs.grading.rewards import component_metrics
from shipyard.metrics.health import Beat
from shipyard.metrics.logger import MetricsLogger, read_metrics
from shipyard.rollout.types import FINISHED_KEY, PROGRESS_KEY, TrainerProgress
from shipyard.store.run import read_identity
from shipyard.store.types import Store
from shipyard.trainer.distributed import ONE_PROCESS, Ranks, full_params, rank_tensors
from shipyard.trainer.feed import BatchGate, RolloutFeed, Taken
from shipyard.trainer.records import write_step_logprobs
from shipyard.weights.snapshot import WeightPublisher, named_params, read_manifest


def run_trainer(
    cfg: ShipyardConfig,
    store: Store,
    run_dir: Path,
    ranks: Ranks = ONE_PROCESS,
    gate: BatchGate | None = None,
    beat: Beat | None = None,
) -> dict[str, Any]:
    """Train the run (module doc); every rank of a sharded trainer calls it, rank 0 leads. ``beat``
    hears each phase of a step begin (the run's watchdog, :mod:`shipyard.metrics.health`).

    Longer than 60 lines on purpose: it is the training loop, kept in one piece so it reads top to
    bottom (set-up, resume, then one step: take, advantages, train, checkpoint, publish, log)."""
    from shipyard.trainer.advantages import batch_advantages
    from shipyard.trainer.checkpoint import load_latest_checkpoint, save_checkpoint
    from shipyard.trainer.step import train_step

    identity = read_identity(store)  # the run this trainer trains: its rollouts only
    policy = build_policy(cfg, ranks)
    step_kw = {
        "cfg": policy.tcfg,
        "pad_id": policy.tok.pad_token_id,
        "temperature": cfg.sampling.temperature,
        "ref_model": _reference_model(cfg),
        "seam": _router_seam(policy.model, cfg),
        "ranks": ranks,
    }
    ckpt_root = run_dir / "checkpoints"
    state = load_latest_checkpoint(ckpt_root, policy.scorer, policy.optimizer, ranks) or {
        "step": 0,
        "consumed": [],
        "idle_s": 0.0,
    }
    publisher = make_publisher(cfg, store, with_feed=ranks.leader)
    lead = _Leader(cfg, store, run_dir, identity.run_id, state, publisher, gate) if ranks.leader else None
    _publish(lead, publisher, ranks, state["step"], policy, only_missing=True)  # a kill after the checkpoint
    if lead:
        _relog_checkpointed_step(lead.logger, state, store)  # after the re-publish: it reads the manifest
        lead.report_progress(state["step"], reread=True)  # a resumed trainer recounts what it consumed
    t_start = time.time() - state.get("elapsed_s", 0.0)  # a resumed run's clock goes on
    phase = beat.enter if beat is not None else lambda _: None
    for step in range(state["step"] + 1, cfg.trainer.steps + 1):
        t0 = time.time()
        phase("wait_rollouts")
        taken = ranks.broadcast(lead.take(cfg, step) if lead else None)
        phase("forward_backward")
        batch = batch_advantages(taken.groups, cfg.trainer.loss, cfg.agent.summary)
        t1 = time.time()
        tokens: dict[str, list[float]] | None = {} if cfg.trainer.record_logprobs else None
        stats = train_step(
            policy.scorer,
            policy.optimizer,
            batch.trajectories,
            batch.advantages,
            trainer_logprobs=tokens,
            **step_kw,
        )
        timing = _timing(t0, t1, time.time(), t_start)
        record = _train_record(
            taken, {**stats, **batch.stats}, timing, step - 1, cfg.trainer.max_off_policy_steps
        )
        groups = [g[0].group_id for g in taken.groups]
        state = {
            "step": step,
            "consumed": sorted(lead.feed.consumed) if lead else [],
            "idle_s": state["idle_s"] + taken.wait_s,
            "elapsed_s": time.time() - t_start,
            "log": {"train": record, "groups": groups},  # re-logged on resume if the kill came first
        }
        if tokens is not None and lead:
            write_step_logprobs(run_dir, step, tokens)
        phase("checkpoint")
        save_checkpoint(
            ckpt_root, step, policy.scorer, policy.optimizer, state, cfg.trainer.keep_checkpoints, ranks
        )
        phase("publish")
        manifest = _publish(lead, publisher, ranks, step, policy)
        if lead and manifest:
            lead.logger.log(
                step, record, {"kind": "consumed", "groups": groups, "digest": manifest.state_digest}
            )
            lead.report_progress(step)
    phase("done")
    if lead:
        lead.finish(cfg, store)
    return {
        "final_version": cfg.trainer.steps,
        "idle_s": state["idle_s"],
        "seconds": time.time() - t_start,
        "precision": policy.precision,
        "foreign_rejected": lead.feed.foreign_rejected if lead else 0,
        "world_size": ranks.world,
    }


class _Leader:
    """What rank 0 alone does: read the feed, publish versions, log metrics, end the run."""

    def __init__(
        self,
        cfg: ShipyardConfig,
        store: Store,
        run_dir: Path,
        run_id: str,
        state: dict[str, Any],
        publisher: Any,
        gate: BatchGate | None = None,
    ) -> None:
        self.publisher = publisher
        self.store = store
        self._reported: tuple[int, Counter[str]] | None = None
        self.feed = RolloutFeed(store, run_id, consumed=set(state["consumed"]), gate=gate)
        self.logger = MetricsLogger(run_dir)

    def take(self, cfg: ShipyardConfig, step: int) -> Taken:
        t = cfg.trainer
        credit = partial(self.report_progress, step - 1)  # while it waits: dropped groups get replaced
        return self.feed.take(
            t.groups_per_step,
            step - 1,
            t.max_off_policy_steps,
            t.wait_timeout_s,
            credit,
            skip_uniform=t.skip_uniform_groups,
        )

    def report_progress(self, version: int, done: Counter[str] | None = None, reread: bool = False) -> None:
        """Tell the workers what is consumed (``control/progress.json``; ``done`` defaults to the
        feed's ``consumed_by``): they pace on it. Written only when it changed. With ``reread``,
        read the store's batches first (a resumed feed counts its consumed groups then)."""
        if reread:
            self.feed.poll()
        done = self.feed.consumed_by if done is None else done
        if (version, done) == self._reported:
            return
        self._reported = (version, Counter(done))
        self.store.put(PROGRESS_KEY, TrainerProgress(version, dict(done), time.time()).to_bytes())

    def finish(self, cfg: ShipyardConfig, store: Store) -> None:
        """Tell the workers the run is done (``control/finished``), close the log and the feed."""
        store.put(FINISHED_KEY, json.dumps({"version": cfg.trainer.steps}).encode())
        self.logger.close()
        if self.publisher.feed is not None:
            self.publisher.feed.close()


def _publish(
    lead: _Leader | None, publisher: Any, ranks: Ranks, step: int, policy: Policy, only_missing: bool = False
) -> Any:
    """Publish version ``step``: its manifest on rank 0, None elsewhere or when ``only_missing`` and it
    is already published. One process codes every tensor; a trainer group gathers the full weights
    on every rank, each rank codes and uploads the share it owns (:func:`rank_tensors`) in
    parallel, and rank 0 writes the one manifest naming every rank's shards, last."""
    if ranks.broadcast(only_missing and lead is not None and lead.publisher.has(step)):
        return None
    if ranks.world == 1:
        return publisher.publish(step, named_params(policy.model))
    weights = full_params(policy.scorer, "model.")
    mine = {n: weights[n] for n in rank_tensors(weights, ranks.world)[ranks.rank]}
    ready = ranks.gather(publisher.delta_ready(step, mine))
    delta = ranks.broadcast(all(ready) if ranks.leader else None)
    snapshot = not delta or step % publisher.snapshot_every == 0
    part = publisher.encode(step, mine, delta=delta, snapshot=snapshot, prefix=f"r{ranks.rank}-")
    parts = ranks.gather(part)
    return publisher.commit(step, parts) if lead else None


def _train_record(
    taken: Taken, stats: dict[str, float], timing: dict[str, float], version: int, bound: int
) -> dict[str, Any]:
    """The step's ``train`` metrics record: trainer, batch, rollout, region and timing figures.
    ``rollout/over_bound_trained`` audits the staleness bound on what is trained: trajectories (session
    segments) with a token sampled more than ``bound`` versions before ``version`` (the weights this step trains)."""
    trajs = [t for group in taken.groups for t in group]
    over = sum(version - t.min_version() > bound for t in trajs if t.num_sampled())
    return {
        "kind": "train",
        **_named(stats),
        **_rollout_metrics(taken, trajs),
        "rollout/over_bound_trained": float(over),
        **region_metrics(taken),
        **timing,
    }


def region_metrics(taken: Taken) -> dict[str, float]:
    """Per region (``fleet.region`` of the workers): ``region/<r>/groups``, ``staleness_mean``,
    ``staleness_max`` of the groups taken, and ``adoption_lag_s`` (mean seconds from a version's
    publication to a server of the region going live with it) and ``version`` (newest adopted) of
    the adoptions reported since the last step."""
    out: dict[str, float] = {}
    for region in sorted(set(taken.regions)):
        st = [s for s, r in zip(taken.staleness, taken.regions, strict=True) if r == region]
        out |= {
            f"region/{region}/groups": float(len(st)),
            f"region/{region}/staleness_mean": sum(st) / len(st),
            f"region/{region}/staleness_max": float(max(st)),
        }
    for region in sorted({a["region"] for a in taken.adoptions}):
        events = [a for a in taken.adoptions if a["region"] == region]
        lags = [a["at"] - a["published_at"] for a in events if a.get("published_at") is not None]
        out[f"region/{region}/version"] = float(max(a["version"] for a in events))
        if lags:
            out[f"region/{region}/adoption_lag_s"] = sum(lags) / len(lags)
    return out


@dataclass
class Policy:
    """The trained policy on one rank: the HF ``model``, the ``scorer`` the step runs (the model in a
    :class:`~shipyard.trainer.logprobs.TokenScorer`, sharded at world size > 1), and its optimizer."""

    model: Any
    scorer: Any
    tok: Any
    optimizer: Any
    tcfg: Any
    precision: dict[str, Any]


def build_policy(cfg: ShipyardConfig, ranks: Ranks) -> Policy:
    """Load the policy on this rank's device, freeze, shard (world > 1) and make its optimizer."""
    import torch

    from shipyard.models.loading import load_model
    from shipyard.trainer.distributed import shard_policy
    from shipyard.trainer.logprobs import TokenScorer
    from shipyard.trainer.step import freeze_lower_layers, make_optimizer

    torch.set_num_threads(cfg.trainer.threads)
    torch.manual_seed(cfg.run.seed)
    model, tok = load_model(cfg.model)
    model = model.to(cfg.trainer.device)
    tcfg, precision = trainer_precision(cfg, cfg.trainer.device)
    model.train()
    freeze_lower_layers(model, tcfg.train_layers)
    scorer = TokenScorer(model)
    if ranks.world > 1:
        shard_policy(scorer, cfg.trainer.fsdp, bf16=bool(tcfg.bf16_decoder))
    return Policy(model, scorer, tok, make_optimizer(scorer, tcfg), tcfg, precision)


def trainer_precision(cfg: ShipyardConfig, device: str) -> tuple[Any, dict[str, Any]]:
    """The trainer settings with ``bf16_decoder`` resolved for the model's ``device`` (``auto`` ->
    true/false from :func:`shipyard.models.hardware.resolve_bf16`), and the record of that choice."""
    from shipyard.models.hardware import resolve_bf16

    use, reason = resolve_bf16(cfg.trainer.bf16_decoder, device, "trainer.bf16_decoder")
    print(f"trainer precision: {reason}", flush=True)
    return cfg.trainer.model_copy(update={"bf16_decoder": use}), {"bf16_decoder": use, "reason": reason}


def make_publisher(cfg: ShipyardConfig, store: Store, with_feed: bool = True) -> WeightPublisher:
    """The trainer's publisher, serving a version feed when ``weights.feed_port`` is set (rank 0's)."""
    from shipyard.weights.feed import VersionFeed

    w = cfg.weights
    feed = None
    if w.feed_port is not None and with_feed:
        feed = VersionFeed(w.feed_host, w.feed_port, int(w.feed_inline_mb * (1 << 20))).start()
    return WeightPublisher(
        store,
        snapshot_every=w.snapshot_every,
        keep=w.keep,
        shard_bytes=int(w.shard_mb * (1 << 20)),
        workers=w.workers,
        connections=cfg.store.connections,
        dtype=published_dtype(cfg),
        feed=feed,
    )


def published_dtype(cfg: ShipyardConfig) -> Any:
    """``weights.dtype`` as a torch dtype: None = the trainer's own; ``auto`` = ``inference.dtype`` as
    it resolves for ``inference.device`` on this host (a CPU engine without bf16 units gets fp32
    versions, one with them or a GPU engine bf16)."""
    import torch

    from shipyard.models.hardware import resolve_dtype

    w = cfg.weights
    if w.dtype == "auto":
        return resolve_dtype(cfg.inference.dtype, cfg.inference.device, "inference.dtype")[0]
    return getattr(torch, w.dtype) if w.dtype else None


def _relog_checkpointed_step(logger: MetricsLogger, state: dict[str, Any], store: Store) -> None:
    """Write the resumed checkpoint's step records if a kill landed between checkpoint and log."""
    step, saved = state["step"], state.get("log")
    if saved is None or any(
        r.get("kind") == "consumed" and r["step"] == step for r in read_metrics(logger.path)
    ):
        return
    digest = read_manifest(store, step).state_digest
    logger.log(step, saved["train"], {"kind": "consumed", "groups": saved["groups"], "digest": digest})


def _reference_model(cfg: ShipyardConfig) -> Any | None:
    """The frozen base model for the KL penalty (a second copy in memory), or None when it is off."""
    if cfg.trainer.loss.kl_coef <= 0:
        return None
    from shipyard.models.loading import load_model

    return load_model(cfg.model)[0].to(cfg.trainer.device).eval().requires_grad_(False)


def _router_seam(model: Any, cfg: ShipyardConfig) -> Any | None:
    """A router seam on an MoE policy (routing disagreement always logged; replay per config)."""
    from shipyard.models.router_replay import RouterSeam, moe_routers

    if not moe_routers(model):
        if cfg.trainer.router_replay:
            raise ValueError("trainer.router_replay = true needs an MoE policy (model has no router)")
        return None
    return RouterSeam(model)


def _named(stats: dict[str, float]) -> dict[str, float]:
    """Mismatch metrics (k1, k3, k3_p99, ess, k3/bucket_0.9-1.0, route_disagree/layer_0, ...:
    ``is_mismatch_key``) under ``mismatch/``, everything else under ``train/``."""
    from shipyard.trainer.mismatch import is_mismatch_key

    return {(f"mismatch/{k}" if is_mismatch_key(k) else f"train/{k}"): v for k, v in stats.items()}


def _rollout_metrics(taken: Taken, trajs: list[Any]) -> dict[str, float]:
    """Rollout metrics per session (a summarizing session's segments count once; turns are summed)."""
    sessions = [t for t in trajs if t.segment_idx == 0]
    rewards = [t.reward for t in sessions]
    n = max(len(sessions), 1)
    return {
        "reward/mean": sum(rewards) / n,
        "reward/solved_frac": sum(r >= 1.0 for r in rewards) / n,
        "staleness/mean": sum(taken.staleness) / max(len(taken.staleness), 1),
        "staleness/max": float(max(taken.staleness, default=0)),
        "rollout/dropped_stale": float(taken.dropped_stale),
        "rollout/dropped_errors": float(taken.dropped_errors),
        "rollout/foreign_rejected": float(taken.foreign_rejected),
        "rollout/refused_groups": float(taken.refused),
        "rollout/dropped_quarantined": float(taken.dropped_quarantined),
        "rollout/skipped_uniform": float(taken.skipped_uniform),
        "rollout/samples": float(len(sessions)),
        "rollout/sampled_tokens": float(sum(t.num_sampled() for t in trajs)),
        "rollout/turns_mean": sum(t.num_turns for t in trajs) / n,
        **rollout_summary_metrics(trajs),
        **hack_metrics(sessions),
        **component_metrics(sessions),
    }


def _timing(t0: float, t1: float, t2: float, t_start: float) -> dict[str, float]:
    """Step timings; ``time/elapsed_s`` is trainer time summed over the processes of a resumed run."""
    return {
        "time/wait_s": t1 - t0,
        "time/train_s": t2 - t1,
        "time/step_s": t2 - t0,
        "time/elapsed_s": t2 - t_start,
    }
