"""Ray placement: trainer, inference servers and rollout workers as Ray actors.

Contract: see :mod:`shipyard.orchestrate.base`. With ``run.ray_address`` unset a local Ray
instance is started (sized so every actor fits on this machine); with an address the same
config joins that cluster (a token-authenticated cluster needs ``RAY_AUTH_MODE=token`` and
``RAY_AUTH_TOKEN`` in the driver's environment, as Ray documents). Actors ask for the CPUs their torch threads use; rollout workers ask
for none (they wait on HTTP and sandboxes). Actor logs stay in Ray's session log directory so
the driver's live table stays readable; actor errors surface through ``trainer_result``.

Watched as the standalone processes are (``run.watchdog``): each actor's component (``trainer``,
``server <i>``, ``worker <id>``) runs under its own watchdog, which names a stall with its stacks
(under ``<run_dir>/actors/<component>/``) and ends the actor's process with status 3, and
publishes its record to the run's store every ``report_s``. The driver reads those records into a
:class:`~shipyard.metrics.health.Monitor` in a thread of its own from the moment the servers are up
(so a stall is named even while the driver waits on a call), and an actor frozen whole is named too
(``silent``), in ``<run_dir>/health.jsonl`` and on the console; a stalled server is killed at
once, so that no call of the driver's waits on it until its timeout. Rollout workers are
restarted by the driver, not by Ray: a worker actor that died (killed by the driver because it
was silent, or by anything else) is replaced by a new actor whose ``run`` resumes after its last
written batch (Ray's own restart once brought an actor back without ever retrying its ``run``: a
partitioned worker then trained nothing until the trainer's deadline); a run that raised while
its actor lived (its server went away under it) is recorded and started again on the same actor. A
stopping placement asks each worker to stop and waits for its run to close its sandboxes. A
stalled trainer or server ends the run with a :class:`~shipyard.metrics.health.StallError`
naming it (``shipyard train`` exits 3; rerun, it resumes), as a server restarted elsewhere would
serve on another address than its workers use.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures
from pathlib import Path
from typing import Any

from shipyard.config.schema import ShipyardConfig
from shipyard.metrics.health import published_records

SERVER_START_S = 900
"""How long the inference actors may take to answer their first call (loading the model)."""
WORKER_STOP_S = 60
"""How long stopping workers may take to return from their runs (a session in flight ends first)."""
MAX_RUN_FAILURES = 5
RUN_FAILURE_WINDOW_S = 600
"""A worker whose run fails ``MAX_RUN_FAILURES`` times within this many seconds ends the run."""
DEAD_WORKER_RESTART_S = 1.0
MAX_ACTOR_DEATHS = 10
"""A worker gets a new actor ``DEAD_WORKER_RESTART_S`` after its actor died, doubling with each death
within ``RUN_FAILURE_WINDOW_S`` up to 60 s; the ``MAX_ACTOR_DEATHS``-th death in the window (an
actor that cannot start, a crash loop) ends the run. Deaths are counted apart from failed runs:
the driver kills a silent worker's actor itself."""


def _watched(cfg: ShipyardConfig, run_dir: str, component: str, store: Any) -> Any:
    from shipyard.metrics.health import Watched

    where = Path(run_dir) / "actors" / component.replace(" ", "-")
    return Watched(cfg.run.watchdog, where, component, publish=store.put)


class _InferenceActor:
    def __init__(self, cfg: ShipyardConfig, index: int, run_dir: str) -> None:
        from shipyard.inference.backends.base import start_node
        from shipyard.orchestrate.components import server_port
        from shipyard.store.run import open_run

        store = open_run(cfg.store, cfg.run.name)
        self.node = start_node(cfg, store, port=server_port(cfg, index))
        self.watched = _watched(cfg, run_dir, f"server {index}", store)
        beat = self.watched.start()
        beat.enter("idle")  # until its first decode step (a vLLM node reports none)
        beat.note(url=self.node.url)
        if (engine := getattr(self.node, "engine", None)) is not None:
            engine.beat = beat
            beat.note(version=engine.version)

    def url(self) -> str:
        return self.node.url

    def pid(self) -> int:
        return os.getpid()

    def stop(self) -> None:
        self.watched.stop()
        self.node.stop()


