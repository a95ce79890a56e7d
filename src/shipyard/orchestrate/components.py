"""Builders shared by every placement: inference node, session spec, rollout worker, task splits.

Contract: the same functions build the same components whether they run as threads in one
process (``run.placement = "local"``) or inside Ray actors (``"ray"``), so placement changes
where things run, never what runs.
"""

from __future__ import annotations

import functools
from typing import Any

from shipyard.agent.session import ChatFrame, SessionSpec
from shipyard.config.schema import SandboxConfig, ShipyardConfig
from shipyard.envs.types import RewardResult, Sandbox, Task
from shipyard.inference.types import InferenceClient
from shipyard.rollout.worker import RolloutWorker
from shipyard.store.types import Store


def task_splits(cfg: ShipyardConfig) -> tuple[list[Task], list[Task]]:
    """(training, held-out) tasks of the generated set, both up to ``tasks.max_difficulty``."""
    from shipyard.envs.tasks import generated_tasks, split_tasks

    tasks = [
        t
        for t in generated_tasks(cfg.tasks.num_generated, cfg.tasks.seed)
        if t.difficulty <= cfg.tasks.max_difficulty
    ]
    return split_tasks(tasks, cfg.tasks.heldout_frac, cfg.tasks.seed)


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


def build_worker(cfg: ShipyardConfig, worker_id: str, url: str, store: Store) -> RolloutWorker:
    from shipyard.inference.client import HttpInferenceClient
    from shipyard.models.loading import load_tokenizer

    client = HttpInferenceClient(url)
    train, _ = task_splits(cfg)
    return RolloutWorker(worker_id, cfg, store, session_spec(cfg, client, load_tokenizer(cfg.model)), train)


class InferenceNode:
    """One inference server: embedded engine + HTTP server + weight subscriber."""

    def __init__(self, cfg: ShipyardConfig, store: Store, port: int = 0) -> None:
        import torch

        from shipyard.inference.engine import EmbeddedEngine
        from shipyard.inference.server import InferenceServer
        from shipyard.models.loading import load_model
        from shipyard.weights.subscriber import EngineSink, WeightSubscriber

        torch.set_num_threads(cfg.inference.threads)
        model, self.tokenizer = load_model(cfg.model)
        self.engine = EmbeddedEngine(
            model,
            self.tokenizer,
            max_batch=cfg.inference.max_batch,
            version=0,
            deterministic=cfg.inference.deterministic,
        )
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
        self.subscriber.start()

    @property
    def url(self) -> str:
        return self.server.url

    def stop(self) -> None:
        self.subscriber.stop()
        self.server.stop()
