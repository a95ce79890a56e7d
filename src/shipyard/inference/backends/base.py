"""Inference backends: what every backend's server node offers, and the switch that picks one.

Contract: a backend runs one inference server of a run that follows the run's published weights
(:class:`InferenceNode`: its ``url`` and ``stop``); :func:`start_node` starts the one
``inference.type`` names (``embedded``: :mod:`shipyard.inference.backends.embedded`; ``vllm``:
:mod:`shipyard.inference.backends.vllm`), and :func:`open_client` gives the
:class:`~shipyard.inference.types.InferenceClient` that talks to such a server. Everything above
(rollout workers, agent sessions, evaluation, the driver) only uses these two functions, so it runs
unchanged on either backend.

Example::

    node = start_node(cfg, store)
    client = open_client(cfg, node.url)
    [res] = client.generate([GenerateRequest(prompt_ids=ids)])
    node.stop()

Limits: SGLang is not a backend (docs/serving.md says why).
"""

from __future__ import annotations

from typing import Any, Protocol

from shipyard.config.schema import ShipyardConfig
from shipyard.inference.types import Priority
from shipyard.store.types import Store


class InferenceNode(Protocol):
    """One inference server of a run, following the run's weights."""

    @property
    def url(self) -> str:
        """Base URL its client talks to."""

    def stop(self) -> None:
        """Stop following weights, then stop serving."""


def start_node(cfg: ShipyardConfig, store: Store | None, port: int = 0) -> InferenceNode:
    """Start the ``inference.type`` backend's server on ``port`` (0: a free one), following the run of
    ``store``; None (embedded only): the base model, until the node's ``follow(store)``."""
    if cfg.inference.type == "embedded":
        from shipyard.inference.backends.embedded import EmbeddedNode

        return EmbeddedNode(cfg, store, port=port)
    if store is None:
        raise ValueError(
            f"inference.type={cfg.inference.type!r} serves a run's weights: it needs the run's store"
        )
    if cfg.inference.type == "vllm":
        from shipyard.inference.backends.vllm import VllmNode

        return VllmNode(cfg, store, port=port)
    raise ValueError(f"inference.type={cfg.inference.type!r}; expected 'embedded' or 'vllm'")


def open_client(cfg: ShipyardConfig, url: str, priority: Priority | None = None) -> Any:
    """The client of the ``inference.type`` backend's server at ``url`` (an InferenceClient with
    ``version``, ``stats``, ``wait_ready`` and ``close``); ``priority`` stamps each request's tier
    (embedded servers; :data:`~shipyard.inference.types.Priority`)."""
    if cfg.inference.type == "embedded":
        from shipyard.inference.client import HttpInferenceClient

        return HttpInferenceClient(url, priority=priority)
    if cfg.inference.type == "vllm":
        from shipyard.inference.backends.vllm import routes_wanted
        from shipyard.inference.backends.vllm_server import VllmClient

        return VllmClient(url, cfg.inference.served_model_name or "policy", moe=routes_wanted(cfg))
    raise ValueError(f"inference.type={cfg.inference.type!r}; expected 'embedded' or 'vllm'")
