"""The read-only system view of a bubblewrap sandbox, with as few mounts as it can have.

Contract: :func:`system_args` returns the bwrap arguments that show a sandbox ``/usr``, the
``/bin``, ``/lib*`` links (or directories) of the host, and the few ``/etc`` entries a program
needs (:data:`ETC_FILES`; with ``network`` also :data:`ETC_NET_FILES`), all read-only. Every
bind mount costs bwrap a mount, a re-read of ``/proc/self/mountinfo`` and a remount, which is
most of a cold start, so the ``/etc`` entries are not bound one by one: they are copied once
into a host directory (:func:`etc_tree`, under ``$XDG_CACHE_HOME/shipyard/sandbox``, named by
the hash of what it holds, built atomically; a cached tree is reused only if we own all of it, none of
it is writable by others, and it still hashes to its name) that is bound at ``/etc`` in one mount; only the
large certificate directories of network sandboxes (:data:`ETC_NET_DIRS`) are still bound on top.
The copy follows the host: the stat signature (inode, size, mtime) of every copied entry is
checked at each :func:`system_args` call (microseconds), and a change makes a new tree.

Limits: a sandbox sees the host's ``/etc`` files as they were when the tree was made; a change
that keeps size and mtime (``touch -r``) is not noticed. Trees of earlier contents stay in the
cache directory (a few KiB each) until removed by hand.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import shutil
import tempfile
from pathlib import Path

ETC_FILES = ("ld.so.cache", "ld.so.conf", "ld.so.conf.d", "passwd", "group", "nsswitch.conf", "localtime")
"""Copied into every sandbox's ``/etc`` (a directory entry is copied with its files)."""
ETC_NET_FILES = ("hosts", "resolv.conf", "host.conf", "gai.conf")
"""Copied too when the sandbox has the network."""
ETC_NET_DIRS = ("ssl", "ca-certificates")
"""Bound (read-only, over the copied tree) when the sandbox has the network."""
ROOT_LINKS = ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
ETC = "/etc"


def cache_dir() -> Path:
    """``$XDG_CACHE_HOME/shipyard/sandbox`` (default ``~/.cache``): the agent binary and /etc trees."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "shipyard" / "sandbox"


def _signature(names: tuple[str, ...], etc: str) -> tuple[tuple[str, int, int, int], ...]:
    """(relative path, inode, size, mtime) of every existing entry (symlinks followed, directories walked)."""
    out = []
    for name in names:
        path = os.path.join(etc, name)
        try:
            st = os.stat(path)
        except OSError:
            continue
        out.append((name, st.st_ino, st.st_size, st.st_mtime_ns))
        if os.path.isdir(path):
            for entry in sorted(os.listdir(path)):
                with contextlib.suppress(OSError):
                    sub = os.stat(os.path.join(path, entry))
                    out.append((f"{name}/{entry}", sub.st_ino, sub.st_size, sub.st_mtime_ns))
    return tuple(out)


def _copy_entry(src: str, dst: str) -> None:
    if os.path.isdir(src):
        shutil.copytree(src, dst, symlinks=False)
    else:
        shutil.copyfile(src, dst)


def _tree_digest(root: str, mountpoints: tuple[str, ...]) -> str:
    """SHA-256 over the tree's file paths and contents (and the mountpoints it was made for)."""
    digest = hashlib.sha256(repr(mountpoints).encode())
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for fname in sorted(filenames):
            path = os.path.join(dirpath, fname)
            digest.update(os.path.relpath(path, root).encode() + b"\0" + Path(path).read_bytes() + b"\0")
    return digest.hexdigest()


def _trusted_tree(root: str, digest: str, mountpoints: tuple[str, ...]) -> bool:
    """An existing tree may be bound only if we own every entry, none is a symlink or writable by
    group or others, and it still holds exactly what its name says (its digest)."""
    uid = os.getuid()
    for dirpath, dirnames, filenames in os.walk(root):
        for path in [dirpath, *(os.path.join(dirpath, n) for n in dirnames + filenames)]:
            st = os.lstat(path)
            if st.st_uid != uid or st.st_mode & 0o022 or os.path.islink(path):
                return False
    return _tree_digest(root, mountpoints) == digest


@functools.lru_cache(maxsize=8)
def _build(signature: tuple[tuple[str, int, int, int], ...], mountpoints: tuple[str, ...], etc: str) -> str:
    """The tree for one signature: copy into a temp dir, hash what was copied, rename into place.

    A tree already in the cache under that digest is reused only if :func:`_trusted_tree`; else it
    is replaced by the fresh copy."""
    cache = cache_dir()
    try:
        cache.mkdir(parents=True, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=".etc-", dir=cache)
    except OSError as e:
        raise RuntimeError(
            f"sandbox /etc tree: cannot write {cache} ({e}); set XDG_CACHE_HOME to a writable directory"
        ) from e
    try:
        for name in dict.fromkeys(entry[0].split("/")[0] for entry in signature):
            _copy_entry(os.path.join(etc, name), os.path.join(tmp, name))
        digest = _tree_digest(tmp, mountpoints)
        for name in mountpoints:
            os.mkdir(os.path.join(tmp, name))
        for dirpath, _, filenames in os.walk(tmp):
            os.chmod(dirpath, 0o755)
            for fname in filenames:
                os.chmod(os.path.join(dirpath, fname), 0o444)
        target = cache / f"etc-{digest[:16]}"
        if target.is_dir() and not _trusted_tree(str(target), digest, mountpoints):
            stale = tempfile.mkdtemp(prefix=".etc-untrusted-", dir=cache)
            os.rename(target, os.path.join(stale, "tree"))
            shutil.rmtree(stale, ignore_errors=True)
        if not target.is_dir():
            with contextlib.suppress(OSError):  # a concurrent builder may have won: same content
                os.rename(tmp, target)
        return str(target)
    finally:
        if os.path.isdir(tmp):
            shutil.rmtree(tmp, ignore_errors=True)


def etc_tree(network: bool, etc: str = ETC) -> str:
    """Host directory to bind at ``/etc`` (made or reused; see the module docstring)."""
    names = ETC_FILES + (ETC_NET_FILES if network else ())
    mountpoints = tuple(d for d in ETC_NET_DIRS if network and os.path.isdir(os.path.join(etc, d)))
    tree = _build(_signature(names, etc), mountpoints, etc)
    if not os.path.isdir(tree):  # removed from the cache while we ran: make it again
        _build.cache_clear()
        tree = _build(_signature(names, etc), mountpoints, etc)
    return tree


@functools.lru_cache(maxsize=1)
def _root_args() -> tuple[str, ...]:
    args = ["--ro-bind", "/usr", "/usr"]
    for path in ROOT_LINKS:
        if os.path.islink(path):
            args += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            args += ["--ro-bind", path, path]
    return tuple(args)


def system_args(network: bool) -> list[str]:
    """bwrap arguments for the read-only system: ``/usr``, root links, ``/etc`` (see module docstring)."""
    args = [*_root_args(), "--ro-bind", etc_tree(network), ETC]
    for name in ETC_NET_DIRS if network else ():
        path = os.path.join(ETC, name)
        if os.path.isdir(path):
            args += ["--ro-bind", path, path]
    return args
