"""Progress of a run's components, and the watchdog that names the one that stopped making it.

Contract: a component (the trainer, a rollout worker, an inference server) holds a :class:`Beat`
from the run's :class:`Health` board and calls :meth:`Beat.enter` when it enters a phase (the
trainer: ``wait_rollouts``, ``forward_backward``, ``checkpoint``, ``publish``; a worker:
``sessions``; a server: ``decode``) and :meth:`Beat.tick` when it makes progress in
it (a session finished, a decode step). A phase named in ``IDLE_PHASES`` is never a stall (an idle
server, a finished component). :meth:`Health.stalled` lists the components whose phase has made no
progress for longer than their deadline; :class:`Watchdog` checks every ``check_s``, and for each
stall (once per stall) writes a line to ``<run_dir>/health.jsonl``, the stacks of the component's
threads (those that entered or ticked) and of every other thread to
``<run_dir>/logs/stall-<component>-<n>.txt``, names it on the console, and calls ``on_stall`` with the stall's record (component, phase,
``age_s``, ``deadline_s``, ``stacks``: the local placement stops the run with a
:class:`StallError` naming it, as threads of one process cannot be restarted). :meth:`Health.snapshot` is every component's last progress, phase and state,
written to ``health.jsonl`` every ``snapshot_s`` and when the watchdog stops (what ``shipyard
view`` shows).

Watched from outside. A process can watch itself only while it runs: a frozen process (SIGSTOP,
a host that stopped scheduling it) freezes its watchdog too. So a standalone process also runs a
:class:`Reporter` that publishes each component's record (with a ``reports`` count that grows
every ``report_s``) to its run's store under ``health/<component>.json`` (an inference server
answers it on ``/health`` instead), and a supervisor anywhere feeds those records to a
:class:`Monitor`: a component whose ``reports`` stop changing for ``silent_s`` is *silent*
(frozen, dead, or cut off from the store), one whose ``seq`` (its progress count) stops changing
for its deadline in a phase that is not idle is *stuck*. The monitor times both on its own
monotonic clock, from the moments it saw a value change: no wall clock of another host is
compared with its own, so a clock that jumps on either side names nothing and hides nothing.

Limits: a stall is a missing tick, not a wrong answer: a component that loops without progress
while ticking is not caught. A monitor names a silent component ``silent_s`` after it last saw a
report change, which is up to ``report_s`` (plus a slow store call) after the freeze.

Example::

    health = Health(deadline_s=600)
    beat = health.beat("trainer")
    beat.enter("forward_backward")
    loss.backward()  # the phase's work
    beat.tick()
"""

from __future__ import annotations

import json
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

IDLE_PHASES = frozenset({"idle", "waiting", "connecting", "done"})
"""Phases in which making no progress is expected (never a stall): an idle server, a worker waiting
on the version gate (the trainer it waits for is watched), a process waiting (with its own
deadline) for the server or store it needs, a finished component."""
STALL_EXIT = 3
"""The exit status of a process whose component stalled (:func:`exit_stalled`), so that its
supervisor restarts it."""


class StallError(RuntimeError):
    """A component made no progress within its deadline; the message names it and its phase."""


@dataclass
class Beat:
    """One component's progress (thread-safe: the component's threads write, the watchdog reads)."""

    component: str
    deadline_s: float
    phase: str = "starting"
    ticks: int = 0
    seq: int = 0
    """Progress events (phases entered and ticks): what a :class:`Monitor` watches change."""
    since: float = field(default_factory=time.monotonic)
    """When the component last entered a phase or made progress (monotonic seconds)."""
    at: float = field(default_factory=time.time)
    """The same moment, wall clock (for people and the viewer)."""
    threads: set[int] = field(default_factory=set)
    info: dict[str, object] = field(default_factory=dict)
    """What the component adds to its record (a server: the weight ``version`` it adopted)."""
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def enter(self, phase: str) -> None:
        """The component starts ``phase`` now (entering counts as progress)."""
        with self._lock:
            self.phase, self.since, self.at = phase, time.monotonic(), time.time()
            self.seq += 1
            self.threads.add(threading.get_ident())

    def tick(self, n: int = 1) -> None:
        """The component made ``n`` units of progress in its phase."""
        with self._lock:
            self.ticks += n
            self.seq += 1
            self.since, self.at = time.monotonic(), time.time()
            self.threads.add(threading.get_ident())

    def note(self, **fields: object) -> None:
        """Record ``fields`` in the component's record (not progress: the phase's clock goes on)."""
        with self._lock:
            self.info.update(fields)

    def age_s(self, now: float | None = None) -> float:
        """Seconds since the last progress."""
        return (time.monotonic() if now is None else now) - self.since

    def record(self) -> dict[str, object]:
        with self._lock:
            return {
                "component": self.component,
                "phase": self.phase,
                "ticks": self.ticks,
                "seq": self.seq,
                "last_progress_at": self.at,
                "age_s": round(self.age_s(), 3),
                "deadline_s": self.deadline_s,
                **self.info,
            }


