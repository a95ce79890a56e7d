"""SandboxPool: warm hand-out, refill, backpressure, the CPU-slot cap, forks, and no leaks after a burst.

Every test uses real bubblewrap sandboxes (skipped with the install hint where bwrap cannot run).
Leak checks look at the host (:func:`~shipyard.envs.sandbox.reaper.leftovers`): processes whose
command line or mount table names a sandbox's directory, this process's ``shipyard-sb-PID-*`` cgroups, the
sandboxes' directories, the mount table, and this process's children.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from shipyard.config.schema import SandboxConfig, SandboxPoolConfig
from shipyard.envs.sandbox import BwrapSandbox, sandbox_available
from shipyard.envs.sandbox.pool import PooledSandbox, SandboxPool
from shipyard.envs.sandbox.reaper import leftovers

pytestmark = pytest.mark.skipif(sandbox_available() is not None, reason=str(sandbox_available()))


def _cfg(warm: int, max_live: int = 8, cpu_slots: int = 0) -> SandboxConfig:
    pool = SandboxPoolConfig(warm=warm, max_live=max_live, cpu_slots=cpu_slots, acquire_timeout_s=60)
    return SandboxConfig(timeout_s=20, memory_mb=256, max_processes=32, pool=pool)


def _children() -> set[int]:
    with open(f"/proc/{os.getpid()}/task/{os.getpid()}/children") as f:
        own = {int(p) for p in f.read().split()}
    for task in os.listdir(f"/proc/{os.getpid()}/task"):
        try:
            with open(f"/proc/{os.getpid()}/task/{task}/children") as f:
                own |= {int(p) for p in f.read().split()}
        except OSError:
            continue
    return own


def test_warm_sandboxes_are_started_and_refilled() -> None:
    with SandboxPool(_cfg(warm=2)) as pool:
        assert pool.wait_warm(60)
        warm = pool.warm_sandboxes()
        assert len(warm) == 2 and all(isinstance(sb, BwrapSandbox) and sb.session_pid for sb in warm)
        with pool.acquire({"task.py": "print(6 * 7)\n"}) as sb:
            assert isinstance(sb, PooledSandbox) and sb.inner is warm[0]
            assert sb.exec("python task.py").stdout == "42\n"
            assert sb.diff().is_empty()  # the task's files are the base
            sb.exec("echo x > out.txt")
            assert list(sb.diff().added) == ["out.txt"]
        assert pool.wait_warm(60) and pool.stats["warm_hits"] == 1 and pool.stats["cold_creates"] == 0
        assert warm[0] not in pool.warm_sandboxes()  # a used sandbox never returns to the pool
        assert pool.live == 2


def test_backpressure_blocks_then_times_out() -> None:
    with SandboxPool(_cfg(warm=0, max_live=2)) as pool:
        a, b = pool.acquire(), pool.acquire()
        assert pool.stats["cold_creates"] == 2
        with pytest.raises(TimeoutError, match="max_live"):
            pool.acquire(timeout_s=0.2)
        got: list[PooledSandbox] = []
        waiter = threading.Thread(target=lambda: got.append(pool.acquire(timeout_s=60)))
        waiter.start()
        a.close()  # frees a place: the blocked acquire proceeds
        waiter.join(60)
        assert len(got) == 1 and got[0].exec("echo ok").stdout == "ok\n"
        assert pool.stats["waits"] >= 1 and pool.live == 2
        b.close()
        got[0].close()
        assert pool.live == 0


def test_cpu_slots_cap_concurrent_commands() -> None:
    with SandboxPool(_cfg(warm=0, max_live=4, cpu_slots=1)) as pool:
        boxes = [pool.acquire() for _ in range(4)]
        marks = "date +%s%N > start; sleep 0.2; date +%s%N > end"
        with ThreadPoolExecutor(4) as ex:
            list(ex.map(lambda sb: sb.exec(marks), boxes))
        spans = sorted((int(sb.read("start")), int(sb.read("end"))) for sb in boxes)
        assert pool.stats["peak_running"] == 1
        assert all(prev[1] <= nxt[0] for prev, nxt in zip(spans, spans[1:], strict=False))  # never overlapped
        for sb in boxes:
            sb.close()


def test_fork_is_counted_by_the_pool(tmp_path: Path) -> None:
    (tmp_path / "repo").mkdir()
    (tmp_path / "repo" / "m.py").write_text("x = 1\n")
    with SandboxPool(_cfg(warm=1, max_live=3), base=str(tmp_path / "repo")) as pool, pool.acquire() as sb:
        sb.exec("echo 'x = 2' > m.py")
        with sb.fork() as child:
            assert pool.live >= 2 and child.read("m.py") == "x = 2\n"
            assert child.diff().modified == {"m.py": "x = 2\n"}
    assert (tmp_path / "repo" / "m.py").read_text() == "x = 1\n"


def test_burst_then_close_leaves_nothing_behind() -> None:
    before_cgroups, before_children = leftovers([])["cgroups"], _children()
    roots: list[str] = []
    lock = threading.Lock()

    def rollout(pool: SandboxPool, i: int) -> str:
        sb = pool.acquire({"i.txt": str(i)})
        with lock:
            roots.append(sb.inner.root)  # type: ignore[attr-defined]
        out = sb.exec("cat i.txt; sleep 0.01 & echo").stdout
        if i % 10:  # three sandboxes are left open (and hold 3 of max_live): pool.close cleans them up
            sb.close()
        return out

    pool = SandboxPool(_cfg(warm=3, max_live=8))
    with ThreadPoolExecutor(8) as ex:
        outs = list(ex.map(lambda i: rollout(pool, i), range(30)))
    roots += [sb.root for sb in pool.warm_sandboxes()]  # type: ignore[attr-defined]
    assert outs == [f"{i}\n" for i in range(30)]
    assert pool.stats["created"] >= 30
    pool.close()
    assert pool.live == 0
    assert leftovers(roots) == {"processes": 0, "mounts": 0, "cgroups": before_cgroups, "dirs": 0}
    assert _children() <= before_children  # every bwrap and shell was reaped


def test_creation_errors_surface_and_the_filler_retries() -> None:
    cfg = _cfg(warm=1, max_live=4)
    calls = {"n": 0}

    def flaky() -> BwrapSandbox:
        calls["n"] += 1
        if calls["n"] <= 2:
            raise OSError(f"transient failure {calls['n']}")
        return BwrapSandbox(None, cfg)

    with SandboxPool(cfg, flaky) as pool:
        assert pool.wait_warm(60)  # retried after two failures
        assert isinstance(pool.last_error, OSError) and calls["n"] == 3
        assert pool.live == 1

    def broken() -> BwrapSandbox:
        raise OSError("no sandboxes today")

    with SandboxPool(_cfg(warm=0, max_live=2), broken) as pool:
        with pytest.raises(OSError, match="no sandboxes today"):
            pool.acquire()
        assert pool.live == 0  # the failed creation gave its place back
