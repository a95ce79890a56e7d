"""Tests of :mod:`shipyard.envs.tasks.db`: generated migrations graded against a real PostgreSQL.

Contract checked: the set is a pure function of ``(n, seed)`` and covers every family; every
reference migration earns 1.0 and doing nothing 0.0 (data-keeping checks only count once the
goal holds); a migration that errors earns 0 with the reason; a partial migration earns the
exact fraction of its checks; the grader applies ``migration.sql`` to a fresh clone, so changing
the session's own database by hand earns nothing; end to end a session's clone is dropped and
the template is byte-identical afterwards. Database tests skip only without the server binaries.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

from shipyard.config.schema import SandboxConfig
from shipyard.envs.sandbox import BwrapSandbox
from shipyard.envs.services.base import lease_binds, lease_files
from shipyard.envs.services.pool import ServicePool
from shipyard.envs.services.postgres import PostgresService, postgres_available
from shipyard.envs.tasks.db import APPLY, FAMILIES, MIGRATION_FILE, db_tasks, grade_db
from shipyard.envs.types import RewardResult, Task

needs_pg = pytest.mark.skipif(postgres_available() is not None, reason=str(postgres_available()))
CFG = SandboxConfig(timeout_s=30)
TASKS = db_tasks(len(FAMILIES), seed=0)


@pytest.fixture(scope="module")
def pool() -> Iterator[ServicePool]:
    with ServicePool() as p:
        yield p


def _family(name: str) -> Task:
    return next(t for t in TASKS if t.id.startswith(f"db-{name}-"))


def _template(pool: ServicePool, task: Task) -> tuple[PostgresService, str]:
    pg = pool.get("postgres")
    assert isinstance(pg, PostgresService)
    return pg, pg.template(task.setup["postgres"])


def test_generation_is_deterministic_and_covers_every_family() -> None:
    again = db_tasks(len(FAMILIES), seed=0)
    assert [t.to_json() for t in again] == [t.to_json() for t in TASKS]
    assert {t.id.split("-")[1] for t in TASKS} == set(FAMILIES)
    assert [t.id for t in db_tasks(3, seed=1)] != [t.id for t in TASKS[:3]] or db_tasks(3, 1)[
        0
    ].setup != TASKS[0].setup
    for t in TASKS:
        assert t.kind == "db" and t.services == ["postgres"] and len(t.hidden_checks) >= 3
        assert Task.from_json(t.to_json()) == t
        assert MIGRATION_FILE in t.prompt and "psql service=db" in t.prompt
        assert t.reference not in t.prompt and "schema.sql" in t.files
    with pytest.raises(ValueError, match="n=-1"):
        db_tasks(-1, seed=0)


@needs_pg
def test_references_pass_and_doing_nothing_earns_nothing(pool: ServicePool) -> None:
    def both(task: Task) -> tuple[RewardResult, RewardResult]:
        good = grade_db(task, {MIGRATION_FILE: task.reference}, pool, CFG)
        return good, grade_db(task, {MIGRATION_FILE: "SELECT 1;\n"}, pool, CFG)

    with ThreadPoolExecutor(4) as ex:  # rollouts grade concurrently against one server, too
        results = list(ex.map(both, TASKS))
    for task, (good, noop) in zip(TASKS, results, strict=True):
        assert (good.reward, good.passed) == (1.0, len(task.hidden_checks)), (task.id, good.details)
        assert noop.reward == 0.0, (task.id, noop.details["tests"])


@needs_pg
def test_failing_missing_and_partial_migrations(pool: ServicePool) -> None:
    task = _family("add_column")
    broken = grade_db(task, {MIGRATION_FILE: task.reference + "SELECT 1/0;\n"}, pool, CFG)
    assert broken.reward == 0.0 and "division by zero" in broken.details["reason"]
    missing = grade_db(task, {"notes.txt": "done"}, pool, CFG)
    assert missing.reward == 0.0 and "no migration.sql" in missing.details["reason"]
    partial = task.reference.rsplit("ALTER TABLE", 1)[0]  # no NOT NULL
    res = grade_db(task, {MIGRATION_FILE: partial}, pool, CFG)
    outcomes = {k: v["outcome"] for k, v in res.details["tests"].items()}
    assert outcomes == {
        "column_added": "passed",
        "not_null": "failed",
        "backfilled": "passed",
        "rows_kept": "passed",
    }
    assert (res.reward, res.passed, res.total) == (0.75, 3, 4)


@needs_pg
def test_privileged_or_meta_command_migrations_fail_inside_the_sandbox(pool: ServicePool) -> None:
    task = _family("add_index")
    _, template = _template(pool, task)
    for evil in (
        "COPY (SELECT 1) TO PROGRAM 'true';\n",
        f"ALTER DATABASE {template} ALLOW_CONNECTIONS true;\n",
        "ALTER ROLE shipyard_grader SUPERUSER;\n",
    ):
        res = grade_db(task, {MIGRATION_FILE: task.reference + evil}, pool, CFG)
        assert res.reward == 0.0 and "migration failed" in res.details["reason"], evil
    marker = f"/var/tmp/shipyard-test-db-pwned-{os.getpid()}"
    shell = grade_db(task, {MIGRATION_FILE: f"\\! touch {marker}\n" + task.reference}, pool, CFG)
    assert shell.reward == 1.0 and not os.path.exists(marker)  # meta-commands run in the grader's sandbox


@needs_pg
def test_session_clone_end_to_end_and_the_grader_ignores_the_session_database(pool: ServicePool) -> None:
    task = _family("split_table")
    pg, template = _template(pool, task)
    before = pg.checksum(template)
    with pool.leases(task) as leases:
        session_db = leases["postgres"].info["database"]
        files = {**task.files, **lease_files(leases)}
        with BwrapSandbox(files, CFG, binds=lease_binds(leases)) as sb:
            sb.write(MIGRATION_FILE, task.reference)
            applied = sb.exec(APPLY)
            assert applied.returncode == 0, applied.stderr
            probe = "SELECT count(*) FROM information_schema.columns WHERE column_name = 'customer_id'"
            assert sb.exec(f'psql service=db -X -tA -c "{probe}"').stdout.strip() == "1"
            final = sb.files()
        by_hand = {k: v for k, v in final.items() if k != MIGRATION_FILE} | {MIGRATION_FILE: "SELECT 1;"}
        assert (
            grade_db(task, by_hand, pool, CFG).reward == 0.0
        )  # the migrated session DB is not what is graded
        assert grade_db(task, final, pool, CFG).reward == 1.0
    assert session_db not in pg.databases()
    assert [d for d in pg.databases() if d.startswith("r_")] == []
    assert pg.checksum(template) == before
