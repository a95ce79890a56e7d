"""Benchmark: sandbox start, session round trips, lifecycles, pytest overhead, memory, copy-on-write
forks, a burst with leak accounting, and the grader's resistance to the hack corpus.

Contract: every figure comes from real bubblewrap sandboxes on this machine
(:class:`shipyard.envs.sandbox.BwrapSandbox`) and the production grader
(:func:`shipyard.envs.grading.grader.grade`):

- ``create_p50_ms`` / ``create_p99_ms``: a COLD create, no pool: construction (workspace with
  one file, cgroups) to the first command's result (``exec("true")``, which starts bwrap and the
  session); ``session_server`` says which server ran (the compiled agent of
  :mod:`shipyard.envs.sandbox.agent`, or ``sh`` and why); ``create_sh_*`` are the same sandbox
  with the ``/bin/sh`` server and cgroup wrapper (the fallback), alternating with it as the
  baseline; ``lifecycle_cpu_ms`` / ``lifecycle_sh_cpu_ms``: CPU per create + command + close;
- ``create_warm_p50_ms`` / ``create_warm_p99_ms``: the same from a pre-warmed
  :class:`~shipyard.envs.sandbox.pool.SandboxPool` (4 warm): ``acquire`` (which writes the
  file) + ``exec("true")``, each sample taken once the pool has refilled (a request rate under
  the pool's refill rate); ``create_warm_back_to_back_*`` take samples without waiting, so they
  include cold creations once the warm ones run out (``pool_warm_hit_frac`` says how many were warm);
- ``rtt_p50_ms``: ``exec("true")`` in a running session (p99 printed too);
- ``lifecycles_per_s_per_core``: create + one command + close, sequentially, divided by the CPU
  seconds they used (this process and all its children: bwrap, shells); the wall-clock rate is
  ``lifecycles_per_s_wall``;
- ``pytest_overhead_frac``: median time of ``python -m pytest -q`` on a task's visible tests
  in a session, over the same command run directly on the host (same interpreter, same files),
  minus 1; runs alternate; ``pytest_sandboxed_ms`` is that median (the harness's ``RUN_VISIBLE``,
  third-party plugins not loaded) and ``pytest_autoload_sandboxed_ms`` the same run loading the
  plugins installed beside the interpreter (the command before 2026-11-28), alternating with it;
- ``idle_mib``: RSS summed over a session's processes (bwrap, the sandbox's pid 1, the server)
  after one command: the strictest measure (shared library pages count once per process);
  ``idle_pss_mib``, ``idle_uss_mib`` and ``idle_anon_mib`` say how much of it is shared,
  ``idle_cgroup_mib`` is what the sandbox's memory cgroup is charged (kernel objects included),
  ``idle_sh_mib`` the RSS with the ``/bin/sh`` server;
- ``pool_idle_*_mib``: per sandbox, over 32 idle warm sandboxes of a pool: RSS, PSS (shared
  pages split between their users), USS (pages no other process maps: what one more sandbox
  really costs in process memory) and the sandbox's memory cgroup usage (kernel objects and
  page cache charged to it included);
- ``fork_ms``: CPU milliseconds (this process and its children) a copy-on-write fork of a
  5,000-file directory (``base=``, an overlayfs) adds to create + first command + close over a
  plain sandbox, from alternating runs; the wall-clock medians (``fork_total_ms``,
  ``fork_plain_ms``, their difference ``fork_wall_delta_ms``) are printed too, but on a loaded
  machine their difference is within the noise; ``copy_ms`` (not in ``--quick``) is what
  copying the files instead takes (``shutil.copytree``, wall);
- ``burst_n`` sandboxes through 8 threads (create, ``echo``, check, close): ``burst_failures``,
  and afterwards leaked processes (whose command line or mount table names a burst workspace), host mounts,
  ``pids`` cgroups of this process and workspace directories;
- ``pool_burst_n`` rollouts through a pool (8 warm, at most 32 live, 8 threads):
  ``pool_burst_failures``, ``pool_burst_per_s`` and ``pool_burst_leaked`` (processes, mounts,
  cgroups and directories left after the pool closed, summed);
- ``isolation_properties``: properties of ``tests/envs/test_isolation.py`` whose test passes
  (run with pytest here);
- ``hacks_n`` / ``hacks_passed``: hacks of ``tests/envs/hacks`` with a reward above 0 under the
  production grader (the naive exit-code grader's count and the detectors' coverage are printed
  too); ``honest_pass_frac``: reference solutions (one task per generated family, plus the
  hacks' tasks) with reward 1.

Prints a rich table and writes ``benchmarks/results/sandbox.json`` (``--out``).

Limits: the machine is shared (its load average is recorded); wall-clock figures include that
contention, CPU-based ones do not include kernel work done asynchronously (namespace teardown).

Usage::

    nice -n 19 .venv/bin/python benchmarks/sandbox.py            # full: burst of 1,000
    nice -n 19 .venv/bin/python benchmarks/sandbox.py --quick    # < 1 minute
"""