class Health:
    """The run's board of :class:`Beat`\\ s, one per component."""

    def __init__(self, deadline_s: float, deadlines: dict[str, float] | None = None) -> None:
        """``deadline_s``: seconds without progress that make a stall; ``deadlines``: per component
        kind (the name before the first space: ``trainer``, ``worker``, ``server``) overrides."""
        self.deadline_s = deadline_s
        self.deadlines = dict(deadlines or {})
        self._beats: dict[str, Beat] = {}
        self._lock = threading.Lock()

    def beat(self, component: str) -> Beat:
        """The beat of ``component`` (made on first use; names are unique within a run)."""
        with self._lock:
            if component not in self._beats:
                kind = component.split(" ", 1)[0]
                self._beats[component] = Beat(component, self.deadlines.get(kind, self.deadline_s))
            return self._beats[component]

    def stalled(self) -> list[Beat]:
        """Components past their deadline in a phase that is not idle."""
        now = time.monotonic()
        with self._lock:
            beats = list(self._beats.values())
        return [b for b in beats if b.phase not in IDLE_PHASES and b.age_s(now) > b.deadline_s]

    def snapshot(self) -> list[dict[str, object]]:
        with self._lock:
            beats = list(self._beats.values())
        return [b.record() for b in beats]


def thread_stacks(first: set[int]) -> str:
    """Every thread's stack, those in ``first`` first (the stalled component's)."""
    names = {t.ident: t.name for t in threading.enumerate()}
    frames = sys._current_frames()
    order = sorted(frames, key=lambda ident: (ident not in first, names.get(ident, "")))
    out = []
    for ident in order:
        mark = "  <- the stalled component's" if ident in first else ""
        out.append(f"--- thread {names.get(ident, '?')} ({ident}){mark}\n")
        out.append("".join(traceback.format_stack(frames[ident])))
    return "".join(out)


