"""What a sandbox must release, and finding what a dead process left behind.

Contract: :class:`_Resources` / :func:`_release` free a sandbox's workspace, cgroup and session;
:func:`reap_stale` removes workspaces and cgroups of Shipyard processes that died without closing
their sandboxes; :func:`descendants` and :func:`leftovers` find processes and directories still
alive under given roots (leak checks in tests, benchmarks and the chaos suite).
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Sequence

from shipyard.envs.processes import pid_alive
from shipyard.envs.sandbox.cgroups import Cgroups, candidate_parents
from shipyard.envs.sandbox.process import _kill_group
from shipyard.envs.sandbox.session import _Session

_OWNED = re.compile(r"^shipyard-(?:sb|grade)-(\d+)-")


def reap_stale() -> int:
    """Remove what sandboxes of dead processes left behind; returns how many entries went.

    A process killed hard (``SIGKILL``, e.g. a Ray actor torn down) runs no finalizer: its
    sandboxes' processes die with it (``--die-with-parent``) but their empty ``shipyard-sb-PID-*``
    cgroups and ``shipyard-sb-PID-*`` / ``shipyard-grade-PID-*`` temp directories stay. This
    removes those whose PID is not a live process here. Runs once per process, on the first
    sandbox. Assumes the temp directory and cgroups are not shared with another pid namespace.
    """
    removed = 0
    for parent in candidate_parents():
        for name in os.listdir(parent):
            m = _OWNED.match(name)
            if m and not pid_alive(int(m.group(1))):
                with contextlib.suppress(OSError):
                    os.rmdir(os.path.join(parent, name))  # fails (and stays) if not empty
                    removed += 1
    tmp = tempfile.gettempdir()
    for name in os.listdir(tmp):
        m = _OWNED.match(name)
        path = os.path.join(tmp, name)
        if m and not pid_alive(int(m.group(1))) and os.path.isdir(path) and not os.path.islink(path):
            with contextlib.suppress(OSError):  # another process may be reaping it too
                _release(_Resources(path, Cgroups()))
                removed += 1
    return removed


def descendants(pid: int) -> list[int]:
    """``pid`` and every process below it (host pids, from ``/proc/PID/task/*/children``)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        with contextlib.suppress(OSError):
            for task in os.listdir(f"/proc/{p}/task"):
                with contextlib.suppress(OSError), open(f"/proc/{p}/task/{task}/children") as f:
                    todo += [int(c) for c in f.read().split()]
    return out


def leftovers(roots: Sequence[str]) -> dict[str, int]:
    """What sandboxes with these workspace ``roots`` left on the host: live processes whose
    command line or mount table names a root (bwrap gets its options through a pipe, so its
    sandbox's processes show the workspace only as a mount), mounts of ours naming one, roots
    still on disk, and this process's ``shipyard-sb-PID-*`` cgroups (of every sandbox, closed or not)."""
    procs = 0
    for entry in os.listdir("/proc"):
        if entry.isdigit() and entry != str(os.getpid()):
            seen = ""
            for name in ("cmdline", "mountinfo"):
                with contextlib.suppress(OSError), open(f"/proc/{entry}/{name}", "rb") as f:
                    seen += f.read().decode(errors="replace")
            procs += any(root in seen for root in roots)
    with open("/proc/self/mountinfo") as f:
        mounts = sum(1 for line in f if any(root in line for root in roots))
    prefix = f"shipyard-sb-{os.getpid()}-"
    cgroups = sum(
        1 for parent in candidate_parents() for name in os.listdir(parent) if name.startswith(prefix)
    )
    dirs = sum(1 for root in roots if os.path.exists(root))
    return {"processes": procs, "mounts": mounts, "cgroups": cgroups, "dirs": dirs}


@functools.lru_cache(maxsize=1)
def _reap_once() -> int:
    try:
        return reap_stale()
    except OSError:
        return 0


class _Resources:
    """What :meth:`BwrapSandbox.close` (or garbage collection) must release."""

    def __init__(self, root: str, cgroups: Cgroups) -> None:
        self.root = root
        self.cgroups = cgroups
        self.procs: list[subprocess.Popen[bytes]] = []
        self.session: _Session | None = None

    def end_session(self, graceful: bool = False) -> None:
        if self.session is not None:
            self.session.kill(graceful)
            with contextlib.suppress(ValueError):
                self.procs.remove(self.session.proc)
            self.session = None


def _release(res: _Resources) -> None:
    res.end_session(graceful=True)
    for proc in res.procs:
        _kill_group(proc)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=5)
    res.procs.clear()
    res.cgroups.remove()

    shutil.rmtree(res.root, onerror=_rmtree_error)


def _rmtree_error(func: Callable[..., object], path: str, exc: tuple[type, BaseException, object]) -> None:
    """``shutil.rmtree``'s error hook for sandbox roots: what is already gone (another process
    reaping the same stale root) is done; an entry the sandboxed code made unwritable (a directory
    of mode 000) is made writable and removed again. Anything else stays, as ``ignore_errors``."""
    if isinstance(exc[1], FileNotFoundError):
        return
    with contextlib.suppress(OSError):
        if func in (os.unlink, os.remove, os.rmdir):
            os.chmod(os.path.dirname(path), 0o700)
            func(path)
        elif os.path.isdir(path) and not os.path.islink(path) and os.stat(path).st_mode & 0o700 != 0o700:
            os.chmod(path, 0o700)  # os.open / os.scandir of a directory we could not read: once more
            shutil.rmtree(path, onerror=_rmtree_error)
