"""`shipyard serve`: one inference server that follows the newest weights in the store.

Contract: loads the configured model as version 0, serves it over HTTP on
``inference.host:inference.port`` (token-in/token-out ``/generate``, OpenAI-compatible
``/v1/chat/completions``, ``/health``, ``/version``) and adopts each new version published to
``weights/`` between decode steps. Runs until interrupted.
"""

from __future__ import annotations

import time

from rich.console import Console

from shipyard.config.schema import ShipyardConfig


def serve(cfg: ShipyardConfig) -> None:
    from shipyard.orchestrate.components import InferenceNode
    from shipyard.store import open_store

    node = InferenceNode(cfg, open_store(cfg.store), port=cfg.inference.port)
    console = Console()
    console.print(f"serving {cfg.model.source} at {node.url}  (weights from {cfg.store.root}; Ctrl-C stops)")
    try:
        while True:
            time.sleep(1.0)
    except KeyboardInterrupt:
        pass
    finally:
        node.stop()
