"""The sandbox interface every backend implements, and the small helpers backends share.

Contract: a sandbox is one isolated workspace with a persistent session, created by its
backend's constructor (or :func:`shipyard.envs.sandbox.make_sandbox` from a config) with the
workspace's starting files. :class:`shipyard.envs.types.Sandbox` (the one sandbox interface) is
what the rest of Shipyard may call:

- ``exec(cmd, timeout_s=None, stdin=None, *, env=None)``: run ``/bin/sh -c cmd`` in the
  workspace (also the working directory) with extra environment variables ``env``; after
  ``timeout_s`` (the backend's default when None) the command's whole process tree is killed
  and the result says ``timed_out``. Commands see the files earlier commands wrote.
- ``read`` / ``write``: one UTF-8 file by workspace-relative path (no absolute paths, no
  ``..``); ``files()``: the workspace's text files.
- ``diff()``: what changed since the base the sandbox was created from (its starting files,
  a base directory, files given to ``seed``) as a :class:`~shipyard.envs.types.WorkspaceDiff`.
- ``fork()``: a new, independent sandbox whose workspace starts as a copy of this one's.
- ``close()``: kill everything, release every resource (idempotent); also ``with`` blocks.

Backends: :mod:`.bwrap` (embedded default), :mod:`.microvm` (Firecracker, needs hardware KVM)
and :mod:`.remote_morph` (Morph Cloud). A backend that cannot run on this host raises
:class:`SandboxUnavailable` from its constructor with what is missing and how to get it.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Mapping

from shipyard.envs.types import WorkspaceDiff

_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class SandboxUnavailable(RuntimeError):
    """This backend cannot run here; the message says what is missing and how to get it."""


def env_prefix(env: Mapping[str, str] | None) -> str:
    """``export K='V'; ...`` for a shell command; rejects names a shell could misread."""
    if not env:
        return ""
    parts = []
    for key, value in env.items():
        if not _ENV_NAME.match(key):
            raise ValueError(f"env: variable name {key!r} must match [A-Za-z_][A-Za-z0-9_]*")
        if "\0" in value:
            raise ValueError(f"env: the value of {key} contains a NUL byte")
        parts.append(f"export {key}={shlex.quote(value)}; ")
    return "".join(parts)


def check_relative(path: str) -> list[str]:
    """The parts of a workspace-relative path; ValueError for absolute paths, ``..`` or empty."""
    parts = [p for p in path.replace("\\", "/").split("/") if p not in ("", ".")]
    if not path or path.startswith("/") or not parts or ".." in parts:
        raise ValueError(f"path {path!r} must be relative to the workspace, without '..'")
    return parts


def diff_files(base: Mapping[str, str], now: Mapping[str, str]) -> WorkspaceDiff:
    """The diff between two file maps (relative path -> text)."""
    out = WorkspaceDiff()
    for path in sorted(now):
        if path not in base:
            out.added[path] = now[path]
        elif base[path] != now[path]:
            out.modified[path] = now[path]
    out.deleted = sorted(p for p in base if p not in now)
    return out
