"""Benchmark: a live run survives SIGKILL of each of its components, one at a time and again and again,
and stalls of each (frozen, cut off, slowed, a full disk, a clock jump), which are named, not silent.

Contract: a run of the tiny model is started as separate processes over real components: a SeaweedFS
S3 server (the origin store), ``shipyard trainer``, ``shipyard relay`` (origin -> a local mirror),
``shipyard serve`` (following the mirror) and ``shipyard worker`` (function and database tasks, so
PostgreSQL runs in the worker's service pool and every session in bubblewrap sandboxes). A
supervisor restarts any process that dies. Then, one kill at a time, each kind of component is sent
SIGKILL at a random moment: the trainer, the inference server, the rollout worker, the relay, the
S3 server (restarted on its data), the PostgreSQL postmaster (the pool replaces it) and the process
tree of one sandbox (the session is recorded as crashed). After each kill the next waits until that
component has recovered: the trainer trained another step, the server answers ``/health``, the
worker wrote another batch, the relay mirrored the next version, S3 lists again, a new postmaster
serves, the worker wrote another batch. The run must then finish all its steps.

Figures (``benchmarks/results/chaos.json``): ``kills`` (count) and ``kinds`` (count per kind),
``lost_versions`` (a trained step without a published version holding the logged weights),
``double_trained_groups`` (a group consumed by two steps), ``leaked_sandboxes`` (sandbox
directories or bwrap processes left after shutdown), ``leaked_processes`` (postgres, bwrap or
component processes left), ``orphaned_store_objects`` (objects under ``weights/`` that no committed
version names), all expected 0, and ``max_recovery_s`` per kind.

Limits: one machine, loopback only; the tiny random model (nothing is learned); kills are spaced
by recovery, so two components are never down at once by design (a second fault during recovery
is the same code path as a restart, but it is not what this measures).

Then stalls (``--stall-rounds``, :mod:`stalls`): components frozen (resumed after 60 s, or
never), the worker cut off from its server, the store slow or its disk full, a component's clock
jumping an hour, each kind once a round. Every process reports its progress to the store
(``run.watchdog``) and the supervisor here watches those reports with the same
:class:`~shipyard.metrics.health.Monitor` that ``shipyard health`` runs; a component it names and
that stays stalled is restarted. Figures: ``stalls`` (count per kind), ``silent_hangs`` (expected 0),
``detect_s`` and ``recover_s`` per kind (their maxima; ``stall_log`` has each one), with the
definitions in ``benchmarks/stalls.py``. A run with stalls is stopped after them rather than
finished, and audited up to its last trained step.

Usage::

    .venv/bin/python benchmarks/chaos.py            # 3 rounds of kills (21), 2 of stalls (12), ~35 min
    .venv/bin/python benchmarks/chaos.py --quick    # 1 round of kills (7), no stalls, ~3 min
    .venv/bin/python benchmarks/chaos.py --rounds 0 --stall-rounds 1   # the 6 stalls once, ~12 min
    .venv/bin/python benchmarks/chaos.py --placement ray --stall-rounds 2  # stalls on Ray, ~25 min
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from faults import ClockShift, FaultProxy, Frozen, TmpfsHolder, freeze, thaw  # noqa: E402
from harness import parser, table, write_results  # noqa: E402
from shipyard.envs.sandbox.reaper import descendants  # noqa: E402
from stalls import STALLS, TARGETS, WATCHDOG, Probes, StallWatch, run_stalls, watchdog_overrides  # noqa: E402
from stalls import figures as stall_figures  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
KINDS = ("trainer", "server", "worker", "relay", "s3", "postgres", "sandbox")
S3_ENV = {"CHAOS_S3_KEY": "chaos", "CHAOS_S3_SECRET": "chaos"}
RUN = "chaos"


class Component:
    """One supervised process: started, restarted when it dies, killed with SIGKILL on demand."""

    def __init__(self, name: str, argv: list[str], log: Path, env: dict[str, str] | None = None) -> None:
        self.name, self.argv, self.log, self.env = name, argv, log, env or {}
        self.proc: subprocess.Popen[bytes] | None = None
        self.grace_s = 30.0
        """How long :meth:`stop` waits after SIGTERM (a Ray driver stops its actors and Ray first)."""
        self.exits: list[tuple[float, int]] = []
        """(monotonic time, status) of every exit the supervisor saw (3: the process named its own stall)."""
        self.pids: list[int] = []
        """Every incarnation's pid (their sandboxes and clusters are named after them)."""
        self.restarts = 0
        self.done = False
        """The process exited 0 on its own (the trainer after its last step): not restarted."""

    def start(self) -> None:
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                self.argv,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                cwd=ROOT,
                env={**os.environ, **self.env},
            )
        self.pids.append(self.proc.pid)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def supervise(self) -> None:
        """Restart the process if it died (not if it finished with status 0: the trainer after its
        last step, a worker after the trainer said the run is finished)."""
        if self.proc is None or self.done or self.alive():
            return
        self.exits.append((time.monotonic(), self.proc.returncode))
        if self.proc.returncode == 0:
            self.done = True
            return
        self.restarts += 1
        self.start()

    def kill(self) -> None:
        assert self.proc is not None
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> None:
        """SIGTERM (the component cleans up), then SIGKILL after :attr:`grace_s`."""
        if not self.alive():
            return
        assert self.proc is not None
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(self.grace_s)
        except subprocess.TimeoutExpired:
            self.kill()


