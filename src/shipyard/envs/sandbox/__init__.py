"""Sandboxes: isolated, persistent workspaces for untrusted code, behind one interface.

Contract: :class:`~shipyard.envs.types.Sandbox` is the interface (create, exec with
stdin/env/timeout, read, write, files, diff against the base, fork, close). Backends, one file
each: :mod:`.bwrap` (bubblewrap, hardened; the embedded default, with its helpers :mod:`.agent`,
the compiled session server, :mod:`.sysroot`, the read-only system view, :mod:`.seccomp` and
:mod:`.cgroups`), :mod:`.microvm` (Firecracker,
needs hardware KVM, reports clearly what is missing where it cannot run) and
:mod:`.remote_morph` (Morph Cloud's REST API). :func:`make_sandbox` builds the one a config's
``type`` names; :class:`~shipyard.envs.sandbox.pool.SandboxPool` keeps sandboxes pre-warmed and
caps concurrent commands. Everything importable from the old single module
``shipyard.envs.sandbox`` (``BwrapSandbox``, ``sandbox_available``, ``reap_stale``, the limits)
is re-exported here.

Example::

    cfg = SandboxConfig(type="bwrap", timeout_s=5)
    with make_sandbox(cfg, {"solution.py": "print(1)"}) as sb:
        sb.exec("python solution.py").stdout      # '1\\n'
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from shipyard.config.schema import SandboxConfig
from shipyard.envs.sandbox.base import SandboxUnavailable
from shipyard.envs.sandbox.bwrap import (
    MAX_FILE_MB,
    MAX_LISTED_FILES,
    TMPFS_MB,
    WORKDIR,
    BwrapSandbox,
    sandbox_available,
)
from shipyard.envs.sandbox.overlay import MAX_TEXT_FILE_BYTES, SKIPPED_DIRS
from shipyard.envs.sandbox.process import OUTPUT_CAP
from shipyard.envs.sandbox.reaper import reap_stale
from shipyard.envs.types import Sandbox

__all__ = [
    "MAX_FILE_MB",
    "MAX_LISTED_FILES",
    "MAX_TEXT_FILE_BYTES",
    "OUTPUT_CAP",
    "SKIPPED_DIRS",
    "TMPFS_MB",
    "WORKDIR",
    "BwrapSandbox",
    "Sandbox",
    "SandboxUnavailable",
    "make_sandbox",
    "reap_stale",
    "sandbox_available",
]


def make_sandbox(
    cfg: SandboxConfig,
    files: Mapping[str, str] | None = None,
    *,
    network: bool = False,
    base: str | None = None,
    binds: Mapping[str, str] | None = None,
    ro_binds: Sequence[str] = (),
) -> Sandbox:
    """A new sandbox of the backend ``cfg.type`` names, holding ``files``.

    ``network`` gives the sandbox network access (the task asks for it); ``base`` is a host
    directory the workspace forks copy-on-write, ``binds`` host directories mounted inside
    (a service lease's socket) and ``ro_binds`` host directories mounted read-only at their own
    paths (a harness's virtualenv): all bwrap only, a ValueError naming ``sandbox.type`` elsewhere.
    Raises :class:`~shipyard.envs.sandbox.base.SandboxUnavailable` when the backend cannot run here.
    """
    if cfg.type == "bwrap":
        problem = sandbox_available()
        if problem is not None:
            raise SandboxUnavailable(problem)
        return BwrapSandbox(files, cfg, network, base=base, binds=binds, ro_binds=ro_binds)
    if base is not None or binds or ro_binds:
        raise ValueError(
            f"sandbox.type={cfg.type!r} cannot mount host directories (a repository base or a service "
            "socket) into its sandboxes; repo and db tasks need sandbox.type='bwrap'"
        )
    if cfg.type == "microvm":
        from shipyard.envs.sandbox.microvm import MicroVMSandbox

        return MicroVMSandbox(files, cfg, network)
    if cfg.type == "remote_morph":
        from shipyard.envs.sandbox.remote_morph import MorphSandbox

        return MorphSandbox(files, cfg, network)
    raise ValueError(f"sandbox.type {cfg.type!r} is unknown; use 'bwrap', 'microvm' or 'remote_morph'")
