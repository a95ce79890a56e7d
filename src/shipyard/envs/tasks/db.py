"""Generated database-migration tasks, graded by hidden SQL checks against a real PostgreSQL.

Contract: :func:`db_tasks` is a pure function of ``(n, seed)``. Each task (``kind = "db"``,
``services = ["postgres"]``) brings the SQL that builds its starting database
(``setup["postgres"]``: schema and seeded rows), a prompt that asks for one migration, the schema
as ``schema.sql`` in the workspace, ``hidden_checks`` (name -> SQL returning one boolean; the
expected values, such as an md5 over the migrated rows, are computed here at generation time)
and a ``reference`` migration that passes every check. Families (:data:`FAMILIES`): add a
column with a backfill, split a table into two with a foreign key, rename a table and column
behind a compatibility view, deduplicate then add a unique constraint, clamp bad values then add
a check constraint, add a composite index, fill NULLs then add a default and NOT NULL.

During a session the rollout's own clone of the task's database is reachable in the sandbox as
``psql service=db``; the policy writes ``migration.sql`` and may apply it there. Grading
(:func:`grade_db`) never trusts that database or the sandbox: it takes ``migration.sql`` from the
final files, applies it with ``psql -v ON_ERROR_STOP=1`` inside a fresh sandbox to a fresh clone
of the template (a new lease), then runs the hidden checks from the host as the read-only
grader role. Reward = passed checks / checks, and 0 when the migration does not apply cleanly
(a migration that errors half-way would fail in production too). ``details["tests"]`` holds each
check's outcome.

Limits: checks look at the final state (schema through the catalogs, data through md5 digests),
not at how long locks were held; rows are small (tens per table), so the tasks teach SQL, not
performance.

Example::

    with ServicePool() as pool:
        task = db_tasks(7, seed=0)[0]
        res = grade_db(task, {"migration.sql": task.reference}, pool, SandboxConfig())
        assert res.reward == 1.0
"""

from __future__ import annotations

import hashlib
import random
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from shipyard.config.schema import SandboxConfig
from shipyard.envs.services.base import lease_binds, lease_files
from shipyard.envs.services.pool import ServicePool
from shipyard.envs.services.postgres import PostgresService
from shipyard.envs.tasks.kinds import (
    FILES_REMINDER,
    FILES_SYSTEM_PROMPT,
    GradingContext,
    clip_output,
    file_state,
)
from shipyard.envs.types import RewardResult, Sandbox, Task

if TYPE_CHECKING:
    from shipyard.envs.tasks.repo import RepoCache

MIGRATION_FILE = "migration.sql"
"""The workspace file the grader applies."""
APPLY = f"psql service=db -X -q -v ON_ERROR_STOP=1 -f {MIGRATION_FILE}"
"""How the migration is applied (in the session by the policy, in a fresh sandbox by the grader)."""

_FIRST = ["ada", "alan", "grace", "edsger", "barbara", "donald", "john", "frances", "ken", "radia"]
_LAST = ["lovelace", "turing", "hopper", "dijkstra", "liskov", "knuth", "backus", "allen", "thompson"]
_ENTITIES = ["customers", "members", "clients", "patrons", "subscribers", "accounts_old", "people"]


@dataclass(frozen=True)
class Migration:
    """What a family builder returns: starting database, instruction, checks and a reference."""

    setup: str
    schema: str
    instruction: str
    checks: dict[str, str]
    reference: str


def _md5(parts: list[str]) -> str:
    """``md5(string_agg(x, ',' ORDER BY ...))`` computed in Python."""
    return hashlib.md5(",".join(parts).encode()).hexdigest()