def _cmdline(pid: int) -> str:
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    return ""


def _procs() -> list[tuple[int, str]]:
    """(pid, cmdline) of every process."""
    return [(int(d.name), _cmdline(int(d.name))) for d in Path("/proc").iterdir() if d.name.isdigit()]


def postmasters(owners: list[int]) -> list[int]:
    """Pids of the postmasters of the PostgreSQL clusters that processes ``owners`` started."""
    names = tuple(f"shipyard-pg-{pid}-" for pid in owners)
    return [
        pid
        for pid, cmd in _procs()
        if "/postgres " in cmd and " -D " in cmd and any(n in cmd for n in names) and "postgres:" not in cmd
    ]


class ChaosRun:
    """The run's processes and stores under ``work``, and what is needed to kill and probe each kind."""

    def __init__(self, work: Path, steps: int, seed: int, faults: bool = False) -> None:
        """``faults``: set up for :mod:`stalls` too: the S3 server on a disk of its own that can fill,
        the store and the worker's server behind fault proxies, every component's clock shiftable."""
        from shipyard.metrics.health import Monitor, ServerProbe
        from shipyard.store.seaweed import SeaweedServer

        self.work, self.steps = work, steps
        self.rng = random.Random(seed)
        self.s3_disk = TmpfsHolder(work / "s3", 4096) if faults else None
        self.s3 = SeaweedServer(  # (the volumes' index on the host's disk: stalls.py, full_disk)
            work / "s3",
            prefix=self.s3_disk.prefix if self.s3_disk else None,
            index_dir=work / "s3-index" if faults else None,
        )
        self.port = _free_port()
        self.store_path = FaultProxy(self.s3.ports["s3.port"]) if faults else None
        self.server_path = FaultProxy(self.port) if faults else None
        self.clocks = {name: ClockShift(work, name) for name in TARGETS} if faults else {}
        self.watch = StallWatch(Monitor(WATCHDOG["silent_s"]), self.health_records, {})
        self.step_times: list[float] = []
        """Monotonic seconds at which the supervisor saw the trainer's step grow."""
        self._seen_step = 0
        self.server_probe = ServerProbe(f"http://127.0.0.1:{self.port}")
        endpoint = self.store_path.url if self.store_path else self.s3.endpoint
        self.common = [
            f"run.name={RUN}",
            f'run.output_dir="{work / "runs"}"',
            f"run.seed={seed}",
            "store.type=s3",
            'store.root="shipyard-chaos/origin"',
            f'store.endpoint_url="{endpoint}"',
            "store.key_env=CHAOS_S3_KEY",
            "store.secret_env=CHAOS_S3_SECRET",
            "store.timeout_s=20",
            f"trainer.steps={steps}",
            "trainer.groups_per_step=1",
            "trainer.max_off_policy_steps=4",
            "trainer.wait_timeout_s=900",
            "rollout.group_size=2",
            "rollout.concurrency=2",
            "tasks.num_generated=10",
            "tasks.num_db=3",
            "weights.keep=100000",
            f'relay.mirror.root="{work / "mirror"}"',
            "relay.poll_s=0.2",
            "inference.poll_s=0.2",
            "sandbox.pool.warm=1",
            *watchdog_overrides(),
        ]
        self.parts: dict[str, Component] = {}
        self._origin: Any = None

    def _cli(self, command: str, *extra: str) -> list[str]:
        return [
            sys.executable,
            "-m",
            "shipyard.cli",
            command,
            str(ROOT / "configs/tiny.toml"),
            *self.common,
            *extra,
        ]

    def origin(self) -> Any:
        """The run's view of the origin store (opened once, once the run is claimed)."""
        if self._origin is None:
            self._origin = self._open_origin()
        return self._origin

    def _open_origin(self) -> Any:
        from shipyard.config.schema import StoreConfig
        from shipyard.store.run import open_run

        cfg = StoreConfig(
            type="s3",
            root="shipyard-chaos/origin",
            endpoint_url=self.s3.endpoint,
            key_env="CHAOS_S3_KEY",
            secret_env="CHAOS_S3_SECRET",
            timeout_s=20,
        )
        return open_run(cfg, RUN)

    def mirror(self) -> Any:
        from shipyard.store import LocalStore

        return LocalStore(self.work / "mirror" / RUN)

    def start(self) -> None:
        os.environ.update(S3_ENV)
        self.s3.start()
        logs = self.work / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        url = self.server_path.url if self.server_path else f"http://127.0.0.1:{self.port}"
        env = {name: clock.env for name, clock in self.clocks.items()}
        self.parts = {
            "trainer": Component("trainer", self._cli("trainer"), logs / "trainer.log", env.get("trainer")),
            "relay": Component("relay", self._cli("relay"), logs / "relay.log", env.get("relay")),
            "server": Component(
                "server",
                self._cli(
                    "serve",
                    "store.type=local",
                    f'store.root="{self.work / "mirror"}"',
                    f"inference.port={self.port}",
                ),
                logs / "server.log",
                env.get("server"),
            ),
            "worker": Component(
                "worker",
                self._cli("worker", "--server", url, "--worker-id", "w0"),
                logs / "worker.log",
                env.get("worker"),
            ),
        }
        self.watch.parts = self.parts
        self.parts["trainer"].start()  # claims the run: the others attach to it
        _until(lambda: _quiet(lambda: self.origin()) is not None, 180, "the trainer claiming the run")
        self.parts["relay"].start()
        _until(
            lambda: (self.work / "mirror" / RUN / "RUN.json").exists(), 120, "the relay stamping the mirror"
        )
        for name in ("server", "worker"):
            self.parts[name].start()

    def supervise(self) -> None:
        for part in self.parts.values():
            part.supervise()
        if self.s3.proc is None or self.s3.proc.poll() is not None:
            self.s3.proc = None
            self.s3.start()
        if self.watch.tick():  # a monitor round (every second): note the trainer's progress
            step = max_step(self)
            if step > self._seen_step:
                self._seen_step = step
                self.step_times.append(time.monotonic())

    targets = TARGETS
    """The components a freeze or a clock jump hits in turn."""

    def freeze(self, target: str) -> Frozen:
        """SIGSTOP the process group of ``target``'s process (its supervisor restarts it when named)."""
        part = self.parts[target]
        assert part.proc is not None
        pid = part.proc.pid
        freeze(pid)
        return Frozen(pid, lambda: part.proc is None or part.proc.pid != pid, lambda: thaw(pid))

    def clock_of(self, target: str) -> ClockShift:
        return self.clocks[target]

    def health_records(self) -> list[dict[str, Any]]:
        """Every component's last published record (the store's ``health/``, read directly, not through
        the fault proxy) and the server's from its ``/health``."""
        from shipyard.metrics.health import published_records

        origin = _quiet(self.origin)
        records = (_quiet(lambda: published_records(origin)) or []) if origin is not None else []
        server = self.server_probe.record()
        return records + ([server] if server is not None else [])

    def close_faults(self) -> None:
        for path in (self.store_path, self.server_path):
            if path is not None:
                path.close()
        if self.s3_disk is not None:
            self.s3_disk.close()

    def finished(self) -> bool:
        return self.parts["trainer"].done

    def stop_components(self) -> None:
        """Stop the run's processes (SIGTERM: each cleans up); the store stays up for the audit."""
        for name in ("worker", "server", "relay", "trainer"):
            if name in self.parts:
                self.parts[name].stop()


