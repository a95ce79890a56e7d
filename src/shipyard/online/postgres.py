"""A durable local PostgreSQL server for the online database when no `online.db.dsn` is given.

Contract: :class:`LocalPostgres` keeps its cluster in ``data_dir`` (``initdb`` on first use, the
same cluster on every later start: data survives restarts and crashes; ``fsync`` stays on). The
server listens only on a unix socket in a private directory under the system temp dir (0700,
owned by the server's user, named after ``data_dir`` so that every process finds it), with ``trust`` authentication for local connections: only that user
and root can reach the socket. As root the server runs as ``services.postgres.run_as`` (PostgreSQL
refuses root), and ``data_dir``'s parents must be searchable by that user. :attr:`dsn` connects
to database ``shipyard``. :meth:`stop` (``fast`` or ``immediate``, the latter a crash as far as
PostgreSQL knows) and :meth:`start` let tests and benchmarks take the database away and bring it
back.

Limits: one server per ``data_dir``; a second ``start`` on a running cluster is refused by
PostgreSQL's own lock (``postmaster.pid``). For a shared or managed database set ``online.db.dsn``.

Example::

    with LocalPostgres("runs/online/postgres") as pg:
        conn = psycopg.connect(pg.dsn)
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import stat
import subprocess
import tempfile
from types import TracebackType

from shipyard.config.schema import PostgresConfig
from shipyard.envs.services.postgres import find_bin_dir, postgres_available, run_pg, runs_as, traversable

DATABASE = "shipyard"
PORT = 5432


class LocalPostgres:
    """One durable cluster in ``data_dir`` (module doc)."""

    def __init__(self, data_dir: str, cfg: PostgresConfig | None = None, start: bool = True) -> None:
        self.cfg = cfg if cfg is not None else PostgresConfig()
        if (problem := postgres_available(self.cfg)) is not None:
            raise RuntimeError(problem)
        self.bin_dir = find_bin_dir(self.cfg.bin_dir) or ""
        self.user, self._run_as, _ = runs_as(self.cfg)
        self.data = os.path.abspath(data_dir)
        parent = os.path.dirname(self.data)
        os.makedirs(parent, exist_ok=True)
        if self._run_as and not traversable(parent, self.user.pw_uid):
            raise ValueError(
                f"online.db.local_dir={data_dir!r}: user {self.user.pw_name!r}, which runs the server, "
                f"cannot reach {parent}; choose a directory whose parents it can search (e.g. under /var/tmp)"
            )
        self.socket_dir = self._socket_dir()
        self.log = os.path.join(parent, f"{os.path.basename(self.data)}.log")
        if not os.path.isfile(os.path.join(self.data, "PG_VERSION")):
            self._initdb()
        if start:
            self.start()

    def _socket_dir(self) -> str:
        """The socket directory of this ``data_dir``: the same path for every process (a server started
        by one command is reached by the next), private to the server's user."""
        digest = hashlib.blake2b(self.data.encode(), digest_size=6).hexdigest()
        path = os.path.join(tempfile.gettempdir(), f"shipyard-online-pg-{digest}")
        with contextlib.suppress(FileExistsError):
            os.mkdir(path, 0o700)
        st = os.lstat(path)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid not in (self.user.pw_uid, os.getuid()):
            raise RuntimeError(
                f"{path} exists but is not a directory owned by {self.user.pw_name}; remove it"
            )
        os.chown(path, self.user.pw_uid, self.user.pw_gid)
        os.chmod(path, 0o700)
        return path

    @property
    def dsn(self) -> str:
        return f"host={self.socket_dir} port={PORT} dbname={DATABASE} user={self.user.pw_name}"

    def _run(self, argv: list[str], what: str, timeout: float = 120.0) -> str:
        return run_pg(self._run_as, argv, what, timeout)

    def _initdb(self) -> None:
        tmp = f"{self.data}.init"
        shutil.rmtree(tmp, ignore_errors=True)  # a half-made cluster of an interrupted first start
        os.mkdir(tmp, 0o700)
        os.chown(tmp, self.user.pw_uid, self.user.pw_gid)
        argv = [os.path.join(self.bin_dir, "initdb"), "-D", tmp, "-U", self.user.pw_name, "-A", "trust"]
        self._run(argv + ["-E", "UTF8", "--locale=C", "--no-instructions"], "initdb")
        with open(os.path.join(tmp, "postgresql.conf"), "a") as f:
            f.write("\n# shipyard online\nlisten_addresses = ''\nmax_connections = 100\n")
            f.write("shared_buffers = 64MB\nlog_min_messages = warning\n")
        with open(os.path.join(tmp, "pg_hba.conf"), "w") as f:
            f.write("# shipyard online: the socket directory is private (0700), so trust is local only\n")
            f.write("local all all trust\n")
        os.rename(tmp, self.data)  # the cluster appears whole or not at all
        self.start()
        psql = shutil.which("psql") or os.path.join(self.bin_dir, "psql")
        self._run(
            [
                psql,
                "-h",
                self.socket_dir,
                "-p",
                str(PORT),
                "-d",
                "postgres",
                "-U",
                self.user.pw_name,
                "-v",
                "ON_ERROR_STOP=1",
                "-qc",
                f"CREATE DATABASE {DATABASE}",
            ],
            "create database",
        )

    def running(self) -> bool:
        res = subprocess.run(
            self._run_as + [os.path.join(self.bin_dir, "pg_ctl"), "status", "-D", self.data],
            capture_output=True,
            timeout=30,
            cwd="/",
        )
        return res.returncode == 0

    def start(self) -> None:
        """Start the server (no-op when it runs); returns once it accepts connections."""
        if self.running():
            return
        if self._run_as and not os.path.exists(self.log):
            with open(self.log, "w"):
                pass
            os.chown(self.log, self.user.pw_uid, -1)
        opts = f"-k {self.socket_dir} -p {PORT}"
        argv = [os.path.join(self.bin_dir, "pg_ctl"), "start", "-D", self.data, "-l", self.log, "-w", "-s"]
        try:
            self._run(argv + ["-o", opts, "-t", str(int(self.cfg.start_timeout_s))], "start")
        except RuntimeError as exc:
            with contextlib.suppress(OSError), open(self.log) as f:
                raise RuntimeError(f"{exc}\nserver log: {f.read()[-1500:]}") from None
            raise

    def stop(self, mode: str = "fast") -> None:
        """Stop the server: ``fast`` (clean shutdown) or ``immediate`` (no checkpoint: a crash)."""
        if self.running():
            self._run(
                [os.path.join(self.bin_dir, "pg_ctl"), "stop", "-D", self.data, "-m", mode, "-w", "-s"],
                "stop",
            )

    def close(self) -> None:
        """Stop the server and remove its socket directory; the data stays."""
        with contextlib.suppress(RuntimeError, OSError, subprocess.SubprocessError):
            self.stop()
        with contextlib.suppress(OSError):
            os.rmdir(self.socket_dir)

    def __enter__(self) -> LocalPostgres:
        return self

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
