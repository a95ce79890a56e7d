"""A persistent, isolated workspace for untrusted code, built on bubblewrap (``bwrap``).

Contract: :class:`BwrapSandbox` implements :class:`shipyard.envs.types.Sandbox`. It owns a fresh
host temp directory (the workspace) that every command sees read-write at ``/workspace`` (the
working directory), so files persist across :meth:`~BwrapSandbox.exec` calls. Each ``exec`` runs
``/bin/sh -c CMD`` in new namespaces (``--unshare-all``: user, pid, ipc, uts, cgroup and network
unless ``network=True``) with all capabilities dropped, a cleared environment, a read-only view
of the system (``/usr``, ``/bin``, ``/lib*``, a few ``/etc`` files and the running Python
installation, so ``python`` is this interpreter with pytest importable), a fresh size-capped
tmpfs ``/tmp`` and ``/dev/shm``, and a read-only root. Nothing outside the workspace (and
``/tmp``, ``/dev/shm``, extra ``binds``) is writable; host paths that are not bound do not exist
inside. Inside, the command runs as uid 0 of its user namespace, mapped to the caller's uid
(files it writes belong to the caller). Needs Linux and bubblewrap >= 0.6
(:func:`sandbox_available` says what is missing).

Limits per ``exec``: ``RLIMIT_AS`` = ``cfg.memory_mb``, ``RLIMIT_FSIZE`` = :data:`MAX_FILE_MB`,
``RLIMIT_CPU`` = the wall timeout rounded up plus 1 s, no core files; the wall timeout
(``cfg.timeout_s`` unless given) kills the whole process tree: bwrap runs in its own process
group, killing it makes the sandbox's pid-1 die (``--die-with-parent``) and the kernel then
kills every process in the sandbox's pid namespace. A command never outlives its ``exec``
(background jobs die with it). stdout and stderr are each capped at :data:`OUTPUT_CAP` bytes
(head and tail kept, a marker says how much was cut).

Process-count limit (``cfg.max_processes``): ``RLIMIT_NPROC`` is counted per real user and
is never enforced for a process whose host uid is 0 (the kernel exempts ``INIT_USER``), and
a user namespace created by root maps the sandbox to host uid 0, so when we run as root the
rlimit alone does nothing (measured here, kernel 6.18 as root: 200 forks succeed under
``ulimit -u 20``). The sandbox
therefore uses, in order: a ``pids`` cgroup made for this sandbox when one can be created
(cgroup v1 ``pids`` hierarchy, or v2 where our cgroup delegates ``pids``), which also counts
threads; else ``RLIMIT_NPROC`` set inside the sandbox (effective when the host uid is not 0);
else none. :attr:`BwrapSandbox.process_limit` says which (``"cgroup"``, ``"rlimit"``,
``"none"``); ``RLIMIT_NPROC`` is set inside in every case as defence in depth (the ``"rlimit"``
path is untested here: our tests run as root, where the cgroup is used). The cgroup lives from
construction to :meth:`~BwrapSandbox.close`; a host process killed hard leaves an empty
``shipyard-sb-*`` cgroup directory behind. The rlimits and the cgroup move are applied in the
forked child before ``exec`` of bwrap (``preexec_fn`` doing plain syscalls only).

Host-side access (:meth:`write`, :meth:`read`, :meth:`files`) never follows symlinks and
rejects absolute paths and ``..``, so sandboxed code cannot make the host read or write
outside the workspace; it relies on no sandboxed process running while it is called (true
because ``exec`` is synchronous and kills everything it started).

Limits not covered: no seccomp filter (the kernel's full syscall surface is reachable from an
unprivileged user namespace); memory is limited per process, not per sandbox (worst case about
``max_processes * memory_mb`` plus the two tmpfs); the workspace is a host directory without a disk quota (bounded
only by ``RLIMIT_FSIZE`` per file and the timeout); ``--die-with-parent`` is tied to the
calling thread, which ``exec`` keeps alive by blocking until the command ends.

Example::

    with BwrapSandbox({"solution.py": "print(1)"}, SandboxConfig(timeout_s=5)) as sb:
        res = sb.exec("python solution.py")      # ExecResult(returncode=0, stdout='1\\n', ...)
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import resource
import selectors
import shlex
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Mapping
from types import TracebackType

from shipyard.config.schema import SandboxConfig
from shipyard.envs.types import ExecResult

WORKDIR = "/workspace"
"""Where the workspace is mounted inside the sandbox (also the working directory and HOME)."""
OUTPUT_CAP = 64 * 1024
"""Bytes of stdout (and separately stderr) kept per exec: the first and last halves."""
MAX_FILE_MB = 16
"""RLIMIT_FSIZE: largest file a sandboxed process may write."""
TMPFS_MB = 64
"""Size of the sandbox's private /tmp and /dev/shm."""
MAX_TEXT_FILE_BYTES = 1024 * 1024
"""Files larger than this are left out of :meth:`BwrapSandbox.files`."""
MAX_LISTED_FILES = 2000
"""At most this many files are returned by :meth:`BwrapSandbox.files` (in sorted path order)."""
SKIPPED_DIRS = frozenset({"__pycache__", ".pytest_cache", ".mypy_cache", ".ruff_cache", ".git"})
"""Directory names whose contents :meth:`BwrapSandbox.files` leaves out."""

