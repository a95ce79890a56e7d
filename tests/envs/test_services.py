"""Tests of :mod:`shipyard.envs.services`: a real PostgreSQL per pool, one cloned database per lease.

Contract checked: a lease is a clone of the task's template that the sandbox reaches through a
bound unix socket (no network) and that only its own role can open; writes in one lease are
invisible to the next and the template's on-disk files are byte-identical after a rollout that
wrote; release drops the database and role; hidden checks run read-only as a non-superuser (an
agent-defined function cannot write or run programs through them); a pool killed hard is
reaped by the next one. Skipped only when the PostgreSQL server binaries are absent.
"""

from __future__ import annotations

import os
import select
import subprocess
import sys
import threading
from collections.abc import Iterator

import pytest

from shipyard.config.schema import PostgresConfig, SandboxConfig, ServicesConfig
from shipyard.envs.sandbox import BwrapSandbox
from shipyard.envs.services.base import lease_binds, lease_files
from shipyard.envs.services.pool import ServicePool
from shipyard.envs.services.postgres import (
    PostgresService,
    find_bin_dir,
    postgres_available,
    reap_stale,
)
from shipyard.envs.types import Task

pytestmark = pytest.mark.skipif(postgres_available() is not None, reason=str(postgres_available()))

SETUP = (
    "CREATE TABLE users (id integer PRIMARY KEY, name text NOT NULL);\n"
    "INSERT INTO users SELECT g, 'user' || g FROM generate_series(1, 100) g;\n"
)
TASK = Task(id="svc", prompt="", entry_point="", services=["postgres"], setup={"postgres": SETUP})
CFG = SandboxConfig(timeout_s=30)


@pytest.fixture(scope="module")
def pool() -> Iterator[ServicePool]:
    with ServicePool(ServicesConfig()) as p:
        yield p


def _pg(pool: ServicePool) -> PostgresService:
    service = pool.get("postgres")
    assert isinstance(service, PostgresService)
    return service


def _sandbox(leases: dict) -> BwrapSandbox:
    return BwrapSandbox(lease_files(leases), CFG, binds=lease_binds(leases))


def test_lease_is_a_private_clone_and_the_template_is_never_touched(pool: ServicePool) -> None:
    pg = _pg(pool)
    template = pg.template(SETUP)
    before = pg.checksum(template)
    with pool.leases(TASK) as leases, _sandbox(leases) as sb:
        db = leases["postgres"].info["database"]
        assert db in pg.databases() and leases["postgres"].info["template"] == template
        res = sb.exec(
            "psql service=db -X -q -v ON_ERROR_STOP=1 -c 'DELETE FROM users WHERE id > 10' "
            "-c 'ALTER TABLE users ADD COLUMN email text' -c 'CREATE TABLE extra (x int)' "
            "&& psql service=db -X -tA -c 'SELECT count(*) FROM users'"
        )
        assert res.returncode == 0, res.stderr
        assert res.stdout.strip() == "10"
        with pool.leases(TASK) as other, _sandbox(other) as sb2:
            fresh = sb2.exec("psql service=db -X -tA -c 'SELECT count(*), max(name) FROM users'")
            assert fresh.stdout.strip() == "100|user99"
    assert db not in pg.databases()
    assert pg.psql(f"SELECT count(*) FROM pg_roles WHERE rolname = '{db}';").strip() == "0"
    assert pg.checksum(template) == before


def test_a_lease_reaches_only_its_own_database(pool: ServicePool) -> None:
    pg = _pg(pool)
    template = pg.template(SETUP)
    with pool.leases(TASK) as mine, pool.leases(TASK) as theirs, _sandbox(mine) as sb:
        me, other = mine["postgres"], theirs["postgres"]
        password = me.files[".pg_service.conf"].split("password=")[1].strip()
        base = f"host=/run/postgresql user={me.info['database']} password={password}"
        for db in (other.info["database"], template, "postgres", "template1"):
            res = sb.exec(f"psql '{base} dbname={db}' -X -c 'SELECT 1'")
            assert res.returncode != 0, f"lease role reached {db}"
        admin = sb.exec("psql 'host=/run/postgresql user=shipyard_admin dbname=postgres' -X -w -c 'SELECT 1'")
        assert admin.returncode != 0
        own = sb.exec(f"psql service=db -X -c 'ALTER DATABASE {template} ALLOW_CONNECTIONS true'")
        assert own.returncode != 0 and "must be owner" in own.stderr
        assert sb.exec("psql service=db -X -c 'SELECT 1'").returncode == 0


def test_no_network_is_needed_or_given(pool: ServicePool) -> None:
    with pool.leases(TASK) as leases, _sandbox(leases) as sb:
        net = sb.exec(f"{sys.executable} -c \"import socket; socket.create_connection(('1.1.1.1', 53), 2)\"")
        assert net.returncode != 0
        assert sb.exec("psql service=db -X -tA -c 'SELECT 1'").stdout.strip() == "1"