class RayChaosRun(ChaosRun):
    """The same run placed on Ray by one ``shipyard train`` driver (a local Ray instance: the trainer,
    an inference server and a rollout worker as actors, each publishing its record to the store).
    The supervisor here restarts the driver when it exits (a stalled trainer or server ends it with
    status 3, and it resumes); the driver restarts a silent worker itself. The clock jumps for the
    whole host (every actor inherits the driver's clock shift). No kills and no relay. For the
    partition, the server actor listens on a port chosen here (``inference.port``) and the worker
    reaches it through the fault proxy (``rollout.server_urls``)."""

    targets = ("worker", "server", "trainer")
    NAMES = {"worker": "worker w0", "server": "server 0", "trainer": "trainer"}

    def __init__(self, work: Path, steps: int, seed: int, faults: bool = True) -> None:
        super().__init__(work, steps, seed, faults)
        self.clocks = {"host": ClockShift(work, "host")} if faults else {}
        self.seen_pids: set[int] = set()
        """Every actor process that reported (their sandboxes and clusters are named after them)."""

    def start(self) -> None:
        os.environ.update(S3_ENV)
        self.s3.start()
        logs = self.work / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        argv = self._cli(
            "train",
            "run.placement=ray",
            "inference.num_servers=1",
            "rollout.num_workers=1",
            "eval.heldout_n=2",
            *(
                [f"inference.port={self.port}", f'rollout.server_urls=["{self.server_path.url}"]']
                if self.server_path
                else []
            ),
        )
        env = self.clocks["host"].env if self.clocks else None
        self.parts = {"driver": Component("driver", argv, logs / "driver.log", env)}
        self.parts["driver"].grace_s = 300.0  # killed before `ray.shutdown`, its actors would outlive it
        self.watch.parts = self.parts
        self.parts["driver"].start()
        _until(lambda: _quiet(lambda: self.origin()) is not None, 180, "the driver claiming the run")

    def freeze(self, target: str) -> Frozen:
        """SIGSTOP the actor process of ``target`` (its last record names it)."""
        name = self.NAMES[target]
        record = self.watch.monitor.record(name)
        assert record is not None, f"{name} never reported"
        pid = int(str(record["pid"]))
        os.kill(pid, signal.SIGSTOP)

        def replaced() -> bool:
            now = self.watch.monitor.record(name)
            return not Path(f"/proc/{pid}").exists() or (now is not None and now.get("pid") != pid)

        def resume() -> None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)

        return Frozen(pid, replaced, resume)

    def clock_of(self, target: str) -> ClockShift:
        return self.clocks["host"]

    def health_records(self) -> list[dict[str, Any]]:
        from shipyard.metrics.health import published_records

        origin = _quiet(self.origin)
        records = (_quiet(lambda: published_records(origin)) or []) if origin is not None else []
        self.seen_pids |= {int(str(r["pid"])) for r in records if str(r.get("pid", "")).isdigit()}
        return records

    def finished(self) -> bool:
        return self.parts["driver"].done

    def stop_components(self) -> None:
        if "driver" in self.parts:
            self.parts["driver"].stop()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _quiet(fn: Callable[[], Any]) -> Any:
    """``fn()``, or None when it raised (a probe of something that may be down)."""
    try:
        return fn()
    except Exception:
        return None


