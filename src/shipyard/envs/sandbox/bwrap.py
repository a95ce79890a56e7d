"""A persistent, isolated workspace for untrusted code, built on bubblewrap (``bwrap``).

Contract: :class:`BwrapSandbox` implements :class:`shipyard.envs.types.Sandbox`. It owns a fresh
host temp directory (the workspace) that every command sees read-write at ``/workspace`` (the
working directory), so files persist across :meth:`~BwrapSandbox.exec` calls. Commands run as
``/bin/sh -c CMD`` in new namespaces (user, pid, ipc, uts, cgroup and network unless
``network=True``) with all capabilities dropped, ``no_new_privs``, further user namespaces
disabled (bwrap ``--disable-userns``), the seccomp deny-list of :mod:`.seccomp` (``EPERM`` for
ptrace, mount, namespace creation, keyrings, BPF, perf, io_uring, module loading and the like;
``cfg.seccomp``), a cleared environment, a read-only view of the system
(``/usr``, ``/bin``, ``/lib*``, a few ``/etc`` files (a prebuilt copy bound once, :mod:`.sysroot`)
and the running Python installation, so
``python`` is this interpreter with pytest importable), a size-capped tmpfs ``/tmp`` and
``/dev/shm``, a minimal ``/dev``, a fresh ``/proc`` (no ``/sys``) and a read-only root. Nothing
outside the workspace (and ``/tmp``, ``/dev/shm``, extra ``binds``) is writable; host paths that
are not bound do not exist inside. Inside, commands run as uid 0 of their user namespace,
mapped to the caller's uid (files they write belong to the caller). bwrap itself starts with
the environment :data:`_HOST_ENV` and working directory ``/``: the sandbox's pid 1 is a bwrap
process whose ``/proc/1/environ`` the sandbox can read, so the caller's environment (tokens,
keys) must never reach it; its ``/proc/1/cmdline`` shows only ``--args FD`` and the server's
command (the options, with host paths, come through a pipe). Needs Linux and bubblewrap >= 0.8
(:func:`sandbox_available` says what is missing).

Session (``persistent=True``, the default): the first ``exec`` starts one long-lived bwrap whose
process is a small command server reading length-framed commands from a pipe: the compiled agent of
:mod:`.agent` (a freestanding C program run from a sealed memfd, 0.03 MiB resident) where a C
compiler is available (``use_agent=True``, the default), else ``/bin/sh`` running :data:`_SERVER`,
which speaks the same protocol; each command runs in a fresh ``/bin/sh -c`` child with stdin
``/dev/null``, its output streams back over two pipes and its exit status over a third. When the
command's main process exits the server kills every other process of the sandbox (``kill -9 -1``
from inside the pid namespace), so a command never outlives its ``exec`` (background jobs die with
it) and the next command starts clean; ``/tmp`` persists between commands of a session. A round
trip costs about a millisecond instead of a bwrap start. On a wall timeout, or if the server dies
(a command can kill it), the whole session is killed and the next ``exec`` starts a new one
(workspace kept, ``/tmp`` lost). ``exec`` with ``stdin`` or ``pass_fds``, and every ``exec`` of a
``persistent=False`` sandbox, runs in a one-shot bwrap of its own sharing the workspace.
In-sandbox code can reach the server's pipes through ``/proc`` and garble or forge its own
session's results: harmless, since rewards never come from session commands (the grader runs in
fresh sandboxes of its own, see :mod:`shipyard.envs.grading.grader`).

Copy-on-write fork (``base=DIR``): the workspace is an overlayfs whose read-only lower layer is
the host directory ``DIR`` and whose upper layer is this sandbox's own directory, so creating a
sandbox over a large repository copies nothing. The overlay is mounted in a user + mount
namespace of its own (``unshare -Urm``, kernel >= 5.11) that bwrap then starts from; ``DIR``
must not change while sandboxes use it. Host-side file access goes through the session's mount
namespace (``/proc/PID/root``), so it starts the session when needed; a one-shot ``exec`` first
ends the session (both would mount the same upper layer), and :meth:`~BwrapSandbox.spawn` is not
available.

Limits per command: ``RLIMIT_AS`` = ``cfg.memory_mb``, ``RLIMIT_FSIZE`` = :data:`MAX_FILE_MB`,
``RLIMIT_CPU`` = the wall timeout rounded up plus 1 s, no core files, all set inside with
``ulimit`` (POSIX ``sh`` units); the wall timeout (``cfg.timeout_s`` unless given) kills the
whole process tree: bwrap runs in its own process group, killing it makes the sandbox's pid 1
die (``--die-with-parent``) and the kernel then kills every process in the sandbox's pid
namespace. stdout and stderr are each capped at :data:`OUTPUT_CAP` bytes (head and tail kept, a
marker says how much was cut).

Whole-sandbox limits (:mod:`.cgroups`): where cgroups can be created the sandbox gets its own
``memory`` cgroup (``cfg.cgroup_memory_mb`` for all its processes and tmpfs pages; the kernel
OOM-kills inside it) and ``cpu`` cgroup (a CFS quota of ``cfg.cpus`` cores);
:attr:`BwrapSandbox.memory_limit` and :attr:`BwrapSandbox.cpu_limit` say whether they apply
(``"cgroup"``) or only the per-process rlimits do (``"rlimit"``).

Process-count limit (``cfg.max_processes``): ``RLIMIT_NPROC`` is counted per real user and is never
enforced for a process whose host uid is 0, and a user namespace created by root maps the sandbox
to host uid 0, so as root the rlimit alone does nothing. The sandbox therefore uses, in order: a
``pids`` cgroup made for this sandbox when one can be created (cgroup v1 ``pids`` hierarchy, or v2
where our cgroup delegates ``pids``), which also counts threads and the sandbox's own bwrap and
server processes (3 of the budget); else ``RLIMIT_NPROC`` (effective when the host uid is not 0);
else none. :attr:`BwrapSandbox.process_limit` says which (``"cgroup"``, ``"rlimit"``, ``"none"``).
bwrap starts blocked reading its options from a pipe (``--args``); the launching thread moves it
into the cgroups, then writes them (:func:`_release_args`), so no wrapper process is needed and
Python never forks with a ``preexec_fn`` (a plain ``vfork``/``exec`` keeps starts cheap in large
processes). The move must come before bwrap creates the sandbox: the cgroup namespace is rooted
where bwrap is then, which keeps the host's cgroup names out of the sandbox's
``/proc/self/cgroup``. The cgroup lives from construction to :meth:`~BwrapSandbox.close`; a host
process killed hard leaves its empty ``shipyard-sb-PID-*`` cgroups and temp directories behind,
which :func:`reap_stale` removes (the first sandbox of every process runs it).

Host-side access (:meth:`write`, :meth:`read`, :meth:`files`) never follows symlinks and
rejects absolute paths and ``..``, so sandboxed code cannot make the host read or write outside
the workspace; it relies on no sandboxed process running while it is called (true because
``exec`` is synchronous and kills everything it started). ``--die-with-parent`` ties a session
to the thread that started it: once that thread has ended, the next ``exec`` ends the session
and starts a new one (long-lived threads, e.g. a :class:`~.pool.SandboxPool`'s, keep it).

Diff and fork: :meth:`~BwrapSandbox.diff` reports the text files added, modified and deleted
relative to the base (the starting files and :meth:`~BwrapSandbox.seed`; with ``base``, the base
directory, read from the overlay's upper layer); :meth:`~BwrapSandbox.fork` makes an
independent sandbox starting from this workspace (with ``base``: copying only the upper layer).

Limits not covered: the seccomp filter is a deny-list (a syscall new to the kernel is allowed);
without a memory cgroup, memory is limited per process only (worst case about
``max_processes * memory_mb`` plus the two tmpfs); the workspace is a host directory without a
disk quota (bounded only by ``RLIMIT_FSIZE`` per file and the timeout).

Example::

    with BwrapSandbox({"solution.py": "print(1)"}, SandboxConfig(timeout_s=5)) as sb:
        res = sb.exec("python solution.py")      # ExecResult(returncode=0, stdout='1\\n', ...)
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import shlex
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Mapping, Sequence
from types import TracebackType
from typing import IO, Any

from shipyard.config.schema import SandboxConfig
from shipyard.envs.sandbox import agent, seccomp, sysroot
from shipyard.envs.sandbox.base import check_relative, diff_files, env_prefix
from shipyard.envs.sandbox.cgroups import make_cgroups
from shipyard.envs.sandbox.overlay import (
    SKIPPED_DIRS,
    _overlay_diff,
    _read_text,
)
from shipyard.envs.sandbox.process import _kill_group, _pump
from shipyard.envs.sandbox.reaper import (
    _reap_once,
    _release,
    _Resources,
)
from shipyard.envs.sandbox.session import _Session
from shipyard.envs.types import ExecResult, WorkspaceDiff

WORKDIR = "/workspace"
"""Where the workspace is mounted inside the sandbox (also the working directory and HOME)."""
MAX_FILE_MB = 16
"""RLIMIT_FSIZE: largest file a sandboxed process may write."""
TMPFS_MB = 64
"""Size of the sandbox's private /tmp and /dev/shm."""
MAX_LISTED_FILES = 2000
"""At most this many files are returned by :meth:`BwrapSandbox.files` (in sorted path order)."""