class Watchdog:
    """Checks a :class:`Health` board every ``check_s`` in its own thread (module doc)."""

    def __init__(
        self,
        health: Health,
        run_dir: Path,
        on_stall: Callable[[dict[str, object]], None],
        check_s: float = 5.0,
        snapshot_s: float = 30.0,
        say: Callable[[str], None] = print,
    ) -> None:
        self.health, self.run_dir, self.on_stall = health, run_dir, on_stall
        self.check_s, self.snapshot_s, self.say = check_s, snapshot_s, say
        self.stalls: list[dict[str, object]] = []
        self._named: set[tuple[str, float]] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="shipyard-watchdog", daemon=True)

    def start(self) -> Watchdog:
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop checking; a watchdog that ran appends a last snapshot (every component's final state)."""
        self._stop.set()
        if self._thread.ident is not None:  # started
            self._thread.join(timeout=max(self.check_s * 2, 5.0))
            self._snapshot()

    def _loop(self) -> None:
        last_snapshot = 0.0
        while not self._stop.wait(self.check_s):
            for beat in self.health.stalled():
                key = (beat.component, beat.since)  # one report per stall, not per check
                if key not in self._named:
                    self._named.add(key)
                    self._report(beat)
            if time.monotonic() - last_snapshot >= self.snapshot_s:
                last_snapshot = time.monotonic()
                self._snapshot()

    def _snapshot(self) -> None:
        self._append({"kind": "snapshot", "at": time.time(), "components": self.health.snapshot()})

    def _report(self, beat: Beat) -> None:
        record = {"kind": "stall", "at": time.time(), **beat.record()}
        logs = self.run_dir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        stacks = logs / f"stall-{beat.component.replace(' ', '-')}-{len(self.stalls)}.txt"
        stacks.write_text(f"{json.dumps(record)}\n\n{thread_stacks(set(beat.threads))}")
        record["stacks"] = str(stacks)
        self.stalls.append(record)
        self._append(record)
        self.say(f"STALL: {stall_message(record)}")
        self.on_stall(record)

    def _append(self, record: dict[str, object]) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        with open(self.run_dir / "health.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")


def stall_message(record: dict[str, object]) -> str:
    """The error a stall ends a run with: what stalled, in which phase, for how long, and where its
    threads' stacks are."""
    return (
        f"{record['component']} made no progress in phase {record['phase']!r} for {record['age_s']} s "
        f"(deadline {record['deadline_s']} s, run.watchdog); its threads' stacks: {record['stacks']}"
    )


def exit_stalled(record: dict[str, object]) -> None:
    """End this process with :data:`STALL_EXIT` after naming the stall (the ``on_stall`` of a
    process that watches itself: a stalled thread cannot be stopped, its supervisor restarts it)."""
    import os

    print(f"shipyard: stopped: {stall_message(record)}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(STALL_EXIT)


def health_key(component: str) -> str:
    """The store key of ``component``'s published record (``health/worker-w0.json``)."""
    return f"health/{component.replace(' ', '-')}.json"


class Reporter:
    """Publishes a :class:`Health` board's records every ``every_s`` from its own thread (so a slow
    store delays reports, never the watchdog): ``publish(key, data)`` gets :func:`health_key` and
    the record as JSON, with ``reports`` (this reporter's count, the monitor's sign of life),
    ``pid``, ``host`` and ``written_at`` (wall clock, for people only). A failed publish is said
    once until one succeeds again; the next round retries."""

    def __init__(
        self,
        health: Health,
        publish: Callable[[str, bytes], None],
        every_s: float,
        say: Callable[[str], None] = print,
    ) -> None:
        import os
        import socket

        self.health, self.publish, self.every_s, self.say = health, publish, every_s, say
        self.reports = 0
        self._origin = {"pid": os.getpid(), "host": socket.gethostname()}
        self._failing = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="shipyard-health-reporter", daemon=True)

    def start(self) -> Reporter:
        self._thread.start()
        return self

    def stop(self, final: bool = True) -> None:
        """Stop reporting; with ``final``, publish the board once more from this thread (a finished
        component's last record says ``done``, which a monitor does not take for silence)."""
        self._stop.set()
        if final and self._thread.ident is not None:
            self._thread.join(timeout=self.every_s + 1.0)
            self._publish_all()

    def records(self) -> list[dict[str, object]]:
        """The board's records as published now (counting one more report)."""
        self.reports += 1
        extra = {"reports": self.reports, **self._origin, "written_at": time.time()}
        return [{**r, **extra} for r in self.health.snapshot()]

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._publish_all()
            self._stop.wait(self.every_s)

    def _publish_all(self) -> None:
        try:
            for record in self.records():
                self.publish(health_key(str(record["component"])), json.dumps(record).encode())
            if self._failing:
                self.say("health reports reach the store again")
            self._failing = False
        except Exception as e:  # the store is down or full: say so once, report again next round
            if not self._failing:
                self.say(f"health report not published ({type(e).__name__}: {e}); retrying")
            self._failing = True


@dataclass
class _Seen:
    """What a :class:`Monitor` last saw of one component, and when (its own monotonic clock)."""

    record: dict[str, object]
    alive_at: float
    moved_at: float


class Monitor:
    """Names silent and stuck components from the records they publish (module doc), watching from
    outside their processes. Feed it with :meth:`observe` as often as records are read; :meth:`check`
    returns each stall once (``reason`` ``silent`` or ``stuck``, ``age_s``, ``deadline_s``) and
    :meth:`stalled` every component stalled now.

    Example::

        monitor = Monitor(silent_s=60)
        monitor.observe(json.loads(store.get(k)) for k in store.list("health/"))
        for stall in monitor.check():
            print(stall_message(stall))
    """

    def __init__(self, silent_s: float) -> None:
        self.silent_s = silent_s
        self._seen: dict[str, _Seen] = {}
        self._named: set[tuple[object, ...]] = set()

    def observe(self, records: Iterable[dict[str, object]], now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        for r in records:
            name = str(r["component"])
            old = self._seen.get(name)
            if old is None:
                self._seen[name] = _Seen(r, now, now)
                continue
            if (r.get("pid"), r.get("reports")) != (old.record.get("pid"), old.record.get("reports")):
                old.alive_at = now
            if (r.get("pid"), r.get("seq")) != (old.record.get("pid"), old.record.get("seq")):
                old.moved_at = now
            old.record = r

    def components(self) -> list[str]:
        """Every component seen so far."""
        return list(self._seen)

    def record(self, component: str) -> dict[str, object] | None:
        """The last record seen of ``component``."""
        seen = self._seen.get(component)
        return None if seen is None else seen.record

    def stalled(self, now: float | None = None) -> list[dict[str, object]]:
        """Every component silent for ``silent_s`` or stuck past its deadline now."""
        now = time.monotonic() if now is None else now
        out = []
        for seen in self._seen.values():
            r = seen.record
            if r.get("phase") == "done":  # finished: it stopped reporting on purpose
                continue
            if now - seen.alive_at > self.silent_s:
                out.append(
                    {
                        **r,
                        "reason": "silent",
                        "age_s": round(now - seen.alive_at, 1),
                        "deadline_s": self.silent_s,
                    }
                )
            elif r.get("phase") not in IDLE_PHASES and now - seen.moved_at > float(str(r["deadline_s"])):
                out.append({**r, "reason": "stuck", "age_s": round(now - seen.moved_at, 1)})
        return out

    def check(self, now: float | None = None) -> list[dict[str, object]]:
        """The stalls not named before (one per frozen report count or progress count)."""
        new = []
        for stall in self.stalled(now):
            value = stall["reports"] if stall["reason"] == "silent" else stall["seq"]
            key = (stall["component"], stall["reason"], stall.get("pid"), value)
            if key not in self._named:
                self._named.add(key)
                new.append(stall)
        return new


class RecordSource(Protocol):
    """Where published records are read (a run's store)."""

    def list(self, prefix: str) -> list[str]: ...

    def get(self, key: str) -> bytes: ...


def published_records(store: RecordSource) -> list[dict[str, object]]:
    """Every record a :class:`Reporter` published to ``store`` (``health/``)."""
    return [json.loads(store.get(k)) for k in store.list("health/")]


class ServerProbe:
    """An inference server's record, from its ``/health`` answer (each answer counts as a report; a
    server that does not answer within ``timeout_s`` gives none)."""

    def __init__(self, url: str, timeout_s: float = 2.0) -> None:
        self.url, self.timeout_s, self.reports = url.rstrip("/"), timeout_s, 0

    def record(self) -> dict[str, object] | None:
        import urllib.request

        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=self.timeout_s) as r:
                body = json.loads(r.read())
        except (OSError, ValueError):
            return None
        if "health" not in body:
            return None
        self.reports += 1
        return {**body["health"], "reports": self.reports, "pid": body["health"].get("pid", self.url)}


class WatchSettings(Protocol):
    """What :func:`watch` reads (``run.watchdog`` of the config has these fields)."""

    enabled: bool
    deadline_s: float
    deadlines: dict[str, float]
    check_s: float
    snapshot_s: float
    report_s: float


class Watched:
    """One process's component, watched (:class:`Watchdog`, records and stacks under ``where``; a stall
    calls ``on_stall``, by default :func:`exit_stalled`) and, with ``publish``, reported every
    ``report_s`` for a :class:`Monitor` outside the process; for holders that cannot keep a ``with``
    block open (a Ray actor between its calls). :meth:`start` returns the component's beat."""

    def __init__(
        self,
        settings: WatchSettings,
        where: Path,
        component: str,
        publish: Callable[[str, bytes], None] | None = None,
        on_stall: Callable[[dict[str, object]], None] = exit_stalled,
    ) -> None:
        self.settings = settings
        health = Health(settings.deadline_s, settings.deadlines)
        self.beat = health.beat(component)
        self.dog = Watchdog(health, where, on_stall, settings.check_s, settings.snapshot_s)
        self.reporter = Reporter(health, publish, settings.report_s) if publish is not None else None

    def start(self) -> Beat:
        if self.settings.enabled:
            self.dog.start()
            if self.reporter is not None:
                self.reporter.start()
        return self.beat

    def stop(self) -> None:
        if self.reporter is not None:
            self.reporter.stop()
        self.dog.stop()


@contextmanager
def watch(
    settings: WatchSettings,
    where: Path,
    component: str,
    publish: Callable[[str, bytes], None] | None = None,
    on_stall: Callable[[dict[str, object]], None] = exit_stalled,
) -> Iterator[Beat]:
    """:class:`Watched` for the length of the block; yields the component's beat."""
    watched = Watched(settings, where, component, publish, on_stall)
    try:
        yield watched.start()
    finally:
        watched.stop()
