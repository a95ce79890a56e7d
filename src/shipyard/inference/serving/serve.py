"""`shipyard serve`: one inference server that follows the newest weights in the store.

Contract: starts the ``inference.type`` backend's server (:func:`shipyard.inference.backends.base.start_node`);
the embedded one loads the configured model as version 0, serves it over HTTP on
``inference.host:inference.port`` (token-in/token-out ``/generate``, OpenAI-compatible
``/v1/chat/completions``, ``/health``, ``/version``) and adopts each new version that the run
``run.name`` publishes (its ``weights/`` in the store, :func:`shipyard.store.run.open_run`: a name
the store does not hold is an error listing the runs it does) between decode steps. Runs until
interrupted.
"""

from __future__ import annotations

import time

from rich.console import Console

from shipyard.config.schema import ShipyardConfig


def serve(cfg: ShipyardConfig) -> None:
    from shipyard.inference.backends.base import start_node
    from shipyard.store.run import open_run

    store = open_run(cfg.store, cfg.run.name)  # follows the run named run.name, and only it
    node = start_node(cfg, store, port=cfg.inference.port)
    engine = getattr(node, "engine", None)
    how = engine.precision["reason"] if engine is not None else f"vLLM, {cfg.inference.vllm.dtype}"
    console = Console()
    console.print(
        f"serving {cfg.model.source} at {node.url}  (weights of {store.identity.describe()} from {store.where}; "
        f"{how}; Ctrl-C stops)",
        soft_wrap=True,
    )
    try:
        while True:
            time.sleep(1.0)
    except KeyboardInterrupt:
        pass
    finally:
        node.stop()