_RESERVED = frozenset({"usr", "bin", "sbin", "lib", "lib32", "lib64", "libx32", "etc", "proc", "dev", "tmp"})
_HOST_ENV = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8"}
"""The whole environment bwrap starts with: its pid-1 process keeps it, and the sandbox can read
that process's ``/proc/1/environ``, so the caller's environment (tokens, keys) never gets there."""
_INSTALL_HINT = (
    "install bubblewrap (Debian/Ubuntu: `apt-get install bubblewrap`; Fedora: `dnf install bubblewrap`; "
    "Arch: `pacman -S bubblewrap`)"
)
_MOUNT_WRAP = (
    'mount -t overlay shipyard -o "lowerdir=$1,upperdir=$2,workdir=$3,userxattr" "$4" || exit 125; '
    'shift 4; exec "$@"'
)
"""Run under ``unshare -Urm``: mount the copy-on-write workspace, then exec bwrap."""
_SERVER = r"""
while IFS=' ' read -r seq n cpu; do
  IFS= read -r cmd || exit 0
  while [ "$n" -gt 1 ]; do
    IFS= read -r line || exit 0
    cmd="$cmd
$line"
    n=$((n - 1))
  done
  ( ulimit -t "$cpu" 2>/dev/null; exec /bin/sh -c "$cmd" ) </dev/null >"/proc/self/fd/$1"
  rc=$?
  kill -9 -1 2>/dev/null
  echo "$seq $rc"
done
"""
"""The session's command server: fd 0 brings commands, fd 1 takes statuses, fd 2 and fd ``$1``
are the commands' stderr and stdout (dash only redirects fds 0-9, so the stdout pipe is reopened
through ``/proc/self/fd``). Frame: ``SEQ NLINES CPU_S\\n`` then the command's NLINES lines;
reply ``SEQ EXIT_STATUS\\n`` once the command and everything it started are gone."""


