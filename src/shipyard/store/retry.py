"""Retrying a store call while the store cannot be reached (a region cut off from the origin).

Contract: :func:`until_reachable` calls ``call`` until it returns, retrying on ``TimeoutError`` and
``ConnectionError`` (what every :class:`~shipyard.store.types.Store` raises for an unreachable
store) with a doubling wait capped at ``max_wait_s``, and printing each miss. Anything else (a
missing key, a refused run) propagates at once. It gives up, re-raising the last error, when
``stop`` is set or after ``deadline_s``. Limits: a call that hangs without raising is not cut short
here; the store's own timeouts bound it.

Example::

    until_reachable(lambda: store.put(key, data), f"batch {key}", stop=worker.stop_event)
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def until_reachable(
    call: Callable[[], T],
    what: str,
    stop: threading.Event | None = None,
    deadline_s: float | None = None,
    max_wait_s: float = 30.0,
) -> T:
    """``call()``, retried while the store is unreachable (see the module docstring)."""
    stop = stop or threading.Event()
    end = None if deadline_s is None else time.monotonic() + deadline_s
    wait = 1.0
    while True:
        try:
            return call()
        except (TimeoutError, ConnectionError) as e:
            if stop.is_set() or (end is not None and time.monotonic() + wait > end):
                raise
            print(f"store unreachable for {what} ({e}); again in {wait:.0f} s", flush=True)
            stop.wait(wait)
            wait = min(2 * wait, max_wait_s)
