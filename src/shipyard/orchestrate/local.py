"""Local placement: every component as threads of this process (tests, debugging).

Contract: see :mod:`shipyard.orchestrate.base`. Components talk exactly as they do under Ray —
rollout workers reach the servers over HTTP on loopback and everything else goes through the
store — only the process boundaries are missing. The trainer, every worker and every embedded
server report progress to the run's :class:`~shipyard.metrics.health.Health` board; its watchdog
(``run.watchdog``) names a component that stalls, writes its threads' stacks to the run's logs,
and the run stops with a :class:`~shipyard.metrics.health.StallError` naming it (threads cannot
be restarted).
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from shipyard.config.schema import ShipyardConfig
from shipyard.inference.backends.base import InferenceNode, start_node
from shipyard.metrics.health import Health, StallError, Watchdog, stall_message
from shipyard.orchestrate.components import build_worker, server_port, trainer_gate, worker_url
from shipyard.rollout.worker import RolloutWorker
from shipyard.store.run import open_run
from shipyard.trainer.loop import run_trainer


class LocalPlacement:
    def __init__(self, cfg: ShipyardConfig, run_dir: Path) -> None:
        self.cfg = cfg
        self.run_dir = run_dir
        self.store = open_run(cfg.store, cfg.run.name)
        self.nodes: list[InferenceNode] = []
        self.workers: list[RolloutWorker] = []
        self._threads: list[threading.Thread] = []
        self._trainer: threading.Thread | None = None
        self._result: dict[str, Any] = {}
        self._error: BaseException | None = None
        w = cfg.run.watchdog
        self.health = Health(w.deadline_s, w.deadlines)
        self.watchdog = Watchdog(self.health, run_dir, self._stalled, w.check_s, w.snapshot_s)
        self._stall: StallError | None = None

    def start_inference(self) -> list[str]:
        n = self.cfg.inference.num_servers
        self.nodes = [start_node(self.cfg, self.store, port=server_port(self.cfg, i)) for i in range(n)]
        for i, node in enumerate(self.nodes):
            engine = getattr(node, "engine", None)  # the embedded engine reports its steps
            if engine is not None:
                engine.beat = self.health.beat(f"server {i}")
                engine.beat.note(version=engine.version)
        return [n.url for n in self.nodes]

    def start_training(self) -> None:
        urls = [n.url for n in self.nodes]
        for i in range(self.cfg.rollout.num_workers):
            worker = build_worker(self.cfg, f"w{i}", worker_url(self.cfg, i, urls), self.store)
            worker.beat = self.health.beat(f"worker w{i}")
            t = threading.Thread(target=worker.run, name=f"rollout-w{i}", daemon=True)
            self.workers.append(worker)
            self._threads.append(t)
            t.start()
        self._trainer = threading.Thread(target=self._train, name="trainer", daemon=True)
        self._trainer.start()
        if self.cfg.run.watchdog.enabled:
            self.watchdog.start()

    def _train(self) -> None:
        try:
            with trainer_gate(self.cfg, self.store) as gate:
                self._result = run_trainer(
                    self.cfg, self.store, self.run_dir, gate=gate, beat=self.health.beat("trainer")
                )
        except BaseException as e:  # surfaced by trainer_result()
            self._error = e

    def _stalled(self, record: dict[str, object]) -> None:
        """The watchdog's verdict: threads cannot be restarted, so the run stops naming the stall."""
        if self._stall is None:
            self._stall = StallError(stall_message(record))

    def trainer_done(self) -> bool:
        return self._stall is not None or (self._trainer is not None and not self._trainer.is_alive())

    def trainer_result(self) -> dict[str, Any]:
        assert self._trainer is not None
        if self._stall is not None:
            raise self._stall
        self._trainer.join()
        if self._error is not None:
            raise self._error
        return self._result

    def stop_workers(self) -> None:
        for w in self.workers:
            w.stop_event.set()
        for t in self._threads:
            t.join(timeout=300 if self._stall is None else 10)  # a stalled thread may never return
        self.workers, self._threads = [], []

    def stop(self) -> None:
        self.watchdog.stop()
        self.stop_workers()
        for n in self.nodes:
            n.stop()
