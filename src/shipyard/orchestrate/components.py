"""The rollout worker of a run, built from the config the same way under every placement.

Contract: :func:`build_worker` builds a :class:`~shipyard.rollout.worker.RolloutWorker` (its
tasks, environment, harness and the run's identity are read here, so the worker's constructor does
no I/O; :func:`assemble_worker` is the part after the client and session spec) whether it
runs as a thread of one process (``run.placement = "local"``) or inside a Ray actor (``"ray"``), so
placement changes where things run, never what runs. :func:`trainer_gate` gives the trainer its
:class:`~shipyard.fleet.verify.RolloutVerifier` when ``fleet.verify.enabled``; :func:`server_port` and
:func:`worker_url` say where a run's servers listen and where its workers reach them. The other components
are built by their own packages: :func:`shipyard.inference.backends.base.start_node`, :func:`shipyard.agent.spec.session_spec`,
:func:`shipyard.envs.tasks.splits.task_splits`.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from shipyard.agent.session import SessionSpec
from shipyard.agent.spec import session_spec
from shipyard.config.schema import ShipyardConfig
from shipyard.envs.tasks.splits import task_splits
from shipyard.envs.types import Task
from shipyard.rollout.worker import RolloutWorker
from shipyard.store.retry import until_reachable
from shipyard.store.run import read_identity
from shipyard.store.types import Store
from shipyard.trainer.feed import BatchGate


def with_judge_server(cfg: ShipyardConfig, url: str) -> ShipyardConfig:
    """``cfg`` with ``rewards.judge.base_url = "self"`` resolved to the inference server at ``url``."""
    from shipyard.envs.grading.judge import resolve_self

    judge = resolve_self(cfg.rewards.judge, url)
    if judge is cfg.rewards.judge:
        return cfg
    return cfg.model_copy(update={"rewards": cfg.rewards.model_copy(update={"judge": judge})})


def server_port(cfg: ShipyardConfig, index: int) -> int:
    """The port the run's server ``index`` listens on: ``inference.port + index``, or 0 (a free one)."""
    return cfg.inference.port + index if cfg.inference.port else 0


def worker_url(cfg: ShipyardConfig, index: int, server_urls: list[str]) -> str:
    """Where worker ``index`` reaches its server: ``rollout.server_urls`` when given (a gateway or a
    proxy in front of the servers), else the servers' own addresses, in turn."""
    urls = cfg.rollout.server_urls or server_urls
    return urls[index % len(urls)]


def build_worker(cfg: ShipyardConfig, worker_id: str, url: str, store: Store) -> RolloutWorker:
    """The rollout worker ``worker_id`` of the run, sampling from the server at ``url`` through the
    harness ``harness.type`` names, on the training split and the config's extra training tasks."""
    from shipyard.inference.backends.base import open_client
    from shipyard.models.loading import load_tokenizer

    client = open_client(cfg, url, priority="scavenger")  # rollouts yield to production where tiers are on
    train, _ = task_splits(cfg)
    cfg = with_judge_server(cfg, url)
    return assemble_worker(cfg, worker_id, store, session_spec(cfg, client, load_tokenizer(cfg.model)), train)


def assemble_worker(
    cfg: ShipyardConfig, worker_id: str, store: Store, spec: SessionSpec, tasks: list[Task]
) -> RolloutWorker:
    """The worker playing ``spec`` (its client and harness) on ``tasks`` plus the config's extra
    training tasks (``tasks.num_db``, ``tasks.num_repo``, ``tasks.files``), in the environment of
    ``cfg``, stamping the run's identity (read from ``store``, waiting while it is unreachable: a
    worker may start while its region is cut off)."""
    from shipyard.envs.environment import Environment
    from shipyard.envs.tasks.files import extra_training_tasks

    identity = until_reachable(lambda: read_identity(store), "the run's identity", deadline_s=600)
    everything = tasks + extra_training_tasks(cfg.tasks)
    return RolloutWorker(worker_id, cfg, store, spec, everything, Environment.from_config(cfg), identity)


@contextmanager
def trainer_gate(cfg: ShipyardConfig, store: Store) -> Iterator[BatchGate | None]:
    """The verifier of untrusted nodes' batches (``fleet.verify``), None when verification is off;
    its environment (services for re-grading) is closed on exit."""
    if not cfg.fleet.verify.enabled:
        yield None
        return
    from shipyard.envs.environment import Environment
    from shipyard.fleet.verify import build_verifier

    with Environment.from_config(cfg) as env:
        yield build_verifier(cfg, store, env)
