"""Weight subscriber: keeps an inference engine on the newest published version.

Contract: a background thread polls ``weights/LATEST`` every ``poll_s``; when it names a
version newer than the one adopted, it downloads and verifies it (the engine keeps serving the
old weights meanwhile) and hands the tensors to ``stage(version, tensors)``, which applies them
between decode steps. A failed download or digest mismatch is recorded in ``errors`` and
retried on the next poll; the engine keeps serving what it has.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from shipyard.store.types import Store
from shipyard.weights.snapshot import latest_version, load_version


class WeightSubscriber:
    def __init__(
        self,
        store: Store,
        stage: Callable[[int, dict[str, Any]], None],
        current: int = 0,
        poll_s: float = 0.5,
    ) -> None:
        self.store = store
        self.stage = stage
        self.current = current
        self.poll_s = poll_s
        self.errors: list[str] = []
        self.fetch_s: list[float] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def poll_once(self) -> bool:
        """Adopt LATEST if it is newer; True when a new version was staged."""
        v = latest_version(self.store)
        if v is None or v <= self.current:
            return False
        t0 = time.perf_counter()
        try:
            tensors = load_version(self.store, v)
        except (FileNotFoundError, ValueError) as e:
            self.errors.append(f"version {v}: {e}")
            return False
        self.fetch_s.append(time.perf_counter() - t0)
        self.stage(v, tensors)
        self.current = v
        return True

    def start(self) -> WeightSubscriber:
        self._thread = threading.Thread(target=self._run, name="weight-subscriber", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            self.poll_once()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