def _until(
    cond: Callable[[], bool], timeout_s: float, what: str, tick: Callable[[], None] | None = None
) -> float:
    """Wait for ``cond`` (calling ``tick`` meanwhile); seconds waited; TimeoutError naming ``what``."""
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > timeout_s:
            raise TimeoutError(f"chaos: {what} did not happen within {timeout_s:.0f} s")
        if tick is not None:
            tick()
        time.sleep(0.1)
    return time.monotonic() - t0


# ------------------------------------------------------------------------------------ kills and probes
def max_step(run: ChaosRun) -> int:
    from shipyard.metrics.logger import read_metrics

    path = run.work / "runs" / RUN / "metrics.jsonl"
    return max((r["step"] for r in read_metrics(path) if r.get("kind") == "train"), default=0)


def batches(run: ChaosRun) -> int:
    return len(_quiet(lambda: run.origin().list("rollouts/w0/")) or [])


def _health(run: ChaosRun) -> bool:
    import urllib.request

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{run.port}/health", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def _latest(store_fn: Callable[[], Any]) -> int:
    from shipyard.weights.versions import latest_version

    return _quiet(lambda: latest_version(store_fn())) or -1


def sandboxes(run: ChaosRun) -> list[int]:
    """Pids of the bwrap processes of the worker's sandboxes (children of the worker)."""
    worker = run.parts["worker"].proc
    if worker is None:
        return []
    return [pid for pid in descendants(worker.pid)[1:] if "bwrap" in _cmdline(pid).split(" ", 1)[0]]