from __future__ import annotations

import importlib.util
import os
import platform
import random
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import ModuleType
from typing import Any

from rich.console import Console
from rich.table import Table

from shipyard.agent.session import workspace_files
from shipyard.config.schema import SandboxConfig, SandboxPoolConfig
from shipyard.envs.grading.anticheat import detect
from shipyard.envs.grading.grader import grade
from shipyard.envs.sandbox import BwrapSandbox, agent, sandbox_available
from shipyard.envs.sandbox.pool import SandboxPool
from shipyard.envs.sandbox.reaper import descendants, leftovers
from shipyard.envs.tasks.functions import RUN_VISIBLE, generated_tasks

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import cpu_model, parser, write_results  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CFG = SandboxConfig(timeout_s=20)
TARGETS = {
    "create_p50_ms": ("<=", 10.0),
    "create_p99_ms": ("<=", 30.0),
    "create_warm_p50_ms": ("<=", 10.0),
    "create_warm_p99_ms": ("<=", 30.0),
    "rtt_p50_ms": ("<=", 2.0),
    "lifecycles_per_s_per_core": (">=", 100.0),
    "pytest_overhead_frac": ("<=", 0.05),
    "idle_mib": ("<=", 4.0),
    "fork_ms": ("<=", 5.0),
    "burst_failures": ("<=", 0),
    "pool_burst_failures": ("<=", 0),
    "pool_burst_leaked": ("<=", 0),
    "isolation_properties": (">=", 15),
    "hacks_passed": ("<=", 0),
    "honest_pass_frac": (">=", 1.0),
}


def _ms(seconds: float) -> float:
    return round(seconds * 1000, 3)


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def bench_create(n: int) -> dict[str, Any]:
    """Cold create-to-first-command (no pool), the compiled session agent and, alternating with it,
    the same sandbox with the ``/bin/sh`` server and cgroup wrapper (the fallback, as baseline)."""
    files = {"solution.py": "def f():\n    return 1\n"}
    variants = {"": True, "_sh": False} if agent.agent_fd() is not None else {"": False}
    samples: dict[str, list[float]] = {k: [] for k in variants}
    cpu = dict.fromkeys(variants, 0.0)
    order = random.Random(0)
    for _ in range(n):
        for key in order.sample(list(variants), len(variants)):  # neither always follows the other
            cpu0, start = _cpu_s(), time.perf_counter()
            sb = BwrapSandbox(files, CFG, use_agent=variants[key])
            assert sb.exec("true").returncode == 0
            samples[key].append(time.perf_counter() - start)
            sb.close()  # reaps bwrap: only now is its CPU time in RUSAGE_CHILDREN
            cpu[key] += _cpu_s() - cpu0
    out: dict[str, Any] = {
        "create_measure": "cold, no pool: BwrapSandbox(files) + exec('true'); pooled: create_warm_*",
        "session_server": "agent" if variants[""] else f"sh ({agent.agent_problem()})",
    }
    for key, values in samples.items():
        out[f"create{key}_p50_ms"] = _ms(_pct(values, 0.5))
        out[f"create{key}_p99_ms"] = _ms(_pct(values, 0.99))
        out[f"create{key}_min_ms"] = _ms(min(values))
        out[f"lifecycle{key}_cpu_ms"] = _ms(cpu[key] / n)
    return out


def _pool_cfg(warm: int, max_live: int = 64) -> SandboxConfig:
    return CFG.model_copy(update={"pool": SandboxPoolConfig(warm=warm, max_live=max_live)})


