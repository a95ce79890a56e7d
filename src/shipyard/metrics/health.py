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

Limits: one process's components (the local placement); components in other processes (Ray
actors, standalone workers) report through the store in a later step. A stall is a missing tick,
not a wrong answer: a component that loops without progress while ticking is not caught.

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
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

IDLE_PHASES = frozenset({"idle", "waiting", "done"})
"""Phases in which making no progress is expected (never a stall): an idle server, a worker waiting
on the version gate (the trainer it waits for is watched), a finished component."""


class StallError(RuntimeError):
    """A component made no progress within its deadline; the message names it and its phase."""


@dataclass
class Beat:
    """One component's progress (thread-safe: the component's threads write, the watchdog reads)."""

    component: str
    deadline_s: float
    phase: str = "starting"
    ticks: int = 0
    since: float = field(default_factory=time.monotonic)
    """When the component last entered a phase or made progress (monotonic seconds)."""
    at: float = field(default_factory=time.time)
    """The same moment, wall clock (for people and the viewer)."""
    threads: set[int] = field(default_factory=set)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def enter(self, phase: str) -> None:
        """The component starts ``phase`` now (entering counts as progress)."""
        with self._lock:
            self.phase, self.since, self.at = phase, time.monotonic(), time.time()
            self.threads.add(threading.get_ident())

    def tick(self, n: int = 1) -> None:
        """The component made ``n`` units of progress in its phase."""
        with self._lock:
            self.ticks += n
            self.since, self.at = time.monotonic(), time.time()
            self.threads.add(threading.get_ident())

    def age_s(self, now: float | None = None) -> float:
        """Seconds since the last progress."""
        return (time.monotonic() if now is None else now) - self.since

    def record(self) -> dict[str, object]:
        with self._lock:
            return {
                "component": self.component,
                "phase": self.phase,
                "ticks": self.ticks,
                "last_progress_at": self.at,
                "age_s": round(self.age_s(), 3),
                "deadline_s": self.deadline_s,
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