class _RolloutActor:
    def __init__(self, cfg: ShipyardConfig, worker_id: str, url: str, run_dir: str) -> None:
        from shipyard.orchestrate.components import build_worker
        from shipyard.store.run import open_run

        self.store = open_run(cfg.store, cfg.run.name)
        self.worker = build_worker(cfg, worker_id, url, self.store)
        self.cfg, self.run_dir, self.worker_id = cfg, run_dir, worker_id

    def run(self) -> int:
        watched = _watched(self.cfg, self.run_dir, f"worker {self.worker_id}", self.store)  # one per run
        beat = watched.start()
        try:
            beat.enter("connecting")  # (idle) a restarted worker may find its server unreachable
            self.worker.spec.client.wait_ready(timeout_s=600)
            self.worker.beat = beat
            return self.worker.run()
        finally:
            watched.stop()

    def stop(self) -> None:
        """Ask the running ``run`` to return (it closes its sandboxes and environment first)."""
        self.worker.stop_event.set()

    def pid(self) -> int:
        return os.getpid()


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
    watched = _watched(cfg, run_dir, "trainer", store)
    with trainer_gate(cfg, store) as gate:
        try:
            return run_trainer(cfg, store, Path(run_dir), ranks, gate=gate, beat=watched.start())
        finally:
            watched.stop()


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


def for_actors(cfg: ShipyardConfig) -> ShipyardConfig:
    """``cfg`` with absolute local paths (actors run in other working directories): a local store's
    root and the model cache; an S3 store's root (``bucket/prefix``) is not a path and stays."""
    cfg = cfg.model_copy(deep=True)
    if cfg.store.type == "local":
        cfg.store.root = str(Path(cfg.store.root).resolve())
    cfg.model.cache_dir = str(Path(cfg.model.cache_dir).expanduser().resolve())
    return cfg


def init_ray(cfg: ShipyardConfig) -> None:
    """Join ``run.ray_address``, or start a local Ray sized so every actor of ``cfg`` fits here.
    The process's SIGTERM handler is kept: ``ray.init`` installs one of its own that ends the
    driver at once, before it can stop its actors (which then outlive it)."""
    import ray

    if ray.is_initialized():
        return
    main = threading.current_thread() is threading.main_thread()
    handler = signal.getsignal(signal.SIGTERM) if main else None
    try:
        _init_ray(ray, cfg)
    finally:
        if handler is not None:
            signal.signal(signal.SIGTERM, handler)


