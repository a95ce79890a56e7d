"""BwrapSandbox: persistence, isolation (filesystem, network, host paths), limits and cleanup.

Every test runs real bubblewrap sandboxes; the module is skipped (with the install hint) where
bwrap cannot run. Network checks use only 127.0.0.1.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from shipyard.config.schema import SandboxConfig
from shipyard.envs.sandbox import OUTPUT_CAP, BwrapSandbox, agent, reap_stale, sandbox_available, sysroot
from shipyard.envs.sandbox.reaper import _rmtree_error, leftovers

pytestmark = pytest.mark.skipif(sandbox_available() is not None, reason=str(sandbox_available()))

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def sb() -> Iterator[BwrapSandbox]:
    with BwrapSandbox(
        {"hello.txt": "hi\n"}, SandboxConfig(timeout_s=10, memory_mb=256, max_processes=32)
    ) as box:
        yield box


def test_files_persist_across_exec_calls(sb: BwrapSandbox) -> None:
    assert sb.exec("cat hello.txt").stdout == "hi\n"
    res = sb.exec("pwd && mkdir -p pkg && echo 'x = 41' > pkg/mod.py")
    assert res.returncode == 0 and res.stdout.strip() == "/workspace"
    res = sb.exec("python -c 'import pkg.mod as m; print(m.x + 1)'")
    assert (res.returncode, res.stdout) == (0, "42\n"), res.stderr
    sb.write("solution.py", "def f():\n    return 7\n")
    assert sb.exec("python -c 'from solution import f; print(f())'").stdout == "7\n"
    assert sb.read("pkg/mod.py") == "x = 41\n"


def test_files_lists_text_only(sb: BwrapSandbox) -> None:
    script = (
        "mkdir -p __pycache__ .pytest_cache && echo c > __pycache__/a.txt && echo c > .pytest_cache/b && "
        "printf 'a\\000b' > bin.dat && head -c 1100000 /dev/zero | tr '\\0' a > big.txt && "
        "ln -s /etc/passwd leak && echo ok > sub.txt"
    )
    assert sb.exec(script).returncode == 0
    assert sb.files() == {"hello.txt": "hi\n", "sub.txt": "ok\n"}


def test_python_and_pytest_run_inside(sb: BwrapSandbox) -> None:
    sb.write("test_x.py", "from solution import f\n\ndef test_f():\n    assert f() == 1\n")
    sb.write("solution.py", "def f():\n    return 1\n")
    res = sb.exec("python -m pytest -q test_x.py")
    assert res.returncode == 0 and "1 passed" in res.stdout, res.stdout + res.stderr
    env = sb.exec("env").stdout
    assert "HOME=/workspace" in env and "PYTHONHASHSEED=0" in env and "PYTHONDONTWRITEBYTECODE=1" in env


@pytest.mark.parametrize("target", ["/etc/shipyard-x", "/usr/shipyard-x", "/root/shipyard-x", "/shipyard-x"])
def test_writes_outside_workspace_fail(sb: BwrapSandbox, target: str) -> None:
    res = sb.exec(f"echo pwned > {target}")
    assert res.returncode != 0 and "Read-only file system" in res.stderr
    assert not os.path.exists(target)


def test_host_python_and_repo_are_read_only_or_absent(sb: BwrapSandbox) -> None:
    for path in (sys.prefix, sys.base_prefix):
        marker = os.path.join(path, f"shipyard-{uuid.uuid4().hex}")
        assert sb.exec(f"touch {marker}").returncode != 0
        assert not os.path.exists(marker)
    assert sb.exec(f"test -e {REPO / 'pyproject.toml'}").returncode != 0  # the repo is not mounted
    sb.exec(f"touch {REPO / 'shipyard-x'}")  # may succeed in the private /tmp tmpfs for a checkout under /tmp
    assert not (REPO / "shipyard-x").exists()
    assert not (REPO / "shipyard-x").exists()


def test_tmp_is_private(sb: BwrapSandbox) -> None:
    name = f"/tmp/shipyard-{uuid.uuid4().hex}"
    assert sb.exec(f"echo x > {name} && cat {name}").stdout == "x\n"
    assert not os.path.exists(name)


def _pending_connection(srv: socket.socket) -> bool:
    """Whether a client completed a TCP handshake with ``srv`` (the kernel queues it un-accepted)."""
    srv.setblocking(False)
    try:
        conn, _ = srv.accept()
    except BlockingIOError:
        return False
    conn.close()
    return True


def test_no_network_to_host_loopback() -> None:
    connect = "python -c \"import socket, sys; socket.create_connection(('127.0.0.1', int(sys.argv[1])), timeout=2)\""
    for network in (False, True):  # network=True is the positive control: the same client connects
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as srv:
            srv.bind(("127.0.0.1", 0))
            srv.listen(4)
            with BwrapSandbox(None, SandboxConfig(timeout_s=10), network=network) as box:
                res = box.exec(f"{connect} {srv.getsockname()[1]}")
            assert (res.returncode == 0) is network, res.stderr
            assert _pending_connection(srv) is network


def _pids_with(marker: str) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if marker.encode() in f.read():
                        found.append(int(entry))
            except OSError:
                continue
    return found


def test_wall_timeout_kills_process_tree(sb: BwrapSandbox) -> None:
    marker = f"100.{uuid.uuid4().int % 10**6:06d}"
    res = sb.exec(f"sleep {marker} & sh -c 'sleep {marker}; true' & sleep {marker}", timeout_s=1)
    assert res.timed_out and res.returncode != 0
    assert res.duration_s < 50  # the command would run for 100 s
    deadline = time.monotonic() + 30
    while _pids_with(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _pids_with(marker) == []


def test_background_jobs_end_with_their_exec(sb: BwrapSandbox) -> None:
    marker = f"100.{uuid.uuid4().int % 10**6:06d}"
    res = sb.exec(f"(sleep {marker} &) ; echo started")
    assert res.stdout == "started\n" and not res.timed_out
    deadline = time.monotonic() + 30
    while _pids_with(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _pids_with(marker) == []


def test_memory_bomb_is_stopped() -> None:
    bomb = "python -c 'a = []\nwhile True: a.append(bytearray(8 * 2**20))'"
    with BwrapSandbox(None, SandboxConfig(timeout_s=20, memory_mb=128)) as box:
        res = box.exec(bomb)
    assert res.returncode != 0 and not res.timed_out
    assert "MemoryError" in res.stderr


def test_process_limit(sb: BwrapSandbox) -> None:
    fork = (
        "import os, time\nn = 0\ntry:\n    for _ in range(200):\n        if os.fork() == 0:\n"
        "            time.sleep(5)\n            os._exit(0)\n        n += 1\nexcept OSError:\n    pass\nprint(n)\n"
    )
    sb.write("fork.py", fork)
    res = sb.exec("python fork.py; ulimit -u 2>/dev/null || ulimit -p")
    forked, nproc = (int(x) for x in res.stdout.split())
    assert nproc == 32  # RLIMIT_NPROC is set inside in every mode
    if sb.process_limit == "none":
        pytest.skip("running as root without a writable pids cgroup: no process limit is enforced here")
    assert forked < 32


def test_output_is_capped_and_stdin_is_fed(sb: BwrapSandbox) -> None:
    res = sb.exec("yes | head -c 500000")
    assert len(res.stdout) < OUTPUT_CAP + 200 and "bytes truncated" in res.stdout
    assert res.stdout.startswith("y\ny\n") and res.stdout.endswith("y\n")
    assert sb.exec("cat", stdin="line from stdin\n").stdout == "line from stdin\n"
    assert sb.exec("exit 3").returncode == 3


def test_command_outliving_its_output_is_awaited_then_timed_out(sb: BwrapSandbox) -> None:
    res = sb.exec("exec >&- 2>&-; sleep 0.5; echo x > late.txt", timeout_s=5)
    assert res.returncode == 0 and not res.timed_out and sb.read("late.txt") == "x\n"
    res = sb.exec("exec >&- 2>&-; sleep 100", timeout_s=1)
    assert res.timed_out and res.duration_s < 50  # killed, not awaited for 100 s


def test_extra_binds_are_validated(tmp_path: Path) -> None:
    for inside in ("relative", "/usr/x", "/workspace/x", "/"):
        with pytest.raises(ValueError, match="binds"):
            BwrapSandbox(None, binds={str(tmp_path): inside})
    with BwrapSandbox(None, binds={str(tmp_path): "/results"}) as box:
        assert box.exec("echo r > /results/out.txt").returncode == 0
    assert (tmp_path / "out.txt").read_text() == "r\n"


def test_read_only_binds_are_readable_not_writable(tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    venv.mkdir()
    (venv / "tool").write_text("v1")
    with pytest.raises(ValueError, match="ro_binds"):
        BwrapSandbox(None, ro_binds=[str(tmp_path / "missing")])
    with BwrapSandbox(None, ro_binds=[str(venv)]) as box:
        assert box.exec(f"cat {venv}/tool").stdout == "v1"
        res = box.exec(f"echo v2 > {venv}/tool || echo refused; touch {venv}/new || echo refused")
        assert res.stdout.count("refused") == 2 and "Read-only file system" in res.stderr
    assert (venv / "tool").read_text() == "v1" and sorted(os.listdir(venv)) == ["tool"]


def test_host_side_paths_cannot_escape(sb: BwrapSandbox) -> None:
    for bad in ("../escape.txt", "/etc/passwd", "a/../../x", ""):
        with pytest.raises(ValueError):
            sb.write(bad, "x")
    assert sb.exec("ln -s /etc escape && ln -s /etc/hostname leak").returncode == 0
    with pytest.raises(ValueError, match="symlink"):
        sb.write("escape/shipyard-x", "x")
    with pytest.raises(ValueError, match="symlink"):
        sb.read("leak")
    assert not os.path.exists("/etc/shipyard-x")
    with pytest.raises(ValueError, match="timeout_s"):
        sb.exec("true", timeout_s=0)


def test_close_removes_workspace() -> None:
    box = BwrapSandbox({"a.txt": "a"})
    root = box.root
    assert os.path.isdir(root)
    box.close()
    box.close()
    assert not os.path.exists(root)
    with pytest.raises(RuntimeError, match="closed"):
        box.exec("true")


def test_sandbox_available_here() -> None:
    assert sandbox_available() is None


def test_session_frames_commands_exactly_and_keeps_tmp(sb: BwrapSandbox) -> None:
    for cmd, want in [
        ("printf '%s' 'a\\b'", "a\\b"),
        ("cat <<'EOF'\nline1\n  line2 \\\nEOF", "line1\n  line2 \\\n"),
        ("\n\necho 'x\n\ny'\n\n", "x\n\ny\n"),
        ("echo héllo ✓", "héllo ✓\n"),
        ("echo " + "y" * 20000 + " | wc -c", "20001\n"),
    ]:
        res = sb.exec(cmd)
        assert (res.returncode, res.stdout) == (0, want), cmd
    pid = sb.session_pid
    assert pid is not None and sb.exec("echo kept > /tmp/t").returncode == 0
    assert sb.exec("cat /tmp/t").stdout == "kept\n" and sb.session_pid == pid  # one session, /tmp persists
    assert sb.exec("export X=1; cd /tmp").returncode == 0
    assert sb.exec("pwd; echo ${X:-unset}").stdout == "/workspace\nunset\n"  # but each command starts clean


def test_session_survives_its_server_being_killed(sb: BwrapSandbox) -> None:
    sb.exec("echo t > /tmp/t")
    res = sb.exec("kill -9 -1; sleep 5")  # from inside
    assert res.returncode != 0 and not res.timed_out and "next command starts a new session" in res.stderr
    assert sb.exec("cat hello.txt; test -e /tmp/t || echo tmp-gone").stdout == "hi\ntmp-gone\n"
    pid = sb.session_pid
    assert pid is not None
    killer = threading.Timer(0.3, os.kill, (pid, signal.SIGKILL))  # from the host, under a command
    killer.start()
    res = sb.exec("sleep 5; echo late")
    killer.join()
    assert res.returncode != 0 and not res.timed_out and "next command starts a new session" in res.stderr
    assert sb.exec("cat hello.txt").stdout == "hi\n" and sb.session_pid not in (None, pid)
    res = sb.exec(
        "echo 12 99 > /proc/1/fd/1 2>/dev/null; echo forged >&2; exit 4"
    )  # garbage on the status pipe
    assert sb.exec("echo ok").stdout == "ok\n"


def test_one_shot_mode_matches_the_session() -> None:
    cfg = SandboxConfig(timeout_s=10, memory_mb=256, max_processes=32)
    cmds = ["echo a; echo b >&2; exit 3", "(sleep 100 &); echo bg", "ulimit -v; ulimit -f", "ls /tmp | wc -l"]
    with BwrapSandbox(None, cfg) as sess, BwrapSandbox(None, cfg, persistent=False) as once:
        for cmd in cmds:
            a, b = sess.exec(cmd), once.exec(cmd)
            assert (a.returncode, a.stdout, a.stderr) == (b.returncode, b.stdout, b.stderr), cmd
        assert once.session_pid is None


def test_pass_fds_and_spawn(sb: BwrapSandbox) -> None:
    r, w = os.pipe()
    try:
        res = sb.exec(
            f"echo through-fd >&{w}" if w < 10 else f"echo through-fd > /proc/self/fd/{w}", pass_fds=(w,)
        )
        assert res.returncode == 0, res.stderr
        assert os.read(r, 100) == b"through-fd\n"
    finally:
        os.close(r)
        os.close(w)
    proc = sb.spawn("cat hello.txt; sleep 100", stdout=subprocess.PIPE)
    assert proc.stdout is not None and proc.stdout.readline() == b"hi\n"
    assert proc.poll() is None
    os.killpg(proc.pid, 9)
    assert proc.wait(timeout=5) != 0
    proc.stdout.close()


def test_session_outlives_the_thread_that_started_it() -> None:
    with BwrapSandbox({"a.txt": "a\n"}, SandboxConfig(timeout_s=10)) as box:
        t = threading.Thread(target=lambda: box.exec("true"))
        t.start()
        t.join()
        assert box.session_pid is None  # --die-with-parent ends it with its thread: reported gone at once
        assert box.exec("cat a.txt").stdout == "a\n"  # a new session, not the dying one
        owner = box.session_pid
        t = threading.Thread(target=lambda: box.exec("echo x > b.txt"))
        t.start()
        t.join()  # another thread used the main thread's session, which stays
        assert owner is not None and box.session_pid == owner and box.read("b.txt") == "x\n"


def test_copy_on_write_fork_of_a_directory(tmp_path: Path) -> None:
    base = tmp_path / "repo"
    (base / "pkg").mkdir(parents=True)
    (base / "pkg" / "mod.py").write_text("x = 1\n")
    (base / "README").write_text("readme\n")
    cfg = SandboxConfig(timeout_s=10)
    with (
        BwrapSandbox({"new.txt": "n\n"}, cfg, base=str(base)) as a,
        BwrapSandbox(None, cfg, base=str(base)) as b,
    ):
        res = a.exec("cat pkg/mod.py && echo 'x = 2' > pkg/mod.py && rm README && ls")
        assert res.stdout == "x = 1\nnew.txt\npkg\n", res.stderr
        assert a.files() == {"new.txt": "n\n", "pkg/mod.py": "x = 2\n"}
        assert b.files() == {"README": "readme\n", "pkg/mod.py": "x = 1\n"}  # forks are independent
        assert a.exec("cat pkg/mod.py", stdin="").stdout == "x = 2\n"  # one-shot commands see the fork too
        a.write("pkg/host.txt", "h\n")
        assert a.exec("cat pkg/host.txt").stdout == "h\n" and a.read("pkg/mod.py") == "x = 2\n"
        with pytest.raises(ValueError, match="spawn"):
            a.spawn("true")
    assert (base / "README").read_text() == "readme\n" and (base / "pkg" / "mod.py").read_text() == "x = 1\n"
    assert sorted(os.listdir(base)) == ["README", "pkg"]
    with pytest.raises(ValueError, match="base"):
        BwrapSandbox(None, cfg, base=str(tmp_path / "missing"))


def test_removing_a_root_already_gone_or_locked_is_clean(tmp_path: Path) -> None:
    """Two processes may reap the same stale root: the one that finds it gone is done (this once
    surfaced as a TypeError from retrying ``os.open`` and failed a rollout's sandbox creation);
    a directory the sandboxed code locked (mode 000) is unlocked and removed."""
    shutil.rmtree(tmp_path / "gone", onerror=_rmtree_error)  # nothing raised
    locked = tmp_path / "root" / "locked"
    (locked / "deep").mkdir(parents=True)
    (locked / "deep" / "f").write_text("x")
    locked.chmod(0)
    shutil.rmtree(tmp_path / "root", onerror=_rmtree_error)
    assert not (tmp_path / "root").exists()


def test_removing_a_root_another_process_empties_meanwhile(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The race itself: a directory found by ``rmtree``'s scan is removed by another process before
    ``rmtree`` opens it. The old hook retried ``os.open(path)`` without flags (a TypeError that
    failed the rollout); this one treats what is gone as done. (The test above cannot see that as
    root, where a mode-000 directory opens anyway.)"""
    (tmp_path / "root" / "a" / "x").mkdir(parents=True)
    (tmp_path / "root" / "b").mkdir()
    real_open = os.open

    def racing_open(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        if path == "a" and (tmp_path / "root" / "a").exists():
            shutil.rmtree(tmp_path / "root" / "a")  # the other reaper, between lstat and open
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", racing_open)
    shutil.rmtree(tmp_path / "root", onerror=_rmtree_error)
    monkeypatch.undo()
    assert not (tmp_path / "root").exists()


def test_reap_stale_removes_what_dead_processes_left() -> None:
    with BwrapSandbox(None) as box:  # the first sandbox of a process reaps once: before the stale ones exist
        cg_parent = os.path.dirname(box.cgroup) if box.cgroup else None
    dead = subprocess.Popen(["true"])
    dead.wait()  # its pid now names no process
    stale_dir = tempfile.mkdtemp(prefix=f"shipyard-sb-{dead.pid}-")
    Path(stale_dir, "sub").mkdir()
    Path(stale_dir, "sub", "f.txt").write_text("x")
    live_dir = tempfile.mkdtemp(prefix=f"shipyard-sb-{os.getpid()}-")
    stale_cg = os.path.join(cg_parent, f"shipyard-sb-{dead.pid}-feedfeedfeed") if cg_parent else None
    if stale_cg:
        os.mkdir(stale_cg)
    try:
        assert reap_stale() >= 1 + (stale_cg is not None)
        assert not os.path.exists(stale_dir) and os.path.isdir(live_dir)
        assert stale_cg is None or not os.path.exists(stale_cg)
    finally:
        shutil.rmtree(live_dir)


def test_exec_env_is_per_command_and_validated(sb: BwrapSandbox) -> None:
    res = sb.exec('echo "$GREETING|$EMPTY|${UNSET:-unset}"', env={"GREETING": "a b'c$x", "EMPTY": ""})
    assert res.stdout == "a b'c$x||unset\n"
    assert sb.exec("echo ${GREETING:-gone}").stdout == "gone\n"  # not kept for the next command
    assert sb.exec("cat", stdin="in\n", env={"X": "1"}).stdout == "in\n"  # one-shot path too
    for bad in ("1X", "A-B", "A B", ""):
        with pytest.raises(ValueError, match="env"):
            sb.exec("true", env={bad: "v"})


def test_diff_and_fork_of_a_plain_workspace(sb: BwrapSandbox) -> None:
    assert sb.diff().is_empty()
    sb.exec("echo new > new.txt && echo changed > hello.txt && mkdir d && echo x > d/x.txt")
    diff = sb.diff()
    assert diff.added == {"d/x.txt": "x\n", "new.txt": "new\n"} and diff.modified == {
        "hello.txt": "changed\n"
    }
    with sb.fork() as child:
        assert child.files() == sb.files() and child.diff() == diff  # same base, same changes
        child.exec("rm new.txt && echo c > only_child.txt")
        assert sorted(child.diff().added) == ["d/x.txt", "only_child.txt"]
        assert "only_child.txt" not in sb.files() and sb.read("new.txt") == "new\n"  # independent
    sb.exec("rm hello.txt")
    assert sb.diff().deleted == ["hello.txt"]


def test_diff_and_fork_over_a_base(tmp_path: Path) -> None:
    base = tmp_path / "repo"
    for rel, text in {
        "a.py": "a\n",
        "pkg/m.py": "m\n",
        "pkg/n.py": "n\n",
        "gone/x.py": "x\n",
        "same.py": "s\n",
    }.items():
        (base / rel).parent.mkdir(parents=True, exist_ok=True)
        (base / rel).write_text(text)
    cfg = SandboxConfig(timeout_s=10)
    with BwrapSandbox(None, cfg, base=str(base)) as sb:
        assert sb.diff().is_empty()
        script = (
            "echo A > a.py && rm -r gone && rm -r pkg && mkdir pkg && echo new > pkg/m2.py && "
            "echo b > b.py && cp same.py same2.py && touch same.py"
        )
        assert sb.exec(script).returncode == 0
        diff = sb.diff()
        assert diff.added == {"b.py": "b\n", "pkg/m2.py": "new\n", "same2.py": "s\n"}
        assert diff.modified == {"a.py": "A\n"}  # same.py was copied up by touch but is unchanged
        assert diff.deleted == ["gone/x.py", "pkg/m.py", "pkg/n.py"]  # whiteout and opaque directory
        sb.seed({"seeded.txt": "s\n"})
        assert sb.diff() == diff  # seeded files count as base
        with sb.fork() as child:
            assert child.files() == sb.files() and child.diff() == diff
            child.exec("echo again > a.py")
            assert sb.read("a.py") == "A\n" and child.read("a.py") == "again\n"
    assert (base / "a.py").read_text() == "a\n" and (base / "gone" / "x.py").exists()


def test_make_sandbox_switches_on_type() -> None:
    from shipyard.envs.sandbox import Sandbox, make_sandbox

    with make_sandbox(SandboxConfig(type="bwrap", timeout_s=10), {"f.txt": "f\n"}) as box:
        assert isinstance(box, BwrapSandbox) and isinstance(box, Sandbox)
        assert box.exec("cat f.txt").stdout == "f\n"
    for kw in ({"base": "/tmp"}, {"binds": {"/tmp": "/run/db"}}):  # a backend without host mounts says so
        with pytest.raises(ValueError, match=r"sandbox.type='remote_morph' cannot mount host directories"):
            make_sandbox(SandboxConfig(type="remote_morph"), **kw)


PARITY = [
    ("echo hi; echo err >&2; exit 3", None),
    ("printf 'a\\nb'; kill -TERM $$", None),
    ("cat; echo stdin-closed", None),  # stdin is /dev/null
    ("ulimit -c; ulimit -v; ulimit -f; ulimit -t; ulimit -p", None),
    ("sleep 30 & echo started", "started\n"),  # returns at once: the job dies with its exec
    ("x='\n  two  \\\n'; printf '%s|' \"$x\"; echo; echo $0", None),
    ("exec 2>&-; echo closed-stderr", None),
]


def test_agent_and_shell_servers_give_the_same_results() -> None:
    """The compiled agent speaks the /bin/sh server's protocol with the same statuses, limits and kills."""
    if agent.agent_fd() is None:
        pytest.skip(f"no session agent here: {agent.agent_problem()}")
    cfg = SandboxConfig(timeout_s=10, memory_mb=300, max_processes=40)
    with BwrapSandbox(None, cfg) as fast, BwrapSandbox(None, cfg, use_agent=False) as slow:
        for cmd, want in PARITY:
            got = [(r.returncode, r.stdout, r.stderr) for r in (fast.exec(cmd), slow.exec(cmd))]
            assert got[0] == got[1], cmd
            assert want is None or got[0][1] == want, cmd
        assert fast.exec("ulimit -v").stdout == f"{300 * 1024}\n" and fast.exec("ulimit -p").stdout == "40\n"
        names = fast.exec("for p in /proc/[0-9]*; do cat $p/comm; done").stdout.split()
        assert sorted(names) == ["bwrap", "sh", "shipyard-agent"]  # pid 1, the agent, the command
        fds = fast.exec("ls /proc/self/fd").stdout.split()
        assert fds == ["0", "1", "2", "3"]  # stdio and ls's own directory: no server pipes, no memfd
        assert fast.exec("ls /proc/self/fd", stdin="").stdout.split() == fds  # one-shot bwrap: the same


def test_agent_binary_is_sealed_and_refuses_the_host() -> None:
    fd = agent.agent_fd()
    if fd is None:
        pytest.skip(f"no session agent here: {agent.agent_problem()}")
    reopened = os.open(f"/proc/self/fd/{fd}", os.O_WRONLY)
    try:
        with pytest.raises(PermissionError):
            os.write(reopened, b"x")  # F_SEAL_WRITE: not even its owner may change it
    finally:
        os.close(reopened)
    res = subprocess.run(
        [f"/proc/self/fd/{fd}", "serve", str(fd), "1", "0", "1024", "1024", "8"],
        pass_fds=(fd,),
        stdin=subprocess.DEVNULL,  # were the guard missing, EOF would end it before any kill(-1)
        capture_output=True,
        text=True,
        timeout=10,
    )
    assert res.returncode == 2 and "only as pid 1 or 2" in res.stderr
    with BwrapSandbox(None, SandboxConfig(timeout_s=10)) as box:
        res = box.exec("printf x >> /proc/2/exe; echo rc=$?")  # the running agent, from inside
        assert res.stdout != "rc=0\n" and box.exec("echo ok").stdout == "ok\n"
        # not dumpable: its fds and exe are closed to the sandbox; the command's own shell is not
        links = box.exec(
            "readlink /proc/2/fd/0 || echo denied; readlink /proc/2/exe || echo denied; readlink /proc/$$/exe"
        )
        assert links.stdout.splitlines()[:2] == ["denied", "denied"] and links.stdout.splitlines()[
            2
        ].endswith("sh")


def test_agent_build_failure_names_the_compiler_error(tmp_path: Path) -> None:
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    bad = tmp_path / "agent.c"
    bad.write_text("int main(void) { return undefined_symbol; }\n")
    with pytest.raises(RuntimeError, match="undefined_symbol"):
        agent.build(cc, source=bad, cache=tmp_path / "cache")
    built = agent.build(cc, cache=tmp_path / "cache")  # the real source builds, and is reused
    assert built.stat().st_mode & 0o777 == 0o555 and agent.build(cc, cache=tmp_path / "cache") == built


def test_etc_tree_copies_what_the_sandbox_needs_and_follows_changes(tmp_path: Path) -> None:
    etc = tmp_path / "etc"
    (etc / "ld.so.conf.d").mkdir(parents=True)
    for name, text in {
        "passwd": "root:x:0:0::/:/bin/sh\n",
        "group": "root:x:0:\n",
        "shadow": "secret\n",
    }.items():
        (etc / name).write_text(text)
    (etc / "ld.so.conf.d" / "a.conf").write_text("/opt/lib\n")
    (etc / "hosts").write_text("127.0.0.1 localhost\n")
    first = Path(sysroot.etc_tree(False, str(etc)))
    assert sorted(p.name for p in first.iterdir()) == [
        "group",
        "ld.so.conf.d",
        "passwd",
    ]  # no shadow, no hosts
    assert (first / "ld.so.conf.d" / "a.conf").read_text() == "/opt/lib\n"
    assert sysroot.etc_tree(False, str(etc)) == str(first)  # unchanged: the same tree
    (etc / "passwd").write_text("root:x:0:0::/root:/bin/sh\n")
    second = Path(sysroot.etc_tree(False, str(etc)))
    assert second != first and (second / "passwd").read_text() == "root:x:0:0::/root:/bin/sh\n"
    assert (Path(sysroot.etc_tree(True, str(etc))) / "hosts").exists()
    tampered = second / "passwd"  # a cached tree changed behind our back is never bound again
    tampered.chmod(0o644)
    tampered.write_text("evil:x:0:0::/:/bin/sh\n")
    sysroot._build.cache_clear()
    again = Path(sysroot.etc_tree(False, str(etc)))
    assert again == second and (again / "passwd").read_text() == "root:x:0:0::/root:/bin/sh\n"
    with BwrapSandbox(None, SandboxConfig(timeout_s=10)) as box:  # the host's own tree, bound once
        res = box.exec("ls /etc; chmod u+w /etc/passwd 2>&1; touch /etc/new 2>&1")
        listing, chmod, touch = res.stdout.splitlines()[:-2], *res.stdout.splitlines()[-2:]
        assert "nsswitch.conf" in listing and "shadow" not in listing and "gshadow" not in listing
        assert (
            "Read-only file system" in chmod and "Read-only file system" in touch
        )  # the host's copy is safe


def test_a_failed_cgroup_move_runs_nothing() -> None:
    box = BwrapSandbox(None, SandboxConfig(timeout_s=10))
    try:
        if not box.cgroups:
            pytest.skip("no cgroups here")
        marker = Path(box.root, "ran")
        os.rmdir(next(iter(box.cgroups.values())))  # the session's first move now fails
        with pytest.raises(RuntimeError, match="moving the sandbox into its cgroups"):
            box.exec("touch ran")
        time.sleep(0.2)
        assert not marker.exists() and leftovers([box.root])["processes"] == 0
    finally:
        box.close()
