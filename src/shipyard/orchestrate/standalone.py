"""One component of a run as its own process: `shipyard trainer`, `shipyard worker`, `shipyard relay`.

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
worker's in ``<run_dir>/workers/<id>/``, a relay's in ``<run_dir>/relays/<region>/``), and the
process exits at once with status 3, so its supervisor starts it again and it resumes (a stuck
thread cannot be stopped from inside). Each also publishes its component's progress to the run's
store every ``report_s`` (``health/<component>.json``), so that a process frozen whole, which
cannot name itself, is named by whoever watches the store (``shipyard health``, the chaos
suite's supervisor). A worker is watched from its start: while it waits for its server it is in
phase ``connecting``.

Limits: no placement, no evaluation, no progress table: each process logs what it does and exits.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from shipyard.config.schema import ShipyardConfig
from shipyard.metrics.health import STALL_EXIT, Beat, watch
from shipyard.store.types import Store

__all__ = ["STALL_EXIT", "relay_process", "trainer_process", "watched", "worker_process"]


@contextmanager
def watched(cfg: ShipyardConfig, where: Path, component: str, store: Store) -> Iterator[Beat]:
    """The beat of this process's ``component``, watched while the block runs and reported to the run's
    ``store``; a stall ends the process with :data:`STALL_EXIT` after naming it (records and stacks
    under ``where``)."""
    with watch(cfg.run.watchdog, where, component, publish=store.put) as beat:
        yield beat


def trainer_process(cfg: ShipyardConfig) -> dict[str, Any]:
    """Train the run ``run.name`` (claiming its store first); returns the trainer's summary."""
    from shipyard.orchestrate.components import trainer_gate
    from shipyard.store.run import claim_run
    from shipyard.trainer.loop import run_trainer

    run_dir = Path(cfg.run.output_dir) / cfg.run.name
    store = claim_run(cfg.store, cfg.run.name, run_dir)
    with trainer_gate(cfg, store) as gate, watched(cfg, run_dir, "trainer", store) as beat:
        return run_trainer(cfg, store, run_dir, gate=gate, beat=beat)


def worker_process(cfg: ShipyardConfig, worker_id: str, server_url: str) -> int:
    """Play groups for the run ``run.name`` against ``server_url``; returns the batches written."""
    from shipyard.orchestrate.components import build_worker
    from shipyard.store.retry import until_reachable
    from shipyard.store.run import open_run

    store = until_reachable(lambda: open_run(cfg.store, cfg.run.name), "the run", deadline_s=600)
    worker = build_worker(cfg, worker_id, server_url, store)
    where = Path(cfg.run.output_dir) / cfg.run.name / "workers" / worker_id
    with watched(cfg, where, f"worker {worker_id}", store) as beat:
        beat.enter("connecting")
        worker.spec.client.wait_ready(timeout_s=600)  # a server started beside it may still be loading
        worker.beat = beat
        return worker.run()


def relay_process(cfg: ShipyardConfig) -> None:
    """Mirror the run ``run.name`` into ``relay.mirror`` until interrupted (``shipyard relay``), watched
    as ``relay <region>``: phase ``sync``, a tick per look at the origin's head."""
    from shipyard.store.retry import until_reachable
    from shipyard.store.run import open_run
    from shipyard.weights.relay import run_relay

    store = until_reachable(lambda: open_run(cfg.store, cfg.run.name), "the run", deadline_s=600)
    where = Path(cfg.run.output_dir) / cfg.run.name / "relays" / cfg.relay.region
    with watched(cfg, where, f"relay {cfg.relay.region}", store) as beat:
        beat.enter("sync")
        run_relay(cfg, progress=beat.tick)