def _init_ray(ray: Any, cfg: ShipyardConfig) -> None:
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
        self.cfg = for_actors(cfg)
        self.run_dir = run_dir.resolve()
        init_ray(self.cfg)
        self.servers: list[Any] = []
        self.workers: list[Any] = []
        self._runs: list[Future[Any]] = []
        """Each worker's current ``run``, as a future (its state is read without a Ray call: a
        ``ray.wait(timeout=0)`` once blocked the driver for minutes while an actor restarted)."""
        self._failures: dict[int, list[float]] = {}
        """Per worker, when its runs failed (monotonic seconds)."""
        self._rerun_at: dict[int, tuple[float, bool]] = {}
        """Workers whose failed run waits to be started again: when, and whether on a new actor (the
        old one died)."""
        self._ended: set[int] = set()
        self._deaths: dict[int, list[float]] = {}
        """Per worker, when its actors died (monotonic seconds)."""
        self._worker_cls: Any = None
        self._worker_urls: list[str] = []
        self._trainer_refs: list[Any] = []
        self._trainer_futures: list[Future[Any]] = []
        self.watch = ActorWatch(self.cfg, self.run_dir, ray)
        self.urls: list[str] = []

    def start_inference(self) -> list[str]:
        inf = self.cfg.inference
        gpus = 1.0 / inf.num_servers if inf.device == "cuda" else 0  # the servers share one GPU
        actor = self.ray.remote(num_cpus=inf.threads, num_gpus=gpus, max_concurrency=4)(_InferenceActor)
        self.servers = [actor.remote(self.cfg, i, str(self.run_dir)) for i in range(inf.num_servers)]
        self.watch.actors.update({f"server {i}": s for i, s in enumerate(self.servers)})
        # each server loads the model first; a node that never comes up ends as a GetTimeoutError
        self.urls = self.ray.get([s.url.remote() for s in self.servers], timeout=SERVER_START_S)
        self.watch.start()
        return self.urls

    def start_training(self) -> None:
        from shipyard.orchestrate.components import worker_url

        urls = self.urls  # (asking a server again could wait on one that froze since)
        # no restarts by Ray: the driver replaces a worker actor that died (`rerun_failed_workers`)
        self._worker_cls = self.ray.remote(num_cpus=0, max_restarts=0, max_task_retries=0, max_concurrency=2)(
            _RolloutActor
        )  # (two calls at once: `stop` reaches a worker inside `run`)
        self._worker_urls = [worker_url(self.cfg, i, urls) for i in range(self.cfg.rollout.num_workers)]
        for i in range(self.cfg.rollout.num_workers):
            self.workers.append(None)
            self._runs.append(self._start_worker(i))
        self._trainer_refs = start_rank_group(self.cfg, _train_rank, self.cfg, str(self.run_dir))
        self._trainer_futures = [r.future() for r in self._trainer_refs]

    def trainer_done(self) -> bool:
        if self.watch.stall is not None:
            return True
        self.rerun_failed_workers()
        return any(f.done() for f in self._trainer_futures)  # any rank ending ends the group

    def _start_worker(self, i: int) -> Future[Any]:
        """A new actor for worker ``i`` (replacing a dead one) and its ``run``, as a future."""
        w = self._worker_cls.remote(self.cfg, f"w{i}", self._worker_urls[i], str(self.run_dir))
        self.workers[i] = w
        self.watch.actors[f"worker w{i}"] = w
        return w.run.remote().future()

    def rerun_failed_workers(self) -> None:
        """A worker whose actor died (the driver killed it as silent; anything else killed it) gets a
        new actor after a backoff (:data:`MAX_ACTOR_DEATHS`), its ``run`` resuming after its last
        batch (recorded in ``health.jsonl`` as a ``crash``). A worker's run that raised while its actor
        lived (a server that stayed unreachable past ``wait_ready``, a store error it does not
        retry) is printed, recorded and started again on the same actor after a backoff (1 s,
        doubling to 60 s); a worker whose run failed so :data:`MAX_RUN_FAILURES` times within
        :data:`RUN_FAILURE_WINDOW_S` ends the run with the last error."""
        now = time.monotonic()
        for i, run in enumerate(self._runs):
            if i in self._rerun_at:
                at, dead = self._rerun_at[i]
                if now >= at:
                    del self._rerun_at[i]
                    self._runs[i] = self._start_worker(i) if dead else self.workers[i].run.remote().future()
                continue
            if i in self._ended or not run.done():
                continue
            if (e := run.exception()) is None:
                self._ended.add(i)  # returned on its own: the run is finished
                continue
            error = (str(e).strip().splitlines() or [type(e).__name__])[-1][:300]
            if isinstance(e, self.ray.exceptions.ActorDiedError):  # the process is gone: a new actor
                self._replace_dead(i, now, error)
                continue
            failed = [t for t in self._failures.get(i, []) if now - t < RUN_FAILURE_WINDOW_S] + [now]
            self._failures[i] = failed
            if len(failed) >= MAX_RUN_FAILURES:
                raise RuntimeError(
                    f"worker w{i}'s run failed {len(failed)} times within {RUN_FAILURE_WINDOW_S} s; last: {error}"
                )
            backoff = min(60.0, 2.0 ** (len(failed) - 1))
            record = {"kind": "crash", "component": f"worker w{i}", "at": time.time(), "error": error}
            self.watch.append({**record, "action": f"running it again in {backoff:.0f} s"})
            print(f"worker w{i} failed ({error}); running it again in {backoff:.0f} s", flush=True)
            self._rerun_at[i] = (now + backoff, False)

    def _replace_dead(self, i: int, now: float, error: str) -> None:
        """Worker ``i``'s actor died: a new one after the backoff, or the end of the run (module doc)."""
        deaths = [t for t in self._deaths.get(i, []) if now - t < RUN_FAILURE_WINDOW_S] + [now]
        self._deaths[i] = deaths
        if len(deaths) >= MAX_ACTOR_DEATHS:
            raise RuntimeError(
                f"worker w{i}'s actor died {len(deaths)} times within {RUN_FAILURE_WINDOW_S} s; last: {error}"
            )
        backoff = min(60.0, DEAD_WORKER_RESTART_S * 2.0 ** (len(deaths) - 1))
        self._rerun_at[i] = (now + backoff, True)
        record = {"kind": "crash", "component": f"worker w{i}", "at": time.time(), "error": error}
        self.watch.append({**record, "action": f"starting a new actor in {backoff:g} s"})
        print(f"worker w{i}'s actor died ({error}); starting a new one in {backoff:g} s", flush=True)

    def trainer_result(self) -> dict[str, Any]:
        """Rank 0's summary, with the node of every rank; a failed rank's error is raised, and a
        stall the driver named as a :class:`~shipyard.metrics.health.StallError`."""
        if self.watch.stall is not None:
            raise self.watch.stall
        results = self.ray.get(self._trainer_refs)
        return {**results[0], "nodes": [r["node"] for r in results]}

    def stop_workers(self) -> None:
        """Ask every worker to stop and give their runs ``WORKER_STOP_S`` to return (so each closes
        its sandboxes), then kill the actors either way."""
        for w in self.workers:
            w.stop.remote()
        wait_futures(self._runs, timeout=WORKER_STOP_S)
        for w in self.workers:
            self.ray.kill(w)
        self.workers, self._runs = [], []

    def stop(self) -> None:
        self.watch.stop()
        self.stop_workers()
        try:  # then killed either way; a stalled server (killed by the watch) answers with an error
            self.ray.get([s.stop.remote() for s in self.servers], timeout=120)
        except (self.ray.exceptions.RayError, TimeoutError) as e:
            print(f"a server did not stop cleanly ({type(e).__name__}); killing it", flush=True)
        for s in self.servers:
            self.ray.kill(s)
        self.ray.shutdown()  # stops a local instance; only disconnects from a cluster given by address


