"""One component of a run as its own process: `shipyard trainer` and `shipyard worker`.

Contract: :func:`trainer_process` claims the run's store (:func:`shipyard.store.run.claim_run`:
a new run, or the same run resumed from its last checkpoint) and trains until
``trainer.steps``; :func:`worker_process` attaches to the run (:func:`shipyard.store.run.open_run`)
and plays GRPO groups against the inference server at ``server_url`` (waiting up to 10 minutes for
it to answer, as one started beside the worker is still loading, and as long for the store, as
its region may be cut off from the origin) until the trainer writes
``control/finished`` (it continues after its last written batch when restarted). With
``shipyard serve`` (an inference server) and ``shipyard relay`` these are the processes an
operator, or a supervisor such as the chaos suite, runs and restarts one by one; ``shipyard
train`` places the same components itself.

Each process watches its own component (``run.watchdog``, :mod:`shipyard.metrics.health`): a
stall is named with its phase and its threads' stacks (the trainer's in its run directory, a
worker's in ``<run_dir>/workers/<id>/``), and the process exits at once with status 3, so its
supervisor starts it again and it resumes (a stuck thread cannot be stopped from inside).

Limits: no placement, no evaluation, no progress table: each process logs what it does and exits.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from shipyard.config.schema import ShipyardConfig
from shipyard.metrics.health import Beat, Health, Watchdog, stall_message

STALL_EXIT = 3
"""The exit status of a process whose component stalled (``shipyard train`` uses it too)."""


@contextmanager
def watched(cfg: ShipyardConfig, where: Path, component: str) -> Iterator[Beat]:
    """The beat of this process's ``component``, watched while the block runs; a stall ends the
    process with :data:`STALL_EXIT` after naming it (records and stacks under ``where``)."""
    w = cfg.run.watchdog
    health = Health(w.deadline_s, w.deadlines)
    dog = Watchdog(health, where, _exit_stalled, w.check_s, w.snapshot_s)
    if w.enabled:
        dog.start()
    try:
        yield health.beat(component)
    finally:
        dog.stop()


def _exit_stalled(record: dict[str, object]) -> None:
    print(f"shipyard: stopped: {stall_message(record)}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(STALL_EXIT)  # the stalled thread cannot be stopped; the supervisor restarts the process


def trainer_process(cfg: ShipyardConfig) -> dict[str, Any]:
    """Train the run ``run.name`` (claiming its store first); returns the trainer's summary."""
    from shipyard.orchestrate.components import trainer_gate
    from shipyard.store.run import claim_run
    from shipyard.trainer.loop import run_trainer

    run_dir = Path(cfg.run.output_dir) / cfg.run.name
    store = claim_run(cfg.store, cfg.run.name, run_dir)
    with trainer_gate(cfg, store) as gate, watched(cfg, run_dir, "trainer") as beat:
        return run_trainer(cfg, store, run_dir, gate=gate, beat=beat)


def worker_process(cfg: ShipyardConfig, worker_id: str, server_url: str) -> int:
    """Play groups for the run ``run.name`` against ``server_url``; returns the batches written."""
    from shipyard.orchestrate.components import build_worker
    from shipyard.store.retry import until_reachable
    from shipyard.store.run import open_run

    store = until_reachable(lambda: open_run(cfg.store, cfg.run.name), "the run", deadline_s=600)
    worker = build_worker(cfg, worker_id, server_url, store)
    worker.spec.client.wait_ready(timeout_s=600)  # a server started beside it may still be loading
    where = Path(cfg.run.output_dir) / cfg.run.name / "workers" / worker_id
    with watched(cfg, where, f"worker {worker_id}") as beat:
        worker.beat = beat
        return worker.run()
