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
- Tiers (``scavenge``, a :class:`~shipyard.config.schema.ScavengeConfig` with ``enabled``): a call whose
  requests all have ``priority = "scavenger"`` is scavenger work; every other call is production.
  Production is admitted first. While production is *active* (a production row running or waiting,
  or one finished less than ``resume_after_s`` ago) scavenger rows may hold at most
  ``rows_with_production`` slots; otherwise all of them. When production arrives, the scavenger rows
  over that allowance (the most recently admitted first) are preempted at the next decode step
  (``mode = "preempt"``): each goes back to the front of the scavenger queue as a continuation (its
  prompt plus the tokens so far; the caller gets one result, the parts joined, exactly as sampled),
  or they run to their end (``mode = "finish"``). Scavenger prompt tokens prefilled at one step boundary
  are capped at ``prefill_tokens``, since a prefill cannot be interrupted; tokens the engine's prefix
  cache holds are not counted (a continuation's own keys/values were kept when it was preempted, so it
  resumes by forwarding one token). A prompt longer than the cap is prefilled in pieces of
  ``prefill_tokens``, one per step boundary, through the prefix cache (:meth:`BatchScheduler._chunk`;
  without a prefix cache it goes in whole, alone).
  :attr:`BatchScheduler.tier_stats` counts each tier's generated tokens and the scavenger's
  preemptions and yields (seconds from a production arrival to the last preempted row leaving).
  Limits: a continuation samples with a fresh seed (``seed + tokens so far`` when the request had
  one), presence/frequency penalties do not see the first part, and a stop string split across the
  preemption point is not matched.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field, replace
from functools import partial

from shipyard.config.schema import ScavengeConfig
from shipyard.inference.engine.batch import Job
from shipyard.inference.engine.engine import EmbeddedEngine
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
    """One ``submit`` call: its requests, those not yet admitted, and the results so far."""

    def __init__(
        self,
        requests: list[GenerateRequest],
        ticket: Ticket,
        on_token: OnToken | None,
        long: bool,
        scavenger: bool,
    ) -> None:
        self.requests = requests
        self.ticket = ticket
        self.on_token = on_token
        self.long = long
        self.scavenger = scavenger
        self.pending: deque[int] = deque(range(len(requests)))
        """Indices to admit next: in order, then preempted ones (at the front) as continuations."""
        self.started = False
        self.parts: list[GenerateResult | None] = [None] * len(requests)
        """What preempted rows sampled before they were preempted (joined into their final result)."""
        self.results: list[GenerateResult | None] = [None] * len(requests)
        self.left = len(requests)

    def request(self, i: int) -> GenerateRequest:
        """Request ``i`` as admitted now: itself, or its continuation after a preemption."""
        part = self.parts[i]
        if part is None:
            return self.requests[i]
        req, n = self.requests[i], len(part.token_ids)
        params = replace(req.params, max_tokens=req.params.max_tokens - n)
        if params.seed is not None:
            params.seed += n
        return replace(
            req, prompt_ids=req.prompt_ids + part.token_ids, params=params, prompt_routes=part.routes
        )

    def job(self, i: int, release: Callable[[GenerateResult], bool], preempted: Callable[[], bool]) -> Job:
        hook = None if self.on_token is None else partial(self.on_token, i)
        stop = self.ticket.stop.is_set

        def cancelled() -> bool:
            return stop() or preempted()

        return Job(self.request(i), partial(self.resolve, i, release), cancelled, hook)

    def resolve(self, i: int, release: Callable[[GenerateResult], bool], result: GenerateResult) -> None:
        if release(result):  # preempted: it goes on later as a continuation
            return
        if (part := self.parts[i]) is not None:
            result = _joined(part, result)
        self.results[i] = result
        self.left -= 1
        if self.left == 0:
            with contextlib.suppress(InvalidStateError):  # failed meanwhile (close, engine error)
                self.ticket.set_result([r for r in self.results if r is not None])


def _joined(first: GenerateResult, rest: GenerateResult) -> GenerateResult:
    """One result from a preempted row's part and its continuation's."""
    top = None
    if first.top_logprobs is not None and rest.top_logprobs is not None:
        top = first.top_logprobs + rest.top_logprobs
    return GenerateResult(
        token_ids=first.token_ids + rest.token_ids,
        logprobs=first.logprobs + rest.logprobs,
        versions=first.versions + rest.versions,
        finish_reason=rest.finish_reason,
        routes=rest.routes,
        top_logprobs=top,
        cached_tokens=first.cached_tokens,
    )


