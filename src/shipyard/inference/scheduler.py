"""The batching scheduler: concurrent callers share one continuous-batching engine loop, fairly.

Contract: :class:`BatchScheduler` queues requests from any number of threads and feeds them to
one worker thread running :meth:`EmbeddedEngine.serve` (continuous batching): at every decode step
the engine's free slots are filled from the queue, and a caller's future is resolved once all its
requests have finished, while the others keep decoding. N concurrent single-sequence calls
therefore share one batch, and a request arriving mid-generation joins it at the next step. When
the engine is idle, the first arrival waits ``gather_window_s`` for others (stopping early once
``max_batch`` sequences are waiting) so they share one prefill. While idle it calls
``engine.apply_pending()`` every ``idle_poll_s`` so staged weights go live without traffic.

- Fairness: a request is *long* when its ``max_tokens`` exceeds ``short_tokens``. Long rows may
  hold at most ``max_batch - reserved_slots`` slots (``reserved_slots`` defaults to a quarter of
  ``max_batch``, 0 below 4 slots); the reserved ones serve short requests, which
  are admitted ahead of long ones that cannot run yet (arrival order otherwise). So a short request
  never waits behind long generations for a slot: it waits at most one decode step.
- Cancellation: :meth:`submit` returns a :class:`Ticket`; ``ticket.cancel()`` (a client that went
  away) drops the requests still queued and ends the running ones at the next decode step with
  ``finish_reason = "abort"`` (their tokens so far). ``on_token`` streams each sampled token.
- Shutdown: :meth:`close` stops admitting, lets running rows finish for up to ``drain_s``, then
  cancels the rest (they end with ``abort``); queued requests fail with :class:`SchedulerClosed`.
- A failure inside the engine fails every caller with a request in flight; the worker then goes
  on serving the queue.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from functools import partial

from shipyard.inference.engine import EmbeddedEngine, Job
from shipyard.inference.types import GenerateRequest, GenerateResult

OnToken = Callable[[int, int, float, "list[tuple[int, float]] | None"], None]
"""``(request index, token id, logprob, top logprobs)``, called on the engine's thread."""


class SchedulerClosed(RuntimeError):
    """The scheduler was closed before (or instead of) running a request."""


class Ticket(Future):  # type: ignore[type-arg]
    """The future of one :meth:`BatchScheduler.submit` call, with :meth:`cancel_requests`."""

    def __init__(self) -> None:
        super().__init__()
        self.stop = threading.Event()

    def cancel_requests(self) -> None:
        """End this call's requests: queued ones never run, running ones stop at the next step."""
        self.stop.set()


class _Item:
    """One ``submit`` call: its requests, how many were admitted, and the results so far."""

    def __init__(
        self, requests: list[GenerateRequest], ticket: Ticket, on_token: OnToken | None, long: bool
    ) -> None:
        self.requests = requests
        self.ticket = ticket
        self.on_token = on_token
        self.long = long
        self.admitted = 0
        self.results: list[GenerateResult | None] = [None] * len(requests)
        self.left = len(requests)

    def job(self, i: int, release: Callable[[], None]) -> Job:
        hook = None if self.on_token is None else partial(self.on_token, i)
        return Job(self.requests[i], partial(self.resolve, i, release), self.ticket.stop.is_set, hook)

    def resolve(self, i: int, release: Callable[[], None], result: GenerateResult) -> None:
        release()
        self.results[i] = result
        self.left -= 1
        if self.left == 0:
            with contextlib.suppress(InvalidStateError):  # failed meanwhile (close, engine error)
                self.ticket.set_result([r for r in self.results if r is not None])


