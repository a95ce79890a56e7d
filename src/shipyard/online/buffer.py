"""The gateway's write-behind buffer: served requests never wait for, or fail because of, the database.

Contract: :meth:`LogBuffer.add_generation` and :meth:`LogBuffer.add_feedback` only append to memory
and return at once; one writer thread drains the buffer into a :class:`~shipyard.online.types.LogSink`
in batches of at most ``batch_max`` (one transaction each, generations before the feedback that may
name them). A failed write keeps its batch and retries it after ``retry_s``, doubling up to
``retry_max_s``, with a fresh sink (a new connection) each time: a database that is down for a while
loses nothing while the buffer holds. The buffer holds at most ``buffer_max`` records:

- a generation record arriving at a full buffer pushes out the oldest buffered generation record,
  counted in ``dropped_overflow`` (the served request itself is never affected);
- a feedback event is never dropped: :meth:`add_feedback` returns False when the buffer is full,
  and the gateway answers 503 so the client retries it (with the same event id, so it counts once).

:meth:`stats` has the counters (``buffered``, ``written_generations``, ``written_feedback``,
``duplicate_feedback``, ``dropped_overflow``, ``write_errors``, ``last_error``, ``sink_up``).
:meth:`close` flushes what it can within its timeout and says how many records it could not write.
"""

from __future__ import annotations

import collections
import itertools
import threading
import time
from collections.abc import Callable
from typing import Any

from shipyard.config.schema import GatewayConfig
from shipyard.online.types import FeedbackEvent, GenerationRecord, LogSink


class LogBuffer:
    """Bounded, retried, write-behind logging (module doc)."""

    def __init__(self, open_sink: Callable[[], LogSink], cfg: GatewayConfig) -> None:
        self.open_sink, self.cfg = open_sink, cfg
        self._gens: collections.deque[GenerationRecord] = collections.deque()
        self._feedback: collections.deque[FeedbackEvent] = collections.deque()
        self._cond = threading.Condition()
        self._closing = False
        self._close_deadline = 0.0
        self._sink: LogSink | None = None
        self.counters = collections.Counter[str]()
        self.last_error = ""
        self._thread = threading.Thread(target=self._run, name="log-writer", daemon=True)
        self._thread.start()

    def _size(self) -> int:
        return len(self._gens) + len(self._feedback)

    def add_generation(self, record: GenerationRecord) -> None:
        with self._cond:
            if self._size() >= self.cfg.buffer_max:
                if self._gens:
                    self._gens.popleft()
                self.counters["dropped_overflow"] += 1
                if self._size() >= self.cfg.buffer_max:  # all feedback: the new record cannot fit
                    self._cond.notify_all()
                    return
            self._gens.append(record)
            self._cond.notify_all()  # all: the writer and anyone in wait()

    def add_feedback(self, events: list[FeedbackEvent]) -> bool:
        """Buffer ``events`` (all or none); False when they do not fit (the caller retries later)."""
        with self._cond:
            room = self.cfg.buffer_max - len(self._feedback)
            if len(events) > room:
                self.counters["feedback_refused_full"] += len(events)
                return False
            while self._size() + len(events) > self.cfg.buffer_max and self._gens:
                self._gens.popleft()  # feedback outranks a generation record
                self.counters["dropped_overflow"] += 1
            self._feedback.extend(events)
            self._cond.notify_all()
            return True

    def _take(self) -> tuple[list[GenerationRecord], list[FeedbackEvent]]:
        n = self.cfg.batch_max
        gens = list(itertools.islice(self._gens, n))
        fb = list(itertools.islice(self._feedback, n - len(gens)))
        return gens, fb

    def _run(self) -> None:
        delay = self.cfg.retry_s
        while True:
            with self._cond:
                while not self._size() and not self._closing:
                    self._cond.wait()
                if not self._size():
                    return
                gens, fb = self._take()
            try:
                new = self._write(gens, fb)
            except Exception as e:  # the database is down or refused: keep the batch, retry
                self._sink = None
                with self._cond:
                    self.counters["write_errors"] += 1
                    self.last_error = f"{type(e).__name__}: {e}"[:500]
                    self._cond.notify_all()
                    if self._closing and self._close_deadline < time.time():
                        return
                time.sleep(delay)  # new records do not shorten the backoff
                delay = min(delay * 2, self.cfg.retry_max_s)
                continue
            delay = self.cfg.retry_s
            with self._cond:
                self._drop_written(gens, fb)
                self.counters["written_generations"] += len(gens)
                self.counters["written_feedback"] += new
                self.counters["duplicate_feedback"] += len(fb) - new
                self._cond.notify_all()

    def _write(self, gens: list[GenerationRecord], fb: list[FeedbackEvent]) -> int:
        if self._sink is None:
            self._sink = self.open_sink()
        new = 0
        if gens:
            self._sink.write_generations(gens)
        if fb:
            new = self._sink.write_feedback(fb)
        return new

    def _drop_written(self, gens: list[GenerationRecord], fb: list[FeedbackEvent]) -> None:
        """Remove the written batch from the buffer's front (overflow may have dropped part of it)."""
        written = {id(g) for g in gens}
        while self._gens and id(self._gens[0]) in written:
            self._gens.popleft()
        for _ in fb:
            self._feedback.popleft()  # feedback is never dropped, so the batch is still the front

    def stats(self) -> dict[str, Any]:
        with self._cond:
            return {
                **self.counters,
                "buffered": self._size(),
                "last_error": self.last_error,
                "sink_up": self._sink is not None,
            }

    def wait(self, until: Callable[[dict[str, Any]], bool], timeout_s: float = 30.0) -> bool:
        """Wait until ``until(stats())`` holds (checked whenever the buffer or its counters change);
        False if ``timeout_s`` passed first."""
        with self._cond:
            return self._cond.wait_for(lambda: until(self.stats()), timeout_s)

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait until everything buffered so far is written; False if ``timeout_s`` passed first."""
        return self.wait(lambda s: s["buffered"] == 0, timeout_s)

    def close(self, timeout_s: float = 10.0) -> int:
        """Flush for up to ``timeout_s``, stop the writer; returns the records left unwritten."""
        self._close_deadline = time.time() + timeout_s
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._thread.join(timeout_s + 1)
        with self._cond:
            left = self._size()
        if callable(close := getattr(self._sink, "close", None)):
            close()
        return left
