"""Builders shared by every placement: inference node, session spec, rollout worker, task splits.

Contract: the same functions build the same components whether they run as threads in one
process (``run.placement = "local"``) or inside Ray actors (``"ray"``), so placement changes
where things run, never what runs.
"""

from __future__ import annotations

import copy
import functools
from typing import Any

from shipyard.agent.session import ChatFrame, SessionSpec
from shipyard.config.schema import SandboxConfig, ShipyardConfig
from shipyard.envs.types import RewardResult, Sandbox, Task
from shipyard.inference.types import InferenceClient
from shipyard.rollout.worker import RolloutWorker
from shipyard.store.types import Store


def task_splits(cfg: ShipyardConfig) -> tuple[list[Task], list[Task]]:
    """(training, held-out) tasks of the set ``tasks.set`` (functions: up to ``tasks.max_difficulty``)."""
    from shipyard.envs.tasks import generated_tasks, split_tasks

    t = cfg.tasks
    if t.set == "long":
        from shipyard.envs.long_tasks import long_tasks

        tasks = long_tasks(
            t.num_generated,
            t.seed,
            t.long_modules,
            t.long_filler_lines,
            local_constants=t.long_local_constants,
            rules=None if t.long_rules is None else tuple(t.long_rules),
        )
    else:
        tasks = [x for x in generated_tasks(t.num_generated, t.seed) if x.difficulty <= t.max_difficulty]
    return split_tasks(tasks, t.heldout_frac, t.seed)


HELDOUT_KINDS = ("function", "db", "repo")
"""Task kinds with a held-out split (:func:`heldout_tasks`)."""


def heldout_tasks(cfg: ShipyardConfig, kind: str, n: int) -> list[Task]:
    """``n`` held-out tasks of ``kind`` from the generators the run trains on, none of them trained on.

    - ``function``: the first ``n`` of :func:`task_splits`' held-out tasks (``tasks.set``);
    - ``db``: ``db_tasks(tasks.num_db + n, tasks.seed)[tasks.num_db:]``: the rollout worker trains on
      the first ``tasks.num_db`` tasks, and task ``k`` of the generator does not depend on ``n``, so
      these are other instances (own rows, names and checks) of the same migration families;
    - ``repo``: tasks whose (template, defect) pair is not among the ``tasks.num_repo`` trained
      tasks. Tasks of one pair differ only by the package name (the fix is the same), so a held-out
      repo task is a defect training never saw; there are 8 pairs, so ``tasks.num_repo`` must leave
      some unseen (at most 7 when every trained task has its own pair).

    Raises ValueError when the generator cannot give ``n`` such tasks, naming the fields to change.
    """
    t = cfg.tasks
    if kind == "function":
        return task_splits(cfg)[1][:n]
    if kind == "db":
        from shipyard.envs.db_tasks import db_tasks

        return db_tasks(t.num_db + n, t.seed)[t.num_db :]
    if kind == "repo":
        every = [copy.deepcopy(x) for x in _every_repo_task(t.seed)]
        seen = {_repo_pair(x) for x in every[: t.num_repo]}
        held = [x for x in every[t.num_repo :] if _repo_pair(x) not in seen][:n]
        if len(held) < n:
            pairs = len({_repo_pair(x) for x in every})
            raise ValueError(
                f"eval.repo_n={n} held-out repo tasks asked for, but tasks.num_repo={t.num_repo} trains on "
                f"{len(seen)} of the {pairs} defects, leaving {len(held)} untrained tasks; lower "
                "tasks.num_repo or eval.repo_n"
            )
        return held
    raise ValueError(f"held-out kind {kind!r} is unknown; use one of {list(HELDOUT_KINDS)}")


