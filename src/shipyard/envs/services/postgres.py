"""A real PostgreSQL server per pool; each rollout gets its own database cloned from a template.

Contract: :class:`PostgresService` runs ``initdb`` into a fresh temp directory and starts the
server listening only on a unix socket (``listen_addresses = ''``; no TCP port is taken, so any
number of pools coexist). As root it runs the server as ``cfg.run_as`` (PostgreSQL refuses root).
Durability is off (``fsync``, ``synchronous_commit``, ``full_page_writes``): the data is scratch.

Roles: ``shipyard_admin`` (bootstrap superuser, host only: its password lives in this process),
``shipyard_owner`` (no login; owns every object a task's setup creates), ``shipyard_grader`` (login,
``pg_read_all_data``, no other rights: runs the hidden checks) and one ``r_<hex>`` role per lease
(login, member of ``shipyard_owner`` so it may alter the task's tables, nothing else).
``pg_hba.conf`` lets a lease role connect only to the database of the same name (``sameuser``),
all with SCRAM passwords.

Templates: the first lease of a task runs ``task.setup["postgres"]`` (SQL, trusted: it comes from
the task author) into ``tmpl_<hash of the SQL>`` as ``shipyard_owner``, then marks it
``IS_TEMPLATE true ALLOW_CONNECTIONS false`` after a ``VACUUM FREEZE`` (so the first clone's catalog
scan sets no hint bits in it) and checkpoints: nobody connects to a template again, so its files
never change (:meth:`PostgresService.checksum` hashes them). Each lease is ``CREATE
DATABASE r_<hex> TEMPLATE tmpl_... OWNER r_<hex>`` (about 30 ms) and is dropped ``WITH (FORCE)``
with its role on :meth:`PostgresService.release`.

Sandbox access: a lease binds its own directory holding a hard link to the server's socket at
:data:`SOCKET_DIR` and writes :data:`SERVICE_FILE` (libpq's ``~/.pg_service.conf``; ``HOME`` is the
workspace), so ``psql service=db`` connects as the lease role to the lease database. Deleting
the link only cuts that lease off; no network is involved.

Hidden checks (:meth:`PostgresService.run_checks`) run from the host through ``psql`` as
``shipyard_grader`` in read-only transactions with ``search_path = pg_catalog, public`` and a
statement timeout, one result line per check; untrusted SQL (a migration) is never run from the
host: the grader applies it inside a sandbox (:mod:`shipyard.envs.tasks.db`).

Limits: a process killed hard leaves its server running; the next pool of any process stops and
removes clusters whose owning process is gone (:func:`reap_stale`). Needs the server binaries
(Debian: ``apt-get install postgresql``); :func:`postgres_available` says what is missing.

Example::

    with PostgresService(PostgresConfig()) as pg:
        lease = pg.lease(task)
        pg.run_checks(lease, {"has_users": "SELECT to_regclass('public.users') IS NOT NULL"})
        pg.release(lease)
"""

from __future__ import annotations

import contextlib
import functools
import glob
import hashlib
import os
import pwd
import re
import secrets
import shutil
import signal
import stat
import subprocess
import tempfile
import threading
import weakref
from types import TracebackType

from shipyard.config.schema import PostgresConfig
from shipyard.envs.processes import pid_alive
from shipyard.envs.services.base import ServiceLease
from shipyard.envs.types import Task

ADMIN = "shipyard_admin"
OWNER = "shipyard_owner"
GRADER = "shipyard_grader"
SOCKET_DIR = "/run/postgresql"
"""Where a lease's socket directory appears inside the sandbox."""
SERVICE_FILE = ".pg_service.conf"
"""Workspace file naming the lease's connection (libpq reads ``~/.pg_service.conf``)."""
SERVICE = "db"
"""Service name in :data:`SERVICE_FILE`: ``psql service=db``."""
PORT = 5432
_PREFIX = "shipyard-pg-"
_CHECK_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,62}$")
_RESULT_LINE = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)[\t ](true|false|error|)(?:[\t ](.*))?$")
_SERVER_BINARIES = ("initdb", "pg_ctl", "postgres")
_INSTALL_HINT = "install the PostgreSQL server (Debian/Ubuntu: `apt-get install postgresql`)"