def _q(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


def _inserts(table: str, cols: list[str], rows: list[tuple[Any, ...]]) -> str:
    def lit(v: Any) -> str:
        return "NULL" if v is None else str(v) if isinstance(v, int) else _q(str(v))

    values = ",\n".join("(" + ", ".join(lit(v) for v in row) + ")" for row in rows)
    return f"INSERT INTO {table} ({', '.join(cols)}) VALUES\n{values};\n"


def _column_exists(table: str, column: str, extra: str = "") -> str:
    return (
        "SELECT EXISTS (SELECT 1 FROM information_schema.columns WHERE table_schema = 'public' "
        f"AND table_name = {_q(table)} AND column_name = {_q(column)}{extra})"
    )


def _relkind(table: str, kind: str) -> str:
    return (
        f"SELECT EXISTS (SELECT 1 FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
        f"WHERE n.nspname = 'public' AND c.relname = {_q(table)} AND c.relkind = {_q(kind)})"
    )


def _count(table: str, n: int) -> str:
    return f"SELECT count(*) = {n} FROM public.{table}"


def _both(goal: str, guard: str) -> str:
    """A guard check (data kept) that only passes once the goal holds too: doing nothing earns nothing."""
    return f"SELECT ({goal}) AND ({guard})"


def _names(rng: random.Random, n: int) -> list[tuple[str, str]]:
    return [(rng.choice(_FIRST), rng.choice(_LAST)) for _ in range(n)]


# ------------------------------------------------------------------------------------ families
def _add_column(rng: random.Random) -> Migration:
    table, col = rng.choice(_ENTITIES), rng.choice(["full_name", "display_name", "label"])
    last_first = rng.random() < 0.5
    rows = [(i + 1, f, last) for i, (f, last) in enumerate(_names(rng, rng.randint(12, 40)))]
    schema = f"CREATE TABLE {table} (\n  id integer PRIMARY KEY,\n  first_name text NOT NULL,\n  last_name text NOT NULL\n);\n"
    expr = "last_name || ', ' || first_name" if last_first else "first_name || ' ' || last_name"
    how = (
        "`last_name, first_name` (last name, a comma and a space, first name)"
        if last_first
        else ("`first_name last_name` (first name, a space, last name)")
    )
    values = [f"{last}, {first}" if last_first else f"{first} {last}" for _, first, last in rows]
    return Migration(
        setup=schema + _inserts(table, ["id", "first_name", "last_name"], rows),
        schema=schema,
        instruction=f"Add a column `{col}` of type text to `{table}`, filled for every existing row as {how}, "
        "and make it NOT NULL.",
        checks={
            "column_added": _column_exists(table, col, " AND data_type = 'text'"),
            "not_null": _column_exists(table, col, " AND is_nullable = 'NO'"),
            "backfilled": f"SELECT md5(string_agg({col}, ',' ORDER BY id)) = {_q(_md5(values))} FROM public.{table}",
            "rows_kept": _both(_column_exists(table, col), _count(table, len(rows))),
        },
        reference=f"ALTER TABLE {table} ADD COLUMN {col} text;\nUPDATE {table} SET {col} = {expr};\n"
        f"ALTER TABLE {table} ALTER COLUMN {col} SET NOT NULL;\n",
    )


def _split_table(rng: random.Random) -> Migration:
    orders, people = rng.choice(["orders", "purchases", "invoices"]), rng.choice(["customers", "buyers"])
    folks = sorted({(f"{f}.{last}@example.com", f"{f.title()} {last.title()}") for f, last in _names(rng, 8)})
    rows = [(i + 1, *rng.choice(folks), rng.randint(1, 500)) for i in range(rng.randint(15, 40))]
    cols = ["id", "customer_email", "customer_name", "amount"]
    schema = (
        f"CREATE TABLE {orders} (\n  id integer PRIMARY KEY,\n  customer_email text NOT NULL,\n"
        "  customer_name text NOT NULL,\n  amount integer NOT NULL\n);\n"
    )
    used = sorted({(e, n) for _, e, n, _ in rows})
    mapping = [f"{i}:{e}:{n}" for i, e, n, _ in rows]
    return Migration(
        setup=schema + _inserts(orders, cols, rows),
        schema=schema,
        instruction=f"Move the customer data out of `{orders}`: create a table `{people}` with columns `id` "
        "(integer primary key), `email` (text, NOT NULL, UNIQUE) and `name` (text, NOT NULL) holding one row "
        f"per distinct customer; add `customer_id` (integer, NOT NULL) to `{orders}` as a foreign key to "
        f"`{people}(id)` pointing at each order's customer; then drop `customer_email` and `customer_name` "
        f"from `{orders}`. Keep every order and its amount.",
        checks={
            "table_created": f"SELECT count(*) = {len(used)} FROM public.{people}",
            "email_unique": "SELECT EXISTS (SELECT 1 FROM pg_index i JOIN pg_attribute a ON a.attrelid = "
            f"i.indrelid AND a.attnum = i.indkey[0] WHERE i.indrelid = 'public.{people}'::regclass AND "
            "i.indisunique AND i.indnkeyatts = 1 AND a.attname = 'email')",
            "foreign_key": "SELECT EXISTS (SELECT 1 FROM pg_constraint WHERE contype = 'f' AND conrelid = "
            f"'public.{orders}'::regclass AND confrelid = 'public.{people}'::regclass)",
            "old_columns_dropped": "SELECT NOT EXISTS (SELECT 1 FROM information_schema.columns WHERE "
            f"table_schema = 'public' AND table_name = {_q(orders)} AND column_name IN "
            "('customer_email', 'customer_name'))",
            "orders_mapped": f"SELECT md5(string_agg(o.id || ':' || c.email || ':' || c.name, ',' ORDER BY o.id)) = "
            f"{_q(_md5(mapping))} FROM public.{orders} o JOIN public.{people} c ON c.id = o.customer_id",
            "amounts_kept": f"SELECT to_regclass('public.{people}') IS NOT NULL AND md5(string_agg(id || ':' || amount, ',' ORDER BY id)) = "
            f"{_q(_md5([f'{i}:{a}' for i, _, _, a in rows]))} FROM public.{orders}",
        },
        reference=f"CREATE TABLE {people} (id integer GENERATED ALWAYS AS IDENTITY PRIMARY KEY, "
        "email text NOT NULL UNIQUE, name text NOT NULL);\n"
        f"INSERT INTO {people} (email, name) SELECT DISTINCT customer_email, customer_name FROM {orders} "
        "ORDER BY 1;\n"
        f"ALTER TABLE {orders} ADD COLUMN customer_id integer REFERENCES {people}(id);\n"
        f"UPDATE {orders} o SET customer_id = c.id FROM {people} c WHERE c.email = o.customer_email;\n"
        f"ALTER TABLE {orders} ALTER COLUMN customer_id SET NOT NULL;\n"
        f"ALTER TABLE {orders} DROP COLUMN customer_email, DROP COLUMN customer_name;\n",
    )


def _rename_with_view(rng: random.Random) -> Migration:
    old, new = rng.choice(
        [("usr", "users"), ("prod", "products"), ("emp", "employees"), ("cust", "customers")]
    )
    c_old, c_new = rng.choice([("nm", "name"), ("ttl", "title"), ("lbl", "label")])
    rows = [
        (i + 1, f"{f}_{last}", rng.randint(0, 100))
        for i, (f, last) in enumerate(_names(rng, rng.randint(10, 30)))
    ]
    schema = f"CREATE TABLE {old} (\n  id integer PRIMARY KEY,\n  {c_old} text NOT NULL,\n  score integer NOT NULL\n);\n"
    digest = _md5([f"{i}:{n}:{s}" for i, n, s in rows])
    return Migration(
        setup=schema + _inserts(old, ["id", c_old, "score"], rows),
        schema=schema,
        instruction=f"Rename table `{old}` to `{new}` and its column `{c_old}` to `{c_new}`. Old code still reads "
        f"`{old}`: create a view named `{old}` over `{new}` that exposes the old column names "
        f"(`id`, `{c_old}`, `score`, in that order).",
        checks={
            "table_renamed": _relkind(new, "r"),
            "column_renamed": _column_exists(new, c_new),
            "old_column_gone": _both(_relkind(new, "r"), f"SELECT NOT ({_column_exists(new, c_old)})"),
            "compat_view": _relkind(old, "v"),
            "view_columns": f"SELECT ({_relkind(old, 'v')}) AND array_agg(column_name::text ORDER BY ordinal_position) = "
            f"ARRAY['id', {_q(c_old)}, 'score'] FROM information_schema.columns WHERE table_schema = 'public' "
            f"AND table_name = {_q(old)}",
            "data_through_view": f"SELECT ({_relkind(old, 'v')}) AND md5(string_agg(id || ':' || {c_old} || ':' || score, ',' ORDER BY id)) = "
            f"{_q(digest)} FROM public.{old}",
            "data_kept": f"SELECT md5(string_agg(id || ':' || {c_new} || ':' || score, ',' ORDER BY id)) = "
            f"{_q(digest)} FROM public.{new}",
        },
        reference=f"ALTER TABLE {old} RENAME TO {new};\nALTER TABLE {new} RENAME COLUMN {c_old} TO {c_new};\n"
        f"CREATE VIEW {old} AS SELECT id, {c_new} AS {c_old}, score FROM {new};\n",
    )


def _unique_after_dedupe(rng: random.Random) -> Migration:
    table = rng.choice(["signups", "contacts", "leads", "newsletter"])
    emails = sorted({f"{f}{rng.randint(1, 9)}@example.org" for f, _ in _names(rng, 14)})
    rows = [(i + 1, rng.choice(emails)) for i in range(rng.randint(20, 45))]
    kept = sorted(min(i for i, e in rows if e == email) for email in {e for _, e in rows})
    schema = f"CREATE TABLE {table} (\n  id integer PRIMARY KEY,\n  email text NOT NULL\n);\n"
    name = f"{table}_email_key"
    return Migration(
        setup=schema + _inserts(table, ["id", "email"], rows),
        schema=schema,
        instruction=f"`{table}.email` has duplicates. Delete the duplicate rows, keeping for each email the row "
        f"with the lowest id, then add a unique constraint named `{name}` on `email`.",
        checks={
            "constraint_added": "SELECT EXISTS (SELECT 1 FROM pg_constraint WHERE contype = 'u' AND conname = "
            f"{_q(name)} AND conrelid = 'public.{table}'::regclass)",
            "lowest_ids_kept": f"SELECT md5(string_agg(id::text, ',' ORDER BY id)) = {_q(_md5([str(i) for i in kept]))} "
            f"FROM public.{table}",
            "rows_left": _count(table, len(kept)),
        },
        reference=f"DELETE FROM {table} a USING {table} b WHERE a.email = b.email AND a.id > b.id;\n"
        f"ALTER TABLE {table} ADD CONSTRAINT {name} UNIQUE (email);\n",
    )


def _check_after_clamp(rng: random.Random) -> Migration:
    table, col = rng.choice([("stock", "quantity"), ("inventory", "on_hand"), ("balances", "credits")])
    rows = [(i + 1, f"sku-{rng.randint(100, 999)}", rng.randint(-5, 50)) for i in range(rng.randint(15, 40))]
    rows[0] = (1, rows[0][1], -rng.randint(1, 5))  # at least one bad row
    schema = f"CREATE TABLE {table} (\n  id integer PRIMARY KEY,\n  sku text NOT NULL,\n  {col} integer NOT NULL\n);\n"
    name = f"{table}_{col}_nonnegative"
    clamped = [f"{i}:{max(q, 0)}" for i, _, q in rows]
    return Migration(
        setup=schema + _inserts(table, ["id", "sku", col], rows),
        schema=schema,
        instruction=f"Some rows of `{table}` have a negative `{col}`. Set those to 0, then add a CHECK constraint "
        f"named `{name}` requiring `{col} >= 0`.",
        checks={
            "constraint_added": "SELECT EXISTS (SELECT 1 FROM pg_constraint WHERE contype = 'c' AND conname = "
            f"{_q(name)} AND conrelid = 'public.{table}'::regclass AND convalidated AND "
            f"pg_get_constraintdef(oid) LIKE {_q(f'%{col} >= 0%')})",
            "clamped": f"SELECT md5(string_agg(id || ':' || {col}, ',' ORDER BY id)) = {_q(_md5(clamped))} "
            f"FROM public.{table}",
            "rows_kept": _both(
                f"SELECT EXISTS (SELECT 1 FROM pg_constraint WHERE conname = {_q(name)})",
                _count(table, len(rows)),
            ),
        },
        reference=f"UPDATE {table} SET {col} = 0 WHERE {col} < 0;\n"
        f"ALTER TABLE {table} ADD CONSTRAINT {name} CHECK ({col} >= 0);\n",
    )


def _add_index(rng: random.Random) -> Migration:
    table, key = rng.choice([("events", "user_id"), ("page_views", "session_id"), ("payments", "account_id")])
    rows = [
        (i + 1, rng.randint(1, 9), f"2026-0{rng.randint(1, 9)}-1{rng.randint(0, 9)} 12:00:00")
        for i in range(30)
    ]
    schema = f"CREATE TABLE {table} (\n  id integer PRIMARY KEY,\n  {key} integer NOT NULL,\n  created_at timestamp NOT NULL\n);\n"
    name = f"{table}_{key}_created_idx"
    return Migration(
        setup=schema + _inserts(table, ["id", key, "created_at"], rows),
        schema=schema,
        instruction=f"Queries filter `{table}` by `{key}` and order by `created_at`. Add a b-tree index named "
        f"`{name}` on (`{key}`, `created_at`), in that column order.",
        checks={
            "index_added": "SELECT EXISTS (SELECT 1 FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid "
            f"WHERE c.relname = {_q(name)} AND i.indrelid = 'public.{table}'::regclass AND i.indisvalid)",
            "index_columns": "SELECT array_agg(a.attname::text ORDER BY k.ord) = "
            f"ARRAY[{_q(key)}, 'created_at'] FROM pg_class c JOIN pg_index i ON i.indexrelid = c.oid "
            "CROSS JOIN LATERAL unnest(i.indkey::int2[]) WITH ORDINALITY AS k(attnum, ord) JOIN pg_attribute a "
            f"ON a.attrelid = i.indrelid AND a.attnum = k.attnum WHERE c.relname = {_q(name)}",
            "btree": "SELECT EXISTS (SELECT 1 FROM pg_class c JOIN pg_am am ON am.oid = c.relam WHERE "
            f"c.relname = {_q(name)} AND am.amname = 'btree')",
            "rows_kept": _both(f"SELECT to_regclass('public.{name}') IS NOT NULL", _count(table, len(rows))),
        },
        reference=f"CREATE INDEX {name} ON {table} ({key}, created_at);\n",
    )


def _not_null_default(rng: random.Random) -> Migration:
    table, col, default = rng.choice(
        [("tickets", "status", "open"), ("users", "plan", "free"), ("jobs", "state", "queued")]
    )
    others = ["closed", "paid", "done", "pending"]
    rows = [(i + 1, None if rng.random() < 0.35 else rng.choice(others)) for i in range(rng.randint(15, 35))]
    rows[0] = (1, None)
    schema = f"CREATE TABLE {table} (\n  id integer PRIMARY KEY,\n  {col} text\n);\n"
    filled = [f"{i}:{v or default}" for i, v in rows]
    return Migration(
        setup=schema + _inserts(table, ["id", col], rows),
        schema=schema,
        instruction=f"Make `{table}.{col}` mandatory: set it to '{default}' where it is NULL, give it the default "
        f"'{default}' for new rows, and make it NOT NULL.",
        checks={
            "filled": f"SELECT md5(string_agg(id || ':' || {col}, ',' ORDER BY id)) = {_q(_md5(filled))} "
            f"FROM public.{table}",
            "not_null": _column_exists(table, col, " AND is_nullable = 'NO'"),
            "default_set": _column_exists(table, col, f" AND column_default LIKE {_q(f'%{default}%')}"),
            "rows_kept": _both(
                _column_exists(table, col, " AND is_nullable = 'NO'"), _count(table, len(rows))
            ),
        },
        reference=f"UPDATE {table} SET {col} = '{default}' WHERE {col} IS NULL;\n"
        f"ALTER TABLE {table} ALTER COLUMN {col} SET DEFAULT '{default}', ALTER COLUMN {col} SET NOT NULL;\n",
    )


FAMILIES: dict[str, Callable[[random.Random], Migration]] = {
    "add_column": _add_column,
    "split_table": _split_table,
    "rename_with_view": _rename_with_view,
    "unique_after_dedupe": _unique_after_dedupe,
    "check_after_clamp": _check_after_clamp,
    "add_index": _add_index,
    "not_null_default": _not_null_default,
}
"""Family key -> builder; :func:`db_tasks` visits them round-robin."""


def _prompt(m: Migration) -> str:
    return (
        f"You maintain a PostgreSQL database (schema in `schema.sql`). {m.instruction}\n\n"
        f"Write the migration as SQL in `{MIGRATION_FILE}`. Your own copy of the database is reachable with "
        f"`psql service=db`; apply the migration there with `{APPLY}` to try it. Grading applies "
        f"`{MIGRATION_FILE}` the same way to a fresh copy of the original database and checks the result."
    )


def db_tasks(n: int, seed: int) -> list[Task]:
    """``n`` migration tasks (ids ``db-<family>-<k>``), a pure function of ``(n, seed)``."""
    if n < 0:
        raise ValueError(f"n={n} must be >= 0")
    keys = list(FAMILIES)
    random.Random(seed).shuffle(keys)
    tasks = []
    for k in range(n):
        family = keys[k % len(keys)]
        rng = random.Random(f"{seed}/{family}/{k}")
        m = FAMILIES[family](rng)
        tasks.append(
            Task(
                id=f"db-{family}-{k:04d}",
                prompt=_prompt(m),
                entry_point=MIGRATION_FILE,
                files={"schema.sql": m.schema},
                difficulty=2 if family in ("add_index", "not_null_default", "add_column") else 3,
                source="db",
                reference=m.reference,
                kind="db",
                services=["postgres"],
                setup={"postgres": m.setup},
                hidden_checks=m.checks,
            )
        )
    return tasks


def grade_db(task: Task, files: dict[str, str], pool: ServicePool, cfg: SandboxConfig) -> RewardResult:
    """Apply ``files["migration.sql"]`` to a fresh clone in a fresh sandbox; run the hidden checks."""
    from shipyard.envs.sandbox import BwrapSandbox

    if not task.hidden_checks:
        raise ValueError(f"task {task.id!r} is a db task without hidden_checks; add some")
    names = list(task.hidden_checks)
    migration = files.get(MIGRATION_FILE)
    if migration is None:
        tests = {n: {"outcome": "missing", "message": ""} for n in names}
        details = {"tests": tests, "reason": f"no {MIGRATION_FILE} in the workspace"}
        return RewardResult(0.0, 0, len(names), details)
    with pool.leases(task) as leases:
        workspace = {MIGRATION_FILE: migration, **lease_files(leases)}
        with BwrapSandbox(workspace, cfg, binds=lease_binds(leases), persistent=False) as sb:
            applied = sb.exec(APPLY, timeout_s=cfg.timeout_s)
        service = pool.get("postgres")
        assert isinstance(service, PostgresService)
        results = service.run_checks(leases["postgres"], task.hidden_checks)
    passed = sum(r["outcome"] == "passed" for r in results.values())
    details: dict[str, Any] = {
        "tests": results,
        "returncode": applied.returncode,
        "log_tail": (applied.stdout + applied.stderr)[-1000:],
    }
    if applied.timed_out or applied.returncode != 0:
        details["reason"] = "migration failed: " + (
            f"timeout after {cfg.timeout_s} s"
            if applied.timed_out
            else (applied.stderr.strip()[-300:] or "error")
        )
        return RewardResult(0.0, 0, len(names), details)
    return RewardResult(passed / len(names), passed, len(names), details)


TRIAL_MIGRATION = f"psql service=db -X -q -v ON_ERROR_STOP=1 -c BEGIN -f {MIGRATION_FILE} -c ROLLBACK"
"""After each write of ``migration.sql`` it runs on the session's database in a transaction that is
rolled back (a migration that commits by itself is not undone)."""
_CHECK_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,62}$")
"""A hidden check's name: an SQL identifier (it names a column of the checks' query)."""


