"""Object store for every hand-off. ``open_store(cfg)`` picks the backend from ``cfg.type``."""

from __future__ import annotations

from shipyard.config.schema import StoreConfig
from shipyard.store.local import LocalStore
from shipyard.store.types import IOStats, Store


def open_store(cfg: StoreConfig) -> Store:
    if cfg.type == "local":
        return LocalStore(cfg.root)
    if cfg.type == "s3":
        from shipyard.store.fsspec_store import s3_store

        return s3_store(
            cfg.root,
            cfg.endpoint_url,
            cfg.region,
            cfg.key_env,
            cfg.secret_env,
            connections=cfg.connections,
            part_bytes=int(cfg.part_mb * (1 << 20)),
            timeout_s=cfg.timeout_s,
        )
    raise ValueError(f"store.type={cfg.type!r} is not a known backend (use 'local' or 's3')")


__all__ = ["IOStats", "LocalStore", "Store", "open_store"]