@dataclass(eq=False)
class _Running:
    """A scavenger row in the engine; ``marked_at``: when production asked for its slot."""

    marked_at: float | None = None
    preempted: bool = False
    """Asked to stop at the next decode step (``mode = "preempt"``)."""


@dataclass
class TierStats:
    """Counters of a tiered scheduler (``BatchScheduler.tier_stats``)."""

    production_tokens: int = 0
    scavenger_tokens: int = 0
    production_requests: int = 0
    scavenger_requests: int = 0
    preemptions: int = 0
    """Scavenger rows preempted (each resumed later as a continuation)."""
    prefill_chunks: int = 0
    """Pieces of scavenger prompts prefilled ahead of their rows (each samples one token, discarded)."""
    production_busy_s: float = 0.0
    """Seconds with a production request waiting or running (the rest of the time the server had no
    production work: the idle capacity scavengers may take)."""
    quiet_periods: int = 0
    """Times the last production request ended (the server went from busy to idle)."""
    resume_wait_s: float = 0.0
    """Idle seconds before a scavenger row was admitted again, summed over quiet periods (the
    ``resume_after_s`` hold and the wait for a step boundary; a quiet period that ended before any
    scavenger came back counts whole): idle capacity no rollout used. It counts whether or not
    scavenger work was waiting."""
    yields_s: deque[float] = field(default_factory=lambda: deque(maxlen=10_000))
    """Per production arrival that found scavenger rows over their allowance: seconds until the last
    of them left the batch (the newest 10,000)."""

    def as_dict(self) -> dict[str, float | int | list[float]]:
        return {**self.__dict__, "yields_s": list(self.yields_s)}


