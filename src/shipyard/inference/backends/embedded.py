"""The embedded backend: one inference server of a run, the embedded engine, its HTTP server and its
weight subscriber (`inference.type = "embedded"`, chosen by :mod:`shipyard.inference.backends.base`).

Contract: loads the configured model as version 0 on ``inference.device`` in ``inference.dtype``
(resolved for that device, :func:`shipyard.models.precision.engine_precision`; :func:`build_engine`,
which evaluations use too), serves it on ``inference.host`` (port given or free), and follows the run's store (a
:class:`~shipyard.store.run.RunStore` view): each new version is fetched, verified and applied
between decode steps; ``weights.follow_url`` adds the push feed. ``stop()`` ends the subscriber,
then the server.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

from shipyard.config.schema import ShipyardConfig
from shipyard.store.types import Store


def build_engine(cfg: ShipyardConfig) -> tuple[Any, Any]:
    """The configured model as version 0 in an :class:`~shipyard.inference.engine.engine.EmbeddedEngine`
    on ``inference.device`` in ``inference.dtype``, and its tokenizer (a server's and an
    evaluation's engine alike)."""
    import torch

    from shipyard.inference.engine.engine import EmbeddedEngine
    from shipyard.models.loading import load_model
    from shipyard.models.precision import engine_precision

    torch.set_num_threads(cfg.inference.threads)
    if cfg.inference.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("inference.device = 'cuda', but torch sees no CUDA device here; use 'cpu'")
    model, tokenizer = load_model(cfg.model)
    model = model.to(cfg.inference.device)
    precision = engine_precision(model, cfg.inference)
    engine = EmbeddedEngine(
        model,
        tokenizer,
        max_batch=cfg.inference.max_batch,
        version=0,
        deterministic=cfg.inference.deterministic,
        prefix_cache_mb=cfg.inference.prefix_cache_mb,
        packed=cfg.inference.packed_linears,
    )
    engine.precision = precision
    return engine, tokenizer


class EmbeddedNode:
    """One inference server: embedded engine + HTTP server + weight subscriber. With ``store=None``
    it serves the base model (version 0) and follows nothing until :meth:`follow` gives it a run's
    store (``shipyard serve`` before the run exists)."""

    def __init__(self, cfg: ShipyardConfig, store: Store | None, port: int = 0) -> None:
        from shipyard.inference.serving.server import InferenceServer

        self.cfg = cfg
        # built on a thread that then exits, taking its OpenMP team with it: the server's batcher is
        # the one thread that runs the engine's kernels from then on (see EngineSink)
        with ThreadPoolExecutor(1, thread_name_prefix="shipyard-build") as pool:
            self.engine, self.tokenizer = pool.submit(build_engine, cfg).result()
        inf = cfg.inference
        self.server = InferenceServer(
            self.engine,
            host=inf.host,
            port=port,
            model_name=inf.served_model_name or None,
            max_n=inf.max_n,
            drain_s=inf.drain_s,
            scavenge=inf.scavenge,
        )
        self.server.start()
        self.subscriber: Any = None
        self.server.app.state.stats_hooks.append(self._adoptions)
        if store is not None:
            self.follow(store)

    def follow(self, store: Store) -> None:
        """Adopt the versions the run of ``store`` publishes from now on (once per node)."""
        from shipyard.weights.subscriber import EngineSink, WeightSubscriber

        assert self.subscriber is None, "the node already follows a run"
        cfg = self.cfg
        self.subscriber = WeightSubscriber(
            store,
            EngineSink(self.engine, applies=False),  # the server's batcher applies, idle or not
            poll_s=cfg.inference.poll_s,
            cache_dir=cfg.weights.cache_dir,
            lease_ttl_s=cfg.weights.lease_ttl_s,
            connections=cfg.store.connections,
            chunk_bytes=int(cfg.store.part_mb * (1 << 20)),
            workers=cfg.weights.workers,
        )
        self.subscriber.start(feed_url=cfg.weights.follow_url)

    def _adoptions(self) -> dict[str, Any]:
        """``/stats``'s ``adoptions``: the last 32 versions this server went live with."""
        sub = self.subscriber
        if sub is None:
            return {"adoptions": []}
        keys = ("version", "at", "published_at")
        return {"adoptions": [{"server": sub.name, **{k: e[k] for k in keys}} for e in sub.adopted[-32:]]}

    @property
    def url(self) -> str:
        return self.server.url

    def stop(self) -> None:
        if self.subscriber is not None:
            self.subscriber.stop()
        self.server.stop()