class DbKind:
    """Write ``migration.sql`` against a private database clone (tried in a rolled-back transaction
    after each write); graded by hidden SQL checks on a fresh clone. See :mod:`shipyard.envs.tasks.kinds`."""

    name = "db"

    def system_prompt(self) -> str:
        return FILES_SYSTEM_PROMPT

    def reminder(self) -> str:
        return FILES_REMINDER

    def default_files(self) -> dict[str, str]:
        return {"sql": MIGRATION_FILE}

    def asks_for_path(self) -> bool:
        return False

    def first_message(self, task: Task) -> str:
        return (
            f"{task.prompt}\n\nWrite the migration in a ```sql block: it becomes {MIGRATION_FILE} "
            "(a block opened with ```sql NAME.sql writes NAME.sql instead). After each write of "
            f"{MIGRATION_FILE} it is tried on your database in a transaction that is rolled back, and you "
            "see the result. Run one command with a ```bash block, e.g. `psql service=db -c '\\d'` or "
            "`cat schema.sql`. Reply SUBMIT when the migration is done."
        )

    def after_write(
        self, task: Task, sb: Sandbox, path: str, limit: int, end_on_pass: bool
    ) -> tuple[str, str]:
        if path != MIGRATION_FILE:
            return f"{path} written.", ""
        res = sb.exec(TRIAL_MIGRATION)
        if res.returncode == 0 and not res.timed_out:
            return (
                f"{path} written. Trial run on your database (rolled back): OK.",
                "passed" if end_on_pass else "",
            )
        status = "timed out" if res.timed_out else f"exit code {res.returncode}"
        out = clip_output(f"{res.stdout}{res.stderr}\n[{status}]", limit)
        return f"{path} written. Trial run on your database (rolled back) failed:\n{out}", ""

    def work_state(self, sb: Sandbox, chars: int) -> str:
        return file_state(sb, MIGRATION_FILE, "sql", chars)

    def check(self, task: Task, where: str) -> None:
        if "postgres" not in task.services or not task.setup.get("postgres", "").strip():
            raise ValueError(
                f"{where}: a db task needs `setup.postgres` (SQL that builds its starting database)"
            )
        if not task.hidden_checks:
            raise ValueError(f"{where}: a db task needs `hidden_checks` (name -> SQL returning one boolean)")
        bad = [n for n in task.hidden_checks if not _CHECK_NAME.match(n)]
        if bad:
            raise ValueError(
                f"{where}: field `hidden_checks` names {bad} must be identifiers (letters, digits, _)"
            )

    def workspace_base(self, task: Task, repos: RepoCache) -> str | None:
        return None

    def ignored_flags(self) -> frozenset[str]:
        return frozenset()

    def reference_files(self, task: Task) -> dict[str, str]:
        return {**task.files, MIGRATION_FILE: task.reference}

    def grade(self, task: Task, files: dict[str, str], ctx: GradingContext) -> RewardResult:
        return grade_db(task, files, ctx.services, ctx.sandbox)