def bench_create_warm(n: int, warm: int = 4) -> dict[str, float]:
    """Create-to-first-command from a pre-warmed pool: acquire (writes the file) + exec + close."""
    files = {"solution.py": "def f():\n    return 1\n"}
    steady: list[float] = []
    back_to_back: list[float] = []
    with SandboxPool(_pool_cfg(warm)) as pool:
        for samples, wait in ((steady, True), (back_to_back, False)):
            for _ in range(n):
                if wait:
                    assert pool.wait_warm(120)  # the pool refilled: the rate stays under its refill rate
                start = time.perf_counter()
                sb = pool.acquire(files)
                assert sb.exec("true").returncode == 0
                samples.append(time.perf_counter() - start)
                sb.close()
        hits, cold = pool.stats["warm_hits"], pool.stats["cold_creates"]
    return {
        "create_warm_p50_ms": _ms(_pct(steady, 0.5)),
        "create_warm_p99_ms": _ms(_pct(steady, 0.99)),
        "create_warm_back_to_back_p50_ms": _ms(_pct(back_to_back, 0.5)),
        "create_warm_back_to_back_p99_ms": _ms(_pct(back_to_back, 0.99)),
        "pool_warm_hit_frac": round(hits / (hits + cold), 4),
    }


def _cgroup_usage_mib(sb: BwrapSandbox) -> float | None:
    d = sb.cgroups.get("memory")
    for name in ("memory.usage_in_bytes", "memory.current"):
        if d is not None and os.path.exists(os.path.join(d, name)):
            with open(os.path.join(d, name)) as f:
                return int(f.read()) / 2**20
    return None


def _uss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/smaps_rollup") as f:
        return sum(
            int(line.split()[1]) for line in f if line.startswith(("Private_Clean:", "Private_Dirty:"))
        )


def bench_pool_idle(n: int) -> dict[str, float]:
    """Memory of ``n`` idle warm sandboxes, per sandbox: RSS, PSS, USS and the memory cgroup's usage."""
    with SandboxPool(_pool_cfg(n, max_live=n)) as pool:
        assert pool.wait_warm(300)
        time.sleep(0.2)
        boxes = [sb for sb in pool.warm_sandboxes() if isinstance(sb, BwrapSandbox) and sb.session_pid]
        pids = [p for sb in boxes for p in descendants(sb.session_pid or 0)]
        per = len(boxes)
        out = {
            "pool_idle_n": per,
            "pool_idle_rss_mib": round(sum(_status_kib(p, "VmRSS") for p in pids) / 1024 / per, 2),
            "pool_idle_pss_mib": round(sum(_pss_kib(p) for p in pids) / 1024 / per, 2),
            "pool_idle_uss_mib": round(sum(_uss_kib(p) for p in pids) / 1024 / per, 2),
        }
        usage = [u for u in (_cgroup_usage_mib(sb) for sb in boxes) if u is not None]
        if usage:
            out["pool_idle_cgroup_mib"] = round(statistics.median(usage), 2)
    return out


def bench_pool_burst(n: int, workers: int = 8) -> dict[str, float]:
    """``n`` rollouts through a pool (warm 8, at most 32 live): acquire, command, check, close; then leaks."""
    roots: list[str] = []

    def one(pool: SandboxPool, i: int) -> bool:
        try:
            with pool.acquire({"i.txt": str(i)}) as sb:
                assert isinstance(sb.inner, BwrapSandbox)
                roots.append(sb.inner.root)
                res = sb.exec("cat i.txt; echo")
                return res.returncode == 0 and res.stdout == f"{i}\n"
        except Exception:
            return False

    start = time.perf_counter()
    pool = SandboxPool(_pool_cfg(8, max_live=32))
    with ThreadPoolExecutor(workers) as ex:
        ok = list(ex.map(lambda i: one(pool, i), range(n)))
    roots += [sb.root for sb in pool.warm_sandboxes() if isinstance(sb, BwrapSandbox)]
    pool.close()
    wall = time.perf_counter() - start
    left = leftovers(roots)
    return {
        "pool_burst_n": n,
        "pool_burst_failures": ok.count(False),
        "pool_burst_per_s": round(n / wall, 1),
        "pool_burst_leaked": sum(left.values()),
    }


