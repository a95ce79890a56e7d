"""The services of one pool: started on first use, leased per rollout, closed together.

Contract: :class:`ServicePool` starts the services a task declares on first use
(:func:`make_service` is the one place that maps a ``Task.services`` name to its implementation),
gives every rollout its leases through :meth:`ServicePool.leases` (a context manager that always
releases them) and stops every server on :meth:`ServicePool.close` (a later lease starts them again).

Example::

    with ServicePool(ServicesConfig()) as pool, pool.leases(task) as leases:
        with BwrapSandbox({**files, **lease_files(leases)}, cfg, binds=lease_binds(leases)) as sb:
            sb.exec("psql service=db -c 'select 1'")
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from types import TracebackType

from shipyard.config.schema import ServicesConfig
from shipyard.envs.services.base import SERVICE_NAMES, Service, ServiceLease, check_services
from shipyard.envs.services.postgres import PostgresService, reap_stale_clusters
from shipyard.envs.types import Task


def make_service(name: str, cfg: ServicesConfig) -> Service:
    """The implementation of service ``name`` (one of :data:`SERVICE_NAMES`)."""
    if name == "postgres":
        return PostgresService(cfg.postgres)
    raise ValueError(f"unknown service {name!r} in task.services; known services are {list(SERVICE_NAMES)}")


class ServicePool:
    """The services of one pool: started on first use, closed together."""

    def __init__(self, cfg: ServicesConfig | None = None) -> None:
        self.cfg = cfg if cfg is not None else ServicesConfig()
        reap_stale_clusters(self.cfg.postgres)  # servers of pools whose process was killed
        self._services: dict[str, Service] = {}
        self._lock = threading.Lock()

    def __enter__(self) -> ServicePool:
        return self

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def get(self, name: str) -> Service:
        """The pool's instance of service ``name``, started on the first call, and started again when the
        server died (its leases then fail; later ones get the new server)."""
        with self._lock:
            dead = self._services.get(name)
            if dead is not None and not dead.healthy():  # killed under us: a fresh server, same config
                dead.close()
                del self._services[name]
            if name not in self._services:
                self._services[name] = make_service(name, self.cfg)
            return self._services[name]

    @contextlib.contextmanager
    def leases(self, task: Task) -> Iterator[dict[str, ServiceLease]]:
        """Leases for every service ``task`` declares, released when the block ends (even on error)."""
        check_services(task)
        taken: dict[str, tuple[Service, ServiceLease]] = {}
        try:
            for name in task.services:
                service = self.get(name)
                taken[name] = (service, service.lease(task))
            yield {name: lease for name, (_, lease) in taken.items()}
        finally:
            for service, lease in taken.values():
                if service.healthy():  # a server that died took its leases with it
                    service.release(lease)

    def close(self) -> None:
        with self._lock:
            services, self._services = list(self._services.values()), {}
        for service in services:
            service.close()