def kill(run: ChaosRun, kind: str) -> Callable[[], bool]:
    """SIGKILL one component of ``kind``; returns the probe that says it recovered."""
    if kind in ("trainer", "server", "worker", "relay"):
        before = {"trainer": max_step, "worker": batches}.get(kind, lambda r: 0)(run)
        origin_latest = _latest(run.origin)
        run.parts[kind].kill()
        probes: dict[str, Callable[[], bool]] = {
            "trainer": lambda: run.finished() or max_step(run) > before,
            "server": lambda: run.parts["server"].alive() and _health(run),
            "worker": lambda: batches(run) > before,
            "relay": lambda: (
                run.finished() or _latest(run.mirror) > origin_latest
            ),  # the next version arrived
        }
        return probes[kind]
    if kind == "s3":
        assert run.s3.proc is not None
        os.killpg(run.s3.proc.pid, signal.SIGKILL)
        run.s3.proc.wait()
        run.s3.stop()  # the process is gone: this removes its sockets; the supervisor starts it again
        return lambda: _quiet(lambda: run.origin().list("control/")) is not None
    if kind == "postgres":
        owners = run.parts["worker"].pids
        old = set(postmasters(owners))
        for pid in old:
            os.kill(pid, signal.SIGKILL)
        return lambda: bool(set(postmasters(owners)) - old)
    assert kind == "sandbox", kind
    before = batches(run)
    pid = sandboxes(run)[0]
    with contextlib.suppress(ProcessLookupError):
        os.killpg(os.getpgid(pid), signal.SIGKILL)
    return lambda: batches(run) > before


