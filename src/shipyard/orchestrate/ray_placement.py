"""Ray placement: trainer, inference servers and rollout workers as Ray actors.

Contract: see :mod:`shipyard.orchestrate.base`. With ``run.ray_address`` unset a local Ray
instance is started (sized so every actor fits on this machine); with an address the same
config joins that cluster (a token-authenticated cluster needs ``RAY_AUTH_MODE=token`` and
``RAY_AUTH_TOKEN`` in the driver's environment, as Ray documents). Actors ask for the CPUs their torch threads use; rollout workers ask
for none (they wait on HTTP and sandboxes). Actor logs stay in Ray's session log directory so
the driver's live table stays readable; actor errors surface through ``trainer_result``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from shipyard.config.schema import ShipyardConfig

SERVER_START_S = 900
"""How long the inference actors may take to answer their first call (loading the model)."""


class _InferenceActor:
    def __init__(self, cfg: ShipyardConfig) -> None:
        from shipyard.inference.backends.base import start_node
        from shipyard.store.run import open_run

        self.node = start_node(cfg, open_run(cfg.store, cfg.run.name))

    def url(self) -> str:
        return self.node.url

    def stop(self) -> None:
        self.node.stop()


class _RolloutActor:
    def __init__(self, cfg: ShipyardConfig, worker_id: str, url: str) -> None:
        from shipyard.orchestrate.components import build_worker
        from shipyard.store.run import open_run

        self.worker = build_worker(cfg, worker_id, url, open_run(cfg.store, cfg.run.name))

    def run(self) -> int:
        return self.worker.run()


class _RankActor:
    """One rank of a trainer group (RL trainer or mid-training); rank 0 also picks the group's
    rendezvous address on its node."""

    def __init__(self, rank: int, world: int, device: str) -> None:
        self.rank, self.world, self.device = rank, world, device

    def address(self) -> str:
        import ray

        from shipyard.trainer.distributed import free_address

        return free_address(ray.util.get_node_ip_address())

    def run(self, address: str, fn: Any, *args: Any) -> dict[str, Any]:
        import ray

        from shipyard.trainer.distributed import join_group

        ranks = join_group(self.rank, self.world, address, self.device)
        return {**fn(ranks, *args), "node": ray.get_runtime_context().get_node_id()}


def _train_rank(ranks: Any, cfg: ShipyardConfig, run_dir: str) -> dict[str, Any]:
    from shipyard.orchestrate.components import trainer_gate
    from shipyard.store.run import open_run
    from shipyard.trainer.loop import run_trainer

    store = open_run(cfg.store, cfg.run.name)
    if not ranks.leader:  # rank 0 reads the feed
        return run_trainer(cfg, store, Path(run_dir), ranks)
    with trainer_gate(cfg, store) as gate:
        return run_trainer(cfg, store, Path(run_dir), ranks, gate=gate)


def start_rank_group(cfg: ShipyardConfig, fn: Any, *args: Any) -> list[Any]:
    """``trainer.world_size`` ranks as Ray actors, one placement-group bundle each (``trainer.threads``
    CPUs, a GPU with ``trainer.device = "cuda"``), each running ``fn(ranks, *args)``; their refs."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    t = cfg.trainer
    bundle = {"CPU": float(t.threads), **({"GPU": 1.0} if t.device == "cuda" else {})}
    _check_fits(bundle, t.world_size, ray.cluster_resources())
    group = ray.util.placement_group([bundle] * t.world_size, strategy=t.placement_strategy)
    if not ray.get(group.ready(), timeout=120):
        raise ValueError(f"trainer.world_size={t.world_size}: Ray could not place {t.world_size} x {bundle}")
    actor = ray.remote(num_cpus=t.threads, num_gpus=bundle.get("GPU", 0))(_RankActor)
    ranks = [
        actor.options(
            scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=r)
        ).remote(r, t.world_size, t.device)
        for r in range(t.world_size)
    ]
    # rank 0's rendezvous address: its actor starting (scheduling, imports) is all it waits for
    address = ray.get(ranks[0].address.remote(), timeout=600) if t.world_size > 1 else ""
    return [r.run.remote(address, fn, *args) for r in ranks]