def find_bin_dir(bin_dir: str = "") -> str | None:
    """Directory holding initdb, pg_ctl and postgres: ``bin_dir``, PATH, or the newest Debian one."""
    candidates = [bin_dir] if bin_dir else []
    on_path = shutil.which("pg_ctl")
    if not bin_dir and on_path:
        candidates.append(os.path.dirname(os.path.realpath(on_path)))
    if not bin_dir:
        versions = glob.glob("/usr/lib/postgresql/*/bin")
        candidates += sorted(
            versions, key=lambda p: int(p.split("/")[-2]) if p.split("/")[-2].isdigit() else 0
        )[::-1]
    for d in candidates:
        if all(os.access(os.path.join(d, b), os.X_OK) for b in _SERVER_BINARIES):
            return d
    return None


def postgres_available(cfg: PostgresConfig | None = None) -> str | None:
    """None when a server can be started here, else why not (and how to fix it)."""
    cfg = cfg if cfg is not None else PostgresConfig()
    if find_bin_dir(cfg.bin_dir) is None:
        where = f"in {cfg.bin_dir!r}" if cfg.bin_dir else "on PATH or under /usr/lib/postgresql/*/bin"
        return f"PostgreSQL server binaries (initdb, pg_ctl, postgres) not found {where}; {_INSTALL_HINT}"
    if shutil.which("psql") is None:
        return f"psql not found on PATH; {_INSTALL_HINT}"
    if os.getuid() == 0:
        try:
            pwd.getpwnam(cfg.run_as)
        except KeyError:
            return f"services.postgres.run_as={cfg.run_as!r} is not a user here; name an unprivileged user"
    return None


def traversable(path: str, uid: int) -> bool:
    """Whether ``uid`` can reach into ``path`` (every ancestor searchable by it)."""
    path = os.path.abspath(path)
    while True:
        st = os.stat(path)
        if not (st.st_mode & stat.S_IXOTH or (st.st_uid == uid and st.st_mode & stat.S_IXUSR)):
            return False
        if path == "/":
            return True
        path = os.path.dirname(path)


def _parent_dir(cfg: PostgresConfig, uid: int) -> str:
    for parent in [cfg.root_dir] if cfg.root_dir else [tempfile.gettempdir(), "/var/tmp"]:
        if os.path.isdir(parent) and traversable(parent, uid):
            return parent
    raise ValueError(
        f"no directory for the PostgreSQL cluster that user uid={uid} can reach "
        f"(tried {cfg.root_dir or tempfile.gettempdir() + ', /var/tmp'}); set services.postgres.root_dir"
    )


def _stop_cluster(bin_dir: str, root: str, run_as: list[str]) -> None:
    """Stop the server of the cluster in ``root`` (immediately) and remove the directory."""
    data = os.path.join(root, "data")
    if os.path.exists(os.path.join(data, "postmaster.pid")):
        pg_ctl = [os.path.join(bin_dir, "pg_ctl"), "stop", "-D", data, "-m", "immediate", "-w", "-s"]
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            subprocess.run(run_as + pg_ctl, capture_output=True, timeout=60, cwd="/")
    _kill_postmaster(data)
    shutil.rmtree(root, ignore_errors=True)


def _kill_postmaster(data: str) -> None:
    """SIGKILL a postmaster pg_ctl could not stop (its pid is the first line of postmaster.pid)."""
    with contextlib.suppress(OSError, ValueError):
        with open(os.path.join(data, "postmaster.pid")) as f:
            pid = int(f.readline())
        os.kill(pid, signal.SIGKILL)


def reap_stale(bin_dir: str, parents: list[str], run_as: list[str]) -> int:
    """Stop and remove clusters under ``parents`` whose owning process is gone; returns how many."""
    n = 0
    for parent in parents:
        for root in glob.glob(os.path.join(parent, f"{_PREFIX}*-*")):
            pid = os.path.basename(root)[len(_PREFIX) :].split("-")[0]
            if pid.isdigit() and int(pid) != os.getpid() and not pid_alive(int(pid)):
                _stop_cluster(bin_dir, root, run_as)
                n += 1
    return n


def runs_as(cfg: PostgresConfig) -> tuple[pwd.struct_passwd, list[str], str]:
    """(the user the server runs as, the command prefix that runs as it, the clusters' parent dir)."""
    user = pwd.getpwnam(cfg.run_as) if os.getuid() == 0 else pwd.getpwuid(os.getuid())
    runuser = shutil.which("runuser") or "/usr/sbin/runuser"
    run_as = [runuser, "-u", user.pw_name, "--"] if os.getuid() == 0 else []
    return user, run_as, _parent_dir(cfg, user.pw_uid)