def ready(run: ChaosRun, kind: str) -> bool:
    """Whether a component of ``kind`` is there to kill now (a postmaster or a sandbox may not be)."""
    if kind == "postgres":
        return bool(postmasters(run.parts["worker"].pids))
    if kind == "sandbox":
        return bool(sandboxes(run))
    if kind == "s3":
        return run.s3.proc is not None
    return run.parts[kind].alive()


def chaos(run: ChaosRun, rounds: int) -> tuple[list[dict[str, Any]], float]:
    """``rounds`` rounds over :data:`KINDS` (each round in a seeded random order): wait for the kind to
    be there, a random 0.5-3 s, SIGKILL it, wait for its recovery. Returns the kills and the seconds."""
    kills: list[dict[str, Any]] = []
    t0 = time.monotonic()
    for r in range(rounds):
        order = list(KINDS)
        run.rng.shuffle(order)
        for kind in order:
            if run.finished():
                raise RuntimeError(f"chaos: the run finished before round {r + 1} ended; raise --steps")
            _until(lambda k=kind: ready(run, k), 300, f"a {kind} to kill", run.supervise)
            deadline = time.monotonic() + run.rng.uniform(0.5, 3.0)
            _until(lambda d=deadline: time.monotonic() >= d, 10, "the delay", run.supervise)
            if not ready(run, kind):
                continue  # gone meanwhile (a session ended): the next round has it
            t_kill = time.monotonic()
            probe = kill(run, kind)
            recovery = _until(probe, 600, f"recovery of the {kind}", run.supervise)
            kills.append({"kind": kind, "round": r, "at_s": t_kill - t0, "recovery_s": recovery})
            print(f"killed {kind:8s} at {t_kill - t0:6.1f} s, recovered in {recovery:5.1f} s", flush=True)
    return kills, time.monotonic() - t0


def orphaned(store: Any) -> list[str]:
    """Objects under ``weights/`` that no committed version names (shards of publishes that never
    committed, or of versions half deleted)."""
    from shipyard.weights.types import SUBSCRIBERS_PREFIX, version_dir
    from shipyard.weights.versions import read_manifests

    manifests = read_manifests(store)
    named = {f"{version_dir(v)}/manifest.json" for v in manifests}
    for v, m in manifests.items():
        named |= {f"{version_dir(v)}/{s.name}" for enc in m.encodings.values() for s in enc.shards}
    keys = [
        k for k in store.list("weights/") if k != "weights/LATEST" and not k.startswith(SUBSCRIBERS_PREFIX)
    ]
    return [k for k in keys if k not in named]


def audit(run: ChaosRun, finished: bool = True) -> dict[str, Any]:
    """The invariants after the run: versions, groups, leaks, orphans (module doc); over every step of
    a ``finished`` run, or up to the last step trained of one stopped early."""
    from collections import Counter

    from shipyard.metrics.logger import read_metrics
    from shipyard.weights.versions import read_manifest

    origin = run.origin()
    consumed = {
        r["step"]: r
        for r in read_metrics(run.work / "runs" / RUN / "metrics.jsonl")
        if r.get("kind") == "consumed"
    }
    upto = run.steps if finished else max(consumed, default=0)
    lost = [
        s
        for s in range(1, upto + 1)
        if s not in consumed
        or _quiet(lambda s=s: read_manifest(origin, s).state_digest) != consumed[s]["digest"]
    ]
    groups = Counter(g for r in consumed.values() for g in r["groups"])
    return {
        "steps_trained": len(consumed),
        "lost_versions": len(lost),
        "double_trained_groups": sum(n - 1 for n in groups.values() if n > 1),
        "orphaned_store_objects": len(orphaned(origin))
        + (len(orphaned(run.mirror())) if not isinstance(run, RayChaosRun) else 0),
        **leaks(
            run.work,
            {pid for part in run.parts.values() for pid in part.pids} | getattr(run, "seen_pids", set()),
            run.s3.proc,
            ray=isinstance(run, RayChaosRun),
        ),
    }


