"""A pool of pre-warmed sandboxes: fast hand-out, burst creation, capped CPU work, backpressure.

Contract: :class:`SandboxPool` keeps ``cfg.pool.warm`` sandboxes created and started (for
bubblewrap: the session's bwrap and command server running, the copy-on-write overlay mounted)
so that :meth:`~SandboxPool.acquire` only writes the task's files and hands one out; the first
command then costs one session round trip instead of a sandbox start. A background thread (the
filler) refills the pool after every hand-out. When no warm sandbox is ready, ``acquire``
creates one itself (burst creation: concurrent callers create in parallel). At most
``cfg.pool.max_live`` sandboxes exist at once (warm, being created and handed out);
``acquire`` blocks beyond that until one is released, and raises ``TimeoutError`` after
``cfg.pool.acquire_timeout_s`` (backpressure). Every ``exec`` of a pooled sandbox holds one of
``cfg.pool.cpu_slots`` slots (default: the core count), so CPU-bound work (tests, builds) never
oversubscribes the cores however many sessions are open. Creating a sandbox is not gated by the
slots: it mostly waits on the kernel (namespaces, mounts, process starts), so creations overlap
(up to four per slot on the spawner threads, one at a time on the filler).

A handed-out sandbox is a :class:`PooledSandbox` (the :class:`~.base.Sandbox` interface);
``close()`` returns nothing to the pool: the sandbox is destroyed (a used workspace is never
handed to another rollout) and the filler starts a fresh one. :meth:`SandboxPool.close`
destroys every sandbox the pool made, handed out or not, and stops the filler; each
sandbox's own ``close`` kills its processes and removes its cgroups, mounts and directories.

Threads: a bubblewrap session belongs to the thread that started it (``--die-with-parent``), so
the pool starts every sandbox in a thread of its own that lives until :meth:`SandboxPool.close`
(the filler, or the spawner threads that serve on-demand creation), never in the caller's
thread, which may be short-lived. Limits: a sandbox used after its pool closed restarts its
session on the next command (files kept, ``/tmp`` lost).
"""

from __future__ import annotations

import collections
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from types import TracebackType

from shipyard.config.schema import SandboxConfig
from shipyard.envs.types import ExecResult, Sandbox, WorkspaceDiff

WARM_COMMAND = "true"
"""Run once on every new sandbox so its session is up before it is handed out."""


class PooledSandbox:
    """A sandbox handed out by a :class:`SandboxPool`: its commands share the pool's CPU slots."""

    def __init__(self, pool: SandboxPool, inner: Sandbox) -> None:
        self._pool = pool
        self.inner = inner
        """The backend's sandbox (e.g. a :class:`~.bwrap.BwrapSandbox`)."""
        self._closed = False

    def exec(
        self,
        cmd: str,
        timeout_s: float | None = None,
        stdin: str | None = None,
        *,
        env: Mapping[str, str] | None = None,
    ) -> ExecResult:
        """``inner.exec`` once a CPU slot is free (the timeout counts from when it runs)."""
        with self._pool.cpu_slot():
            return self.inner.exec(cmd, timeout_s, stdin, env=env)

    def write(self, path: str, content: str) -> None:
        self.inner.write(path, content)

    def read(self, path: str) -> str:
        return self.inner.read(path)

    def files(self) -> dict[str, str]:
        return self.inner.files()

    def seed(self, files: Mapping[str, str]) -> None:
        self.inner.seed(files)

    def diff(self) -> WorkspaceDiff:
        return self.inner.diff()

    def fork(self) -> PooledSandbox:
        """A fork of this sandbox, counted by the pool like any sandbox it hands out."""
        return self._pool.adopt(self.inner.fork)

    def close(self) -> None:
        """Destroy the sandbox and free its place in the pool (idempotent)."""
        if not self._closed:
            self._closed = True
            self._pool.release(self)

    def __enter__(self) -> PooledSandbox:
        return self

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


