"""Isolation suite: every property is a real escape attempted from inside a sandbox, asserted to fail.

One test per entry of :data:`PROPERTIES` (``test_<name>``); :data:`ISOLATION_PROPERTIES` counts
them. Most run in one shared session sandbox (a failed attempt that kills the session only
costs a restart); the rest need a configuration of their own. Where an attempt could fail for a
trivial reason (a missing tool), a positive control shows the same code works where it is
allowed. Network checks use 127.0.0.1 only. The whole module runs in a few seconds.
"""

from __future__ import annotations

import os
import platform
import shlex
import signal
import socket
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from shipyard.agent.session import workspace_files
from shipyard.config.schema import SandboxConfig
from shipyard.envs.grading.grader import grade
from shipyard.envs.sandbox import MAX_FILE_MB, TMPFS_MB, BwrapSandbox, sandbox_available, seccomp
from shipyard.envs.sandbox.reaper import descendants
from shipyard.envs.tasks.functions import generated_tasks
from shipyard.envs.types import Task

pytestmark = pytest.mark.skipif(sandbox_available() is not None, reason=str(sandbox_available()))

PROPERTIES: tuple[str, ...] = (
    "no_network",
    "no_writes_outside_workspace",
    "read_only_system_dirs",
    "no_host_secrets",
    "hidden_tests_unreadable",
    "fork_bomb_contained",
    "memory_bomb_killed",
    "disk_fill_capped",
    "runaway_time_killed",
    "no_ptrace_of_host",
    "host_pids_invisible",
    "proc_root_confined",
    "no_capabilities",
    "no_nested_userns",
    "device_nodes_minimal",
    "tmp_private",
    "no_sys_or_cgroup_escape",
    "sandboxes_isolated_from_each_other",
    "host_file_access_confined",
    "no_ptrace_inside",
    "no_namespace_creation",
    "no_kernel_attack_surface",
    "no_aslr_disable",
    "no_foreign_arch_syscalls",
    "memory_capped_for_whole_sandbox",
    "cpu_capped_for_whole_sandbox",
)
"""Every isolation property checked here, in test order."""
ISOLATION_PROPERTIES = len(PROPERTIES)

REPO = Path(__file__).resolve().parents[2]
CFG = SandboxConfig(timeout_s=10, memory_mb=256, max_processes=32)


@pytest.fixture(scope="module")
def box() -> Iterator[BwrapSandbox]:
    with BwrapSandbox({"hello.txt": "hi\n"}, CFG) as sb:
        yield sb


def _py(sb: BwrapSandbox, code: str, timeout_s: float = 10) -> str:
    """Run Python ``code`` in the sandbox; its stdout (the test asserts on it)."""
    sb.write("probe.py", code)
    res = sb.exec("python probe.py", timeout_s=timeout_s)
    assert res.returncode == 0, res.stderr
    return res.stdout


def _sandbox_pids(cgroup: str | None) -> list[int]:
    if cgroup is None:
        return []
    with open(os.path.join(cgroup, "cgroup.procs")) as f:
        return [int(x) for x in f.read().split()]


def _gone(cgroup: str | None, within_s: float = 30.0) -> bool:
    """Whether the sandbox's cgroup empties (the kernel reaps a dead pid namespace asynchronously)."""
    deadline = time.monotonic() + within_s
    while _sandbox_pids(cgroup) and time.monotonic() < deadline:
        time.sleep(0.02)
    return _sandbox_pids(cgroup) == []


def _only_left(cgroup: str | None, keep: set[int], within_s: float = 30.0) -> bool:
    """Whether the cgroup empties down to ``keep`` (the kernel reaps killed processes asynchronously)."""
    deadline = time.monotonic() + within_s
    while not set(_sandbox_pids(cgroup)) <= keep and time.monotonic() < deadline:
        time.sleep(0.02)
    return set(_sandbox_pids(cgroup)) <= keep


def test_every_property_has_its_test() -> None:
    assert len(set(PROPERTIES)) == ISOLATION_PROPERTIES >= 15
    assert all(callable(globals().get(f"test_{p}")) for p in PROPERTIES)


