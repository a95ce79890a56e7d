"""Object store for every hand-off. ``open_store(cfg)`` picks the backend from ``cfg.type``."""

from __future__ import annotations

from shipyard.config.schema import StoreConfig
from shipyard.store.local import LocalStore
from shipyard.store.types import Store


def open_store(cfg: StoreConfig) -> Store:
    if cfg.type == "local":
        return LocalStore(cfg.root)
    raise ValueError(f"store.type={cfg.type!r} is not a known backend (use 'local')")


__all__ = ["LocalStore", "Store", "open_store"]
