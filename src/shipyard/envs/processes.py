"""Process facts the sandbox and services packages share (they stand alone otherwise).

Contract: :func:`pid_alive` says whether a process runs, also one this process may not signal
(another user's, e.g. a PostgreSQL server run as ``nobody``); a zombie counts as dead. Used to reap what dead processes
left: sandbox workspaces and cgroups, PostgreSQL clusters.
"""

from __future__ import annotations

import os


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` runs (signal 0: ``ESRCH`` means gone, ``EPERM`` means it exists); a
    zombie (dead, not yet reaped by its parent, e.g. a killed server reparented to init) is not alive."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:  # gone since the signal
        return False
    except (OSError, IndexError):
        return True  # no /proc to ask: signal 0 said it exists