def test_checks_report_each_outcome_and_run_read_only_without_privileges(pool: ServicePool) -> None:
    pg = _pg(pool)
    marker = "/tmp/shipyard-test-services-pwned"
    with pool.leases(TASK) as leases, _sandbox(leases) as sb:
        evil = (
            "CREATE TABLE log (x int);\n"
            "CREATE FUNCTION public.sneaky() RETURNS boolean LANGUAGE plpgsql AS $$ BEGIN "
            "INSERT INTO log VALUES (1); RETURN true; END $$;\n"
            "CREATE FUNCTION public.shell() RETURNS boolean LANGUAGE plpgsql AS $$ BEGIN "
            f"COPY (SELECT 1) TO PROGRAM 'touch {marker}'; RETURN true; END $$;\n"
            "CREATE VIEW trap AS SELECT sneaky() AS a, shell() AS b;\n"
        )
        sb.write("evil.sql", evil)
        assert sb.exec("psql service=db -X -q -v ON_ERROR_STOP=1 -f evil.sql").returncode == 0
        lease = leases["postgres"]
        out = pg.run_checks(
            lease,
            {
                "count_ok": "SELECT count(*) = 100 FROM users",
                "count_wrong": "SELECT count(*) = 7 FROM users",
                "broken": "SELECT x FROM no_such_table",
                "writes": "SELECT a FROM trap",
                "null_is_false": "SELECT NULL::boolean",
                "after_errors": "SELECT true",
            },
        )
        assert {k: v["outcome"] for k, v in out.items()} == {
            "count_ok": "passed",
            "count_wrong": "failed",
            "broken": "error",
            "writes": "error",
            "null_is_false": "failed",
            "after_errors": "passed",
        }
        assert "no_such_table" in out["broken"]["message"]
        assert "read-only" in out["writes"]["message"]
        assert pg.run_checks(lease, {"shell": "SELECT b FROM trap"})["shell"]["outcome"] == "error"
        assert (
            pg.run_checks(lease, {"no_log": "SELECT count(*) = 0 FROM log"})["no_log"]["outcome"] == "passed"
        )
    assert not os.path.exists(marker)
    with pytest.raises(ValueError, match="must be an identifier"):
        pg.run_checks(lease, {"bad name": "SELECT true"})


def test_concurrent_leases_of_one_template(pool: ServicePool) -> None:
    names: list[str] = []
    errors: list[BaseException] = []

    def one() -> None:
        try:
            with pool.leases(TASK) as leases:
                names.append(leases["postgres"].info["database"])
        except BaseException as exc:  # collected and asserted below
            errors.append(exc)

    threads = [threading.Thread(target=one) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(set(names)) == 6
    assert not set(names) & set(_pg(pool).databases())


def test_unknown_service_and_stray_setup_are_named() -> None:
    with ServicePool() as p:
        with (
            pytest.raises(ValueError, match="unknown service 'redis'"),
            p.leases(Task("t", "", "", services=["redis"])),
        ):
            pass
        stray = Task("t2", "", "", setup={"postgres": "SELECT 1"})
        with pytest.raises(ValueError, match="does not declare"), p.leases(stray):
            pass


def _postmaster_pid(data: str) -> int:
    with open(os.path.join(data, "postmaster.pid")) as f:
        return int(f.readline())


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            return "zombie" in f.read().lower()
    except FileNotFoundError:
        return True


def test_close_stops_the_server_and_a_killed_pool_is_reaped() -> None:
    service = PostgresService(PostgresConfig())
    root, pid = service.root, _postmaster_pid(service.data)
    service.close()
    assert not os.path.exists(root) and _gone(pid)
    code = (
        "import os, sys\nfrom shipyard.envs.services.postgres import PostgresService\n"
        "s = PostgresService()\nprint(s.root, flush=True)\nos.kill(os.getpid(), 9)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    orphan = out.stdout.strip()
    assert orphan and os.path.isdir(orphan), out.stderr
    orphan_pid = _postmaster_pid(os.path.join(orphan, "data"))
    assert not _gone(orphan_pid)
    run_as = ["runuser", "-u", PostgresConfig().run_as, "--"] if os.getuid() == 0 else []
    assert reap_stale(find_bin_dir() or "", [os.path.dirname(orphan)], run_as) >= 1
    assert not os.path.exists(orphan) and _gone(orphan_pid)


def test_a_killed_server_is_replaced_and_its_leases_fail_cleanly() -> None:
    import signal

    with ServicePool(ServicesConfig()) as fresh:
        first = _pg(fresh)
        with pytest.raises(RuntimeError), fresh.leases(TASK):  # the server dies under a live lease
            with open(os.path.join(first.data, "postmaster.pid")) as f:
                pid = int(f.readline())
            pidfd = os.pidfd_open(pid)  # readable once the process has exited: an event, not a poll
            os.kill(pid, signal.SIGKILL)
            assert select.select([pidfd], [], [], 30)[0], "the postmaster did not die"
            os.close(pidfd)
            assert not first.healthy()
            first.psql("SELECT 1;")
        second = _pg(fresh)
        assert second is not first and second.healthy() and not os.path.exists(first.root)
        with fresh.leases(TASK) as leases, _sandbox(leases) as sb:
            out = sb.exec("psql service=db -Atc 'SELECT count(*) FROM users'")
            assert out.stdout.strip() == "100", out.stderr