_ETC_FILES = ("ld.so.cache", "ld.so.conf", "ld.so.conf.d", "passwd", "group", "nsswitch.conf", "localtime")
_ETC_NET_FILES = ("hosts", "resolv.conf", "host.conf", "gai.conf", "ssl", "ca-certificates")
_ROOT_LINKS = ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
_CG_ROOT = "/sys/fs/cgroup"
_RESERVED = frozenset({"usr", "bin", "sbin", "lib", "lib32", "lib64", "libx32", "etc", "proc", "dev", "tmp"})
_INSTALL_HINT = (
    "install bubblewrap (Debian/Ubuntu: `apt-get install bubblewrap`; Fedora: `dnf install bubblewrap`; "
    "Arch: `pacman -S bubblewrap`)"
)


@functools.lru_cache(maxsize=1)
def sandbox_available() -> str | None:
    """None when sandboxes can run here, else a message saying what is missing and how to fix it."""
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        return f"bubblewrap (`bwrap`) is not on PATH: {_INSTALL_HINT}"
    probe = [bwrap, "--unshare-all", "--die-with-parent", "--ro-bind", "/", "/"]
    probe += ["--size", "1048576", "--tmpfs", "/tmp", "--remount-ro", "/", "true"]
    try:
        res = subprocess.run(probe, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"running `{shlex.join(probe)}` failed: {exc}"
    if res.returncode != 0 and "size" in res.stderr:
        return f"this bwrap is too old ({res.stderr.strip()}): bubblewrap >= 0.6 is needed; {_INSTALL_HINT}"
    if res.returncode != 0:
        return (
            f"bwrap cannot create namespaces here ({res.stderr.strip()}): allow unprivileged user "
            "namespaces (e.g. `sysctl kernel.unprivileged_userns_clone=1`, or on Ubuntu 24.04+ "
            "`sysctl kernel.apparmor_restrict_unprivileged_userns=0`) or run in a container that permits them"
        )
    return None


class _Capture:
    """Keeps the first and last ``cap // 2`` bytes of a stream and counts what was cut between."""

    def __init__(self, cap: int) -> None:
        self.head_cap = cap // 2
        self.tail_cap = cap - self.head_cap
        self.head = bytearray()
        self.tail = bytearray()
        self.total = 0

    def add(self, data: bytes) -> None:
        self.total += len(data)
        room = self.head_cap - len(self.head)
        if room > 0:
            self.head += data[:room]
            data = data[room:]
        if data:
            self.tail += data
            if len(self.tail) > 2 * self.tail_cap:
                del self.tail[: len(self.tail) - self.tail_cap]

    def text(self) -> str:
        tail = bytes(self.tail[-self.tail_cap :]) if self.tail_cap else b""
        cut = self.total - len(self.head) - len(tail)
        mid = f"\n[... {cut} bytes truncated ...]\n".encode() if cut > 0 else b""
        return (bytes(self.head) + mid + tail).decode("utf-8", errors="replace")


def _pump(proc: subprocess.Popen[bytes], stdin: bytes | None, deadline: float) -> tuple[str, str, bool]:
    """Feed stdin, drain stdout/stderr (capped) until both close or the deadline passes."""
    assert proc.stdout is not None and proc.stderr is not None
    caps = {proc.stdout.fileno(): _Capture(OUTPUT_CAP), proc.stderr.fileno(): _Capture(OUTPUT_CAP)}
    sel = selectors.DefaultSelector()
    for f in (proc.stdout, proc.stderr):
        os.set_blocking(f.fileno(), False)
        sel.register(f.fileno(), selectors.EVENT_READ)
    pending = memoryview(stdin or b"")
    if proc.stdin is not None:
        os.set_blocking(proc.stdin.fileno(), False)
        if pending:
            sel.register(proc.stdin.fileno(), selectors.EVENT_WRITE)
        else:
            proc.stdin.close()
    timed_out = False
    reading = 2
    while reading:
        left = deadline - time.monotonic()
        if left <= 0 and not timed_out:
            timed_out = True
            _kill_group(proc)
            deadline = time.monotonic() + 5.0  # the pid namespace is gone; drain what is buffered
            continue
        if left <= 0:
            break
        for key, _ in sel.select(timeout=min(left, 1.0)):
            fd = key.fd
            if fd in caps:
                chunk = os.read(fd, 65536)
                if chunk:
                    caps[fd].add(chunk)
                else:
                    sel.unregister(fd)
                    reading -= 1
            else:
                assert proc.stdin is not None
                try:
                    pending = pending[os.write(fd, pending[:65536]) :]
                except BrokenPipeError:
                    pending = pending[:0]
                if not pending:
                    sel.unregister(fd)
                    proc.stdin.close()
    sel.close()
    out, err = caps[proc.stdout.fileno()].text(), caps[proc.stderr.fileno()].text()
    return out, err, timed_out


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)


