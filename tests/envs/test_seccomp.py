"""The seccomp deny-list: its BPF program's decisions, and the same syscalls made for real.

The program is checked two ways: :func:`seccomp.evaluate` runs it on (arch, nr, args) tuples as
the kernel would, and a sandbox makes the real syscalls (with arguments that are harmless and
invalid, so that without the filter each would fail with an error other than EPERM: the same
probe run unsandboxed on the host is the positive control).
"""

from __future__ import annotations

import errno
import json
import platform
import subprocess
import sys

import pytest

from shipyard.config.schema import SandboxConfig
from shipyard.envs.sandbox import BwrapSandbox, sandbox_available, seccomp

MACHINE = platform.machine()
ARCH = seccomp.AUDIT_ARCH.get(MACHINE, 0)
EPERM = seccomp.RET_ERRNO | errno.EPERM


def _verdict(name: str, *args: int, machine: str = "x86_64") -> int:
    prog = seccomp.deny_filter(machine)
    return seccomp.evaluate(prog, seccomp.AUDIT_ARCH[machine], seccomp.SYSCALLS[machine][name], args)


@pytest.mark.parametrize("machine", sorted(seccomp.SYSCALLS))
def test_program_denies_the_list_and_allows_the_rest(machine: str) -> None:
    prog = seccomp.deny_filter(machine)
    nr, arch = seccomp.SYSCALLS[machine], seccomp.AUDIT_ARCH[machine]
    assert len(prog) % 8 == 0 and len(prog) // 8 < 100
    for name in seccomp.DENIED:
        assert seccomp.evaluate(prog, arch, nr[name], (0, 0)) == EPERM, name
    for allowed in (0, 1, 3, 60, 200, 231, 300):  # read/write/close/exit/... numbers not on the list
        if allowed not in nr.values():
            assert seccomp.evaluate(prog, arch, allowed, ()) == seccomp.RET_ALLOW, allowed
    assert seccomp.evaluate(prog, arch ^ 0x1, nr["ptrace"], ()) == seccomp.RET_KILL_PROCESS
    assert seccomp.evaluate(prog, 0x40000003, 26, ()) == seccomp.RET_KILL_PROCESS  # i386 int 0x80


def test_argument_rules() -> None:
    newuser, newns, newnet = 0x10000000, 0x00020000, 0x40000000
    thread_flags = 0x003D0F00  # what pthread_create passes: no namespace bit
    assert _verdict("clone", thread_flags) == seccomp.RET_ALLOW
    assert _verdict("clone", 0x11) == seccomp.RET_ALLOW  # fork(): SIGCHLD
    for flag in (newuser, newns, newnet, 0x80, 0x20000000):
        assert _verdict("clone", 0x11 | flag) == EPERM, hex(flag)
        assert _verdict("unshare", flag) == EPERM, hex(flag)
    assert _verdict("unshare", 0x200) == seccomp.RET_ALLOW  # CLONE_FS: no namespace
    assert _verdict("clone", newuser | (1 << 40)) == EPERM  # high bits do not hide the flag
    assert _verdict("clone3") == seccomp.RET_ERRNO | errno.ENOSYS
    assert _verdict("personality", 0xFFFFFFFF) == seccomp.RET_ALLOW  # the query
    assert _verdict("personality", 0x0040000) == EPERM  # ADDR_NO_RANDOMIZE
    assert _verdict("ioctl", 0, 0x5412) == EPERM  # TIOCSTI
    assert _verdict("ioctl", 0, 0x5401) == seccomp.RET_ALLOW  # TCGETS
    x32 = seccomp.evaluate(seccomp.deny_filter("x86_64"), seccomp.AUDIT_ARCH["x86_64"], 0x40000000 | 39, ())
    assert x32 == EPERM


def test_unknown_machine_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="riscv64"):
        seccomp.deny_filter("riscv64")


PROBE = r"""
import ctypes, json, sys
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
calls = {
    "ptrace": (int(sys.argv[1]), 0, 0, 0, 0),             # PTRACE_TRACEME: 0 when allowed
    "bpf": (int(sys.argv[2]), 999, 0, 0),                 # unknown command: EINVAL
    "perf_event_open": (int(sys.argv[3]), 0, 0, -1, -1, 0),  # NULL attr: EFAULT
    "keyctl": (int(sys.argv[4]), 99999, 0, 0, 0),         # unknown op: EOPNOTSUPP
    "io_uring_setup": (int(sys.argv[5]), 0, 0),           # 0 entries: EINVAL / EFAULT
    "userfaultfd": (int(sys.argv[6]), -1),                # bad flags: EINVAL
    "personality_norand": (int(sys.argv[7]), 0x0040000),  # ADDR_NO_RANDOMIZE
    "unshare_net": (int(sys.argv[8]), 0x40000000),
    "getpid": (int(sys.argv[9]),),
}
out = {}
for name, (nr, *args) in calls.items():
    ctypes.set_errno(0)
    rc = libc.syscall(nr, *[ctypes.c_long(a) for a in args])
    out[name] = [rc, ctypes.get_errno()]
print(json.dumps(out))
"""
_PROBE_CALLS = (
    "ptrace",
    "bpf",
    "perf_event_open",
    "keyctl",
    "io_uring_setup",
    "userfaultfd",
    "personality",
    "unshare",
)


def _probe_args() -> list[str]:
    nr = seccomp.SYSCALLS[MACHINE]
    return [str(nr[n]) for n in _PROBE_CALLS] + [str({"x86_64": 39, "aarch64": 172}[MACHINE])]


@pytest.mark.skipif(sandbox_available() is not None, reason=str(sandbox_available()))
@pytest.mark.skipif(MACHINE not in seccomp.SYSCALLS, reason=f"no syscall table for {MACHINE}")
def test_real_syscalls_get_eperm_inside_and_something_else_outside() -> None:
    with BwrapSandbox({"probe.py": PROBE}, SandboxConfig(timeout_s=20)) as sb:
        status = sb.exec("grep -E '^Seccomp' /proc/self/status").stdout
        res = sb.exec(f"python probe.py {' '.join(_probe_args())}")
    assert res.returncode == 0, res.stderr
    inside = json.loads(res.stdout)
    assert "Seccomp:\t2" in status  # filter mode
    for name, (rc, err) in inside.items():
        if name == "getpid":
            assert rc > 0, inside  # control: ordinary syscalls work
        else:
            assert (rc, err) == (-1, errno.EPERM), (name, inside)
    # positive control, unsandboxed: harmless invalid calls fail differently (or succeed)
    host = subprocess.run(
        [sys.executable, "-c", PROBE, *_probe_args()], capture_output=True, text=True, check=True
    )
    outside = json.loads(host.stdout)
    for name in ("bpf", "perf_event_open", "keyctl", "io_uring_setup", "userfaultfd"):
        assert outside[name][1] != errno.EPERM or outside[name][0] >= 0, (name, outside)
    assert outside["ptrace"][0] == 0  # PTRACE_TRACEME works without the filter


@pytest.mark.skipif(sandbox_available() is not None, reason=str(sandbox_available()))
def test_seccomp_can_be_switched_off_by_config() -> None:
    with BwrapSandbox(None, SandboxConfig(timeout_s=10, seccomp=False)) as sb:
        assert "Seccomp:\t0" in sb.exec("grep -E '^Seccomp' /proc/self/status").stdout