def leaks(
    work: Path, pids: set[int], store: subprocess.Popen[bytes] | None, ray: bool = False
) -> dict[str, Any]:
    """Sandboxes, clusters and processes the run's components (``pids``, every incarnation) left
    (the S3 server ``store``, still up for the audit, aside)."""
    import re

    tmp = [Path(tempfile.gettempdir()), Path("/var/tmp")]
    owned = re.compile(r"^shipyard-(?:sb|grade|pg)-(\d+)-")
    dirs = [
        d for t in tmp if t.is_dir() for d in t.iterdir() if (m := owned.match(d.name)) and int(m[1]) in pids
    ]
    spared = set(descendants(store.pid)) if store is not None else set()
    ours = ("ray::", "/raylet", "gcs_server") if ray else ()  # a Ray instance the driver did not stop
    alive = [
        f"{pid} {cmd[:200]}"
        for pid, cmd in _procs()
        if pid != os.getpid()
        and pid not in spared
        and (str(work) in cmd or any(str(d) in cmd for d in dirs) or any(o in cmd for o in ours))
    ]
    return {
        "leaked_sandboxes": sum("shipyard-pg-" not in d.name for d in dirs),
        "leaked_processes": len(alive) + sum("shipyard-pg-" in d.name for d in dirs),
        "leaked": alive + [str(d) for d in dirs],
    }


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--rounds", type=int, default=None, help="rounds over the 7 kinds (default 3, --quick 1)")
    p.add_argument(
        "--stall-rounds",
        type=int,
        default=None,
        help="rounds over the 6 stall kinds after the kills (benchmarks/stalls.py; default 2, --quick 0)",
    )
    p.add_argument(
        "--stall-kinds",
        default=",".join(STALLS),
        help="comma-separated stall kinds (default: all six); a run of some kinds on Ray is merged "
        "into chaos.json under `ray_<kinds>`, beside the full run's `ray`",
    )
    p.add_argument("--steps", type=int, default=None, help="trainer steps (default: enough for the rounds)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--work", type=Path, help="keep the run (logs, run dir) here instead of a temporary dir")
    p.add_argument(
        "--placement",
        choices=["process", "ray"],
        default="process",
        help="ray: the run as Ray actors under one `shipyard train`, stalls only (merged into chaos.json under `ray`)",
    )
    args = p.parse_args()
    kinds = tuple(k for k in args.stall_kinds.split(",") if k)
    if not kinds or set(kinds) - set(STALLS):
        raise ValueError(f"--stall-kinds {args.stall_kinds!r}: give some of {', '.join(STALLS)}")
    if set(kinds) != set(STALLS) and args.placement != "ray":
        raise ValueError(
            "--stall-kinds selects kinds on --placement ray only (the process run records every kind)"
        )
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # a stopped benchmark stops its run too
    ray = args.placement == "ray"
    rounds = args.rounds if args.rounds is not None else (0 if ray else 1 if args.quick else 3)
    stall_rounds = args.stall_rounds if args.stall_rounds is not None else (0 if args.quick else 2)
    steps = args.steps or 60 * max(rounds, 1)
    with tempfile.TemporaryDirectory(prefix="chaos-") as tmp:
        work = args.work or Path(tmp)
        figures = run_chaos(work, rounds, steps, args.seed, stall_rounds, kinds, args.placement)
    if rounds:
        table(
            "chaos: recovery after SIGKILL, per component kind",
            {
                k: {"kills": figures["kinds"][k], "max recovery s": figures["max_recovery_s"][k]}
                for k in figures["kinds"]
            },
        )
    if stall_rounds:
        table(
            "chaos: stalls (detect: first naming after the injection; recover: after the fault ended)",
            {
                k: {
                    "stalls": n,
                    "max detect s": figures["detect_s"][k],
                    "max recover s": figures["recover_s"][k],
                }
                for k, n in figures["stalls"].items()
            },
        )
    table("chaos: invariants (all 0)", {"": {k: figures[k] for k in INVARIANTS}})
    if ray:  # beside the process placement's figures
        path = args.out / f"chaos{'_quick' if args.quick else ''}.json"
        merged = json.loads(path.read_text()) if path.exists() else {}
        key = "ray" if set(kinds) == set(STALLS) else "ray_" + "_".join(kinds)
        merged[key] = {**figures, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
        tmp_path = path.with_suffix(".tmp")
        tmp_path.write_text(json.dumps(merged, indent=1) + "\n")
        tmp_path.replace(path)
        print(f"merged into {path} under {key!r}")
    else:  # keeping the Ray figures a `--placement ray` run merged in
        path = args.out / f"chaos{'_quick' if args.quick else ''}.json"
        old = json.loads(path.read_text()) if path.exists() else {}
        kept = {k: v for k, v in old.items() if k == "ray" or k.startswith("ray_")}
        write_results(args, "chaos", {**figures, **kept})


INVARIANTS = (
    "lost_versions",
    "double_trained_groups",
    "leaked_sandboxes",
    "leaked_processes",
    "orphaned_store_objects",
    "silent_hangs",
)


def run_chaos(
    work: Path,
    rounds: int,
    steps: int,
    seed: int,
    stall_rounds: int = 0,
    stall_kinds: tuple[str, ...] = STALLS,
    placement: str = "process",
) -> dict[str, Any]:
    """Start the run, kill ``rounds`` x 7 times, then stall it ``stall_rounds`` x 6 times
    (:mod:`stalls`), let it finish (a run with stalls is stopped where it is: its length is not
    known in advance), stop it, audit it; the figures."""
    if placement == "ray" and rounds:
        raise ValueError("--placement ray runs stalls only: --rounds 0")
    make = RayChaosRun if placement == "ray" else ChaosRun
    run = make(work, steps if not stall_rounds else 1_000_000, seed, faults=stall_rounds > 0)
    stall_log: list[dict[str, Any]] = []
    try:
        run.start()
        kills, chaos_s = chaos(run, rounds)
        if stall_rounds:
            stall_log = run_stalls(run, stall_rounds, probes(run), lambda: run.step_times, stall_kinds)
            finish_s = 0.0
        else:
            finish_s = _until(run.finished, 1800, "the run finishing its steps", run.supervise)
        run.stop_components()
        invariants = audit(run, finished=not stall_rounds)
    finally:
        run.stop_components()
        run.s3.stop()
        run.close_faults()
    kinds: dict[str, list[float]] = {}
    for k in kills:
        kinds.setdefault(k["kind"], []).append(k["recovery_s"])
    return {
        "kills": len(kills),
        "kinds": {k: len(v) for k, v in kinds.items()},
        "max_recovery_s": {k: max(v) for k, v in kinds.items()},
        "restarts": {name: part.restarts for name, part in run.parts.items()},
        "steps": steps if not stall_rounds else invariants["steps_trained"],
        "chaos_s": chaos_s,
        "finish_s": finish_s,
        "kill_log": kills,
        **stall_figures(stall_log),
        **invariants,
    }


def probes(run: ChaosRun) -> Probes:
    """What :func:`stalls.run_stalls` asks of the run."""

    def restart_store() -> None:
        run.s3.stop()
        run.s3.start()

    def writable() -> bool:
        try:
            run.origin().put("chaos/probe", b"x")
        except Exception:
            return False
        return True

    return Probes(
        steps=lambda: max_step(run),
        batches=lambda: batches(run),
        server_up=(lambda: _health(run))
        if not isinstance(run, RayChaosRun)
        else (lambda: all(x["component"] != "server 0" for x in run.watch.monitor.stalled())),
        mirror_latest=lambda: _latest(run.mirror),
        origin_latest=lambda: _latest(run.origin),
        store_writable=writable,
        restart_store=restart_store,
        until=lambda cond, timeout_s, what: _until(cond, timeout_s, what, run.supervise),
    )


if __name__ == "__main__":
    main()