class BatchScheduler:
    """Feeds concurrent ``submit`` calls into one continuous-batching ``engine.serve`` loop (module doc)."""

    def __init__(
        self,
        engine: EmbeddedEngine,
        gather_window_s: float = 0.005,
        idle_poll_s: float = 0.05,
        short_tokens: int = 256,
        reserved_slots: int | None = None,
    ) -> None:
        if gather_window_s < 0 or idle_poll_s <= 0:
            raise ValueError(
                f"gather_window_s={gather_window_s} must be >= 0 and idle_poll_s={idle_poll_s} > 0"
            )
        reserved = engine.max_batch // 4 if reserved_slots is None else reserved_slots
        if not 0 <= reserved < engine.max_batch:
            raise ValueError(f"reserved_slots={reserved} must be in [0, max_batch={engine.max_batch})")
        self.engine = engine
        self.gather_window_s = gather_window_s
        self.idle_poll_s = idle_poll_s
        self.short_tokens = short_tokens
        self.long_slots = engine.max_batch - reserved
        self._long_running = 0
        self._queue: deque[_Item] = deque()
        self._cond = threading.Condition()
        self._closed = False
        self._thread: threading.Thread | None = None
        self._inflight: list[_Item] = []
        """Items with a request admitted into the engine and a future not yet resolved (worker thread only)."""

    def start(self) -> BatchScheduler:
        """Start the worker thread (idempotent)."""
        with self._cond:
            if self._closed:
                raise SchedulerClosed("the scheduler is closed")
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="shipyard-batcher", daemon=True)
                self._thread.start()
        return self

    def submit(self, requests: list[GenerateRequest], on_token: OnToken | None = None) -> Ticket:
        """Queue ``requests`` (validated now, so a bad one fails alone); the ticket gets their results."""
        self.engine.validate(requests)
        ticket = Ticket()
        if not requests:
            ticket.set_result([])
            return ticket
        self.start()
        long = max(r.params.max_tokens for r in requests) > self.short_tokens
        with self._cond:
            if self._closed:
                raise SchedulerClosed("the scheduler is closed")
            self._queue.append(_Item(requests, ticket, on_token, long))
            self._cond.notify_all()
        return ticket

    def generate(self, requests: list[GenerateRequest]) -> list[GenerateResult]:
        """Blocking ``submit``: the results of ``requests`` once they have all finished."""
        return self.submit(requests).result()

    def close(self, drain_s: float = 5.0) -> None:
        """Stop admitting; running rows get ``drain_s`` to finish, then are cancelled (``abort``);
        queued requests fail with SchedulerClosed."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(drain_s)
            if thread.is_alive():
                for item in list(self._inflight):
                    item.ticket.cancel_requests()
                thread.join(30.0)
        with self._cond:
            leftover, self._queue = list(self._queue), deque()
        for item in leftover:  # never admitted, or admitted in part when the admissions stopped
            if item.admitted > 0 or item.ticket.set_running_or_notify_cancel():
                with contextlib.suppress(InvalidStateError):
                    item.ticket.set_exception(
                        SchedulerClosed("inference server shut down before all requests ran")
                    )

    def _run(self) -> None:
        while True:
            with self._cond:
                if not self._queue and not self._closed:
                    self._cond.wait(self.idle_poll_s)
                if self._closed:
                    return
                busy = bool(self._queue)
            try:  # serve returns (releasing the engine) once idle with an empty queue
                if busy:
                    self.engine.serve(self._take)
                else:
                    self.engine.apply_pending()
            except Exception as e:  # the failure belongs to the callers with requests in flight
                self._fail_inflight(e)

    def _fail_inflight(self, e: Exception) -> None:
        for item in self._inflight:
            with contextlib.suppress(InvalidStateError):
                item.ticket.set_exception(e)
        with self._cond:  # a partly admitted item lost its running rows: it failed as a whole
            self._queue = deque(item for item in self._queue if item not in self._inflight)
            self._inflight, self._long_running = [], 0

    def _take(self, free: int, idle: bool) -> list[Job] | None:
        """The engine's admission hook: up to ``free`` queued requests; None when closed or idle and empty."""
        with self._cond:
            if self._closed or (idle and not self._queue):
                return None
            if idle:
                self._gather()
            return None if self._closed else self._pop(free)

    def _waiting(self) -> int:
        return sum(len(item.requests) - item.admitted for item in self._queue)

    def _gather(self) -> None:
        """Wait (holding the condition) up to the gather window for more requests to arrive."""
        deadline = time.monotonic() + self.gather_window_s
        while not self._closed and self._waiting() < self.engine.max_batch:
            left = deadline - time.monotonic()
            if left <= 0:
                return
            self._cond.wait(left)

    def _pop(self, free: int) -> list[Job]:
        """Up to ``free`` queued requests: arrival order, long ones only within their share of slots."""
        jobs: list[Job] = []
        self._inflight = [item for item in self._inflight if not item.ticket.done()]
        self._drop_cancelled()
        for item in list(self._queue):
            if len(jobs) >= free:
                break
            if item.long and self._long_running >= self.long_slots:
                continue  # its share is full: shorter requests behind it go first
            if item.admitted == 0:
                if not item.ticket.set_running_or_notify_cancel():
                    self._queue.remove(item)  # Future.cancel()ed by its caller before it ran
                    continue
                self._inflight.append(item)
            while item.admitted < len(item.requests) and len(jobs) < free:
                if item.long and self._long_running >= self.long_slots:
                    break
                jobs.append(item.job(item.admitted, partial(self._release, item.long)))
                self._long_running += item.long
                item.admitted += 1
            if item.admitted == len(item.requests):
                self._queue.remove(item)
        return jobs

    def _drop_cancelled(self) -> None:
        """Remove cancelled items: one never started fails; one partly started resolves with its
        started rows (each ends with ``abort`` at the next step), the rest never run."""
        for item in [item for item in self._queue if item.ticket.stop.is_set()]:
            self._queue.remove(item)
            if item.admitted == 0:
                if item.ticket.set_running_or_notify_cancel():
                    item.ticket.set_exception(SchedulerClosed("cancelled by the caller before it ran"))
                continue
            item.left -= len(item.requests) - item.admitted
            item.requests = item.requests[: item.admitted]
            if item.left == 0:  # its started rows are all done already
                with contextlib.suppress(InvalidStateError):
                    item.ticket.set_result([r for r in item.results if r is not None])

    def _release(self, long: bool) -> None:
        with self._cond:
            self._long_running -= long