def test_no_network(box: BwrapSandbox) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen(4)
        port = srv.getsockname()[1]
        code = (
            "import socket\nfor host in ('127.0.0.1', 'localhost', '::1'):\n    try:\n"
            f"        socket.create_connection((host, {port}), timeout=1)\n        print('connected', host)\n"
            "    except OSError as e:\n        print('refused', host, type(e).__name__)\n"
            "print(open('/proc/net/dev').read().count(':'))\n"
        )
        out = _py(box, code)
        srv.setblocking(False)
        with pytest.raises(BlockingIOError):  # nothing reached the host's listener
            srv.accept()
    assert "connected" not in out and out.count("refused") == 3
    assert out.strip().endswith("1")  # one interface: the sandbox's own loopback


def test_no_writes_outside_workspace(box: BwrapSandbox) -> None:
    name = f"shipyard-{uuid.uuid4().hex[:8]}"
    targets = ["/", "/root", "/work", "/home", "/var", "/opt", "/mnt", sys.prefix, str(REPO), "/proc/sys"]
    for d in targets:
        res = box.exec(f"echo pwned > {d}/{name}")
        # A path under /tmp lands in the sandbox's private tmpfs (e.g. a checkout under /tmp whose
        # venv is bound read-only there): writable inside, never on the host. Elsewhere it must fail.
        assert res.returncode != 0 or d.startswith("/tmp/"), d
        assert not os.path.exists(os.path.join(d, name)), d
    assert box.exec(f"echo ok > {name} && cat {name}").stdout == "ok\n"  # control: the workspace is writable


def test_read_only_system_dirs(box: BwrapSandbox) -> None:
    for cmd in (
        "touch /usr/x",
        "touch /etc/x",
        "touch /bin/x",
        "touch /lib/x",
        "rm -f /usr/bin/env",
        "mkdir /newdir",
    ):
        res = box.exec(cmd)
        assert res.returncode != 0 and "Read-only file system" in res.stderr, cmd
    assert os.path.exists("/usr/bin/env") and not os.path.exists("/usr/x")


def test_no_host_secrets(monkeypatch: pytest.MonkeyPatch) -> None:
    secret = f"shipyard-secret-{uuid.uuid4().hex}"
    monkeypatch.setenv("SHIPYARD_TEST_SECRET", secret)
    with BwrapSandbox(None, CFG) as sb:  # started after the secret entered our environment
        env = sb.exec("env; for p in /proc/[0-9]*; do tr '\\000' '\\n' < $p/environ; done").stdout
        assert secret not in env and "SHIPYARD_TEST_SECRET" not in env
        assert "HOME=/workspace" in env  # control: the environment is readable, just not ours
        for path in (
            "/etc/shadow",
            "/etc/gshadow",
            "/root/.ssh",
            "/root/.bash_history",
            f"{REPO}/pyproject.toml",
        ):
            assert sb.exec(f"test -e {path}").returncode != 0, path
        # under /root and the repo only the path to the bound Python installation exists
        inside = set(sb.exec("ls -A /root 2>/dev/null").stdout.split())
        assert inside <= {p.split("/")[2] for p in (sys.prefix, sys.base_prefix) if p.startswith("/root/")}
        assert set(sb.exec(f"ls -A {REPO} 2>/dev/null").stdout.split()) <= {".venv"}


PROBE = """
import os
import sys

# the bound Python installation is the host's, read-only (under /tmp when the checkout is there:
# tens of thousands of files, more than the sandbox's 10 s to read)
PYTHON = tuple(p for p in {sys.prefix, sys.base_prefix} if p.count("/") >= 2)


def probe():
    token = "".join(["PART_A", "PART_B"]).encode()  # not folded into one constant by the compiler
    found = []
    for top in ("/workspace", "/tmp", "/dev/shm", "/grader", "/"):
        for d, dirs, files in os.walk(top):
            if d.startswith(("/proc", "/usr", "/sys", "/dev") + PYTHON) or (top == "/" and d.count("/") > 3):
                dirs[:] = []
                continue
            for f in files:
                path = os.path.join(d, f)
                try:
                    if os.path.isfile(path) and token in open(path, "rb").read(1 << 20):
                        found.append(path)
                except OSError:
                    pass
    for p in os.listdir("/proc"):
        for leaf in ("cmdline", "environ"):
            try:
                if token in open(f"/proc/{p}/{leaf}", "rb").read():
                    found.append(f"/proc/{p}/{leaf}")
            except OSError:
                pass
    return sorted(set(found))
"""
"""Looks for a token of the hidden tests wherever a solution could read: files, other processes."""