class SandboxPool:
    """Pre-warmed sandboxes from ``factory`` (default: ``make_sandbox(cfg, base=..., network=...)``)."""

    def __init__(
        self,
        cfg: SandboxConfig,
        factory: Callable[[], Sandbox] | None = None,
        *,
        base: str | None = None,
        network: bool = False,
    ) -> None:
        if factory is None:
            from shipyard.envs.sandbox import make_sandbox

            def factory() -> Sandbox:
                return make_sandbox(cfg, network=network, base=base)

        self.cfg = cfg
        self._factory = factory
        self._warm_target = cfg.pool.warm
        self._max_live = max(cfg.pool.max_live, 1)
        self.cpu_slots = cfg.pool.cpu_slots or os.cpu_count() or 1
        self._slots = threading.BoundedSemaphore(self.cpu_slots)
        self._cond = threading.Condition()
        self._warm: collections.deque[Sandbox] = collections.deque()
        self._leased: set[PooledSandbox] = set()
        self._live = 0
        self._filling = 0
        self._closed = False
        self.last_error: Exception | None = None
        """The last error the filler met creating a sandbox (it retries with a growing pause;
        ``acquire`` creating on demand raises such errors itself)."""
        self.stats = {
            "created": 0,
            "warm_hits": 0,
            "cold_creates": 0,
            "waits": 0,
            "running": 0,
            "peak_running": 0,
        }
        """Counters: sandboxes created, hand-outs served warm / created on demand, acquires that
        waited for room, commands running now and the most that ever ran at once."""
        self._spawner = ThreadPoolExecutor(min(self._max_live, 4 * self.cpu_slots), "sandbox-pool-spawn")
        """Creates sandboxes on demand: its threads live until :meth:`close`, and a sandbox's session
        lives as long as the thread that started it."""
        self._filler = threading.Thread(target=self._fill_loop, name="sandbox-pool-filler", daemon=True)
        self._filler.start()

    # ----------------------------------------------------------------- CPU slots
    @contextmanager
    def cpu_slot(self) -> Iterator[None]:
        """Hold one of ``cpu_slots`` while CPU-bound work (a command) runs."""
        with self._slots:
            with self._cond:
                self.stats["running"] += 1
                self.stats["peak_running"] = max(self.stats["peak_running"], self.stats["running"])
            try:
                yield
            finally:
                with self._cond:
                    self.stats["running"] -= 1

    # ----------------------------------------------------------------- creating
    def _create(self, factory: Callable[[], Sandbox]) -> Sandbox:
        """A new started sandbox (its place in ``_live`` is already reserved by the caller)."""
        sb = factory()
        try:
            res = sb.exec(WARM_COMMAND)
            if res.returncode != 0:
                raise RuntimeError(f"sandbox pool: warm-up command failed: {res.stderr.strip()}")
        except BaseException:
            sb.close()
            raise
        with self._cond:
            self.stats["created"] += 1
        return sb

    def _fill_loop(self) -> None:
        backoff = 0.0
        while True:
            with self._cond:
                while not self._closed and not (
                    len(self._warm) + self._filling < self._warm_target and self._live < self._max_live
                ):
                    self._cond.wait()
                if self._closed:
                    return
                self._live += 1
                self._filling += 1
            try:
                sb = self._create(self._factory)
            except Exception as exc:  # keep it for inspection; retry with a growing pause
                backoff = min(max(2 * backoff, 0.1), 5.0)
                with self._cond:
                    self._live -= 1
                    self._filling -= 1
                    self.last_error = exc
                    self._cond.notify_all()
                    self._cond.wait(backoff)
                continue
            backoff = 0.0
            with self._cond:
                self._filling -= 1
                if self._closed:
                    self._live -= 1
                    sb.close()
                else:
                    self._warm.append(sb)
                self._cond.notify_all()

    def _reserve(self, deadline: float) -> Sandbox | None:
        """A warm sandbox, or None after reserving room to create one; waits for room (backpressure)."""
        with self._cond:
            waited = False
            while not self._warm and self._live >= self._max_live and not self._closed:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(
                        f"sandbox pool: no room within {self.cfg.pool.acquire_timeout_s} s "
                        f"(sandbox.pool.max_live = {self._max_live} sandboxes are all in use)"
                    )
                waited = True
                self._cond.wait(left)
            if self._closed:
                raise RuntimeError("sandbox pool is closed")
            self.stats["waits"] += waited
            if self._warm:
                self.stats["warm_hits"] += 1
                sb = self._warm.popleft()
                self._cond.notify_all()  # the filler refills
                return sb
            self._live += 1
            self.stats["cold_creates"] += 1
            return None

    def adopt(self, factory: Callable[[], Sandbox], timeout_s: float | None = None) -> PooledSandbox:
        """Create a sandbox with ``factory`` under the pool's accounting (``max_live``, slots)."""
        deadline = time.monotonic() + (self.cfg.pool.acquire_timeout_s if timeout_s is None else timeout_s)
        with self._cond:
            while self._live >= self._max_live and not self._closed:
                if not self._cond.wait(max(0.0, deadline - time.monotonic())):
                    raise TimeoutError(f"sandbox pool: no room for a fork (max_live = {self._max_live})")
            if self._closed:
                raise RuntimeError("sandbox pool is closed")
            self._live += 1
        return self._lease(self._spawner.submit(self._checked_create, factory).result())

    def _checked_create(self, factory: Callable[[], Sandbox]) -> Sandbox:
        try:
            return self._create(factory)
        except BaseException:
            with self._cond:
                self._live -= 1
                self._cond.notify_all()
            raise

    def _lease(self, sb: Sandbox) -> PooledSandbox:
        lease = PooledSandbox(self, sb)
        with self._cond:
            if self._closed:
                self._live -= 1
                sb.close()
                raise RuntimeError("sandbox pool is closed")
            self._leased.add(lease)
        return lease

    # ----------------------------------------------------------------- public
    def acquire(
        self, files: Mapping[str, str] | None = None, timeout_s: float | None = None
    ) -> PooledSandbox:
        """A started sandbox holding ``files`` (as its base, see ``seed``); blocks while the pool is full."""
        deadline = time.monotonic() + (self.cfg.pool.acquire_timeout_s if timeout_s is None else timeout_s)
        sb = self._reserve(deadline)
        if sb is None:
            sb = self._spawner.submit(self._checked_create, self._factory).result()
        lease = self._lease(sb)
        if files:
            try:
                lease.seed(files)
            except BaseException:
                lease.close()
                raise
        return lease

    def release(self, lease: PooledSandbox) -> None:
        """Destroy a handed-out sandbox and free its place (``PooledSandbox.close`` calls this)."""
        with self._cond:
            if lease not in self._leased:
                return
            self._leased.discard(lease)
        try:
            lease.inner.close()
        finally:
            with self._cond:
                self._live -= 1
                self._cond.notify_all()

    def wait_warm(self, timeout_s: float = 60.0) -> bool:
        """Block until ``warm`` sandboxes are ready (or the filler stopped); whether they are."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while len(self._warm) < self._warm_target and not self._closed:
                left = deadline - time.monotonic()
                if left <= 0 or self._warm_target == 0:
                    break
                self._cond.wait(left)
            return len(self._warm) >= self._warm_target

    def warm_sandboxes(self) -> list[Sandbox]:
        """The sandboxes ready now (for measurements; do not use them directly)."""
        with self._cond:
            return list(self._warm)

    @property
    def live(self) -> int:
        return self._live

    def close(self) -> None:
        """Destroy every sandbox of the pool (warm and handed out) and stop the filler (idempotent)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            warm, self._warm = list(self._warm), collections.deque()
            leased, self._leased = list(self._leased), set()
        self._filler.join()
        self._spawner.shutdown(wait=True)
        for sb in warm:
            sb.close()
        for lease in leased:
            lease.inner.close()
        with self._cond:
            self._live -= len(warm) + len(leased)

    def __enter__(self) -> SandboxPool:
        return self

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
