"""`shipyard serve`: one inference server that follows the newest weights in the store.

Contract: starts the ``inference.type`` backend's server (:func:`shipyard.inference.backends.base.start_node`);
the embedded one loads the configured model as version 0, serves it over HTTP on
``inference.host:inference.port`` (token-in/token-out ``/generate``, OpenAI-compatible
``/v1/chat/completions``, ``/health``, ``/version``) and adopts each new version that the run
``run.name`` publishes (its ``weights/`` in the store, :func:`shipyard.store.run.open_run`) between
decode steps. When the store holds no run of that name yet (a fresh clone before its first
``shipyard train``), the embedded server serves the base model and says so, checks for the run
every ``inference.poll_s`` without writing to the store, and follows it from the moment it
exists; the vLLM backend needs the run first (an error names the command to run). Runs until
interrupted. The server is watched (``run.watchdog``): a decode step that does not come within
the server's deadline is named with its threads' stacks under ``<run_dir>/servers/<port>/`` and the
process exits with status 3 for its supervisor to restart; ``/health`` answers the server's
progress (``health``: phase, ``seq``, age), which a supervisor outside feeds to a
:class:`~shipyard.metrics.health.Monitor`.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console

from shipyard.config.schema import ShipyardConfig
from shipyard.metrics.health import watch

if TYPE_CHECKING:
    from shipyard.inference.backends.embedded import EmbeddedNode

console = Console()


def serve(cfg: ShipyardConfig) -> None:
    from shipyard.inference.backends.base import start_node
    from shipyard.store.run import describe_store, open_run, run_exists

    name, where = cfg.run.name, describe_store(cfg.store)
    store = open_run(cfg.store, name) if run_exists(cfg.store, name) else None
    if store is None and cfg.inference.type != "embedded":
        raise ValueError(
            f"{where} holds no run named {name!r} yet, and the vLLM backend serves a run's weights: run "
            f"`shipyard train` with this config first, or set run.name / store.root to a run that exists"
        )
    node = start_node(cfg, store, port=cfg.inference.port)
    engine = getattr(node, "engine", None)
    how = engine.precision["reason"] if engine is not None else f"vLLM, {cfg.inference.vllm.dtype}"
    follows = (
        f"weights of {store.identity.describe()} from {store.where}"
        if store is not None
        else f"the base model: {where} holds no run named {name!r} yet; its versions are adopted once "
        f"`shipyard train` creates it"
    )
    console.print(
        f"serving {cfg.model.source} at {node.url}  ({follows}; {how}; Ctrl-C stops)", soft_wrap=True
    )
    stop = threading.Event()
    if store is None:
        from shipyard.inference.backends.embedded import EmbeddedNode

        assert isinstance(node, EmbeddedNode)  # the only backend started without a run
        threading.Thread(target=_follow_once_created, args=(cfg, node, stop), daemon=True).start()
    port = node.url.rsplit(":", 1)[-1]
    try:
        with watch(
            cfg.run.watchdog, Path(cfg.run.output_dir) / name / "servers" / port, f"server {port}"
        ) as beat:
            beat.enter("idle")  # until a decode step (vLLM's server reports none: it stays idle)
            if engine is not None:
                engine.beat = beat  # its decode steps; `/health` answers its progress
                beat.note(version=engine.version)
            while True:
                time.sleep(1.0)
    except KeyboardInterrupt:
        pass
    finally:
        stop.set()
        node.stop()


def _follow_once_created(cfg: ShipyardConfig, node: EmbeddedNode, stop: threading.Event) -> None:
    """Wait (reading only) until the store holds the run ``run.name``, then have ``node`` follow it."""
    from shipyard.store.run import open_run, run_exists

    while not stop.wait(cfg.inference.poll_s):
        try:
            if not run_exists(cfg.store, cfg.run.name):
                continue
        except (TimeoutError, ConnectionError):
            continue  # the store is unreachable for now: look again
        store = open_run(cfg.store, cfg.run.name)
        node.follow(store)
        console.print(f"following {store.identity.describe()} from {store.where}", soft_wrap=True)
        return