def test_hidden_tests_unreadable() -> None:
    token = f"hidden-{uuid.uuid4().hex}"
    hidden = f"from solution import probe\n\n\ndef test_a():\n    assert probe() == []  # {token}\n"
    task = Task(id="t-probe", prompt="", entry_point="probe", hidden_tests=hidden)
    probe = PROBE.replace("PART_A", token[:8]).replace("PART_B", token[8:])  # the token never appears whole
    # positive control: with the hidden tests in its workspace (as a naive harness does) it finds them
    with BwrapSandbox({"solution.py": probe, "test_hidden.py": hidden}, CFG) as sb:
        assert "test_hidden.py" in sb.exec("python -c 'from solution import probe; print(probe())'").stdout
    # during a session the task's hidden tests are nowhere in the agent's sandbox
    gen = generated_tasks(1, 0)[0]
    with BwrapSandbox(workspace_files(gen), CFG) as sb:
        last = gen.hidden_tests.strip().splitlines()[-1].strip()
        assert sb.exec(f"grep -rlF {shlex.quote(last)} /workspace /tmp /dev/shm").stdout == ""
        assert "test_visible.py" in sb.exec("grep -rlF 'def test' /workspace").stdout  # control
    # during grading the solution runs where neither the tests nor the report directory exist
    res = grade(task, {"solution.py": probe}, CFG)
    assert res.reward == 1.0, res.details


def test_fork_bomb_contained(box: BwrapSandbox) -> None:
    box.exec("true")
    idle = set(descendants(box.session_pid or 0))  # the session's own processes, between commands
    start = time.monotonic()
    res = box.exec("b() { b | b & }; b; sleep 30", timeout_s=1.5)
    assert res.timed_out or res.returncode != 0
    assert time.monotonic() - start < 25  # the bomb would otherwise run for 30 s
    if box.process_limit == "cgroup":
        assert box.cgroup is not None
        with open(os.path.join(box.cgroup, "pids.events")) as f:
            assert int(f.read().split()[-1]) > 0  # the limit was hit, so it held
        assert _only_left(box.cgroup, idle)  # nothing of the bomb is left (it may end its command first)
    assert box.exec("echo alive").stdout == "alive\n"


def test_memory_bomb_killed() -> None:
    with BwrapSandbox(None, SandboxConfig(timeout_s=10, memory_mb=128)) as sb:
        res = sb.exec("python -c 'a = []\nwhile True: a.append(bytearray(8 * 2**20))'")
    assert res.returncode != 0 and not res.timed_out and "MemoryError" in res.stderr


def test_disk_fill_capped(box: BwrapSandbox) -> None:
    res = box.exec(f"head -c {MAX_FILE_MB + 8}M /dev/zero > big.bin; ls -l big.bin")
    assert "File size limit exceeded" in res.stderr and int(res.stdout.split()[4]) <= MAX_FILE_MB * 2**20
    # the files go to a fresh directory of the sandbox's /tmp: a checkout under /tmp (bound into the
    # sandbox at its own path) is never counted, whatever its name
    res = box.exec(
        f"d=$(mktemp -d /tmp/fill.XXXXXX); for i in 1 2 3 4 5 6; do head -c {MAX_FILE_MB - 1}M /dev/zero"
        ' > "$d/f$i" || break; done; du -sm "$d" | cut -f1; rm -rf "$d"'
    )
    assert "No space left" in res.stderr and int(res.stdout.split()[0]) <= TMPFS_MB
    box.exec("rm -f big.bin")


