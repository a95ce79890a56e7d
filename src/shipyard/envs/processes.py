"""Process facts the sandbox and services packages share (they stand alone otherwise).

Contract: :func:`pid_alive` says whether a process exists, also one this process may not signal
(another user's, e.g. a PostgreSQL server run as ``nobody``). Used to reap what dead processes
left: sandbox workspaces and cgroups, PostgreSQL clusters.
"""

from __future__ import annotations

import os


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists (signal 0: ``ESRCH`` means gone, ``EPERM`` means alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
