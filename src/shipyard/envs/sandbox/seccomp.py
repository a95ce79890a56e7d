"""A seccomp deny-list compiled to classic BPF here, in Python, for bwrap's ``--seccomp FD``.

Contract: :func:`deny_filter` returns the program (``struct sock_filter[]``, 8 bytes per
instruction, native little-endian) that :class:`~shipyard.envs.sandbox.bwrap.BwrapSandbox`
hands to bubblewrap, which installs it (with ``no_new_privs``) right before it executes the
sandbox's first process; every process of the sandbox inherits it and cannot remove it. The
program:

1. kills the process when the syscall's architecture is not the host's (a 32-bit ``int 0x80``
   call on x86_64 would otherwise reach a different syscall table with different numbers), and
   on x86_64 refuses the x32 ABI (numbers with bit 30 set);
2. returns ``EPERM`` for every syscall of :data:`DENIED` (kernel attack surface a coding task
   never needs: tracing, mounting, namespaces, keyrings, BPF, perf, module and kexec loading,
   reboot, swap, handle-based opens, userfaultfd, io_uring, new mount API, cross-process memory
   access);
3. returns ``EPERM`` for ``clone``/``unshare`` whose flags ask for any new namespace, for
   ``personality`` other than the harmless values Docker's default profile also allows (so no
   ``ADDR_NO_RANDOMIZE``), and for the terminal-injection ioctls ``TIOCSTI``/``TIOCLINUX``;
4. returns ``ENOSYS`` for ``clone3`` (its flags live in memory a filter cannot read; libc then
   falls back to ``clone``, which rule 3 checks), and allows everything else.

:func:`evaluate` runs a program on one syscall (architecture, number, arguments) the way the
kernel does, so tests check the filter's decisions directly as well as through real syscalls
in a sandbox. Limits: a deny-list, not an allow-list (a syscall added to a future kernel is
allowed); only x86_64 and aarch64 are known (:func:`deny_filter` raises ``ValueError`` naming
the machine elsewhere).
"""

from __future__ import annotations

import errno
import functools
import os
import platform
import struct
from dataclasses import dataclass

# classic BPF opcodes (linux/filter.h, linux/bpf_common.h)
_LD_W_ABS = 0x20
_JEQ_K = 0x15
_JGE_K = 0x35
_JSET_K = 0x45
_RET_K = 0x06

RET_KILL_PROCESS = 0x80000000
RET_ERRNO = 0x00050000
RET_ALLOW = 0x7FFF0000

_OFF_NR, _OFF_ARCH = 0, 4


def _arg_lo(i: int) -> int:
    """Offset of the low 32 bits of syscall argument ``i`` in ``struct seccomp_data`` (LE)."""
    return 16 + 8 * i


AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
X32_SYSCALL_BIT = 0x40000000

CLONE_NEW_FLAGS = 0x00000080 | 0x00020000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000
CLONE_NEW_FLAGS |= 0x20000000 | 0x40000000
"""CLONE_NEWTIME, NEWNS, NEWCGROUP, NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET."""
PERSONALITY_ALLOWED = (0x0, 0x8, 0x20000, 0x20008, 0xFFFFFFFF)
"""PER_LINUX, PER_LINUX32, UNAME26 variants and the query value (as Docker's default profile)."""
TTY_INJECT_IOCTLS = (0x5412, 0x541C)
"""TIOCSTI, TIOCLINUX."""

SYSCALLS: dict[str, dict[str, int]] = {
    "x86_64": {
        "ptrace": 101, "mount": 165, "umount2": 166, "unshare": 272, "setns": 308, "pivot_root": 155,
        "chroot": 161, "keyctl": 250, "add_key": 248, "request_key": 249, "bpf": 321,
        "perf_event_open": 298, "kexec_load": 246, "kexec_file_load": 320, "init_module": 175,
        "finit_module": 313, "delete_module": 176, "reboot": 169, "swapon": 167, "swapoff": 168,
        "open_by_handle_at": 304, "name_to_handle_at": 303, "userfaultfd": 323, "io_uring_setup": 425,
        "io_uring_enter": 426, "io_uring_register": 427, "acct": 163, "open_tree": 428, "move_mount": 429,
        "fsopen": 430, "fsconfig": 431, "fsmount": 432, "fspick": 433, "mount_setattr": 442,
        "process_vm_readv": 310, "process_vm_writev": 311, "personality": 135, "clone": 56,
        "clone3": 435, "ioctl": 16,
    },
    "aarch64": {
        "ptrace": 117, "mount": 40, "umount2": 39, "unshare": 97, "setns": 268, "pivot_root": 41,
        "chroot": 51, "keyctl": 219, "add_key": 217, "request_key": 218, "bpf": 280,
        "perf_event_open": 241, "kexec_load": 104, "kexec_file_load": 294, "init_module": 105,
        "finit_module": 273, "delete_module": 106, "reboot": 142, "swapon": 224, "swapoff": 225,
        "open_by_handle_at": 265, "name_to_handle_at": 264, "userfaultfd": 282, "io_uring_setup": 425,
        "io_uring_enter": 426, "io_uring_register": 427, "acct": 89, "open_tree": 428, "move_mount": 429,
        "fsopen": 430, "fsconfig": 431, "fsmount": 432, "fspick": 433, "mount_setattr": 442,
        "process_vm_readv": 270, "process_vm_writev": 271, "personality": 92, "clone": 220,
        "clone3": 435, "ioctl": 29,
    },
}  # fmt: skip
"""Syscall numbers per machine (from the kernel's syscall tables)."""

