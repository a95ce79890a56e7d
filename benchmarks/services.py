"""Benchmark: per-rollout databases by template clone, against re-running setup and a cluster per rollout.

Contract: one real PostgreSQL cluster (:class:`shipyard.envs.services.postgres.PostgresService`)
serves every measurement. A task database is built by setup SQL (a table of ``--rows`` rows
with an index, plus the generated migration tasks' own setups). Three ways to give each
rollout a fresh database are timed side by side:

- ``clone`` (ours): ``CREATE DATABASE r TEMPLATE tmpl`` with a private role, then ``DROP ... WITH
  (FORCE)`` (:meth:`PostgresService.lease` / :meth:`release`);
- ``setup`` (baseline): ``CREATE DATABASE`` from the empty template, then run the setup SQL;
- ``cluster`` (baseline): ``initdb`` + start + setup + stop, a whole server per rollout.

It also times :func:`shipyard.envs.tasks.db.grade_db` (fresh clone, migration applied in a fresh
sandbox, hidden checks) on the reference migrations, checks that the template's on-disk files
are byte-identical after every rollout wrote to its clone, and that no rollout database is
left. Prints a rich table and writes ``benchmarks/results/services.json`` (keys
``pool_start_ms``, ``template_build_ms``, ``clone_p50_ms``, ``clone_p99_ms``, ``release_p50_ms``,
``setup_p50_ms``, ``cluster_p50_ms``, ``clone_speedup_vs_setup``, ``grade_db_p50_ms``,
``template_unchanged``, ``leaked_databases``).

Limits: wall-clock times on a shared machine (the load average is recorded); the cluster
baseline runs only ``--cluster-runs`` times.

Usage::

    .venv/bin/python benchmarks/services.py            # 40 rollouts, 20k-row table, 3 cluster runs
    .venv/bin/python benchmarks/services.py --quick    # 8 rollouts, 5k rows, 1 cluster run (< 1 minute)
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from shipyard.config.schema import PostgresConfig, SandboxConfig
from shipyard.envs.services.pool import ServicePool
from shipyard.envs.services.postgres import PostgresService, postgres_available
from shipyard.envs.tasks.db import MIGRATION_FILE, db_tasks, grade_db
from shipyard.envs.types import Task

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import parser, table, write_results  # noqa: E402


def setup_sql(rows: int) -> str:
    return (
        "CREATE TABLE events (id integer PRIMARY KEY, user_id integer NOT NULL, kind text NOT NULL, "
        "payload text NOT NULL);\n"
        f"INSERT INTO events SELECT g, g % 97, 'kind' || (g % 7), repeat(md5(g::text), 4) FROM generate_series(1, {rows}) g;\n"
        "CREATE INDEX events_user_idx ON events (user_id);\n"
    )


def timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1000


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def clone_rollouts(pg: PostgresService, task: Task, n: int) -> tuple[list[float], list[float]]:
    """(lease ms, release ms) per rollout; each rollout writes to its clone."""
    leases, releases = [], []
    for _ in range(n):
        t0 = time.perf_counter()
        lease = pg.lease(task)
        leases.append((time.perf_counter() - t0) * 1000)
        pg.psql(
            "DELETE FROM events WHERE id % 2 = 0;\nALTER TABLE events ADD COLUMN x int;",
            db=lease.info["database"],
        )
        releases.append(timed(lambda lease=lease: pg.release(lease)))  # type: ignore[misc]
    return leases, releases


def setup_rollouts(pg: PostgresService, sql: str, n: int) -> list[float]:
    out = []
    for i in range(n):
        name = f"bench_setup_{i}"
        out.append(timed(lambda name=name: (pg.psql(f"CREATE DATABASE {name};"), pg.psql(sql, db=name))))  # type: ignore[misc]
        pg.psql(f"DROP DATABASE {name} WITH (FORCE);")
    return out


def cluster_rollouts(sql: str, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        with PostgresService(PostgresConfig()) as pg:
            pg.psql("CREATE DATABASE task;")
            pg.psql(sql, db="task")
        out.append((time.perf_counter() - t0) * 1000)
    return out


def grade_times(pool: ServicePool, tasks: list[Task]) -> tuple[list[float], int]:
    times, passed = [], 0
    for task in tasks:
        t0 = time.perf_counter()
        res = grade_db(task, {MIGRATION_FILE: task.reference}, pool, SandboxConfig(timeout_s=60))
        times.append((time.perf_counter() - t0) * 1000)
        passed += res.reward == 1.0
    return times, passed


def _args() -> argparse.Namespace:
    ap = parser(__doc__)
    ap.add_argument("--rollouts", type=int, default=None, help="rollouts per method (default 40, quick 8)")
    ap.add_argument(
        "--rows", type=int, default=None, help="rows of the task table (default 20000, quick 5000)"
    )
    ap.add_argument(
        "--cluster-runs", type=int, default=None, help="cluster-per-rollout runs (default 3, quick 1)"
    )
    args = ap.parse_args()
    args.rollouts = args.rollouts or (8 if args.quick else 40)
    args.rows = args.rows or (5000 if args.quick else 20000)
    args.cluster_runs = args.cluster_runs or (1 if args.quick else 3)
    return args


def measure(args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, list[float]]]:
    """The figures of one run, and the raw per-rollout timings of the three methods."""
    sql = setup_sql(args.rows)
    task = Task("bench", "", "", kind="db", services=["postgres"], setup={"postgres": sql})
    with ServicePool() as pool:
        start_ms = timed(lambda: pool.get("postgres"))
        pg = pool.get("postgres")
        assert isinstance(pg, PostgresService)
        build_ms = timed(lambda: pg.template(sql))
        template = pg.template(sql)
        before = pg.checksum(template)
        leases, releases = clone_rollouts(pg, task, args.rollouts)
        unchanged = pg.checksum(template) == before
        setups = setup_rollouts(pg, sql, args.rollouts)
        migrations = db_tasks(7 if args.quick else 14, seed=0)
        grades, passed = grade_times(pool, migrations)
        leaked = [d for d in pg.databases() if d.startswith("r_")]
    clusters = cluster_rollouts(sql, args.cluster_runs)
    figures = {
        "pool_start_ms": start_ms,
        "template_build_ms": build_ms,
        "clone_p50_ms": statistics.median(leases),
        "clone_p99_ms": pct(leases, 0.99),
        "release_p50_ms": statistics.median(releases),
        "setup_p50_ms": statistics.median(setups),
        "cluster_p50_ms": statistics.median(clusters),
        "clone_speedup_vs_setup": statistics.median(setups) / statistics.median(leases),
        "grade_db_p50_ms": statistics.median(grades),
        "grade_db_references_passed": f"{passed}/{len(migrations)}",
        "template_unchanged": unchanged,
        "leaked_databases": len(leaked),
        "config": {"rollouts": args.rollouts, "rows": args.rows, "cluster_runs": args.cluster_runs},
        "load_avg": os.getloadavg()[0],
    }
    return figures, {"clone": leases, "setup": setups, "cluster": clusters}


def main() -> None:
    args = _args()
    problem = postgres_available()
    if problem is not None:
        raise SystemExit(problem)
    r, times = measure(args)
    runs = {"clone": args.rollouts, "setup": args.rollouts, "cluster": args.cluster_runs}
    labels = {
        "clone": "clone from template (ours)",
        "setup": "create + run setup SQL",
        "cluster": "cluster per rollout",
    }
    table(
        f"fresh database per rollout ({args.rows} rows + index; {args.rollouts} rollouts)",
        {
            labels[k]: {"p50 ms": statistics.median(v), "p99 ms": pct(v, 0.99), "runs": runs[k]}
            for k, v in times.items()
        },
    )
    print(
        f"pool start {r['pool_start_ms']:.0f} ms, template build {r['template_build_ms']:.0f} ms, release p50 "
        f"{r['release_p50_ms']:.0f} ms, grade_db p50 {r['grade_db_p50_ms']:.0f} ms "
        f"({r['grade_db_references_passed']} references pass), template unchanged: {r['template_unchanged']}, "
        f"leaked databases: {r['leaked_databases']}"
    )
    write_results(args, "services", {k: round(v, 2) if isinstance(v, float) else v for k, v in r.items()})


if __name__ == "__main__":
    main()
