"""`shipyard online ACTION CONFIG`: run the gateway, mature rewards, export, retain, show status.

Contract: every action opens the database of ``online.db`` (``dsn``, or the durable local server in
``local_dir``, started if needed and left running for the other actions) and migrates it first.

- ``gateway``: serve the gateway on ``online.gateway.host:port`` until SIGINT/SIGTERM, then flush
  its buffer (the records it could not write are reported);
- ``mature``: compute the reward of every generation older than ``online.reward.mature_after_s``;
- ``export --out FILE``: joined generations, feedback and rewards as JSONL;
- ``retain``: delete what is older than ``online.db.retention_days``;
- ``status``: schema version, row counts, the serving version and the last decisions;
- ``promote VERSION``: serve candidate ``VERSION`` (from ``<run.name>-candidates``) as the next
  serving version of ``<run.name>``, recorded as a manual decision (the gate is bypassed, and the
  record says so);
- ``rollback VERSION``: serve serving version ``VERSION``'s weights again, as the next version.

The serving line is the run ``run.name`` of ``store`` (what ``shipyard serve`` follows); the online
trainer's candidates are the run ``<run.name>-candidates``.

Example::

    shipyard online gateway configs/online.toml online.gateway.upstream=http://127.0.0.1:8000
    shipyard online export configs/online.toml --out runs/online/export.jsonl
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from shipyard.config.schema import ShipyardConfig
from shipyard.online.database import OnlineDB

ACTIONS = ("gateway", "mature", "export", "retain", "status", "promote", "rollback")


def database_dsn(cfg: ShipyardConfig) -> str:
    """``online.db.dsn``, else the local server's (started when it is not running)."""
    if cfg.online.db.dsn:
        return cfg.online.db.dsn
    from shipyard.online.postgres import LocalPostgres

    return LocalPostgres(cfg.online.db.local_dir, cfg.services.postgres).dsn


def run_online(
    cfg: ShipyardConfig, action: str, out: str | None = None, version: int | None = None
) -> dict[str, Any]:
    if action not in ACTIONS:
        raise ValueError(f"unknown online action {action!r}; use one of {list(ACTIONS)}")
    if action in ("promote", "rollback") and version is None:
        raise ValueError(f"shipyard online {action} needs a VERSION")
    dsn = database_dsn(cfg)
    db = OnlineDB(dsn, cfg.online.db.connect_timeout_s)
    try:
        applied = db.migrate()
        if action == "gateway":
            return _gateway(cfg, dsn)
        if action == "mature":
            from shipyard.online.reward import RewardModel

            return {"matured": db.mature(RewardModel(cfg.online.reward), time.time())}
        if action == "export":
            if not out:
                raise ValueError("shipyard online export needs --out FILE")
            return {"lines": db.export_jsonl(Path(out)), "file": out}
        if action == "retain":
            return db.retain(cfg.online.db.retention_days)
        if action in ("promote", "rollback"):
            return _move(cfg, db, action, version or 0)
        status = {"schema_version": db.schema_version(), "migrations_applied_now": applied, **db.counts()}
        return {**status, **_line_status(cfg, db)}
    finally:
        db.close()


def _gateway(cfg: ShipyardConfig, dsn: str) -> dict[str, Any]:
    from shipyard.online.gateway import Gateway

    gw = Gateway(cfg.online.gateway, lambda: OnlineDB(dsn, cfg.online.db.connect_timeout_s)).start()
    print(f"gateway on {gw.url} -> {cfg.online.gateway.upstream} (Ctrl-C stops and flushes)", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    left = gw.stop()
    return {**gw.stats(), "unwritten_at_exit": left}


def _move(cfg: ShipyardConfig, db: OnlineDB, action: str, version: int) -> dict[str, Any]:
    from shipyard.online.serving import ServingLine
    from shipyard.store.run import open_run
    from shipyard.weights.versions import load_version

    line = ServingLine(open_run(cfg.store, cfg.run.name), db)
    if action == "rollback":
        return {"serving_version": line.rollback(version, reason="manual (shipyard online rollback)")}
    weights = load_version(open_run(cfg.store, f"{cfg.run.name}-candidates"), version)
    return {"serving_version": line.promote(version, weights, {"manual": True, "gate": "bypassed"})}


def _line_status(cfg: ShipyardConfig, db: OnlineDB) -> dict[str, Any]:
    from shipyard.online.serving import ServingLine
    from shipyard.store.run import RunStoreError, open_run

    try:
        return ServingLine(open_run(cfg.store, cfg.run.name), db).status()
    except RunStoreError as e:
        return {"serving_version": None, "serving_line": str(e)}
