"""Shared fixtures of the online tests: one durable PostgreSQL server per module, and a migrated,
emptied database per test."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator

import pytest

from shipyard.online.database import OnlineDB
from shipyard.online.postgres import LocalPostgres


@pytest.fixture(scope="module")
def pg() -> Iterator[LocalPostgres]:
    root = tempfile.mkdtemp(prefix="shipyard-online-test-")
    os.chmod(root, 0o755)  # the server's user must reach its data directory
    with LocalPostgres(os.path.join(root, "pg")) as server:
        yield server


@pytest.fixture()
def db(pg: LocalPostgres) -> Iterator[OnlineDB]:
    pg.start()  # a test may have stopped it
    db = OnlineDB(pg.dsn)
    db.migrate()
    with db.conn.cursor() as cur:
        cur.execute("TRUNCATE generations, feedback, rewards, decisions")
    yield db
    db.close()