def test_runaway_time_killed(box: BwrapSandbox) -> None:
    res = box.exec("while :; do :; done", timeout_s=1)
    assert res.timed_out and res.duration_s < 25  # the loop never ends by itself
    assert _gone(box.cgroup)


def test_no_ptrace_of_host(box: BwrapSandbox) -> None:
    host = os.getpid()
    code = (
        "import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\n"
        f"print(libc.ptrace(16, {host}, 0, 0), ctypes.get_errno())\n"  # PTRACE_ATTACH
        f"try:\n    os.kill({host}, 0)\n    print('signalled')\nexcept OSError as e:\n    print(e.errno)\n"
    )
    attach, errno, kill = _py(box, code).split()
    assert attach == "-1" and int(errno) in (1, 3) and kill == "3"  # EPERM/ESRCH; ESRCH


def test_host_pids_invisible(box: BwrapSandbox) -> None:
    host = [p for p in os.listdir("/proc") if p.isdigit()]
    names = box.exec("for p in /proc/[0-9]*; do cat $p/comm; done").stdout.split()
    assert len(host) > 10 and 3 <= len(names) <= 6  # bwrap's pid 1, the server, the command, cat
    assert set(names) <= {"bwrap", "sh", "shipyard-agent", "cat"}
    assert "python" not in names and "pytest" not in names  # this very process is not there


def test_proc_root_confined(box: BwrapSandbox) -> None:
    assert box.exec("readlink /proc/1/root").stdout.strip() == "/"
    inside = box.exec("ls -A /proc/1/root/").stdout.split()
    assert inside == box.exec("ls -A /").stdout.split()
    for path in ("/proc/1/root/etc/shadow", f"/proc/1/root{REPO}/pyproject.toml", "/proc/1/root/sys"):
        assert box.exec(f"cat {path}").returncode != 0, path
    assert box.exec("cat /proc/1/mem").returncode != 0


def test_no_capabilities(box: BwrapSandbox) -> None:
    status = box.exec("grep -E '^(CapEff|CapPrm|CapBnd|NoNewPrivs)' /proc/self/status").stdout
    assert status.count("0000000000000000") == 3 and "NoNewPrivs:\t1" in status
    for cmd in ("mount -t tmpfs none /tmp", "chroot / true", "mknod /tmp/sda b 8 0", "hostname evil"):
        assert box.exec(cmd).returncode != 0, cmd
    code = "import os\ntry:\n    os.setuid(1000)\n    print('setuid')\nexcept OSError as e:\n    print(e.errno)\n"
    assert _py(box, code).strip() in ("1", "22")


def test_no_nested_userns(box: BwrapSandbox) -> None:
    for cmd in ("unshare -U true", "unshare -r true", "unshare -Urm true"):
        assert box.exec(cmd).returncode != 0, cmd
    code = "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\nprint(libc.unshare(0x10000000), ctypes.get_errno())\n"
    assert _py(box, code).split()[0] == "-1"  # CLONE_NEWUSER


def test_device_nodes_minimal(box: BwrapSandbox) -> None:
    devs = set(box.exec("ls -A /dev").stdout.split())
    allowed = {
        "null",
        "zero",
        "full",
        "random",
        "urandom",
        "tty",
        "pts",
        "ptmx",
        "shm",
        "fd",
        "stdin",
        "stdout",
    }
    assert devs <= allowed | {"stderr", "core", "mqueue", "console"}
    for dev in ("/dev/sda", "/dev/mem", "/dev/kmsg", "/dev/vda", "/dev/nvme0n1", "/dev/fuse", "/dev/kvm"):
        assert box.exec(f"test -e {dev}").returncode != 0, dev
    assert box.exec("echo x > /dev/null && head -c 4 /dev/urandom | wc -c").stdout.strip() == "4"
    assert box.exec("touch /dev/evil").returncode != 0


def test_tmp_private(box: BwrapSandbox) -> None:
    marker = f"shipyard-{uuid.uuid4().hex}"
    host_file = Path("/tmp") / marker
    host_file.write_text("host")
    try:
        assert box.exec(f"cat /tmp/{marker}").returncode != 0
        assert box.exec(f"echo in > /tmp/{marker}.in").returncode == 0
        assert not Path(f"/tmp/{marker}.in").exists()
        with BwrapSandbox(None, CFG) as other:
            assert other.exec(f"cat /tmp/{marker}.in").returncode != 0
    finally:
        host_file.unlink()


