"""Per-sandbox cgroups: process count, memory and CPU limits for a sandbox's whole process tree.

Contract: :func:`make_cgroups` creates, for one sandbox, a child cgroup named
``shipyard-sb-PID-HEX`` under this process's own cgroup in every hierarchy that lets it (cgroup
v1: one directory per controller hierarchy; v2: one directory where our cgroup delegates the
controller) and writes the limits: ``pids`` (tasks, threads included), ``memory`` (resident
memory of all processes plus the tmpfs pages they write, swap included where the kernel counts
it; the kernel OOM-kills inside the cgroup when it is exceeded) and ``cpu`` (a CFS quota of
``cpus`` cores per 100 ms period). A controller that cannot be set up is left out and reported
by :attr:`Cgroups.controllers`, so callers fall back to rlimits for it. The sandbox's launcher
moves itself into every directory (:meth:`Cgroups.procs_files`) before it execs bwrap, so every
sandboxed process starts inside. :meth:`Cgroups.remove` kills whatever is still inside and
removes the directories (bounded retries); a host process killed hard leaves empty directories
that :func:`shipyard.envs.sandbox.reaper.reap_stale` removes through :func:`candidate_parents`.

Limits: needs write access to the cgroup filesystem (root, or a delegated v2 subtree); nothing
here works inside an unprivileged container without delegation, which is why every limit has an
rlimit fallback in the sandbox.
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field

CG_ROOT = "/sys/fs/cgroup"
CONTROLLERS = ("pids", "memory", "cpu")
CPU_PERIOD_US = 100_000


def _own_cgroups() -> list[str]:
    try:
        with open("/proc/self/cgroup") as f:
            return f.read().splitlines()
    except OSError:
        return []


def candidate_parents(controller: str | None = None) -> list[str]:
    """Directories of this process's cgroups (v1 for ``controller``, or all v1; then v2)."""
    return list(_candidate_parents(tuple(_own_cgroups()), controller))


@functools.lru_cache(maxsize=16)
def _candidate_parents(lines: tuple[str, ...], controller: str | None) -> tuple[str, ...]:
    """:func:`candidate_parents` for the lines of ``/proc/self/cgroup`` (cached: they rarely change)."""
    out = []
    for ln in lines:
        if ln.count(":") < 2:
            continue
        _, ctrls, path = ln.split(":", 2)
        names = [c for c in ctrls.split(",") if c]
        for c in names:
            if c in CONTROLLERS and (controller is None or c == controller):
                out.append(os.path.join(CG_ROOT, c, path.lstrip("/")))
        if ln.startswith("0::"):
            for base in (CG_ROOT, os.path.join(CG_ROOT, "unified")):
                out.append(os.path.join(base, path.lstrip("/")))
    seen: list[str] = []
    for d in out:
        if os.path.isfile(os.path.join(d, "cgroup.procs")) and d not in seen:
            seen.append(d)
    return tuple(seen)


def _is_v2(parent: str) -> bool:
    return os.path.isfile(os.path.join(parent, "cgroup.controllers"))


def _limit_files(controller: str, v2: bool, limits: Mapping[str, float]) -> list[tuple[str, str, bool]]:
    """(file, value, required) to write for ``controller``; optional files may be missing."""
    if controller == "pids":
        return [("pids.max", str(int(limits["pids"])), True)]
    if controller == "memory":
        nbytes = str(int(limits["memory_mb"]) * 2**20)
        if v2:
            return [("memory.max", nbytes, True), ("memory.swap.max", "0", False)]
        return [("memory.limit_in_bytes", nbytes, True), ("memory.memsw.limit_in_bytes", nbytes, False)]
    quota = max(1000, int(float(limits["cpus"]) * CPU_PERIOD_US))
    if v2:
        return [("cpu.max", f"{quota} {CPU_PERIOD_US}", True)]
    return [("cpu.cfs_period_us", str(CPU_PERIOD_US), True), ("cpu.cfs_quota_us", str(quota), True)]


def _write_limits(path: str, controller: str, limits: Mapping[str, float]) -> bool:
    for name, value, required in _limit_files(controller, _is_v2(path), limits):
        target = os.path.join(path, name)
        if not required and not os.path.exists(target):
            continue
        try:
            with open(target, "w") as f:
                f.write(value)
        except OSError:
            if required:
                return False
    return True


@dataclass
class Cgroups:
    """The cgroup directories of one sandbox, by controller (one directory may serve several)."""

    dirs: dict[str, str] = field(default_factory=dict)

    @property
    def controllers(self) -> tuple[str, ...]:
        return tuple(c for c in CONTROLLERS if c in self.dirs)

    def procs_files(self) -> list[str]:
        return [os.path.join(d, "cgroup.procs") for d in dict.fromkeys(self.dirs.values())]

    def pids(self) -> list[int]:
        """Host pids of every process inside (from the first directory: all hold the same tree)."""
        if not self.dirs:
            return []
        try:
            with open(self.procs_files()[0]) as f:
                return [int(x) for x in f.read().split()]
        except OSError:
            return []

    def remove(self) -> None:
        for d in dict.fromkeys(self.dirs.values()):
            remove_cgroup(d)
        self.dirs.clear()


def make_cgroups(limits: Mapping[str, float], wanted: tuple[str, ...] = CONTROLLERS) -> Cgroups:
    """Create this sandbox's cgroups for the ``wanted`` controllers; limits: pids, memory_mb, cpus."""
    name = f"shipyard-sb-{os.getpid()}-{uuid.uuid4().hex[:12]}"
    made = Cgroups()
    for controller in wanted:
        for parent in candidate_parents(controller):
            path = os.path.join(parent, name)
            created = False
            if not os.path.isdir(path):
                try:
                    os.mkdir(path)
                    created = True
                except OSError:
                    continue
            if _write_limits(path, controller, limits):
                made.dirs[controller] = path
                break
            if created and path not in made.dirs.values():
                remove_cgroup(path)
    return made


def remove_cgroup(path: str) -> None:
    """Kill whatever is left in the cgroup and remove it (best effort, bounded)."""
    for _ in range(50):
        try:
            os.rmdir(path)
            return
        except FileNotFoundError:
            return
        except OSError:
            try:
                with open(os.path.join(path, "cgroup.procs")) as f:
                    pids = [int(x) for x in f.read().split()]
            except OSError:
                pids = []
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.02)