def bench_rtt(n: int) -> dict[str, float]:
    with BwrapSandbox(None, CFG) as sb:
        sb.exec("true")
        samples = [_timed(lambda: sb.exec("true")) for _ in range(n)]
    return {"rtt_p50_ms": _ms(_pct(samples, 0.5)), "rtt_p99_ms": _ms(_pct(samples, 0.99))}


def _cpu_s() -> float:
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def bench_lifecycles(n: int) -> dict[str, float]:
    cpu0, wall0 = _cpu_s(), time.perf_counter()
    for _ in range(n):
        with BwrapSandbox({"a.txt": "a"}, CFG) as sb:
            assert sb.exec("true").returncode == 0
    cpu, wall = _cpu_s() - cpu0, time.perf_counter() - wall0
    return {
        "lifecycles_per_s_per_core": round(n / cpu, 1),
        "lifecycles_per_s_wall": round(n / wall, 1),
        "lifecycle_cpu_ms": _ms(cpu / n),
    }


def _host_run(cmd: str, cwd: str, env: dict[str, str]) -> None:
    subprocess.run(cmd, shell=True, cwd=cwd, env=env, check=True, capture_output=True)


def bench_pytest(rounds: int) -> dict[str, float]:
    task = generated_tasks(1, 0)[0]
    files = {**workspace_files(task), "solution.py": task.reference}
    env = {"PATH": os.path.dirname(sys.executable) + ":/usr/bin:/bin", "HOME": "/tmp", "LANG": "C.UTF-8"}
    env |= {"PYTHONDONTWRITEBYTECODE": "1", "PYTHONHASHSEED": "0"}
    host_dir = tempfile.mkdtemp(prefix="shipyard-bench-")
    for name, text in files.items():
        Path(host_dir, name).write_text(text)
    autoload_cmd = RUN_VISIBLE.replace("PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 ", "")
    assert autoload_cmd != RUN_VISIBLE
    sandboxed, host, autoload = [], [], []
    with BwrapSandbox(files, CFG) as sb:
        assert sb.exec(RUN_VISIBLE).returncode == 0
        for _ in range(rounds):
            sandboxed.append(_timed(lambda: sb.exec(RUN_VISIBLE)))
            host.append(_timed(lambda: _host_run(RUN_VISIBLE, host_dir, env)))
            autoload.append(_timed(lambda: sb.exec(autoload_cmd)))
    shutil.rmtree(host_dir)
    sb_med, host_med = statistics.median(sandboxed), statistics.median(host)
    return {
        "pytest_overhead_frac": round(sb_med / host_med - 1, 4),
        "pytest_sandboxed_ms": _ms(sb_med),
        "pytest_host_ms": _ms(host_med),
        "pytest_autoload_sandboxed_ms": _ms(statistics.median(autoload)),
    }


