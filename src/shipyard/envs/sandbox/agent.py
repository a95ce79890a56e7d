"""The compiled session agent (``agent.c``): built once per machine, run from a sealed memfd.

Contract: :func:`agent_fd` returns a file descriptor (close-on-exec: pass it in ``pass_fds``) of
a sealed, executable memfd holding the static ``shipyard-agent`` binary, or None when it cannot
be had here (:func:`agent_problem` says why: no C compiler, a failed build, memfd exec refused).
:class:`~shipyard.envs.sandbox.bwrap.BwrapSandbox` runs ``/proc/self/fd/N serve ...`` as the
session's command server inside the sandbox, instead of ``/bin/sh`` running
:data:`~shipyard.envs.sandbox.bwrap._SERVER` (same protocol, same statuses; the shell stays the
fallback). The agent starts in a fraction of a shell's time and is 0.03 MiB resident instead of
1.7 MiB.

Why a memfd: executing it through ``/proc/self/fd/N`` needs no mount in the sandbox (a bind mount
costs about as much as the agent's whole start), and its seals (``F_SEAL_WRITE``, ``SHRINK``,
``GROW``, ``SEAL``) make it immutable, so sandboxed code that reaches it through
``/proc/PID/exe`` cannot change what later sandboxes run; a binary on a host path would be
writable by the sandbox's uid (mapped to ours). One memfd serves every sandbox of the process.

Build: ``cc`` with :data:`CFLAGS` (static, freestanding: no C library, so it maps a few pages;
a static glibc build is 0.7 MiB resident, a shell's RSS is mostly shared libc pages) of
``agent.c`` into :func:`~.sysroot.cache_dir`, named by the hash of the source, the flags and
the compiler binary (path, size, mtime), written atomically; a cached binary not owned by us or
writable by others is rebuilt. Limits: Linux on x86_64 or aarch64 only; needs ``cc``, ``gcc`` or ``clang`` once.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

from shipyard.envs.sandbox import sysroot

SOURCE = Path(__file__).with_name("agent.c")
CFLAGS = (
    "-O2", "-static", "-nostdlib", "-ffreestanding", "-fno-stack-protector", "-fno-builtin",
    "-fno-tree-loop-distribute-patterns", "-fno-asynchronous-unwind-tables", "-s",
)  # fmt: skip
"""Freestanding static build: no C library, no stack protector (it would need libc's TLS)."""
_MFD_EXEC = 0x0010
"""memfd_create flag (Linux >= 6.3): executable memfd; older kernels reject it, then plain flags."""


def _compiler() -> str | None:
    for name in ("cc", "gcc", "clang"):
        path = shutil.which(name)
        if path is not None:
            return path
    return None


def _trusted(path: Path) -> bool:
    try:
        st = path.stat()
    except OSError:
        return False
    return st.st_uid == os.getuid() and not st.st_mode & 0o022


def build(cc: str, source: Path = SOURCE, cache: Path | None = None) -> Path:
    """Compile ``source`` statically with ``cc`` into the cache (reused when present); its path.

    Raises RuntimeError with the compiler's message when the build fails."""
    real = os.path.realpath(cc)
    st = os.stat(real)
    compiler = f"{real} {st.st_size} {st.st_mtime_ns} {' '.join(CFLAGS)}"  # keyed without starting cc
    digest = hashlib.sha256(source.read_bytes() + compiler.encode()).hexdigest()[:16]
    cache = cache or sysroot.cache_dir()
    target = cache / f"shipyard-agent-{digest}"
    if _trusted(target):
        return target
    cache.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".agent-", dir=cache)
    os.close(fd)
    try:
        res = subprocess.run(
            [cc, *CFLAGS, "-o", tmp, str(source)], capture_output=True, text=True, check=False, timeout=300
        )
        if res.returncode != 0:
            raise RuntimeError(f"`{cc} {' '.join(CFLAGS)} {source.name}` failed: {res.stderr.strip()[-500:]}")
        os.chmod(tmp, 0o555)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def sealed_memfd(binary: Path) -> int:
    """A sealed, executable memfd (close-on-exec) holding the bytes of ``binary``."""
    data = binary.read_bytes()
    flags = os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING
    try:
        fd = os.memfd_create("shipyard-agent", flags | _MFD_EXEC)
    except OSError:
        fd = os.memfd_create("shipyard-agent", flags)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        seals = fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _probe(fd: int) -> str | None:
    """None when ``/proc/self/fd/FD`` executes (its usage line, exit 2), else what went wrong."""
    try:
        res = subprocess.run(
            [f"/proc/self/fd/{fd}"], pass_fds=(fd,), capture_output=True, text=True, timeout=30, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"executing the agent from a memfd failed: {exc}"
    if res.returncode != 2 or "usage: agent" not in res.stderr:
        return f"the agent binary did not run (exit {res.returncode}: {res.stderr.strip()[:200]})"
    return None


_LOCK = threading.Lock()


def _load() -> tuple[int | None, str | None]:
    with _LOCK:  # pool threads may create their first sandboxes at once: one build, one memfd
        return _load_once()


@functools.lru_cache(maxsize=1)
def _load_once() -> tuple[int | None, str | None]:
    cc = _compiler()
    if cc is None:
        return None, "no C compiler (cc, gcc or clang) on PATH; sandboxes use the /bin/sh session server"
    try:
        fd = sealed_memfd(build(cc))
    except (OSError, RuntimeError) as exc:
        return None, f"building the session agent failed ({exc}); sandboxes use the /bin/sh session server"
    problem = _probe(fd)
    if problem is not None:
        os.close(fd)
        return None, problem
    return fd, None


def agent_fd() -> int | None:
    """The process-wide sealed memfd of the agent (built on first use), or None (:func:`agent_problem`)."""
    return _load()[0]


def agent_problem() -> str | None:
    """None when :func:`agent_fd` has an agent, else why not (and what the sandbox uses instead)."""
    return _load()[1]