def _cgroup_candidates() -> list[str]:
    """Directories of this process's cgroups whose children could get a ``pids.max``."""
    try:
        with open("/proc/self/cgroup") as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    v1 = [ln.split(":", 2)[2] for ln in lines if ln.count(":") >= 2 and "pids" in ln.split(":")[1].split(",")]
    v2 = [ln.split(":", 2)[2] for ln in lines if ln.startswith("0::")]
    out = [os.path.join(_CG_ROOT, "pids", p.lstrip("/")) for p in v1]
    for p in v2:
        for base in (_CG_ROOT, os.path.join(_CG_ROOT, "unified")):
            out.append(os.path.join(base, p.lstrip("/")))
    return [d for d in out if os.path.isfile(os.path.join(d, "cgroup.procs"))]


def _make_pids_cgroup(max_processes: int) -> str | None:
    """Create a cgroup limited to ``max_processes`` tasks; None where no controller lets us."""
    for parent in _cgroup_candidates():
        path = os.path.join(parent, f"shipyard-sb-{os.getpid()}-{uuid.uuid4().hex[:12]}")
        try:
            os.mkdir(path)
        except OSError:
            continue
        try:
            with open(os.path.join(path, "pids.max"), "w") as f:
                f.write(str(max_processes))
            return path
        except OSError:
            _remove_cgroup(path)
    return None


def _remove_cgroup(path: str) -> None:
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


def _cleanup(workdir: str, cgroup: str | None) -> None:
    if cgroup is not None:
        _remove_cgroup(cgroup)

    def _onerror(func: Callable[..., object], path: str, _exc: object) -> None:
        try:
            os.chmod(os.path.dirname(path), 0o700)
            func(path)
        except OSError:
            pass

    shutil.rmtree(workdir, onerror=_onerror)


def _python_roots() -> list[str]:
    """The Python installation(s) to bind read-only: venv prefix and base prefix, outside /usr."""
    roots: list[str] = []
    for p in (sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix):
        for q in (os.path.abspath(p), os.path.realpath(p)):
            if q != "/" and not q.startswith("/usr/") and q != "/usr" and q not in roots:
                roots.append(q)
    roots.sort(key=len)
    return [r for r in roots if not any(r != o and r.startswith(o + "/") for o in roots)]


def _system_args(network: bool) -> list[str]:
    args = ["--ro-bind", "/usr", "/usr"]
    for path in _ROOT_LINKS:
        if os.path.islink(path):
            args += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            args += ["--ro-bind", path, path]
    for name in _ETC_FILES + (_ETC_NET_FILES if network else ()):
        if os.path.exists(os.path.join("/etc", name)):
            args += ["--ro-bind", os.path.join("/etc", name), os.path.join("/etc", name)]
    return args


