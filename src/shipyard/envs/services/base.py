"""Services a task can declare: one server per pool, one private lease per rollout.

Contract: a :class:`Service` is started once per pool (a rollout worker, a test, an evaluation)
and hands out :class:`ServiceLease` objects: each lease is a private resource of one rollout
(for PostgreSQL a database cloned from the task's template and a role that can reach only it),
released when the rollout ends. A lease says how a sandbox reaches it: host directories to bind
(``binds``, e.g. a unix-socket directory; no network is needed) and workspace files that tell
the code inside how to connect (``files``). ``info`` holds what the grader needs (the database
name); the grader talks to the service from the host, outside the sandbox.

:class:`ServicePool` starts the services a task declares on first use (``make_service`` is the
one place that maps a ``Task.services`` name to its implementation), gives every rollout its
leases through :meth:`ServicePool.leases` (a context manager that always releases them) and
stops every server on :meth:`ServicePool.close` (a later lease starts them again).

Example::

    with ServicePool(ServicesConfig()) as pool, pool.leases(task) as leases:
        with BwrapSandbox({**files, **lease_files(leases)}, cfg, binds=lease_binds(leases)) as sb:
            sb.exec("psql service=db -c 'select 1'")
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from types import TracebackType
from typing import Protocol

from shipyard.config.schema import ServicesConfig
from shipyard.envs.types import Task

SERVICE_NAMES = ("postgres",)
"""Every name a task may list in ``Task.services``."""


@dataclass
class ServiceLease:
    """One rollout's private share of a service."""

    service: str
    binds: dict[str, str] = field(default_factory=dict)
    """Host directory -> absolute sandbox path, bound read-write into the rollout's sandboxes."""
    files: dict[str, str] = field(default_factory=dict)
    """Workspace files (relative path -> text) that tell sandboxed code how to connect."""
    info: dict[str, str] = field(default_factory=dict)
    """What the grader needs to reach the lease from the host (never shown to the policy)."""


class Service(Protocol):
    """A server started once per pool."""

    name: str

    def lease(self, task: Task) -> ServiceLease:
        """A fresh private resource for one rollout of ``task`` (built from ``task.setup[name]``)."""

    def release(self, lease: ServiceLease) -> None:
        """Destroy the lease's resource; idempotent."""

    def close(self) -> None:
        """Stop the server and remove everything it wrote; idempotent."""


def make_service(name: str, cfg: ServicesConfig) -> Service:
    """The implementation of service ``name`` (one of :data:`SERVICE_NAMES`)."""
    if name == "postgres":
        from shipyard.envs.services.postgres import PostgresService

        return PostgresService(cfg.postgres)
    raise ValueError(f"unknown service {name!r} in task.services; known services are {list(SERVICE_NAMES)}")


def check_services(task: Task) -> None:
    """Raise a ValueError naming the task and field when its services are not usable as declared."""
    for name in task.services:
        if name not in SERVICE_NAMES:
            raise ValueError(
                f"task {task.id!r}: services lists unknown service {name!r}; known: {list(SERVICE_NAMES)}"
            )
    extra = sorted(set(task.setup) - set(task.services))
    if extra:
        raise ValueError(
            f"task {task.id!r}: setup has entries {extra} for services the task does not declare"
        )


class ServicePool:
    """The services of one pool: started on first use, closed together."""

    def __init__(self, cfg: ServicesConfig | None = None) -> None:
        self.cfg = cfg if cfg is not None else ServicesConfig()
        self._services: dict[str, Service] = {}
        self._lock = threading.Lock()

    def __enter__(self) -> ServicePool:
        return self

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def get(self, name: str) -> Service:
        """The pool's instance of service ``name``, started on the first call."""
        with self._lock:
            if name not in self._services:
                self._services[name] = make_service(name, self.cfg)
            return self._services[name]

    @contextlib.contextmanager
    def leases(self, task: Task) -> Iterator[dict[str, ServiceLease]]:
        """Leases for every service ``task`` declares, released when the block ends (even on error)."""
        check_services(task)
        taken: dict[str, ServiceLease] = {}
        try:
            for name in task.services:
                taken[name] = self.get(name).lease(task)
            yield taken
        finally:
            for name, lease in taken.items():
                self._services[name].release(lease)

    def close(self) -> None:
        with self._lock:
            services, self._services = list(self._services.values()), {}
        for service in services:
            service.close()


def lease_binds(leases: Mapping[str, ServiceLease]) -> dict[str, str]:
    """All host -> sandbox binds of ``leases``."""
    return {host: inside for lease in leases.values() for host, inside in lease.binds.items()}


def lease_files(leases: Mapping[str, ServiceLease]) -> dict[str, str]:
    """All workspace files of ``leases``."""
    return {path: text for lease in leases.values() for path, text in lease.files.items()}