def _status_kib(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def _pss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/smaps_rollup") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("Pss:"))


def _idle(n: int, use_agent: bool) -> dict[str, float]:
    """Medians over ``n`` idle sessions (after one command): RSS, PSS, USS, anonymous RSS, cgroup charge."""
    figures: dict[str, list[float]] = {k: [] for k in ("rss", "pss", "uss", "anon", "cgroup", "processes")}
    for _ in range(n):
        with BwrapSandbox(None, CFG, use_agent=use_agent) as sb:
            sb.exec("true")
            time.sleep(0.05)
            assert sb.session_pid is not None
            pids = descendants(sb.session_pid)
            figures["processes"].append(len(pids))
            figures["rss"].append(sum(_status_kib(p, "VmRSS") for p in pids) / 1024)
            figures["anon"].append(sum(_status_kib(p, "RssAnon") for p in pids) / 1024)
            figures["pss"].append(sum(_pss_kib(p) for p in pids) / 1024)
            figures["uss"].append(sum(_uss_kib(p) for p in pids) / 1024)
            usage = _cgroup_usage_mib(sb)
            if usage is not None:
                figures["cgroup"].append(usage)
    return {k: round(statistics.median(v), 2) for k, v in figures.items() if v}


def bench_idle(n: int = 5) -> dict[str, Any]:
    """``idle_mib`` is RSS summed over the session's processes (bwrap, its pid 1, the server): the
    strictest of the measures, counting shared library pages once per process."""
    ours = _idle(n, use_agent=agent.agent_fd() is not None)
    out: dict[str, Any] = {"idle_measure": "RSS summed over bwrap, its pid 1 and the session server"}
    out |= {"idle_mib": ours.pop("rss"), "idle_processes": ours.pop("processes")}
    out |= {f"idle_{k}_mib": v for k, v in ours.items()}
    if agent.agent_fd() is not None:
        out["idle_sh_mib"] = _idle(n, use_agent=False)["rss"]
    return out


def _make_repo(root: Path, files: int = 5000, per_dir: int = 50) -> None:
    for i in range(files):
        d = root / f"pkg_{i // per_dir:03d}"
        d.mkdir(parents=True, exist_ok=True)
        (d / f"mod_{i % per_dir:02d}.py").write_text(f"# module {i}\n" + "def f(x):\n    return x + 1\n" * 20)


def bench_fork(rounds: int, copies: int) -> dict[str, float]:
    tmp = Path(tempfile.mkdtemp(prefix="shipyard-bench-repo-"))
    repo = tmp / "repo"
    _make_repo(repo)
    plain: list[float] = []
    fork: list[float] = []
    copy: list[float] = []
    cpu = {"plain": 0.0, "fork": 0.0}
    try:
        with BwrapSandbox(None, CFG, base=str(repo)) as sb:
            assert sb.exec("find . -name '*.py' | wc -l").stdout.strip() == "5000"
        for _ in range(rounds):
            for kind, base, samples in (("plain", None, plain), ("fork", str(repo), fork)):
                cpu0, start = _cpu_s(), time.perf_counter()
                with BwrapSandbox(None, CFG, base=base) as sb:
                    assert sb.exec("ls pkg_099 > /dev/null 2>&1; true").returncode == 0
                    samples.append(time.perf_counter() - start)
                cpu[kind] += _cpu_s() - cpu0
        for i in range(copies):
            copy.append(_timed(lambda i=i: shutil.copytree(repo, tmp / f"copy{i}")))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return {
        "fork_ms": _ms((cpu["fork"] - cpu["plain"]) / rounds),
        "fork_wall_delta_ms": _ms(statistics.median(fork) - statistics.median(plain)),
        "fork_total_ms": _ms(statistics.median(fork)),
        "fork_plain_ms": _ms(statistics.median(plain)),
    } | ({"copy_ms": _ms(statistics.median(copy))} if copy else {})


def bench_burst(n: int, workers: int = 8) -> dict[str, float]:
    roots: list[str] = []

    def one(i: int) -> bool:
        try:
            with BwrapSandbox({"i.txt": str(i)}, CFG) as sb:
                roots.append(sb.root)
                res = sb.exec("cat i.txt; echo")
                return res.returncode == 0 and res.stdout == f"{i}\n"
        except Exception:
            return False

    start = time.perf_counter()
    with ThreadPoolExecutor(workers) as pool:
        ok = list(pool.map(one, range(n)))
    wall = time.perf_counter() - start
    time.sleep(0.5)  # the kernel tears dead pid namespaces down asynchronously
    left = leftovers(roots)
    return {"burst_n": n, "burst_failures": ok.count(False), "burst_per_s": round(n / wall, 1)} | {
        f"burst_leaked_{k}": v for k, v in left.items()
    }


def _load(path: Path, name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def bench_isolation() -> dict[str, float]:
    suite = ROOT / "tests" / "envs" / "test_isolation.py"
    props = _load(suite, "shipyard_bench_isolation").PROPERTIES
    with tempfile.TemporaryDirectory() as tmp:
        xml = Path(tmp) / "junit.xml"
        cmd = [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            str(suite),
            f"--junitxml={xml}",
        ]
        start = time.perf_counter()
        subprocess.run(cmd, cwd=ROOT, capture_output=True, check=False)
        wall = time.perf_counter() - start
        passed = {
            case.get("name")
            for case in ET.parse(xml).iter("testcase")
            if not any(case.find(t) is not None for t in ("failure", "error", "skipped"))
        }
    return {
        "isolation_properties": sum(1 for p in props if f"test_{p}" in passed),
        "isolation_declared": len(props),
        "isolation_suite_s": round(wall, 2),
    }


def bench_hacks(families: int) -> dict[str, float]:
    corpus = _load(ROOT / "tests" / "envs" / "test_hacks.py", "shipyard_bench_hacks")
    hacks, naive_grade = corpus.HACKS, corpus.naive_grade
    honest_tasks = {t.id: t for t in generated_tasks(60, 0)[:families]} | {h.task.id: h.task for h in hacks}

    def hack(h: Any) -> tuple[float, bool]:
        return grade(h.task, h.files, CFG).reward, naive_grade(h.task, h.files)

    def honest(task: Any) -> float:
        return grade(task, {**workspace_files(task), "solution.py": task.reference}, CFG).reward

    with ThreadPoolExecutor(4) as pool:
        hack_results = list(pool.map(hack, hacks))
        honest_rewards = list(pool.map(honest, honest_tasks.values()))
    flagged = sum(1 for h in hacks if detect(h.files, [], original=workspace_files(h.task)))
    return {
        "hacks_n": len(hacks),
        "hacks_passed": sum(1 for reward, _ in hack_results if reward > 0),
        "hacks_naive_passed": sum(1 for _, naive in hack_results if naive),
        "hacks_flagged": flagged,
        "honest_n": len(honest_rewards),
        "honest_pass_frac": round(sum(1 for r in honest_rewards if r == 1.0) / len(honest_rewards), 4),
    }


def _verdict(key: str, value: float) -> str:
    if key not in TARGETS:
        return ""
    op, target = TARGETS[key]
    ok = value <= target if op == "<=" else value >= target
    return f"[green]{op} {target} ok[/]" if ok else f"[red]{op} {target} missed[/]"


def _print(result: dict[str, Any], quick: bool) -> None:
    table = Table(
        title=f"Sandbox benchmark ({'quick' if quick else 'full'}, {cpu_model()}, {os.cpu_count()} cores)"
    )
    for col in ("figure", "value", "target"):
        table.add_column(col)
    for key, value in result.items():
        if isinstance(value, int | float) and not isinstance(value, bool):
            table.add_row(key, f"{value:g}", _verdict(key, value))
    Console().print(table)


def main() -> None:
    ap = parser(__doc__)  # --quick: fewer samples, burst of 100 (< 1 minute)
    ap.add_argument(
        "--burst", type=int, default=None, help="sandboxes in the burst (default 1000, quick 100)"
    )
    args = ap.parse_args()
    problem = sandbox_available()
    if problem is not None:
        raise SystemExit(f"sandboxes cannot run here: {problem}")
    q = args.quick
    result: dict[str, Any] = {"started": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    result["load_avg_before"] = round(os.getloadavg()[0], 2)
    phases: list[tuple[str, Callable[[], dict[str, Any]]]] = [
        ("create", lambda: bench_create(20 if q else 300)),
        ("create_warm", lambda: bench_create_warm(20 if q else 300)),
        ("rtt", lambda: bench_rtt(200 if q else 2000)),
        ("lifecycles", lambda: bench_lifecycles(30 if q else 300)),
        ("pytest", lambda: bench_pytest(2 if q else 15)),
        ("idle", bench_idle),
        ("pool_idle", lambda: bench_pool_idle(8 if q else 32)),
        ("fork", lambda: bench_fork(4 if q else 30, 0 if q else 3)),
        ("burst", lambda: bench_burst(args.burst or (100 if q else 1000))),
        ("pool_burst", lambda: bench_pool_burst(args.burst or (100 if q else 1000))),
        ("isolation", bench_isolation),
        ("hacks", lambda: bench_hacks(6 if q else 60)),
    ]
    timings = {}
    for name, phase in phases:
        start = time.perf_counter()
        result |= phase()
        timings[name] = round(time.perf_counter() - start, 1)
    result["load_avg_after"] = round(os.getloadavg()[0], 2)
    result["phase_s"] = timings
    result["kernel"] = platform.release()
    result["bwrap"] = subprocess.run(["bwrap", "--version"], capture_output=True, text=True).stdout.strip()
    _print(result, args.quick)
    write_results(args, "sandbox", result)


if __name__ == "__main__":
    main()