def reap_stale_clusters(cfg: PostgresConfig) -> int:
    """Stop and remove the clusters of processes that died without closing them (once per process;
    a pool calls it when it starts, so a killed worker's server does not outlive it for long)."""
    if postgres_available(cfg) is not None:
        return 0
    _, run_as, parent = runs_as(cfg)
    return _reap_once(find_bin_dir(cfg.bin_dir) or "", parent, tuple(run_as))


@functools.lru_cache(maxsize=4)
def _reap_once(bin_dir: str, parent: str, run_as: tuple[str, ...]) -> int:
    return reap_stale(bin_dir, [parent], list(run_as))


def run_pg(run_as: list[str], argv: list[str], what: str, timeout: float = 120.0) -> str:
    """Run a PostgreSQL program as the server's user; its stdout, or RuntimeError with its tail."""
    res = subprocess.run(run_as + argv, capture_output=True, text=True, timeout=timeout, cwd="/")
    if res.returncode != 0:
        raise RuntimeError(
            f"PostgreSQL {what} failed ({res.returncode}): {(res.stderr or res.stdout)[-800:]}"
        )
    return res.stdout


def _sql_literal(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


class PostgresService:
    """One PostgreSQL cluster for a pool; see the module docstring."""

    name = "postgres"

    def __init__(self, cfg: PostgresConfig | None = None) -> None:
        self.cfg = cfg if cfg is not None else PostgresConfig()
        problem = postgres_available(self.cfg)
        if problem is not None:
            raise RuntimeError(problem)
        self.bin_dir = find_bin_dir(self.cfg.bin_dir) or ""
        own_psql = os.path.join(self.bin_dir, "psql")
        self.psql_bin = own_psql if os.access(own_psql, os.X_OK) else shutil.which("psql") or "psql"
        user, self._run_as, parent = runs_as(self.cfg)
        _reap_once(self.bin_dir, parent, tuple(self._run_as))
        self.root = tempfile.mkdtemp(prefix=f"{_PREFIX}{os.getpid()}-", dir=parent)
        self._finalizer = weakref.finalize(self, _stop_cluster, self.bin_dir, self.root, self._run_as)
        self.data = os.path.join(self.root, "data")
        self.socket_dir = os.path.join(self.root, "socket")
        self.lease_root = os.path.join(self.root, "leases")
        self._admin_pw = secrets.token_hex(16)
        self._grader_pw = secrets.token_hex(16)
        self._lock = threading.Lock()
        self._templates: dict[str, threading.Lock] = {}
        self._ready: set[str] = set()
        try:
            self._init_cluster(user.pw_uid, user.pw_gid)
            self._start()
            self._bootstrap()
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> PostgresService:
        return self

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    # ----------------------------------------------------------------- cluster lifecycle
    def _init_cluster(self, uid: int, gid: int) -> None:
        os.chmod(self.root, 0o755)
        for d in (self.data, self.socket_dir, self.lease_root):
            os.mkdir(d, 0o700 if d == self.data else 0o755)
        pwfile = os.path.join(self.root, "pw")
        with open(os.open(pwfile, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
            f.write(self._admin_pw + "\n")
        for path in (self.root, self.data, self.socket_dir, pwfile):
            os.chown(path, uid, gid)
        argv = [os.path.join(self.bin_dir, "initdb"), "-D", self.data, "-U", ADMIN, f"--pwfile={pwfile}"]
        argv += ["-A", "scram-sha-256", "-E", "UTF8", "--locale=C", "--no-sync", "--no-instructions"]
        try:
            self._run(argv, "initdb")
        finally:
            os.unlink(pwfile)
        conf = {
            "listen_addresses": "''",
            "unix_socket_directories": _sql_literal(self.socket_dir),
            "unix_socket_permissions": "0777",
            "port": str(PORT),
            "fsync": "off",
            "synchronous_commit": "off",
            "full_page_writes": "off",
            "max_connections": "200",
            "shared_buffers": "32MB",
            "log_min_messages": "warning",
        }
        with open(os.path.join(self.data, "postgresql.conf"), "a") as f:
            f.write("\n# shipyard\n" + "".join(f"{k} = {v}\n" for k, v in conf.items()))
        with open(os.path.join(self.data, "pg_hba.conf"), "w") as f:
            f.write(
                "# shipyard: lease roles reach only their own database; admin and grader reach all\n"
                f"local all {ADMIN} scram-sha-256\n"
                f"local all {GRADER} scram-sha-256\n"
                "local sameuser all scram-sha-256\n"
            )

    def _run(self, argv: list[str], what: str, timeout: float = 120.0) -> str:
        return run_pg(self._run_as, argv, what, timeout)

    def _start(self) -> None:
        log = os.path.join(self.root, "server.log")
        argv = [os.path.join(self.bin_dir, "pg_ctl"), "start", "-D", self.data, "-l", log, "-w", "-s"]
        argv += ["-t", str(int(self.cfg.start_timeout_s))]
        if self._run_as:
            with open(log, "w"):
                pass
            os.chown(log, pwd.getpwnam(self.cfg.run_as).pw_uid, -1)
        try:
            self._run(argv, "start", timeout=self.cfg.start_timeout_s + 30)
        except RuntimeError as exc:
            with contextlib.suppress(OSError), open(log) as f:
                raise RuntimeError(f"{exc}\nserver log: {f.read()[-1500:]}") from None
            raise

    def _bootstrap(self) -> None:
        self.psql(
            f"CREATE ROLE {OWNER} NOLOGIN;\n"
            f"CREATE ROLE {GRADER} LOGIN PASSWORD {_sql_literal(self._grader_pw)};\n"
            f"GRANT pg_read_all_data TO {GRADER};\n"
            "REVOKE ALL ON DATABASE postgres, template1 FROM PUBLIC;\n"
        )

    def close(self) -> None:
        """Stop the server and remove the cluster; idempotent."""
        self._finalizer()

    def healthy(self) -> bool:
        """Whether the cluster's postmaster is running (its pid from ``postmaster.pid``)."""
        try:
            with open(os.path.join(self.data, "postmaster.pid")) as f:
                return self._finalizer.alive and pid_alive(int(f.readline()))
        except (OSError, ValueError):
            return False

    # ----------------------------------------------------------------- host-side SQL (trusted only)
    def _env(self, user: str, password: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("PG")}
        env.update(PGHOST=self.socket_dir, PGPORT=str(PORT), PGUSER=user, PGPASSWORD=password)
        env.update(PGAPPNAME="shipyard", PGCONNECT_TIMEOUT="30")
        return env

    def psql(self, sql: str, db: str = "postgres", *, stop_on_error: bool = True) -> str:
        """Run trusted SQL as the admin (each statement autocommits); stdout, unaligned, tuples only."""
        argv = [self.psql_bin, "-X", "-q", "-A", "-t", "-F", "\t", "-d", db, "-f", "-"]
        argv += ["-v", f"ON_ERROR_STOP={int(stop_on_error)}"]
        res = subprocess.run(
            argv, input=sql, capture_output=True, text=True, env=self._env(ADMIN, self._admin_pw), timeout=300
        )
        if res.returncode != 0:
            raise RuntimeError(f"psql on {db!r} failed ({res.returncode}): {res.stderr[-800:]}")
        return res.stdout

    # ----------------------------------------------------------------- templates and leases
    def template(self, setup: str) -> str:
        """Name of the template database built from ``setup`` (built on the first call)."""
        name = "tmpl_" + hashlib.sha256(setup.encode()).hexdigest()[:20]
        with self._lock:
            lock = self._templates.setdefault(name, threading.Lock())
        with lock:
            if name in self._ready:
                return name
            self.psql(f"DROP DATABASE IF EXISTS {name};\nCREATE DATABASE {name};")
            prelude = f"GRANT ALL ON SCHEMA public TO {OWNER};\nSET ROLE {OWNER};\n"
            try:
                self.psql(prelude + setup + "\n", db=name)
            except RuntimeError as exc:
                self.psql(f"DROP DATABASE IF EXISTS {name};")
                raise ValueError(f"task setup['postgres'] failed to run: {exc}") from None
            self.psql("RESET ROLE;\nVACUUM FREEZE;\n", db=name)  # hint bits set now, not by the first clone
            self.psql(f"ALTER DATABASE {name} IS_TEMPLATE true ALLOW_CONNECTIONS false;\nCHECKPOINT;")
            self._ready.add(name)
            return name

    def lease(self, task: Task) -> ServiceLease:
        """A database cloned from ``task``'s template and a role that reaches only it."""
        template = self.template(task.setup.get("postgres", ""))
        name, password = f"r_{secrets.token_hex(6)}", secrets.token_hex(16)
        lease = ServiceLease(service=self.name, info={"database": name, "template": template})
        sock = os.path.join(self.lease_root, name)
        try:
            self.psql(
                f"CREATE ROLE {name} LOGIN PASSWORD {_sql_literal(password)} IN ROLE {OWNER} CONNECTION LIMIT 16;\n"
                f"CREATE DATABASE {name} TEMPLATE {template} OWNER {name};\n"
            )
            os.mkdir(sock, 0o755)
            os.link(os.path.join(self.socket_dir, f".s.PGSQL.{PORT}"), os.path.join(sock, f".s.PGSQL.{PORT}"))
        except BaseException:
            self.release(lease)  # drops whatever part was made
            raise
        lease.binds = {sock: SOCKET_DIR}
        lease.files = {
            SERVICE_FILE: f"[{SERVICE}]\nhost={SOCKET_DIR}\nport={PORT}\ndbname={name}\nuser={name}\n"
            f"password={password}\n"
        }
        return lease

    def release(self, lease: ServiceLease) -> None:
        """Drop the lease's database (closing its connections) and role; idempotent."""
        name = lease.info["database"]
        if not self._finalizer.alive:
            return
        self.psql(f"DROP DATABASE IF EXISTS {name} WITH (FORCE);\nDROP ROLE IF EXISTS {name};\n")
        shutil.rmtree(os.path.join(self.lease_root, name), ignore_errors=True)

    def databases(self) -> list[str]:
        """Names of every database of the cluster (sorted)."""
        return sorted(self.psql("SELECT datname FROM pg_database;").split())

    def checksum(self, database: str) -> str:
        """SHA-256 over the on-disk files of ``database`` after a checkpoint (any change shows)."""
        oid = self.psql(f"CHECKPOINT;\nSELECT oid FROM pg_database WHERE datname = {_sql_literal(database)};")
        if not oid.strip():
            raise ValueError(f"no database named {database!r}")
        base = os.path.join(self.data, "base", oid.strip())
        h = hashlib.sha256()
        for name in sorted(os.listdir(base)):
            if name.startswith("pg_internal.init"):
                continue  # relcache init file: rewritten by backends, not data
            h.update(name.encode() + b"\0")
            with open(os.path.join(base, name), "rb") as f:
                h.update(f.read())
        return h.hexdigest()

    # ----------------------------------------------------------------- hidden checks
    def run_checks(self, lease: ServiceLease, checks: dict[str, str]) -> dict[str, dict[str, str]]:
        """Per check: ``{"outcome": "passed" | "failed" | "error", "message": ...}``.

        A check is one SQL query returning one boolean; it passes when that is true. Run as the
        read-only grader role (never as a superuser: agent-defined views and functions run with
        the caller's rights), read-only transactions, fixed ``search_path`` and statement timeout.
        """
        for name in checks:
            if not _CHECK_NAME.match(name):
                raise ValueError(f"hidden check name {name!r} must be an identifier (letters, digits, _)")
        timeout_ms = int(self.cfg.check_timeout_s * 1000)
        script = [
            "SET search_path = pg_catalog, public;",
            f"SET statement_timeout = {timeout_ms};",
            "SET default_transaction_read_only = on;",
        ]
        for name, sql in checks.items():
            body = sql.strip().rstrip(";")
            script.append(f"SELECT {_sql_literal(name)}, (({body}))::boolean::text;")
            script.append(f"\\if :ERROR\n\\echo {name} error :LAST_ERROR_MESSAGE\n\\endif")
        argv = [self.psql_bin, "-X", "-q", "-A", "-t", "-F", "\t", "-d", lease.info["database"], "-f", "-"]
        total_s = self.cfg.check_timeout_s * (len(checks) + 1) + 30
        res = subprocess.run(
            argv,
            input="\n".join(script) + "\n",
            capture_output=True,
            text=True,
            env=self._env(GRADER, self._grader_pw),
            timeout=total_s,
        )
        return _parse_checks(res.stdout, res.stderr, list(checks))


def _parse_checks(stdout: str, stderr: str, names: list[str]) -> dict[str, dict[str, str]]:
    """Result lines are ``name<TAB>true|false|`` (the query) or ``name error MESSAGE`` (``\\echo``)."""
    problem = stderr.strip()[-300:] or "psql failed"
    out = {n: {"outcome": "error", "message": f"no result ({problem})"} for n in names}
    for line in stdout.splitlines():
        m = _RESULT_LINE.match(line)
        if m is None or m.group(1) not in out:
            continue
        name, value, message = m.group(1), m.group(2), (m.group(3) or "")[:300]
        if value == "error":
            out[name] = {"outcome": "error", "message": message}
        elif value == "true":
            out[name] = {"outcome": "passed", "message": ""}
        else:
            out[name] = {"outcome": "failed", "message": f"returned {value or 'null'}"}
    return out