class BatchScheduler:
    """Feeds concurrent ``submit`` calls into one continuous-batching ``engine.serve`` loop (module doc)."""

    def __init__(
        self,
        engine: EmbeddedEngine,
        gather_window_s: float = 0.005,
        idle_poll_s: float = 0.05,
        short_tokens: int = 256,
        reserved_slots: int | None = None,
        scavenge: ScavengeConfig | None = None,
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
        self.scavenge = scavenge if scavenge is not None and scavenge.enabled else None
        self.tier_stats = TierStats()
        self._long_running = 0
        self._production_running = 0
        self._production_open = 0
        """Production requests submitted and not yet finished (queued or running)."""
        self._busy_since = 0.0
        self._quiet_since: float | None = None
        """When the last production request ended, until a scavenger row or production comes back."""
        self._production_seen = float("-inf")
        """When production was last running or waiting (monotonic seconds)."""
        self._scavengers: list[_Running] = []
        """Scavenger rows in the engine, in admission order."""
        self._yield_marks: list[list[_Running]] = []
        """Per production arrival that found scavenger rows over their allowance: those rows, until all left."""
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
        scavenger = self.scavenge is not None and all(r.priority == "scavenger" for r in requests)
        with self._cond:
            if self._closed:
                raise SchedulerClosed("the scheduler is closed")
            self._queue.append(_Item(requests, ticket, on_token, long, scavenger))
            if self.scavenge is not None and not scavenger:
                self._production_seen = time.monotonic()
                self._production_opened(len(requests))
                self._preempt_excess()
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
            if item.started or item.ticket.set_running_or_notify_cancel():
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
            self._production_closed(sum(item.left for item in self._inflight if not item.scavenger))
            self._inflight, self._long_running, self._production_running = [], 0, 0
            self._scavengers, self._yield_marks = [], []

    def _take(self, free: int, idle: bool) -> list[Job] | None:
        """The engine's admission hook: up to ``free`` queued requests; None when closed or idle and empty."""
        with self._cond:
            if self._closed or (idle and not self._queue):
                return None
            if idle:
                self._gather()
            if self._closed:
                return None
            jobs = self._pop(free)
            if idle and not jobs:  # only scavenger work, held back for now: wait for a change
                self._cond.wait(self.idle_poll_s)
            return jobs

    def _waiting(self) -> int:
        return sum(len(item.pending) for item in self._queue)

    def _gather(self) -> None:
        """Wait (holding the condition) up to the gather window for more requests to arrive."""
        deadline = time.monotonic() + self.gather_window_s
        while not self._closed and self._waiting() < self.engine.max_batch:
            left = deadline - time.monotonic()
            if left <= 0:
                return
            self._cond.wait(left)

    def _pop(self, free: int) -> list[Job]:
        """Up to ``free`` queued requests: production first, each tier in arrival order, long ones only
        within their share of slots, scavenger rows within their allowance and prefill budget."""
        jobs: list[Job] = []
        self._inflight = [item for item in self._inflight if not item.ticket.done()]
        self._drop_cancelled()
        production = [item for item in self._queue if not item.scavenger]
        if production:
            self._production_seen = time.monotonic()
        for item in production:
            self._admit(item, free - len(jobs), jobs)
        room = min(free - len(jobs), self._scavenger_room())
        budget = self.scavenge.prefill_tokens if self.scavenge is not None else 0
        first = True  # one scavenger row always goes in, whatever its prompt's length
        for item in [item for item in self._queue if item.scavenger]:
            if room <= 0 or budget <= 0:
                break
            admitted, spent = self._admit(item, room, jobs, budget, first)
            room -= len(admitted)
            budget -= spent
            first = first and not admitted
        return jobs

    def _admit(
        self, item: _Item, free: int, jobs: list[Job], budget: int | None = None, first: bool = True
    ) -> tuple[list[Job], int]:
        """Admit up to ``free`` of ``item``'s pending requests into ``jobs``; with a ``budget``, only
        while the prompt tokens they prefill fit in it (past it only the ``first`` row of the step);
        returns those admitted and the tokens they prefill (0 without a budget)."""
        new: list[Job] = []
        if free <= 0 or (item.long and self._long_running >= self.long_slots):
            return new, 0  # its share is full: shorter requests behind it go first
        if not item.started:
            if not item.ticket.set_running_or_notify_cancel():
                self._queue.remove(item)  # Future.cancel()ed by its caller before it ran
                if not item.scavenger:
                    self._production_closed(len(item.requests))
                return new, 0
            item.started = True
            self._inflight.append(item)
        spent = 0
        while item.pending and len(new) < free:
            if item.long and self._long_running >= self.long_slots:
                break
            i = item.pending[0]
            if budget is not None:  # a scavenger row: its uncached prompt tokens count
                req = item.request(i)
                cost = self.engine.prefill_cost(req.prompt_ids)
                if (new or not first) and budget < spent + cost:
                    break
                if cost > budget and self.engine.prefix is not None:
                    new.append(self._chunk(req, cost, budget))  # the row stays queued
                    spent += budget
                    break
                spent += cost
            item.pending.popleft()
            new.append(self._job(item, i))
        if not item.pending:
            self._queue.remove(item)
        jobs += new
        return new, spent

    def _chunk(self, req: GenerateRequest, cost: int, budget: int) -> Job:
        """A job that prefills the next ``budget`` uncached tokens of ``req``'s prompt and samples one
        token (discarded): the engine keeps the keys/values of that piece in its prefix cache, so the
        row's prompt costs ``budget`` fewer tokens at the next boundary. A long prompt is prefilled
        this way one piece per step boundary, never holding production up for more than one piece."""
        cut = len(req.prompt_ids) - cost + budget
        piece = replace(req, prompt_ids=req.prompt_ids[:cut], params=replace(req.params, max_tokens=1))
        self._end_quiet()
        self.tier_stats.prefill_chunks += 1
        return Job(piece, lambda _: None)

    def _job(self, item: _Item, i: int) -> Job:
        """The engine job of ``item``'s request ``i`` with its bookkeeping (tier counts, preemption)."""
        self._long_running += item.long
        if not item.scavenger:
            self._production_running += 1
            return item.job(i, partial(self._release, item, i, None), lambda: False)
        running = _Running()
        self._end_quiet()
        self._scavengers.append(running)
        return item.job(i, partial(self._release, item, i, running), lambda: running.preempted)

    def _scavenger_room(self) -> int:
        """How many more scavenger rows may be admitted now."""
        if self.scavenge is None:
            return self.engine.max_batch
        return self._allowance() - len(self._scavengers)

    def _allowance(self) -> int:
        """Most scavenger rows allowed in the batch now (module doc: production active or not)."""
        assert self.scavenge is not None
        quiet = time.monotonic() - self._production_seen >= self.scavenge.resume_after_s
        if self._production_running == 0 and quiet:
            return self.engine.max_batch
        return self.scavenge.rows_with_production

    def _production_opened(self, n: int) -> None:
        if self._production_open == 0:
            self._busy_since = time.monotonic()
            self._end_quiet()
        self._production_open += n

    def _end_quiet(self) -> None:
        """A scavenger row or production came back after a quiet period: count the wait."""
        if self._quiet_since is not None:
            self.tier_stats.resume_wait_s += time.monotonic() - self._quiet_since
            self._quiet_since = None

    def _production_closed(self, n: int) -> None:
        """``n`` production requests finished, failed or were dropped (tiers on only)."""
        if self.scavenge is None or n == 0:
            return
        self._production_open -= n
        if self._production_open == 0:
            self._quiet_since = time.monotonic()
            self.tier_stats.production_busy_s += self._quiet_since - self._busy_since
            self.tier_stats.quiet_periods += 1

    def _preempt_excess(self) -> None:
        """Production arrived: the scavenger rows over the allowance (newest first) must give their
        slots back: preempted at the next step, or (``finish``) left to end; the yield is timed."""
        assert self.scavenge is not None
        live = [r for r in self._scavengers if r.marked_at is None]
        excess = len(live) - self.scavenge.rows_with_production
        if excess <= 0:
            return
        now = time.monotonic()
        marked = live[-excess:]
        for r in marked:
            r.marked_at, r.preempted = now, self.scavenge.mode == "preempt"
        self._yield_marks.append(marked)

    def _drop_cancelled(self) -> None:
        """Remove cancelled items: one never started fails; one partly started resolves with its
        started rows (each ends with ``abort`` at the next step), the rest never run."""
        for item in [item for item in self._queue if item.ticket.stop.is_set()]:
            self._queue.remove(item)
            if not item.scavenger:
                self._production_closed(len(item.pending))
            if not item.started:
                if item.ticket.set_running_or_notify_cancel():
                    item.ticket.set_exception(SchedulerClosed("cancelled by the caller before it ran"))
                continue
            for i in item.pending:  # a preempted row answers with what it had sampled
                item.results[i] = item.parts[i]
            item.left -= len(item.pending)
            item.pending.clear()
            if item.left == 0:  # its started rows are all done already
                with contextlib.suppress(InvalidStateError):
                    item.ticket.set_result([r for r in item.results if r is not None])

    def _release(self, item: _Item, i: int, running: _Running | None, result: GenerateResult) -> bool:
        """A row left the engine: free its slot and count it; True when it was preempted and went
        back to the queue as a continuation (so ``item.resolve`` does not resolve it)."""
        with self._cond:
            self._long_running -= item.long
            stats = self.tier_stats
            if running is None:
                self._production_running -= 1
                self._production_seen = time.monotonic()
                self._production_closed(1)
                stats.production_tokens += len(result.token_ids)
                stats.production_requests += 1
                return False
            self._scavengers.remove(running)
            stats.scavenger_tokens += len(result.token_ids)
            self._note_yields()
            part = item.parts[i]
            sampled = len(result.token_ids) + (0 if part is None else len(part.token_ids))
            left = item.requests[i].params.max_tokens - sampled
            if (
                not running.preempted
                or result.finish_reason != "abort"
                or item.ticket.stop.is_set()
                or left <= 0
            ):
                stats.scavenger_requests += 1
                return False
            stats.preemptions += 1
            item.parts[i] = result if part is None else _joined(part, result)
            item.pending.appendleft(i)
            if item not in self._queue:
                self._queue.appendleft(item)
            self._cond.notify_all()
        return True

    def _note_yields(self) -> None:
        """Record each production arrival whose preempted rows have all left the batch."""
        now = time.monotonic()
        for marks in list(self._yield_marks):
            if all(r not in self._scavengers for r in marks):
                self.tier_stats.yields_s.append(now - marks[0].marked_at)
                self._yield_marks.remove(marks)