class BwrapSandbox:
    """One persistent sandboxed workspace; see the module docstring for isolation and limits.

    ``binds`` maps extra host directories (which must exist) to absolute sandbox paths, mounted
    read-write; the grader uses it for a report directory made fresh per grading.
    """

    def __init__(
        self,
        files: Mapping[str, str] | None = None,
        cfg: SandboxConfig | None = None,
        network: bool = False,
        *,
        binds: Mapping[str, str] | None = None,
    ) -> None:
        problem = sandbox_available()
        if problem is not None:
            raise RuntimeError(problem)
        self.cfg = cfg if cfg is not None else SandboxConfig()
        self.network = network
        self._binds = dict(binds or {})
        for host, inside in self._binds.items():
            if not os.path.isdir(host):
                raise ValueError(f"binds: host directory {host!r} does not exist; create it first")
            top = inside.split("/")[1] if inside.startswith("/") else ""
            if not top or top in _RESERVED or top == WORKDIR.strip("/"):
                raise ValueError(
                    f"binds: sandbox path {inside!r} must be absolute, outside system dirs and the workspace"
                )
        self._bwrap = shutil.which("bwrap") or "bwrap"
        self.root = tempfile.mkdtemp(prefix="shipyard-sb-")
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[bytes] | None = None
        self._cgroup = _make_pids_cgroup(self.cfg.max_processes)
        self._finalizer = weakref.finalize(self, _cleanup, self.root, self._cgroup)
        if self._cgroup is not None:
            self.process_limit = "cgroup"
        else:
            self.process_limit = "rlimit" if os.getuid() != 0 else "none"
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

    # ----------------------------------------------------------------- running commands
    def _argv(self, cmd: str) -> list[str]:
        py_bin = os.path.dirname(os.path.abspath(sys.executable))
        path = ":".join(dict.fromkeys([py_bin, "/usr/local/bin", "/usr/bin", "/bin"]))
        argv = [self._bwrap, "--unshare-all"] + (["--share-net"] if self.network else [])
        argv += ["--die-with-parent", "--new-session", "--cap-drop", "ALL", "--hostname", "sandbox"]
        argv += _system_args(self.network)
        size = str(TMPFS_MB * 1024 * 1024)
        argv += ["--size", size, "--tmpfs", "/tmp", "--proc", "/proc", "--dev", "/dev"]
        argv += ["--size", size, "--tmpfs", "/dev/shm", "--remount-ro", "/dev"]
        for root in _python_roots():
            argv += ["--ro-bind", root, root]
        argv += ["--bind", self.root, WORKDIR]
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
        n = self.cfg.max_processes
        limit = f'ulimit -u {n} 2>/dev/null || ulimit -p {n} 2>/dev/null; exec /bin/sh -c "$1"'
        return argv + ["/bin/sh", "-c", limit, "sandbox-sh", cmd]

    def _preexec(self, timeout_s: float) -> Callable[[], None]:
        mem = self.cfg.memory_mb * 1024 * 1024
        fsize = MAX_FILE_MB * 1024 * 1024
        cpu = math.ceil(timeout_s) + 1
        procs = os.path.join(self._cgroup, "cgroup.procs") if self._cgroup else None

        def apply() -> None:  # runs in the forked child: plain syscalls only
            if procs is not None:
                fd = os.open(procs, os.O_WRONLY)
                try:
                    os.write(fd, b"0")
                finally:
                    os.close(fd)
            resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
            resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
            resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu))
            resource.setrlimit(resource.RLIMIT_CORE, (0, 0))

        return apply

    def exec(self, cmd: str, timeout_s: float | None = None, stdin: str | None = None) -> ExecResult:
        """Run ``cmd`` with ``/bin/sh -c`` in the workspace; kill everything after ``timeout_s``."""
        timeout = self.cfg.timeout_s if timeout_s is None else timeout_s
        if not timeout > 0:
            raise ValueError(f"timeout_s={timeout_s} must be > 0 (seconds of wall-clock time)")
        if not self._finalizer.alive:
            raise RuntimeError("exec on a closed sandbox; create a new BwrapSandbox")
        if "\0" in cmd:  # what a shell would refuse too; not worth failing the session over
            return ExecResult(2, "", "sandbox: the command contains a NUL byte\n", False, 0.0)
        with self._lock:
            start = time.monotonic()
            proc = subprocess.Popen(
                self._argv(cmd),
                stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,
                preexec_fn=self._preexec(timeout),
            )
            self._proc = proc
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
                self._proc = None
            return ExecResult(proc.returncode, out, err, timed_out, time.monotonic() - start)

    # ----------------------------------------------------------------- host-side file access
    def _host_path(self, path: str) -> str:
        """Host path of workspace-relative ``path``; no absolute paths, ``..`` or symlinks."""
        parts = [p for p in path.replace("\\", "/").split("/") if p not in ("", ".")]
        if not path or path.startswith("/") or not parts or ".." in parts:
            raise ValueError(f"path {path!r} must be relative to the workspace, without '..'")
        cur = self.root
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
        for dirpath, dirnames, filenames in os.walk(self.root, followlinks=False):
            dirnames[:] = sorted(d for d in dirnames if d not in SKIPPED_DIRS)
            for name in sorted(filenames):
                if len(out) >= MAX_LISTED_FILES:
                    return out
                host = os.path.join(dirpath, name)
                text = _read_text(host)
                if text is not None:
                    out[os.path.relpath(host, self.root).replace(os.sep, "/")] = text
        return out

    def close(self) -> None:
        """Kill anything still running and remove the workspace (idempotent)."""
        proc = self._proc
        if proc is not None:
            _kill_group(proc)
        self._finalizer()


def _read_text(host: str) -> str | None:
    """Content of a regular, small, NUL-free UTF-8 file (never following links), else None."""
    try:
        st = os.lstat(host)
        if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_TEXT_FILE_BYTES:
            return None
        fd = os.open(host, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        with os.fdopen(fd, "rb") as f:
            data = f.read(MAX_TEXT_FILE_BYTES + 1)
    except OSError:
        return None
    if len(data) > MAX_TEXT_FILE_BYTES or b"\0" in data:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None
