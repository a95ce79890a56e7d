"""The chaos suite's stalls: components alive but stuck, found and named by the watchdog, then recovered.

Contract: on a live run of ``benchmarks/chaos.py`` (``--stall-rounds N``), each round injects every
kind of :data:`STALLS` once, in a seeded random order, waiting before each until every component
reports and none is stalled:

- ``freeze_resumed``: a component's process group is SIGSTOPped for :data:`FAULT_S` s, then
  SIGCONTed (unless its supervisor restarted it meanwhile);
- ``freeze``: the same, never resumed: the supervisor, told by the monitor, SIGKILLs it
  :data:`RESTART_AFTER_S` s after naming it and starts it again;
- ``partition``: the path between the rollout worker and its inference server drops every byte
  for :data:`FAULT_S` s (``faults.FaultProxy``);
- ``slow_store``: every call to the S3 store is answered 2 s late for :data:`FAULT_S` s;
- ``full_disk``: the S3 server's disk (a tmpfs of its own) is filled for :data:`FAULT_S` s, then
  freed; a store that still refuses writes 30 s later is restarted on its data (SeaweedFS does not
  take writes again after ENOSPC without a restart: ``store_restarted`` says when that was needed).
  The volumes' index files live on the host's disk (``-volume.dir.idx``): filled to ENOSPC with the
  data, SeaweedFS once tore a volume's ``.idx`` and refused that volume after its restart, losing
  objects, a failure of the test store that no client can recover from;
- ``clock_jump``: one component's wall clock steps an hour (forward, then back on its next turn)
  and stays there.

The frozen or jumped component rotates over :data:`TARGETS`. Every process publishes its progress
(``run.watchdog.report_s``) and a :class:`StallWatch` (the supervisor's monitor,
:class:`shipyard.metrics.health.Monitor`) reads the records every second.

Definitions, fixed before any run:

- *named*: the monitor named the component (silent or stuck), or the component's process exited
  with status 3 after naming its own stall, or it exited with an error (a crash is loud, not
  silent); ``detect_s`` is the time from the injection to the first such event of a component the
  fault stalls (the frozen one; the worker for a partition; any component for a full disk).
- *silent hang*: a fault that stalls a component by construction (``freeze_resumed``, ``freeze``,
  ``partition``, ``full_disk``) with no such event within the stalled kind's deadline plus
  ``silent_s`` plus 15 s; or, for ``slow_store`` and ``clock_jump`` (which need not stall
  anything), a fault during which the trainer went longer than its deadline without a step and
  nothing was named.
- ``recover_s``: from the fault's end (the SIGCONT, the healed path, the freed disk, the jump;
  for ``freeze`` the injection itself) until the stalled component made progress again (the
  trainer a new step, the worker a new batch, the server its ``/health`` and a new batch, the
  relay the origin's latest version mirrored; for store, path and clock faults a new step and a
  new batch).

Limits: one machine; the monitor reads the store directly, not through the slowed path.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

STALLS = ("freeze_resumed", "freeze", "partition", "slow_store", "full_disk", "clock_jump")
TARGETS = ("worker", "server", "trainer", "relay")
FAULT_S = 60.0
RESTART_AFTER_S = 50.0
WATCHDOG = {"report_s": 2.0, "silent_s": 20.0, "check_s": 1.0}
DEADLINES = {"trainer": 300.0, "worker": 40.0, "server": 30.0, "relay": 30.0}
STALLED_BY_CONSTRUCTION = ("freeze_resumed", "freeze", "partition", "full_disk")


def watchdog_overrides() -> list[str]:
    """The run's ``run.watchdog`` for the chaos suite (the config's dotted overrides)."""
    return [f"run.watchdog.{k}={v}" for k, v in WATCHDOG.items()] + [
        f"run.watchdog.deadlines.{k}={v}" for k, v in DEADLINES.items()
    ]


@dataclass
class Event:
    at: float
    """Monotonic seconds."""
    component: str
    how: str
    """``silent``/``stuck`` (the monitor), ``exit 3`` (named itself), ``exit N`` (crashed)."""


@dataclass
class StallWatch:
    """The supervisor's monitor: reads every component's record each ``every_s``, names stalls, and
    SIGKILLs a component stalled for ``restart_after_s`` after it was named (its supervisor restarts
    it). ``records`` reads the records; ``parts`` are the supervised components by kind."""

    monitor: Any
    records: Callable[[], list[dict[str, Any]]]
    parts: dict[str, Any]
    every_s: float = 1.0
    restart_after_s: float = RESTART_AFTER_S
    events: list[Event] = field(default_factory=list)
    restarts: list[Event] = field(default_factory=list)
    _last: float = 0.0
    _exits_seen: dict[str, int] = field(default_factory=dict)

    def tick(self) -> bool:
        """Supervise; whether this call was a monitor round (one each ``every_s``)."""
        now = time.monotonic()
        self._note_exits()
        if now - self._last < self.every_s:
            return False
        self._last = now
        self.monitor.observe(self.records(), now=now)
        for stall in self.monitor.check(now=now):
            part = self.parts.get(str(stall["component"]).split(" ")[0])  # None: a Ray actor
            if (part is not None and part.done) or stall.get("phase") == "done":
                continue
            self.events.append(Event(now, str(stall["component"]), str(stall["reason"])))
            print(
                f"monitor: {stall['component']} {stall['reason']} in phase {stall['phase']!r} "
                f"for {stall['age_s']} s",
                flush=True,
            )
        self._restart_stalled(now)
        return True

    def _note_exits(self) -> None:
        for kind, part in self.parts.items():
            for at, status in part.exits[self._exits_seen.get(kind, 0) :]:
                if status not in (0, -9):  # -9: the supervisor's own SIGKILL
                    self.events.append(Event(at, kind, f"exit {status}"))
            self._exits_seen[kind] = len(part.exits)

    def _restart_stalled(self, now: float) -> None:
        for stall in self.monitor.stalled(now=now):
            kind = str(stall["component"]).split(" ")[0]
            part = self.parts.get(kind)
            if part is None or part.done or not part.alive() or part.proc.pid != stall.get("pid"):
                continue  # finished, or a stall of an incarnation that is gone
            named = [e.at for e in self.events if e.component == stall["component"]]
            if named and now - named[-1] >= self.restart_after_s:
                print(f"supervisor: restarting {stall['component']} (stalled)", flush=True)
                self.restarts.append(Event(now, str(stall["component"]), "restart"))
                part.kill()

    def first_event(self, since: float, kinds: tuple[str, ...] | None) -> Event | None:
        for e in self.events:
            if e.at >= since and (kinds is None or e.component.split(" ")[0] in kinds):
                return e
        return None


@dataclass
class Probes:
    """What the stall driver asks of the run (``benchmarks/chaos.py`` gives them)."""

    steps: Callable[[], int]
    batches: Callable[[], int]
    server_up: Callable[[], bool]
    mirror_latest: Callable[[], int]
    origin_latest: Callable[[], int]
    store_writable: Callable[[], bool]
    restart_store: Callable[[], None]
    until: Callable[..., float]
    """``until(cond, timeout_s, what)``: wait, supervising, for ``cond``; seconds waited."""


def recovered(kind: str, target: str, probes: Probes) -> Callable[[], bool]:
    """The probe that says the run recovered from the fault (module doc), from its state now."""
    steps, batches, origin = probes.steps(), probes.batches(), probes.origin_latest()
    if kind in ("freeze_resumed", "freeze"):
        return {
            "trainer": lambda: probes.steps() > steps,
            "worker": lambda: probes.batches() > batches,
            "server": lambda: probes.server_up() and probes.batches() > batches,
            "relay": lambda: probes.mirror_latest() >= origin,
        }[target]
    return lambda: probes.steps() > steps and probes.batches() > batches


def inject(run: Any, kind: str, target: str, n: int, probes: Probes) -> dict[str, Any]:
    """Cause the fault, hold it, end it; what happened (without detection, which the caller reads)."""
    rec: dict[str, Any] = {"kind": kind, "target": target, "t0": time.monotonic()}
    if kind in ("freeze_resumed", "freeze"):
        frozen = run.freeze(target)
        if kind == "freeze_resumed":
            probes.until(lambda: time.monotonic() - rec["t0"] >= FAULT_S, FAULT_S + 10, "the freeze")
            rec["resumed"] = not frozen.replaced()
            if rec["resumed"]:
                frozen.thaw()
        else:  # its supervisor restarts it once it was named
            probes.until(frozen.replaced, 600, f"the frozen {target} being restarted")
            frozen.thaw()  # (gone already: a no-op)
        rec["ended"] = time.monotonic() if kind == "freeze_resumed" else rec["t0"]
        return rec
    if kind == "partition":
        run.server_path.partition()
    elif kind == "slow_store":
        run.store_path.slow()
    elif kind == "full_disk":
        run.s3_disk.fill(leave_mb=0)
    else:
        assert kind == "clock_jump", kind
        rec["jump_s"] = 3600 if n % 2 == 0 else -3600
        run.clock_of(target).jump(rec["jump_s"])
    probes.until(lambda: time.monotonic() - rec["t0"] >= FAULT_S, FAULT_S + 10, f"the {kind}")
    if kind == "partition":
        run.server_path.heal()
    elif kind == "slow_store":
        run.store_path.heal()
    elif kind == "full_disk":
        run.s3_disk.free()
        try:
            probes.until(probes.store_writable, 30, "the store taking writes again")
            rec["store_restarted"] = False
        except TimeoutError:
            probes.restart_store()
            rec["store_restarted"] = True
    rec["ended"] = time.monotonic()
    return rec


def stalled_kinds(kind: str, target: str) -> tuple[str, ...] | None:
    """The component kinds a fault stalls by construction (None: any); on Ray the driver's exit with
    status 3 names a stall of one of its actors too."""
    if kind in ("freeze_resumed", "freeze", "clock_jump"):
        return (target, "driver")
    return ("worker", "driver") if kind == "partition" else None


def judge(rec: dict[str, Any], watch: StallWatch, step_times: list[float]) -> dict[str, Any]:
    """``detect_s`` and ``silent_hang`` of one injection (module doc)."""
    kind, t0 = rec["kind"], rec["t0"]
    first = watch.first_event(t0, stalled_kinds(kind, rec["target"]))
    deadline = DEADLINES[rec["target"]] if kind in ("freeze_resumed", "freeze") else DEADLINES["worker"]
    limit = deadline + WATCHDOG["silent_s"] + 15
    detect = None if first is None else first.at - t0
    named_in_time = detect is not None and detect <= limit
    if kind in STALLED_BY_CONSTRUCTION:
        silent = not named_in_time
    else:  # stalled only if the trainer went past its deadline without a step
        window = [t0, *[t for t in step_times if t0 <= t <= rec["ended"]], rec["ended"]]
        gap = max(b - a for a, b in zip(window, window[1:], strict=False))
        rec["max_step_gap_s"] = gap
        silent = gap > DEADLINES["trainer"] and watch.first_event(t0, None) is None
    named = [f"{e.component}: {e.how}" for e in watch.events if t0 <= e.at <= rec["recovered_at"]]
    return {
        **rec,
        "detect_s": detect,
        "named_by": first.how if first else None,
        "named": named,
        "silent_hang": silent,
    }


def run_stalls(
    run: Any,
    rounds: int,
    probes: Probes,
    step_times: Callable[[], list[float]],
    kinds: tuple[str, ...] = STALLS,
) -> list[dict[str, Any]]:
    """``rounds`` rounds over ``kinds`` (module doc); one record per injection."""
    out: list[dict[str, Any]] = []
    counts: dict[str, int] = {}
    for r in range(rounds):
        order = list(kinds)
        run.rng.shuffle(order)
        for kind in order:
            n = counts[kind] = counts.get(kind, 0) + 1
            target = target_of(kind, n - 1, run.targets)
            probes.until(lambda: steady(run), 300, "every component reporting, none stalled")
            rec = inject(run, kind, target, n - 1, probes)
            probe = recovered(kind, target, probes)
            probes.until(probe, 900, f"recovery from the {kind}")
            rec["recovered_at"] = time.monotonic()
            rec["recover_s"] = rec["recovered_at"] - rec["ended"]
            rec = judge(rec, run.watch, step_times())
            rec["round"] = r
            out.append(rec)
            print(
                f"stall {kind:14s} {target:8s} detect {_s(rec['detect_s'])} recover {rec['recover_s']:6.1f} s"
                f"{'  SILENT HANG' if rec['silent_hang'] else ''}",
                flush=True,
            )
    return out


def target_of(kind: str, n: int, targets: tuple[str, ...] = TARGETS) -> str:
    """The component the ``n``-th fault of ``kind`` hits: rotating over :data:`TARGETS` (offset per
    kind, so two rounds freeze four different components); the worker for a partition (its path to
    its server), the store for the store's faults."""
    offset = {"freeze_resumed": 0, "freeze": 2, "clock_jump": 1}
    if kind in offset:
        return targets[(n + offset[kind]) % len(targets)]
    return "worker" if kind == "partition" else "store"