def test_no_sys_or_cgroup_escape(box: BwrapSandbox) -> None:
    assert box.exec("ls /sys").returncode != 0
    assert box.exec("echo 1 > /sys/fs/cgroup/pids/cgroup.procs").returncode != 0
    cg = box.exec("cat /proc/self/cgroup").stdout
    assert "shipyard-sb" not in cg  # the cgroup namespace hides the host's cgroup paths


def test_sandboxes_isolated_from_each_other(box: BwrapSandbox) -> None:
    with BwrapSandbox({"mine.txt": "secret\n"}, CFG) as other:
        assert other.exec("sleep 0.01; ls /workspace").stdout == "mine.txt\n"
        for path in (other.root, f"{other.root}/mine.txt", f"/proc/{other.session_pid}"):
            assert box.exec(f"test -e {path}").returncode != 0, path
        assert box.exec("cat /workspace/mine.txt").returncode != 0


def test_host_file_access_confined(box: BwrapSandbox) -> None:
    assert box.exec("ln -sf /etc escape_dir && ln -sf /etc/hostname escape_file").returncode == 0
    with pytest.raises(ValueError, match="symlink"):
        box.write("escape_dir/shipyard-x", "x")
    with pytest.raises(ValueError, match="symlink"):
        box.read("escape_file")
    for bad in ("../x", "/etc/passwd", "a/../../x"):
        with pytest.raises(ValueError):
            box.write(bad, "x")
    assert "escape_file" not in box.files() and not os.path.exists("/etc/shipyard-x")


NO_FILTER = SandboxConfig(timeout_s=10, memory_mb=256, max_processes=32, seccomp=False)

PTRACE_CHILD = """
import ctypes, os, time
libc = ctypes.CDLL(None, use_errno=True)
child = os.fork()
if child == 0:
    time.sleep(5)
    os._exit(0)
rc = libc.ptrace(16, child, 0, 0)  # PTRACE_ATTACH to our own child, same user: allowed by the kernel
print(rc, ctypes.get_errno())
os.kill(child, 9)
"""


def test_no_ptrace_inside(box: BwrapSandbox) -> None:
    assert _py(box, PTRACE_CHILD).split() == ["-1", "1"]  # EPERM from the seccomp filter
    with BwrapSandbox(None, NO_FILTER) as control:  # without the filter the same attach succeeds
        assert _py(control, PTRACE_CHILD).split()[0] == "0"


def test_no_namespace_creation(box: BwrapSandbox) -> None:
    for cmd in (
        "unshare -m true",
        "unshare -n true",
        "unshare -p -f true",
        "unshare -i true",
        "unshare -C true",
    ):
        res = box.exec(cmd)
        assert res.returncode != 0 and "Operation not permitted" in res.stderr, cmd
    code = (
        "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
        "for flags in (0x20000, 0x40000000, 0x20000000, 0x02000000, 0x80):\n"
        "    print(libc.unshare(flags), ctypes.get_errno())\n"
        "print(libc.setns(0, 0), ctypes.get_errno())\n"
    )
    assert _py(box, code).split() == ["-1", "1"] * 6  # every namespace kind, and joining one


KERNEL_SURFACE = """
import ctypes, sys
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
for nr, args in ((int(a), (0, 0, 0)) for a in sys.argv[1:]):
    ctypes.set_errno(0)
    print(libc.syscall(nr, *args), ctypes.get_errno())
"""


def test_no_kernel_attack_surface(box: BwrapSandbox) -> None:
    nr = seccomp.SYSCALLS.get(platform.machine())
    if nr is None:
        pytest.skip(f"no syscall table for {platform.machine()}")
    names = ("bpf", "perf_event_open", "userfaultfd", "io_uring_setup", "keyctl", "add_key", "init_module")
    names += (
        "kexec_load",
        "open_by_handle_at",
        "mount",
        "pivot_root",
        "swapon",
        "reboot",
        "process_vm_readv",
    )
    box.write("surface.py", KERNEL_SURFACE)
    res = box.exec("python surface.py " + " ".join(str(nr[n]) for n in names))
    assert res.stdout.split() == ["-1", "1"] * len(names), res.stdout + res.stderr