@functools.lru_cache(maxsize=1)
def sandbox_available() -> str | None:
    """None when sandboxes can run here, else a message saying what is missing and how to fix it."""
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        return f"bubblewrap (`bwrap`) is not on PATH: {_INSTALL_HINT}"
    probe = [bwrap, "--unshare-all", "--unshare-user", "--disable-userns", "--die-with-parent"]
    probe += ["--ro-bind", "/", "/", "--size", "1048576", "--tmpfs", "/tmp", "--remount-ro", "/", "true"]
    try:
        res = subprocess.run(probe, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"running `{shlex.join(probe)}` failed: {exc}"
    if res.returncode != 0 and ("Unknown option" in res.stderr or "size" in res.stderr):
        return f"this bwrap is too old ({res.stderr.strip()}): bubblewrap >= 0.8 is needed; {_INSTALL_HINT}"
    if res.returncode != 0:
        return (
            f"bwrap cannot create namespaces here ({res.stderr.strip()}): allow unprivileged user "
            "namespaces (e.g. `sysctl kernel.unprivileged_userns_clone=1`, or on Ubuntu 24.04+ "
            "`sysctl kernel.apparmor_restrict_unprivileged_userns=0`) or run in a container that permits them"
        )
    return None


@functools.lru_cache(maxsize=1)
def _python_roots() -> tuple[str, ...]:
    """The Python installation(s) to bind read-only: venv prefix and base prefix, outside /usr."""
    roots: list[str] = []
    for p in (sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix):
        for q in (os.path.abspath(p), os.path.realpath(p)):
            if q != "/" and not q.startswith("/usr/") and q != "/usr" and q not in roots:
                roots.append(q)
    roots.sort(key=len)
    return tuple(r for r in roots if not any(r != o and r.startswith(o + "/") for o in roots))


@functools.lru_cache(maxsize=8)
def _which(name: str) -> str:
    """Absolute path of a program on PATH (looked up once per process), else ``name``."""
    return shutil.which(name) or name


def _release_args(
    proc: subprocess.Popen[bytes], procs_files: Sequence[str], args_w: int, options: list[str]
) -> None:
    """Move ``proc`` (bwrap, or the overlay wrapper that becomes it; blocked reading its options)
    into the cgroups, then hand it ``options``. Anything short of that (a failed move, an
    interrupt) kills it before its pipe closes: a sandbox never runs outside its cgroups, nor
    with a truncated option list. On cgroup v1 the first move after an idle spell waits for an
    RCU grace period (``cgroup.procs`` writes take a global lock that needs one)."""
    written = False
    try:
        for path in procs_files:
            with open(path, "w") as f:
                f.write(str(proc.pid))
        data = b"".join(arg.encode("utf-8", "surrogateescape") + b"\0" for arg in options)
        view = memoryview(data)
        while view:
            view = view[os.write(args_w, view) :]
        written = True
    except BrokenPipeError:
        pass  # bwrap died first: its caller sees it exit and reads its stderr
    except OSError as exc:
        raise RuntimeError(
            f"moving the sandbox into its cgroups ({list(procs_files)}) failed: {exc}"
        ) from exc
    finally:
        if not written:  # killed while it still waits: it never reads a short option list
            _kill_group(proc)
        os.close(args_w)


def _check_base(base: str) -> str:
    path = os.path.realpath(base)
    if not os.path.isdir(path):
        raise ValueError(f"base: {base!r} is not a directory; give the host directory to fork")
    if any(c in path for c in ",:\\"):
        raise ValueError(f"base: {path!r} contains ',', ':' or '\\\\', which overlayfs options cannot hold")
    if shutil.which("unshare") is None:
        raise ValueError("base: needs `unshare` (util-linux) on PATH to mount the copy-on-write workspace")
    return path


def _checked_binds(
    binds: Mapping[str, str], ro_binds: Sequence[str]
) -> tuple[dict[str, str], tuple[str, ...]]:
    """``binds`` and ``ro_binds`` (:class:`BwrapSandbox`) checked: host directories that exist,
    read-write ones mounted at absolute paths outside the system directories and the workspace."""
    for host, inside in binds.items():
        if not os.path.isdir(host):
            raise ValueError(f"binds: host directory {host!r} does not exist; create it first")
        top = inside.split("/")[1] if inside.startswith("/") else ""
        if not top or top in _RESERVED or top == WORKDIR.strip("/"):
            raise ValueError(
                f"binds: sandbox path {inside!r} must be absolute, outside system dirs and the workspace"
            )
    ro = tuple(os.path.abspath(p) for p in ro_binds)
    for path in ro:
        if not os.path.isdir(path):
            raise ValueError(f"ro_binds: host directory {path!r} does not exist")
    return dict(binds), ro


class BwrapSandbox:
    """One persistent sandboxed workspace; see the module docstring for isolation and limits.

    ``binds`` maps extra host directories (which must exist) to absolute sandbox paths, mounted
    read-write; the grader uses it for a report directory made fresh per grading. ``ro_binds``
    are host directories mounted read-only at their own paths (a harness's virtualenv). ``base`` makes
    the workspace a copy-on-write fork of a host directory. ``persistent=False`` runs every
    ``exec`` in a one-shot bwrap (no session).
    """

    def __init__(
        self,
        files: Mapping[str, str] | None = None,
        cfg: SandboxConfig | None = None,
        network: bool = False,
        *,
        binds: Mapping[str, str] | None = None,
        ro_binds: Sequence[str] = (),
        base: str | None = None,
        persistent: bool = True,
        use_agent: bool = True,
    ) -> None:
        problem = sandbox_available()
        if problem is not None:
            raise RuntimeError(problem)
        self.cfg = cfg if cfg is not None else SandboxConfig()
        self.network = network
        self.persistent = persistent
        self._binds, self._ro_binds = _checked_binds(binds or {}, ro_binds)
        self._base = _check_base(base) if base is not None else None
        self._initial = dict(files or {})
        """Files written at creation or by :meth:`seed`: part of the base :meth:`diff` compares with."""
        self._bwrap = _which("bwrap")
        _reap_once()
        self.root = tempfile.mkdtemp(prefix=f"shipyard-sb-{os.getpid()}-")
        self._ws = self.root if self._base is None else os.path.join(self.root, "upper")
        self._layers = [os.path.join(self.root, d) for d in ("upper", "work", "merged")] if base else []
        for d in self._layers:
            os.mkdir(d)
        self._lock = threading.RLock()
        limits = {
            "pids": self.cfg.max_processes,
            "memory_mb": self.cfg.cgroup_memory_mb,
            "cpus": self.cfg.cpus,
        }
        self._res = _Resources(self.root, make_cgroups(limits))
        self._finalizer = weakref.finalize(self, _release, self._res)
        made = self._res.cgroups.controllers
        self.process_limit = "cgroup" if "pids" in made else ("rlimit" if os.getuid() != 0 else "none")
        self.memory_limit = "cgroup" if "memory" in made else "rlimit"
        """``"cgroup"``: the whole sandbox is held to ``cfg.cgroup_memory_mb``; ``"rlimit"``: only
        each process's address space (``cfg.memory_mb``)."""
        self.cpu_limit = "cgroup" if "cpu" in made else "rlimit"
        """``"cgroup"``: a CFS quota of ``cfg.cpus`` cores; ``"rlimit"``: only ``RLIMIT_CPU`` per command."""
        self._seccomp = seccomp.deny_filter() if self.cfg.seccomp else None
        self._agent = agent.agent_fd() if use_agent else None
        """The compiled session agent's memfd (:mod:`.agent`), or None: the ``/bin/sh`` server."""
        try:
            for path, content in (files or {}).items():
                self.write(path, content)
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> BwrapSandbox:
        return self

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    @property
    def cgroup(self) -> str | None:
        """Host path of this sandbox's ``pids`` cgroup (None when ``process_limit`` is not ``"cgroup"``)."""
        return self._res.cgroups.dirs.get("pids")

    @property
    def cgroups(self) -> dict[str, str]:
        """Host paths of this sandbox's cgroups by controller (``pids``, ``memory``, ``cpu``)."""
        return dict(self._res.cgroups.dirs)

    @property
    def session_pid(self) -> int | None:
        """Host pid of the running session's bwrap (its sandbox processes are its descendants)."""
        session = self._res.session
        return session.proc.pid if session is not None and session.alive() else None

    # ----------------------------------------------------------------- launching bwrap
    def _bwrap_argv(self) -> list[str]:
        py_bin = os.path.dirname(os.path.abspath(sys.executable))
        path = ":".join(dict.fromkeys([py_bin, "/usr/local/bin", "/usr/bin", "/bin"]))
        argv = [self._bwrap, "--unshare-all", "--unshare-user", "--disable-userns"]
        argv += ["--share-net"] if self.network else []
        argv += ["--die-with-parent", "--new-session", "--cap-drop", "ALL", "--hostname", "sandbox"]
        argv += sysroot.system_args(self.network)
        size = str(TMPFS_MB * 1024 * 1024)
        argv += ["--size", size, "--tmpfs", "/tmp", "--proc", "/proc", "--dev", "/dev"]
        argv += ["--size", size, "--tmpfs", "/dev/shm", "--remount-ro", "/dev"]
        for root in _python_roots():
            argv += ["--ro-bind", root, root]
        argv += ["--bind", self._layers[2] if self._base else self._ws, WORKDIR]
        for ro in self._ro_binds:
            argv += ["--ro-bind", ro, ro]
        for host, inside in self._binds.items():
            argv += ["--bind", host, inside]
        argv += ["--chdir", WORKDIR, "--remount-ro", "/", "--clearenv"]
        env = {
            "PATH": path,
            "HOME": WORKDIR,
            "TMPDIR": "/tmp",
            "LANG": "C.UTF-8",
            "PYTHONDONTWRITEBYTECODE": "1",
            "PYTHONHASHSEED": "0",
        }
        for k, v in env.items():
            argv += ["--setenv", k, v]
        return argv

    def _limits(self) -> str:
        """Shell prelude setting the per-process rlimits (POSIX sh units: KiB, 512-byte blocks)."""
        kib, blocks, n = self.cfg.memory_mb * 1024, MAX_FILE_MB * 2048, self.cfg.max_processes
        return (
            f"ulimit -c 0 2>/dev/null; ulimit -v {kib} 2>/dev/null; ulimit -f {blocks} 2>/dev/null; "
            f"ulimit -u {n} 2>/dev/null || ulimit -p {n} 2>/dev/null; "
        )

    def _server(self, out_w: int) -> list[str]:
        """The session's command server: the compiled agent, else ``/bin/sh`` running :data:`_SERVER`."""
        if self._agent is None:
            return ["/bin/sh", "-c", self._limits() + _SERVER, "shipyard-session", str(out_w)]
        limits = (0, self.cfg.memory_mb * 1024, MAX_FILE_MB * 2048, self.cfg.max_processes)
        return [f"/proc/self/fd/{self._agent}", "serve", str(self._agent), str(out_w), *map(str, limits)]

    def _launch(
        self, tail: Sequence[str], *, agent_fd: bool = False, **popen: Any
    ) -> subprocess.Popen[bytes]:
        """Start bwrap running ``tail`` (through the overlay wrapper with ``base``), in the cgroups;
        ``agent_fd``: ``tail`` runs the session agent, whose memfd it inherits.

        bwrap's options travel through a pipe (``--args FD``) written only once this thread has
        moved the new process into the sandbox's cgroups, so bwrap creates the sandbox (and its
        cgroup namespace, rooted at the sandbox's cgroup) from inside them, without a wrapper."""
        options = self._bwrap_argv()[1:]
        keep: list[int] = []  # fds bwrap inherits, closed here once it has started
        if self._seccomp is not None:
            keep.append(seccomp.filter_fd(self._seccomp))
            options += ["--seccomp", str(keep[-1])]
        args_r, args_w = os.pipe()
        keep.append(args_r)
        argv = [self._bwrap, "--args", str(args_r), *tail]
        if self._base is not None:
            wrap = [_which("unshare"), "-Urm", "/bin/sh", "-c", _MOUNT_WRAP, "shipyard-mount", self._base]
            argv = wrap + self._layers + argv
        agent_fds = (self._agent,) if agent_fd and self._agent is not None else ()
        popen["pass_fds"] = (*popen.get("pass_fds", ()), *keep, *agent_fds)
        self._res.procs[:] = [p for p in self._res.procs if p.poll() is None]
        try:
            proc: subprocess.Popen[bytes] = subprocess.Popen(
                argv, start_new_session=True, env=_HOST_ENV, cwd="/", **popen
            )
        except BaseException:
            os.close(args_w)
            raise
        finally:
            for fd in keep:
                os.close(fd)
        self._res.procs.append(proc)
        _release_args(proc, self._res.cgroups.procs_files(), args_w, options)
        return proc

    def _session(self, mounted: bool = False) -> _Session:
        """The running session, started when there is none; ``mounted``: wait until it has answered."""
        res = self._res
        if res.session is not None and res.session.alive():
            if mounted and not res.session.answered and res.session.run(b":", 30.0)[3]:
                raise RuntimeError(f"the copy-on-write workspace over {self._base!r} could not be mounted")
            return res.session
        res.end_session()
        cmd_r, cmd_w = os.pipe()
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        st_r, st_w = os.pipe()
        try:
            tail = self._server(out_w)
            proc = self._launch(
                tail, agent_fd=True, stdin=cmd_r, stdout=st_w, stderr=err_w, pass_fds=(out_w,)
            )
        except BaseException:
            for fd in (cmd_w, out_r, err_r, st_r):
                os.close(fd)
            raise
        finally:
            for fd in (cmd_r, out_w, err_w, st_w):
                os.close(fd)
        res.session = _Session(proc, cmd_w, out_r, err_r, st_r)
        if mounted and res.session.run(b":", 30.0)[3]:
            res.end_session()
            raise RuntimeError(f"the copy-on-write workspace over {self._base!r} could not be mounted")
        return res.session

    # ----------------------------------------------------------------- running commands
    def exec(
        self,
        cmd: str,
        timeout_s: float | None = None,
        stdin: str | None = None,
        *,
        env: Mapping[str, str] | None = None,
        pass_fds: Sequence[int] = (),
    ) -> ExecResult:
        """Run ``cmd`` with ``/bin/sh -c`` in the workspace; kill everything after ``timeout_s``.

        ``env`` adds environment variables for this command only. ``pass_fds`` are host file
        descriptors the command inherits (same numbers); with them, or with ``stdin``, the
        command runs in a one-shot bwrap rather than the session.
        """
        cmd = env_prefix(env) + cmd
        timeout = self.cfg.timeout_s if timeout_s is None else timeout_s
        if not timeout > 0:
            raise ValueError(f"timeout_s={timeout_s} must be > 0 (seconds of wall-clock time)")
        if not self._finalizer.alive:
            raise RuntimeError("exec on a closed sandbox; create a new BwrapSandbox")
        if "\0" in cmd:  # what a shell would refuse too; not worth failing the session over
            return ExecResult(2, "", "sandbox: the command contains a NUL byte\n", False, 0.0)
        with self._lock:
            if self.persistent and stdin is None and not pass_fds:
                return self._exec_session(cmd, timeout)
            if self._base is not None:
                self._res.end_session()  # a one-shot bwrap mounts the same upper layer
            return self._exec_once(cmd, timeout, stdin, tuple(pass_fds))

    def _exec_session(self, cmd: str, timeout: float) -> ExecResult:
        start = time.monotonic()
        session = self._session()
        code, out, err, problem = session.run(cmd.encode("utf-8", "surrogateescape"), timeout)
        if problem:
            proc = session.proc
            self._res.end_session()
            if problem != "timeout":
                err += f"\n[sandbox: the session's command server {'died' if problem == 'died' else 'sent garbage'}"
                err += (
                    " during this command; the next command starts a new session (files kept, /tmp lost)]\n"
                )
            code = proc.returncode if problem != "timeout" and proc.returncode else -signal.SIGKILL
        assert code is not None
        return ExecResult(code, out, err, problem == "timeout", time.monotonic() - start)

    def _exec_once(
        self, cmd: str, timeout: float, stdin: str | None, pass_fds: tuple[int, ...]
    ) -> ExecResult:
        start = time.monotonic()
        run = self._limits() + f'ulimit -t {math.ceil(timeout) + 1} 2>/dev/null; exec /bin/sh -c "$1"'
        proc = self._launch(
            ["/bin/sh", "-c", run, "sandbox-sh", cmd],
            stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            pass_fds=pass_fds,
        )
        try:
            data = stdin.encode() if stdin is not None else None
            out, err, timed_out = _pump(proc, data, start + timeout)
            if not timed_out:  # output closed; the command may still be running
                try:
                    proc.wait(timeout=max(0.0, start + timeout - time.monotonic()))
                except subprocess.TimeoutExpired:
                    timed_out = True
        finally:
            _kill_group(proc)
            proc.wait()
            for f in (proc.stdin, proc.stdout, proc.stderr):
                if f is not None:
                    f.close()
            with contextlib.suppress(ValueError):
                self._res.procs.remove(proc)
        return ExecResult(proc.returncode, out, err, timed_out, time.monotonic() - start)

    def spawn(
        self,
        cmd: str,
        *,
        stdin: int | IO[bytes] | None = None,
        stdout: int | IO[bytes] | None = None,
        stderr: int | IO[bytes] | None = None,
        pass_fds: Sequence[int] = (),
    ) -> subprocess.Popen[bytes]:
        """Start ``cmd`` in a one-shot bwrap over this workspace and return at once.

        The caller waits for or kills the process (its group: ``os.killpg(p.pid, SIGKILL)``);
        :meth:`close` kills it if it still runs. No wall timeout applies; the rlimits do, with
        ``RLIMIT_CPU`` at ``cfg.timeout_s`` + 1 s. Not available with ``base``.
        """
        if self._base is not None:
            raise ValueError("spawn: not available for a sandbox with base (its session owns the overlay)")
        if not self._finalizer.alive:
            raise RuntimeError("spawn on a closed sandbox; create a new BwrapSandbox")
        run = (
            self._limits()
            + f'ulimit -t {math.ceil(self.cfg.timeout_s) + 1} 2>/dev/null; exec /bin/sh -c "$1"'
        )
        with self._lock:
            return self._launch(
                ["/bin/sh", "-c", run, "sandbox-sh", cmd],
                stdin=subprocess.DEVNULL if stdin is None else stdin,
                stdout=stdout,
                stderr=stderr,
                pass_fds=tuple(pass_fds),
            )

    # ----------------------------------------------------------------- host-side file access
    def _view(self) -> str:
        """Host path of the workspace as the sandbox sees it (``base``: through the session)."""
        if self._base is None:
            return self._ws
        with self._lock:
            return f"/proc/{self._session(mounted=True).proc.pid}/root{self._layers[2]}"

    def _host_path(self, path: str) -> str:
        """Host path of workspace-relative ``path``; no absolute paths, ``..`` or symlinks."""
        parts = check_relative(path)
        cur = self._view()
        for part in parts:
            cur = os.path.join(cur, part)
            if os.path.islink(cur):
                raise ValueError(f"path {path!r} goes through the symlink {part!r}; refusing to follow it")
        return cur

    def write(self, path: str, content: str) -> None:
        """Write ``content`` (UTF-8) to workspace-relative ``path``, creating parent directories."""
        host = self._host_path(path)
        os.makedirs(os.path.dirname(host), exist_ok=True)
        fd = os.open(host, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(content)

    def read(self, path: str) -> str:
        """Content of workspace-relative ``path`` (invalid UTF-8 is replaced); must be a regular file."""
        host = self._host_path(path)
        fd = os.open(host, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        with os.fdopen(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                raise ValueError(f"path {path!r} is not a regular file")
            return f.read().decode("utf-8", errors="replace")

    def files(self) -> dict[str, str]:
        """UTF-8 text files of the workspace (relative path -> content), see the module limits."""
        out: dict[str, str] = {}
        top = self._view()
        for dirpath, dirnames, filenames in os.walk(top, followlinks=False):
            dirnames[:] = sorted(d for d in dirnames if d not in SKIPPED_DIRS)
            for name in sorted(filenames):
                if len(out) >= MAX_LISTED_FILES:
                    return out
                host = os.path.join(dirpath, name)
                text = _read_text(host)
                if text is not None:
                    out[os.path.relpath(host, top).replace(os.sep, "/")] = text
        return out

    def diff(self) -> WorkspaceDiff:
        """Text files added, modified and deleted since creation (``base``: since the base directory).

        Without ``base`` the reference is the ``files`` given at construction. With ``base`` only
        the overlay's upper layer (what the sandbox changed) is walked: a file copied up but
        unchanged is not reported; a whiteout or an opaque directory deletes what the base had there.
        """
        if self._base is None:
            return diff_files(self._initial, self.files())
        with self._lock:
            out = _overlay_diff(self._base, self._layers[0])
        for path, text in self._initial.items():  # seeded files belong to the base
            for changed in (out.added, out.modified):
                if changed.get(path) == text:
                    del changed[path]
        return out

    def seed(self, files: Mapping[str, str]) -> None:
        """Write ``files`` as part of the base: :meth:`diff` does not report them (a pooled sandbox
        receives its task's files this way after it was created and started)."""
        for path, content in files.items():
            self.write(path, content)
        self._initial.update(files)

    def fork(self) -> BwrapSandbox:
        """A new sandbox (same config and network, no extra binds) whose workspace starts as this one's.

        Without ``base`` the workspace is copied (``cp -a``); with ``base`` the fork shares the
        base and copies only this sandbox's upper layer, so forking a large repository costs
        what the session changed. The fork's :meth:`diff` is relative to the same base as this
        sandbox's, so right after the fork both report the same diff.
        """
        if not self._finalizer.alive:
            raise RuntimeError("fork of a closed sandbox")
        with self._lock:
            child = BwrapSandbox(
                None,
                self.cfg,
                self.network,
                base=self._base,
                persistent=self.persistent,
                use_agent=self._agent is not None,
            )
            try:
                src, dst = (self._layers[0], child._layers[0]) if self._base else (self._ws, child._ws)
                res = subprocess.run(  # a workspace copy; a stuck filesystem ends as an error, not a hang
                    ["cp", "-a", "--reflink=auto", f"{src}/.", dst],
                    capture_output=True,
                    text=True,
                    timeout=600,
                )
                if res.returncode != 0:
                    raise RuntimeError(f"fork: copying the workspace failed: {res.stderr.strip()}")
                child._initial = dict(self._initial)
            except BaseException:
                child.close()
                raise
            return child

    def close(self) -> None:
        """End the session, kill anything else still running and remove the workspace (idempotent)."""
        session = self._res.session.proc if self._res.session is not None else None
        for proc in list(self._res.procs):
            if proc is not session:
                _kill_group(proc)
        self._finalizer()
