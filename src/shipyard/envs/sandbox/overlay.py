"""Reading a sandbox workspace from the host: text files, and the diff of an overlay against its base.

Contract: :func:`_overlay_diff` reports what the overlay's upper directory adds, modifies and
deletes (whiteouts, opaque directories) relative to the read-only base; :func:`_read_text` reads one
file as text when it is UTF-8 and at most ``MAX_TEXT_FILE_BYTES``; directories in ``SKIPPED_DIRS``
are never listed.
"""

from __future__ import annotations

import contextlib
import os
import stat

from shipyard.envs.types import WorkspaceDiff

MAX_TEXT_FILE_BYTES = 1024 * 1024
"""Files larger than this are left out of :meth:`BwrapSandbox.files`."""


SKIPPED_DIRS = frozenset({"__pycache__", ".pytest_cache", ".mypy_cache", ".ruff_cache", ".git"})
"""Directory names whose contents :meth:`BwrapSandbox.files` leaves out."""


def _is_whiteout(st: os.stat_result) -> bool:
    return stat.S_ISCHR(st.st_mode) and st.st_rdev == 0


def _is_opaque(path: str) -> bool:
    for name in ("user.overlay.opaque", "trusted.overlay.opaque"):
        with contextlib.suppress(OSError):
            if os.getxattr(path, name, follow_symlinks=False) == b"y":
                return True
    return False


def _base_texts(base: str, rel: str) -> dict[str, str]:
    """Text files under ``base/rel`` (a file or a directory), by workspace-relative path."""
    top = os.path.join(base, rel)
    if not os.path.isdir(top) or os.path.islink(top):
        text = _read_text(top)
        return {} if text is None else {rel: text}
    out = {}
    for dirpath, dirnames, filenames in os.walk(top, followlinks=False):
        dirnames[:] = [d for d in dirnames if d not in SKIPPED_DIRS]
        for name in filenames:
            text = _read_text(os.path.join(dirpath, name))
            if text is not None:
                out[os.path.relpath(os.path.join(dirpath, name), base).replace(os.sep, "/")] = text
    return out


def _overlay_diff(base: str, upper: str) -> WorkspaceDiff:
    """The diff an overlay's upper layer makes to its lower directory ``base`` (text files)."""
    out = WorkspaceDiff()
    deleted: set[str] = set()
    for dirpath, dirnames, filenames in os.walk(upper, followlinks=False):
        rel_dir = os.path.relpath(dirpath, upper)
        rel_dir = "" if rel_dir == "." else rel_dir.replace(os.sep, "/")
        if rel_dir and _is_opaque(dirpath):
            kept = {os.path.join(rel_dir, n).replace(os.sep, "/") for n in filenames}
            deleted |= {p for p in _base_texts(base, rel_dir) if p not in kept}
        for name in list(dirnames) + filenames:
            host, rel = os.path.join(dirpath, name), f"{rel_dir}/{name}".lstrip("/")
            st = os.lstat(host)
            if _is_whiteout(st):
                deleted |= set(_base_texts(base, rel))
            elif name in filenames:
                text = _read_text(host)
                before = _read_text(os.path.join(base, rel))
                if text is not None and before is None and not os.path.lexists(os.path.join(base, rel)):
                    out.added[rel] = text
                elif text is not None and text != before:
                    out.modified[rel] = text
        dirnames[:] = [d for d in dirnames if d not in SKIPPED_DIRS]
    out.added, out.modified = dict(sorted(out.added.items())), dict(sorted(out.modified.items()))
    out.deleted = sorted(deleted)
    return out


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