ARG_CHECKED = frozenset({"personality", "clone", "unshare", "clone3", "ioctl"})
DENIED: tuple[str, ...] = tuple(n for n in SYSCALLS["x86_64"] if n not in ARG_CHECKED)
"""Syscalls refused outright with EPERM."""


@dataclass(frozen=True)
class _Ins:
    code: int
    k: int
    jt: int | str = 0
    jf: int | str = 0


def _assemble(prog: list[_Ins | str]) -> bytes:
    """Resolve label strings (list entries) used as jump targets into relative offsets."""
    labels: dict[str, int] = {}
    body: list[_Ins] = []
    for item in prog:
        if isinstance(item, str):
            labels[item] = len(body)
        else:
            body.append(item)
    out = bytearray()
    for i, ins in enumerate(body):
        jt, jf = (labels[j] - i - 1 if isinstance(j, str) else j for j in (ins.jt, ins.jf))
        assert 0 <= jt <= 255 and 0 <= jf <= 255, "jump out of classic BPF range"
        out += struct.pack("<HBBI", ins.code, jt, jf, ins.k)
    assert len(body) <= 4096
    return bytes(out)


def deny_filter(machine: str | None = None) -> bytes:
    """The BPF program described in the module docstring for ``machine`` (default: this host)."""
    return _deny_filter(machine or platform.machine())


@functools.lru_cache(maxsize=4)
def _deny_filter(machine: str) -> bytes:
    """:func:`deny_filter`, assembled once per machine (it is a pure function of the tables above)."""
    if machine not in SYSCALLS:
        raise ValueError(
            f"seccomp: no syscall table for machine {machine!r}; known: {sorted(SYSCALLS)} "
            "(set sandbox.seccomp = false to run without the filter)"
        )
    nr = SYSCALLS[machine]
    deny, allow = "deny", "allow"
    prog: list[_Ins | str] = [
        _Ins(_LD_W_ABS, _OFF_ARCH),
        _Ins(_JEQ_K, AUDIT_ARCH[machine], 1, 0),
        _Ins(_RET_K, RET_KILL_PROCESS),
        _Ins(_LD_W_ABS, _OFF_NR),
    ]
    if machine == "x86_64":
        prog.append(_Ins(_JGE_K, X32_SYSCALL_BIT, deny, 0))
    prog += [_Ins(_JEQ_K, nr[name], deny, 0) for name in DENIED]
    prog.append(_Ins(_JEQ_K, nr["clone3"], "enosys", 0))
    for name, arg in (("clone", 0), ("unshare", 0)):
        prog += [_Ins(_JEQ_K, nr[name], 0, f"not_{name}"), _Ins(_LD_W_ABS, _arg_lo(arg))]
        prog += [_Ins(_JSET_K, CLONE_NEW_FLAGS, deny, allow), f"not_{name}"]
    prog += [_Ins(_JEQ_K, nr["personality"], 0, "not_personality"), _Ins(_LD_W_ABS, _arg_lo(0))]
    prog += [_Ins(_JEQ_K, v, allow, 0) for v in PERSONALITY_ALLOWED]
    prog += [_Ins(_RET_K, RET_ERRNO | errno.EPERM), "not_personality"]
    prog += [_Ins(_JEQ_K, nr["ioctl"], 0, allow), _Ins(_LD_W_ABS, _arg_lo(1))]
    prog += [_Ins(_JEQ_K, v, deny, 0) for v in TTY_INJECT_IOCTLS]
    prog += [allow, _Ins(_RET_K, RET_ALLOW), deny, _Ins(_RET_K, RET_ERRNO | errno.EPERM)]
    prog += ["enosys", _Ins(_RET_K, RET_ERRNO | errno.ENOSYS)]
    return _assemble(prog)


def evaluate(program: bytes, arch: int, nr: int, args: tuple[int, ...] = ()) -> int:
    """The kernel's verdict (``RET_*`` value) of ``program`` for one syscall (classic BPF subset)."""
    data = struct.pack("<iI", nr, arch) + struct.pack("<Q", 0)
    data += b"".join(struct.pack("<Q", a & 0xFFFFFFFFFFFFFFFF) for a in (tuple(args) + (0,) * 6)[:6])
    ins = [struct.unpack_from("<HBBI", program, i) for i in range(0, len(program), 8)]
    pc, acc = 0, 0
    while True:
        code, jt, jf, k = ins[pc]
        pc += 1
        if code == _LD_W_ABS:
            acc = struct.unpack_from("<I", data, k)[0]
        elif code == _RET_K:
            return k
        elif code in (_JEQ_K, _JGE_K, _JSET_K):
            hit = acc == k if code == _JEQ_K else (acc >= k if code == _JGE_K else bool(acc & k))
            pc += jt if hit else jf
        else:
            raise ValueError(f"seccomp.evaluate: unsupported opcode {code:#x} at {pc - 1}")


def filter_fd(program: bytes) -> int:
    """A fresh read-only fd at offset 0 holding ``program`` (a memfd; the caller closes it)."""
    fd = os.memfd_create("shipyard-seccomp", os.MFD_CLOEXEC)
    try:
        os.write(fd, program)
        os.lseek(fd, 0, os.SEEK_SET)
    except BaseException:
        os.close(fd)
        raise
    return fd
