"""Services a task can declare: one server per pool, one private lease per rollout.

Contract: a :class:`Service` is started once per pool (a rollout worker, a test, an evaluation)
and hands out :class:`ServiceLease` objects: each lease is a private resource of one rollout
(for PostgreSQL a database cloned from the task's template and a role that can reach only it),
released when the rollout ends. A lease says how a sandbox reaches it: host directories to bind
(``binds``, e.g. a unix-socket directory; no network is needed) and workspace files that tell
the code inside how to connect (``files``). ``info`` holds what the grader needs (the database
name); the grader talks to the service from the host, outside the sandbox.

:class:`~shipyard.envs.services.pool.ServicePool` starts the services a task declares and hands
out their leases; this module holds only the interface and the records, so implementations
(``postgres.py``) import it and nothing here imports them.

Example::

    lease = service.lease(task)   # a Service implementation, e.g. PostgresService
    with BwrapSandbox({**files, **lease.files}, cfg, binds=lease.binds) as sb:
        sb.exec("psql service=db -c 'select 1'")
    service.release(lease)
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

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

    def healthy(self) -> bool:
        """Whether the server is still running (a pool replaces one that died)."""


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


def lease_binds(leases: Mapping[str, ServiceLease]) -> dict[str, str]:
    """All host -> sandbox binds of ``leases``."""
    return {host: inside for lease in leases.values() for host, inside in lease.binds.items()}


def lease_files(leases: Mapping[str, ServiceLease]) -> dict[str, str]:
    """All workspace files of ``leases``."""
    return {path: text for lease in leases.values() for path, text in lease.files.items()}