def steady(run: Any) -> bool:
    """Every component alive and reporting, none stalled in the monitor's eyes, the trainer stepping."""
    seen = {c.split(" ")[0] for c in run.watch.monitor.components()}
    return (
        all(p.alive() for p in run.parts.values())
        and seen >= set(run.targets)
        and not run.watch.monitor.stalled()
        and bool(run.step_times)
    )


def _s(x: float | None) -> str:
    return "   -  " if x is None else f"{x:6.1f} s"


def figures(records: list[dict[str, Any]]) -> dict[str, Any]:
    """``stalls`` (by kind), ``silent_hangs``, ``detect_s`` and ``recover_s`` (per kind: max and all)."""
    by: dict[str, list[dict[str, Any]]] = {}
    for r in records:
        by.setdefault(r["kind"], []).append(r)
    return {
        "stalls": {k: len(v) for k, v in by.items()},
        "silent_hangs": sum(r["silent_hang"] for r in records),
        "detect_s": {
            k: max((r["detect_s"] for r in v if r["detect_s"] is not None), default=None)
            for k, v in by.items()
        },
        "recover_s": {k: max(r["recover_s"] for r in v) for k, v in by.items()},
        "store_restarted": sum(bool(r.get("store_restarted")) for r in records),
        "stall_log": [
            {k: v for k, v in r.items() if k not in ("t0", "ended", "recovered_at")} for r in records
        ],
    }