class ActorWatch:
    """The driver's view of its actors' health (module doc): every ``report_s`` (in a thread of its
    own, from :meth:`start` until :meth:`stop`) the records in the run's store go to a
    :class:`~shipyard.metrics.health.Monitor`; a named stall is written to ``health.jsonl`` and
    printed, a silent worker is killed for Ray to restart, a stalled trainer or server sets
    :attr:`stall`."""

    def __init__(self, cfg: ShipyardConfig, run_dir: Path, ray: Any) -> None:
        from shipyard.metrics.health import Monitor
        from shipyard.store.run import open_run

        self.cfg, self.run_dir, self.ray = cfg, run_dir, ray
        self.store = open_run(cfg.store, cfg.run.name)
        self.monitor = Monitor(cfg.run.watchdog.silent_s)
        self.actors: dict[str, Any] = {}
        """The actor of each watched component (servers and workers; the trainer's ranks are a group)."""
        self.stall: Exception | None = None
        self.named: list[dict[str, Any]] = []
        self._snapshot = 0.0
        self._earlier = self._records_now()
        """Records in the store before this driver made any actor: an earlier driver's, never named.
        (Taken here, not at :meth:`start`: the servers report before the watch starts, and a server
        taken for an earlier one was never watched, so a frozen one stopped nothing.)"""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="shipyard-actor-watch", daemon=True)

    def _records_now(self) -> set[tuple[object, object]]:
        try:
            return {(r["component"], r.get("pid")) for r in published_records(self.store)}
        except (OSError, TimeoutError, ValueError):
            return set()

    def start(self) -> None:
        """Check in a thread of the driver's own, so a stall is named while the driver waits on a call."""
        if not self.cfg.run.watchdog.enabled or self._thread.ident is not None:
            return
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.ident is not None:
            self._thread.join(timeout=60)

    def _loop(self) -> None:
        while not self._stop.wait(self.cfg.run.watchdog.report_s):
            self.check()

    def check(self) -> None:
        now = time.monotonic()
        try:
            records = published_records(self.store)
        except (OSError, TimeoutError, ValueError):
            return  # the driver cannot read the store now: no verdict on anyone
        self.monitor.observe(records, now)
        for stall in self.monitor.check(now):
            if (stall["component"], stall.get("pid")) not in self._earlier:
                self._named(stall)
        if now - self._snapshot >= self.cfg.run.watchdog.snapshot_s:  # what `shipyard view` shows
            self._snapshot = now
            self.append({"kind": "snapshot", "at": time.time(), "components": records})

    def _kill(self, stall: dict[str, Any]) -> None:
        """Kill the frozen actor's process: SIGKILL when it runs on this host (a frozen process cannot
        take Ray's kill request, which then waits for minutes), else through Ray."""
        import socket

        pid, actor = stall.get("pid"), self.actors.get(str(stall["component"]))
        if stall.get("host") == socket.gethostname() and isinstance(pid, int):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        elif actor is not None:
            self.ray.kill(actor, no_restart=str(stall["component"]).startswith("server "))

    def append(self, record: dict[str, Any]) -> None:
        with open(self.run_dir / "health.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")

    def _named(self, stall: dict[str, Any]) -> None:
        from shipyard.metrics.health import StallError
        from shipyard.orchestrate.supervise import describe

        component = str(stall["component"])
        if component.startswith("worker "):
            if stall["reason"] != "silent":
                return  # a stuck worker's own watchdog ends it (and Ray restarts it)
            action = "restarting it"  # killed here; `rerun_failed_workers` gives it a new actor
        else:
            action = "stopping the run"
            self.stall = StallError(describe(stall))
        if stall["reason"] == "silent":  # calls waiting on a frozen actor fail now, not at their timeout
            self._kill(stall)
        record = {**stall, "kind": "stall", "at": time.time(), "watcher": "driver", "action": action}
        self.named.append(record)
        self.append(record)
        print(f"STALL ({stall['reason']}): {describe(stall)}; {action}", flush=True)
