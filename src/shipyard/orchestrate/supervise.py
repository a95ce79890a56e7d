"""`shipyard health`: watch a run's components from outside their processes, the probe a supervisor runs.

Contract: :func:`watch_run` reads every record the run's standalone processes publish to its store
(``health/<component>.json``, :class:`shipyard.metrics.health.Reporter`) and the ``/health`` of each
inference server URL given, every ``run.watchdog.report_s``, and feeds them to a
:class:`~shipyard.metrics.health.Monitor` (``run.watchdog.silent_s``; each component's own
deadline): a component whose reports stop is named *silent* (frozen, dead or cut off from the
store), one that reports but makes no progress in a phase that is not idle past its deadline is
named *stuck*. Each stall is printed once as it is named, with its phase; after ``for_s`` seconds
(or on Ctrl-C) the table of components is printed and the components stalled at that moment are
returned, so ``shipyard health CONFIG --for 90`` exits 3 when one is (a liveness probe: its
supervisor restarts the named component; restarting one that is cut off from the store does not
help, which the message says).

Limits: a store that cannot be read looks like every component going silent (the error is printed
with each failed read); the first report of a component starts its clock, so a probe shorter than
``silent_s`` names nothing.
"""

from __future__ import annotations

import time
from typing import Any

from rich.console import Console
from rich.table import Table

from shipyard.config.schema import ShipyardConfig
from shipyard.metrics.health import Monitor, ServerProbe, published_records, stall_message
from shipyard.store.types import Store

console = Console()


def read_records(store: Store, servers: list[ServerProbe]) -> list[dict[str, Any]]:
    """Every published record, and each server's from its ``/health``."""
    return [*published_records(store), *(r for p in servers if (r := p.record()) is not None)]


def watch_run(cfg: ShipyardConfig, servers: list[str], for_s: float | None) -> list[dict[str, Any]]:
    """Watch the run ``run.name`` (module doc); the components stalled when the watch ends."""
    from shipyard.store.run import open_run

    w = cfg.run.watchdog
    store = open_run(cfg.store, cfg.run.name)
    monitor, probes = Monitor(w.silent_s), [ServerProbe(url) for url in servers]
    console.print(f"watching {store.identity.describe()} in {store.where} (silent after {w.silent_s} s)")
    end = None if for_s is None else time.monotonic() + for_s
    last: list[dict[str, Any]] = []
    try:
        while end is None or time.monotonic() < end:
            try:
                last = read_records(store, probes)
            except (OSError, TimeoutError, ValueError) as e:
                console.print(f"[yellow]the store could not be read: {e}")
            monitor.observe(last)
            for stall in monitor.check():
                console.print(f"[red]STALL ({stall['reason']}): {describe(stall)}")
            time.sleep(min(w.report_s, 5.0))
    except KeyboardInterrupt:
        pass
    stalled = monitor.stalled()
    console.print(table(last, {str(s["component"]) for s in stalled}))
    return stalled


def describe(stall: dict[str, Any]) -> str:
    if stall["reason"] == "silent":
        return (
            f"{stall['component']} (pid {stall.get('pid')} on {stall.get('host', '?')}) has not reported for "
            f"{stall['age_s']} s (run.watchdog.silent_s={stall['deadline_s']}), last in phase "
            f"{stall['phase']!r}: frozen, dead, or cut off from the store"
        )
    return stall_message({**stall, "stacks": "in its own run directory's logs/ once it names itself"})


def table(records: list[dict[str, Any]], stalled: set[str]) -> Table:
    t = Table("component", "phase", "progress", "reports", "pid", "state", title="components")
    for r in sorted(records, key=lambda r: str(r["component"])):
        name = str(r["component"])
        state = "[red]stalled" if name in stalled else "ok"
        t.add_row(name, str(r["phase"]), str(r.get("seq")), str(r.get("reports")), str(r.get("pid")), state)
    return t