def test_no_aslr_disable(box: BwrapSandbox) -> None:
    res = box.exec("setarch -R true || setarch $(uname -m) -R true")
    assert res.returncode != 0 and "Operation not permitted" in res.stderr
    code = "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\nprint(libc.personality(0x0040000), ctypes.get_errno())\n"
    assert _py(box, code).split() == ["-1", "1"]
    with BwrapSandbox(None, NO_FILTER) as control:
        assert control.exec("setarch -R true || setarch $(uname -m) -R true").returncode == 0


INT80 = """
import ctypes, mmap
code = bytes([0x31, 0xDB, 0xB8, 0x14, 0, 0, 0, 0xCD, 0x80, 0xC3])  # xor ebx,ebx; mov eax,20 (i386 getpid); int 0x80; ret
buf = mmap.mmap(-1, 4096, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
buf.write(code)
fn = ctypes.CFUNCTYPE(ctypes.c_long)(ctypes.addressof(ctypes.c_char.from_buffer(buf)))
print(fn())
"""


def test_no_foreign_arch_syscalls(box: BwrapSandbox) -> None:
    if platform.machine() != "x86_64":
        pytest.skip("the 32-bit syscall entry probe is x86_64 machine code")
    with BwrapSandbox({"int80.py": INT80}, NO_FILTER) as control:
        ctl = control.exec("python int80.py")
    if ctl.returncode != 0:
        pytest.skip(f"this kernel has no 32-bit syscall entry (control exited {ctl.returncode})")
    assert int(ctl.stdout) > 0  # getpid through the i386 table works without the filter
    box.write("int80.py", INT80)
    res = box.exec("python int80.py")
    assert res.returncode == 128 + signal.SIGSYS and res.stdout == ""  # killed by the filter


def test_memory_capped_for_whole_sandbox() -> None:
    cfg = SandboxConfig(timeout_s=20, memory_mb=256, max_processes=32, cgroup_memory_mb=96)
    hog = "python -c 'b = bytearray(40 * 2**20); import time; time.sleep({})'".format
    with BwrapSandbox(None, cfg) as sb:
        if sb.memory_limit != "cgroup":
            pytest.skip("no memory cgroup can be created here: only the per-process rlimit applies")
        assert sb.exec(hog(0)).returncode == 0  # control: one 40 MiB process fits its rlimit
        res = sb.exec(f"for i in 1 2 3 4; do ({hog(0.5)}; echo $? > rc$i) & done; wait; cat rc*")
        codes = [int(x) for x in res.stdout.split()]
        events = os.path.join(sb.cgroups["memory"], "memory.events")  # v2; v1: memory.oom_control
        with open(
            events if os.path.exists(events) else os.path.join(sb.cgroups["memory"], "memory.oom_control")
        ) as f:
            oom_kills = int(dict(line.split() for line in f)["oom_kill"])
    assert len(codes) == 4 and 137 in codes, res  # 4 x 40 MiB > 96 MiB: the kernel killed at least one
    assert oom_kills == codes.count(137) > 0


def test_cpu_capped_for_whole_sandbox() -> None:
    cfg = SandboxConfig(timeout_s=20, memory_mb=256, max_processes=32, cpus=0.1)
    spin = "timeout 0.5 sh -c 'while :; do :; done'"
    with BwrapSandbox(None, cfg) as sb:
        if sb.cpu_limit != "cgroup":
            pytest.skip("no cpu cgroup can be created here: only RLIMIT_CPU per command applies")
        sb.exec(f"{spin} & {spin} & wait")
        with open(os.path.join(sb.cgroups["cpu"], "cpu.stat")) as f:
            stat = dict(line.split() for line in f)
    assert int(stat["nr_throttled"]) > 0  # two spinning processes hit the 10 ms / 100 ms quota