@functools.lru_cache(maxsize=2)
def _every_repo_task(seed: int) -> tuple[Task, ...]:
    """Every task the repo generator makes for ``seed``, in its order (built once per seed: each
    task builds and squashes a git history; callers get copies)."""
    from shipyard.envs.repo_tasks import TEMPLATES, repo_tasks

    return tuple(repo_tasks(sum(len(t.defects) * len(t.names) for t in TEMPLATES.values()), seed))


def _repo_pair(task: Task) -> str:
    """``repo-<template>-<defect>`` of a generated repo task id (``...-<index>`` dropped)."""
    return task.id.rsplit("-", 1)[0]


def _sandbox(files: dict[str, str], cfg: SandboxConfig) -> Sandbox:
    from shipyard.envs.sandbox import BwrapSandbox

    return BwrapSandbox(files, cfg)


def _grade(task: Task, files: dict[str, str], cfg: SandboxConfig) -> RewardResult:
    from shipyard.envs.grader import grade

    return grade(task, files, cfg)


def session_spec(cfg: ShipyardConfig, client: InferenceClient, tokenizer: Any) -> SessionSpec:
    return SessionSpec(
        client=client,
        frame=ChatFrame(tokenizer),
        agent=cfg.agent,
        sampling=cfg.sampling,
        sandbox_factory=functools.partial(_sandbox, cfg=cfg.sandbox),
        grader=functools.partial(_grade, cfg=cfg.sandbox),
        seed=cfg.run.seed,
    )


def with_judge_server(cfg: ShipyardConfig, url: str) -> ShipyardConfig:
    """``cfg`` with ``rewards.judge.base_url = "self"`` resolved to the inference server at ``url``."""
    from shipyard.envs.rewards.judge import resolve_self

    judge = resolve_self(cfg.rewards.judge, url)
    if judge is cfg.rewards.judge:
        return cfg
    return cfg.model_copy(update={"rewards": cfg.rewards.model_copy(update={"judge": judge})})


def build_worker(cfg: ShipyardConfig, worker_id: str, url: str, store: Store) -> RolloutWorker:
    from shipyard.inference.client import HttpInferenceClient
    from shipyard.models.loading import load_tokenizer

    client = HttpInferenceClient(url)
    train, _ = task_splits(cfg)
    cfg = with_judge_server(cfg, url)
    return RolloutWorker(worker_id, cfg, store, session_spec(cfg, client, load_tokenizer(cfg.model)), train)


class InferenceNode:
    """One inference server: embedded engine + HTTP server + weight subscriber."""

    def __init__(self, cfg: ShipyardConfig, store: Store, port: int = 0) -> None:
        import torch

        from shipyard.inference.engine import EmbeddedEngine
        from shipyard.inference.server import InferenceServer
        from shipyard.models.loading import load_model
        from shipyard.models.precision import engine_precision
        from shipyard.weights.subscriber import EngineSink, WeightSubscriber

        torch.set_num_threads(cfg.inference.threads)
        model, self.tokenizer = load_model(cfg.model)
        precision = engine_precision(model, cfg.inference)
        self.engine = EmbeddedEngine(
            model,
            self.tokenizer,
            max_batch=cfg.inference.max_batch,
            version=0,
            deterministic=cfg.inference.deterministic,
            prefix_cache_mb=cfg.inference.prefix_cache_mb,
        )
        self.engine.precision = precision
        self.server = InferenceServer(self.engine, host=cfg.inference.host, port=port)
        self.server.start()
        self.subscriber = WeightSubscriber(
            store,
            EngineSink(self.engine),
            poll_s=cfg.inference.poll_s,
            cache_dir=cfg.weights.cache_dir,
            lease_ttl_s=cfg.weights.lease_ttl_s,
            connections=cfg.store.connections,
            chunk_bytes=int(cfg.store.part_mb * (1 << 20)),
            workers=cfg.weights.workers,
        )
        self.subscriber.start(feed_url=cfg.weights.follow_url)

    @property
    def url(self) -> str:
        return self.server.url

    def stop(self) -> None:
        self.subscriber.stop()
        self.server.stop()