def init_ray(cfg: ShipyardConfig) -> None:
    """Join ``run.ray_address``, or start a local Ray sized so every actor of ``cfg`` fits here."""
    import ray

    if ray.is_initialized():
        return
    env = {"env_vars": {"TOKENIZERS_PARALLELISM": "false"}}
    if cfg.run.ray_address:
        ray.init(
            address=cfg.run.ray_address,
            _node_ip_address=_loopback_host(cfg.run.ray_address),
            log_to_driver=False,
            runtime_env=env,
        )
        return
    need = cfg.trainer.threads * cfg.trainer.world_size + cfg.inference.num_servers * cfg.inference.threads
    ray.init(
        num_cpus=max(os.cpu_count() or 1, need),
        include_dashboard=False,
        log_to_driver=False,
        object_store_memory=128 * 1024**2,
        runtime_env=env,
        # Ray renices workers to 15 by default; here the actors are the workload.
        _system_config={"worker_niceness": 0},
    )


def _loopback_host(address: str) -> str | None:
    """The driver's node IP when the cluster runs on loopback, else None (Ray detects it).

    Ray otherwise takes this machine's outward interface as the driver's node and finds no
    raylet there. Use a loopback address other than 127.0.0.1 (e.g. 127.0.0.2): Ray rewrites
    "127.0.0.1" and "localhost" to the outward interface.
    """
    host = address.rsplit(":", 1)[0]
    return host if host.startswith("127.") else None


def _check_fits(bundle: dict[str, float], world: int, cluster: dict[str, float]) -> None:
    """ValueError naming ``trainer.world_size`` when the cluster has too few CPUs or GPUs for it."""
    for resource, amount in bundle.items():
        have = cluster.get(resource, 0.0)
        if amount * world > have:
            raise ValueError(
                f"trainer.world_size={world} needs {amount * world:g} {resource} ({amount:g} per rank: "
                f"trainer.threads{' and trainer.device = cuda' if resource == 'GPU' else ''}); the Ray "
                f"cluster has {have:g}. Lower trainer.world_size or add nodes"
            )


class RayPlacement:
    def __init__(self, cfg: ShipyardConfig, run_dir: Path) -> None:
        import ray

        self.ray = ray
        self.cfg = cfg
        self.run_dir = run_dir.resolve()
        # Actors run in other working directories: give them absolute paths.
        self.cfg = cfg.model_copy(deep=True)
        self.cfg.store.root = str(Path(cfg.store.root).resolve())
        self.cfg.model.cache_dir = str(Path(cfg.model.cache_dir).expanduser().resolve())
        init_ray(self.cfg)
        self.servers: list[Any] = []
        self.workers: list[Any] = []
        self._runs: list[Any] = []
        self._trainer_refs: list[Any] = []

    def start_inference(self) -> list[str]:
        inf = self.cfg.inference
        gpus = 1.0 / inf.num_servers if inf.device == "cuda" else 0  # the servers share one GPU
        actor = self.ray.remote(num_cpus=inf.threads, num_gpus=gpus, max_concurrency=4)(_InferenceActor)
        self.servers = [actor.remote(self.cfg) for _ in range(self.cfg.inference.num_servers)]
        # each server loads the model first; a node that never comes up ends as a GetTimeoutError
        return self.ray.get([s.url.remote() for s in self.servers], timeout=SERVER_START_S)

    def start_training(self) -> None:
        urls = self.ray.get([s.url.remote() for s in self.servers], timeout=SERVER_START_S)
        worker_cls = self.ray.remote(num_cpus=0)(_RolloutActor)
        for i in range(self.cfg.rollout.num_workers):
            w = worker_cls.remote(self.cfg, f"w{i}", urls[i % len(urls)])
            self.workers.append(w)
            self._runs.append(w.run.remote())
        self._trainer_refs = start_rank_group(self.cfg, _train_rank, self.cfg, str(self.run_dir))

    def trainer_done(self) -> bool:
        ready, _ = self.ray.wait(self._trainer_refs, timeout=0)  # any rank ending ends the group
        return bool(ready)

    def trainer_result(self) -> dict[str, Any]:
        """Rank 0's summary, with the node of every rank; a failed rank's error is raised."""
        results = self.ray.get(self._trainer_refs)
        return {**results[0], "nodes": [r["node"] for r in results]}

    def stop_workers(self) -> None:
        for w in self.workers:
            self.ray.kill(w)
        self.workers, self._runs = [], []

    def stop(self) -> None:
        self.stop_workers()
        self.ray.get([s.stop.remote() for s in self.servers], timeout=120)  # then killed either way
        for s in self.servers:
            self.ray.kill(s)
        self.ray.shutdown()  # stops a local instance; only disconnects from a cluster given by address
