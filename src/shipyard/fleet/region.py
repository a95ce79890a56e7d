"""A region as one unit: its relay, its inference servers and its rollout workers, kept running.

Contract: ``shipyard region CONFIG fleet.region=<name>`` looks ``<name>`` up in ``fleet.regions``
(:class:`~shipyard.config.schema.RegionConfig`) and runs on this machine, each as its own
``shipyard`` process given the same config and overrides:

- ``relay``: the origin store (``store``) into the region's mirror (``mirror_root``);
- ``servers`` inference servers following the mirror, on loopback ports ``port``, ``port + 1``, ...
  (started once the mirror holds the run, so they do not start on an empty store);
- ``workers_per_server`` rollout workers per server (ids ``<name>-w<i>``, ``fleet.region=<name>``),
  writing their batches to the origin.

A worker that exits with an error is started again after ``restart_s`` (what systemd or a Ray
actor's restart policy would do) and one that exits 0 stays down; the relay and the servers are
started again however they exit. A process alive but stuck ends itself (its own watchdog,
``run.watchdog``, exits with status 3) and is restarted the same way; one frozen whole cannot, so
the region also watches its processes from outside: every ``report_s`` the records its relay and
workers publish to the origin store and its servers' ``/health`` go to a
:class:`~shipyard.metrics.health.Monitor`, and a process named silent is killed (SIGKILL) to be
restarted. When every worker has exited 0 (the
trainer wrote ``control/finished``), the region stops its servers and relay and returns 0. A
signal (:meth:`Region.stop`) stops the workers first, then the servers, then the relay. The region
adopts versions at its relay's pace and goes on with the version it holds when cut off from the
origin; its processes retry the store meanwhile.

Limits: one machine per region (a region of many machines runs ``shipyard serve`` and ``shipyard
worker`` under its own orchestration); restarts are not throttled beyond ``restart_s``.

Example::

    region = Region(cfg, "configs/demo.toml", ["store.type=s3", "fleet.region=eu"])
    region.run()   # until the run finishes or region.stop() is called
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from shipyard.config.schema import RegionConfig, ShipyardConfig
from shipyard.metrics.health import Monitor, RecordSource, ServerProbe, published_records


class Supervised:
    """One child process, started again ``restart_s`` after it exits with an error; one that may
    ``finish`` (a worker at the run's end) stays down after a clean exit, any other is restarted
    whatever its exit (a server or relay is only ever stopped by its supervisor)."""

    def __init__(
        self, name: str, argv: list[str], log: Path, restart_s: float, finishes: bool = True
    ) -> None:
        self.name, self.argv, self.log, self.restart_s = name, argv, log, restart_s
        self.finishes = finishes
        self.proc: subprocess.Popen[bytes] | None = None
        self.restarts = 0
        self.done = False
        """Exited 0: it finished and stays down."""
        self._died_at: float | None = None

    def start(self) -> None:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                self.argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )

    def supervise(self) -> None:
        """Restart the process if it exited with an error ``restart_s`` ago; note a clean exit."""
        if self.proc is None or self.done or self.proc.poll() is None:
            return
        if self.proc.returncode == 0 and self.finishes:
            self.done = True
            return
        now = time.monotonic()
        if self._died_at is None:
            self._died_at = now
            print(
                f"{self.name} exited with code {self.proc.returncode}; restarting in {self.restart_s:g} s",
                flush=True,
            )
        if now - self._died_at >= self.restart_s:
            self._died_at = None
            self.restarts += 1
            self.start()

    def kill(self) -> None:
        """SIGKILL its process group (a frozen process: :meth:`supervise` restarts it)."""
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)

    def stop(self, grace_s: float = 30.0) -> None:
        """SIGTERM its process group, SIGKILL after ``grace_s``."""
        if self.proc is None or self.proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def region_of(cfg: ShipyardConfig) -> RegionConfig:
    """The entry of ``fleet.regions`` named by ``fleet.region``."""
    for r in cfg.fleet.regions:
        if r.name == cfg.fleet.region:
            return r
    names = [r.name for r in cfg.fleet.regions]
    raise ValueError(
        f"fleet.region={cfg.fleet.region!r} is not in fleet.regions ({names or 'none configured'}); "
        "set fleet.region to one of them, or add a [[fleet.regions]] entry for it"
    )


class Region:
    """The supervised processes of the region ``fleet.region`` (module docstring)."""

    def __init__(
        self, cfg: ShipyardConfig, config_path: str, overrides: list[str], log_dir: Path | None = None
    ) -> None:
        self.cfg, self.spec = cfg, region_of(cfg)
        self.logs = log_dir or Path(cfg.run.output_dir) / f"region-{self.spec.name}"
        self._base = [sys.executable, "-m", "shipyard.cli"]
        self._config = [config_path, *overrides, f"fleet.region={self.spec.name}"]
        self._stop = threading.Event()
        self.monitor = Monitor(cfg.run.watchdog.silent_s)
        self.named: list[dict[str, object]] = []
        """Every stall the region named (each with its ``action``)."""
        self._origin: RecordSource | None = None
        self._checked = 0.0
        self._probes = [ServerProbe(f"http://127.0.0.1:{self.port(i)}") for i in range(self.spec.servers)]
        mirror = f'"{self.spec.mirror_root}"'
        self.relay = self._proc(
            "relay", "relay", [f"relay.mirror.root={mirror}", f"relay.region={self.spec.name}"]
        )
        self.servers = [
            self._proc(
                f"server{i}",
                "serve",
                ["store.type=local", f"store.root={mirror}", f"inference.port={self.port(i)}"],
            )
            for i in range(self.spec.servers)
        ]
        per = self.spec.workers_per_server
        self.workers = [
            self._proc(
                f"worker{w}",
                "worker",
                [],
                [
                    "--server",
                    f"http://127.0.0.1:{self.port(w // per)}",
                    "--worker-id",
                    f"{self.spec.name}-w{w}",
                ],
            )
            for w in range(self.spec.servers * per)
        ]

    def port(self, server: int) -> int:
        return self.spec.port + server

    def components(self) -> dict[str, Supervised]:
        """Each process by the name its component reports under."""
        name = self.spec.name
        return {
            f"relay {name}": self.relay,
            **{f"server {self.port(i)}": p for i, p in enumerate(self.servers)},
            **{f"worker {name}-w{w}": p for w, p in enumerate(self.workers)},
        }

    def check_health(self) -> None:
        """Every ``report_s``: the records of the region's processes into the monitor; a process named
        silent (frozen whole) is killed, and restarted by its supervision."""
        now = time.monotonic()
        if not self.cfg.run.watchdog.enabled or now - self._checked < self.cfg.run.watchdog.report_s:
            return
        self._checked = now
        ours = self.components()
        try:
            if self._origin is None:
                from shipyard.store.run import open_run

                self._origin = open_run(self.cfg.store, self.cfg.run.name)
            records = [r for r in published_records(self._origin) if r["component"] in ours]
        except (OSError, TimeoutError, ValueError):
            return  # the origin cannot be read from here now: no verdict on anyone
        records += [r for p in self._probes if (r := p.record()) is not None]
        self.monitor.observe(records, now)
        for stall in self.monitor.check(now):
            proc = ours[str(stall["component"])]
            frozen = (
                stall["reason"] == "silent" and proc.proc is not None and proc.proc.pid == stall.get("pid")
            )
            action = "killed, to be restarted" if frozen else "left to its own watchdog"
            self.named.append({**stall, "action": action})
            print(
                f"region {self.spec.name}: {stall['component']} {stall['reason']} in phase "
                f"{stall['phase']!r} for {stall['age_s']} s: {action}",
                flush=True,
            )
            if frozen:
                proc.kill()

    def _proc(
        self, name: str, command: str, overrides: list[str], flags: list[str] | None = None
    ) -> Supervised:
        # the overrides come before the flags: argparse takes the positional overrides first
        argv = [*self._base, command, *self._config, *overrides, *(flags or [])]
        return Supervised(f"{self.spec.name}/{name}", argv, self.logs / f"{name}.log", self.spec.restart_s)

    def mirror_ready(self) -> bool:
        """The relay copied the run's stamp: servers can open the run in the mirror."""
        return (Path(self.spec.mirror_root) / self.cfg.run.name / "RUN.json").is_file()

    @property
    def processes(self) -> list[Supervised]:
        return [self.relay, *self.servers, *self.workers]

    def run(self, poll_s: float = 0.5) -> int:
        """Start the relay, then (once the mirror holds the run) the servers and workers; supervise
        until every worker finished or :meth:`stop`; returns 0."""
        print(f"region {self.spec.name}: logs in {self.logs}", flush=True)
        self.relay.start()
        try:
            while not self._stop.is_set() and not self.mirror_ready():
                self.relay.supervise()
                self._stop.wait(poll_s)
            for p in [*self.servers, *self.workers]:
                if not self._stop.is_set():
                    p.start()
            while not self._stop.is_set() and not all(w.done for w in self.workers):
                for p in self.processes:
                    p.supervise()
                self.check_health()
                self._stop.wait(poll_s)
        finally:
            for p in [*self.workers, *self.servers, self.relay]:
                p.stop()
        restarts = {p.name: p.restarts for p in self.processes if p.restarts}
        print(f"region {self.spec.name}: stopped (restarts: {restarts or 'none'})", flush=True)
        return 0

    def stop(self) -> None:
        self._stop.set()
