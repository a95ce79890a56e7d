"""MicroVM sandboxes (Firecracker) behind the sandbox interface: host detection and VM configuration.

Contract: :func:`probe_kvm` checks, step by step, that hardware virtualization is usable here:
``/dev/kvm`` exists and opens read-write, ``KVM_GET_API_VERSION`` answers 12, ``KVM_CREATE_VM``
returns a VM, and a one-instruction guest (``hlt`` in real mode, one vCPU, one page of memory)
runs through ``KVM_RUN`` to a ``KVM_EXIT_HLT`` exit (in a child process, so a broken driver
cannot hang the caller). :func:`host_problems` adds what a microVM needs besides KVM: the
Firecracker binary and the guest kernel and root filesystem named in ``cfg.microvm``, each with
how to get it; :func:`microvm_available` is the whole message :class:`MicroVMSandbox` raises
(as :class:`~.base.SandboxUnavailable`).

How it runs (docs/sandboxes.md): one Firecracker process per sandbox, started with
``--no-api --config-file`` holding :func:`firecracker_config` (kernel, a copy-on-write copy of the
root filesystem as the root drive, vCPUs and memory, no network interface unless the task asks,
a vsock device whose host side is a Unix socket), inside the same cgroups the bubblewrap backend
uses; the guest runs a small command agent listening on vsock port :data:`AGENT_PORT` that speaks
the same framing as the bubblewrap session server (:data:`.bwrap._SERVER`); the host connects
through the Unix socket with Firecracker's ``CONNECT <port>`` handshake.

Limits: this release detects the host and builds the VM configuration, but ships no guest
image or agent, so even on a fully equipped host the constructor raises
:class:`~.base.SandboxUnavailable` saying so: nothing here pretends to run a VM. x86_64 only for
the guest probe (other machines report that the probe is not implemented for them).
"""

from __future__ import annotations

import fcntl
import functools
import os
import platform
import shutil
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from shipyard.config.schema import SandboxConfig
from shipyard.envs.sandbox.base import SandboxUnavailable

KVM_GET_API_VERSION = 0xAE00
KVM_CREATE_VM = 0xAE01
KVM_API_VERSION = 12
AGENT_PORT = 5005
"""vsock port of the in-guest command agent."""
_KVM_HINT = (
    "hardware virtualization must be enabled and exposed to this machine: on bare metal enable "
    "VT-x/AMD-V in the firmware and `modprobe kvm_intel` (or `kvm_amd`); in a cloud VM pick an "
    "instance type with nested virtualization (or a bare-metal instance); in a container pass "
    "`--device /dev/kvm`"
)
_FIRECRACKER_HINT = (
    "install Firecracker: download the release tarball for this machine from "
    "https://github.com/firecracker-microvm/firecracker/releases and put `firecracker` on PATH "
    "(or set sandbox.microvm.binary); it is not packaged by Debian or PyPI"
)


@dataclass(frozen=True)
class KvmProbe:
    """What :func:`probe_kvm` found; ``usable`` only when every step passed."""

    path: str
    exists: bool = False
    opened: bool = False
    api_version: int | None = None
    created_vm: bool = False
    guest_ran: bool = False
    detail: str = ""
    """The first failure, with its error."""

    @property
    def usable(self) -> bool:
        return self.guest_ran


_GUEST_PROBE = r"""
import ctypes, fcntl, mmap, os, struct, sys
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CLOEXEC)
vm = fcntl.ioctl(fd, 0xAE01, 0)                                # KVM_CREATE_VM
mem = mmap.mmap(-1, 0x1000, prot=mmap.PROT_READ | mmap.PROT_WRITE)
mem.write(bytes([0xF4]))                                       # hlt
addr = ctypes.addressof(ctypes.c_char.from_buffer(mem))
fcntl.ioctl(vm, 0x4020AE46, struct.pack("<IIQQQ", 0, 0, 0x1000, 0x1000, addr))  # SET_USER_MEMORY_REGION
vcpu = fcntl.ioctl(vm, 0xAE41, 0)                              # KVM_CREATE_VCPU
run = mmap.mmap(vcpu, fcntl.ioctl(fd, 0xAE04, 0), mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
sregs = bytearray(312)
fcntl.ioctl(vcpu, 0x8138AE83, sregs)                           # KVM_GET_SREGS
struct.pack_into("<Q", sregs, 0, 0)                            # cs.base = 0
struct.pack_into("<H", sregs, 12, 0)                           # cs.selector = 0
fcntl.ioctl(vcpu, 0x4138AE84, bytes(sregs))                    # KVM_SET_SREGS
regs = bytearray(144)
struct.pack_into("<QQ", regs, 128, 0x1000, 0x2)                # rip, rflags
fcntl.ioctl(vcpu, 0x4090AE82, bytes(regs))                     # KVM_SET_REGS
fcntl.ioctl(vcpu, 0xAE80, 0)                                   # KVM_RUN
print(struct.unpack_from("<I", run, 8)[0])                     # exit_reason (KVM_EXIT_HLT = 5)
"""
"""A real-mode guest of one ``hlt`` instruction, run once through KVM (the classic KVM API demo)."""


def _guest_runs(path: str) -> tuple[bool, str]:
    if platform.machine() != "x86_64":
        return False, f"the guest probe is x86_64 machine code; not implemented for {platform.machine()}"
    try:
        res = subprocess.run(
            [sys.executable, "-c", _GUEST_PROBE, path], capture_output=True, text=True, timeout=20
        )
    except subprocess.TimeoutExpired:
        return False, "KVM_RUN of a one-instruction guest did not return within 20 s"
    if res.returncode != 0:
        err = res.stderr.strip().splitlines()[-1] if res.stderr.strip() else f"exit {res.returncode}"
        return False, f"running a one-instruction guest failed: {err}"
    if res.stdout.strip() != "5":
        return False, f"a one-instruction guest exited with KVM exit reason {res.stdout.strip()}, not HLT (5)"
    return True, ""


def probe_kvm(path: str = "/dev/kvm") -> KvmProbe:
    """Check ``path`` step by step (see the module docstring); stops at the first failure."""
    if not os.path.exists(path):
        return KvmProbe(path, detail=f"{path} does not exist")
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    except OSError as exc:
        return KvmProbe(path, exists=True, detail=f"opening {path} read-write failed: {exc}")
    try:
        try:
            version = fcntl.ioctl(fd, KVM_GET_API_VERSION, 0)
        except OSError as exc:
            return KvmProbe(path, True, True, detail=f"KVM_GET_API_VERSION on {path} failed: {exc}")
        if version != KVM_API_VERSION:
            return KvmProbe(path, True, True, version, detail=f"KVM API version {version}, need 12")
        try:
            os.close(fcntl.ioctl(fd, KVM_CREATE_VM, 0))
        except OSError as exc:
            return KvmProbe(path, True, True, version, detail=f"KVM_CREATE_VM failed: {exc}")
    finally:
        os.close(fd)
    ran, detail = _guest_runs(path)
    return KvmProbe(path, True, True, version, True, ran, detail)


@functools.lru_cache(maxsize=8)
def _cached_probe(path: str) -> KvmProbe:
    return probe_kvm(path)


def host_problems(cfg: SandboxConfig, kvm_path: str = "/dev/kvm") -> list[str]:
    """What this host lacks for microVMs (KVM, the Firecracker binary, kernel, rootfs), with how to get it."""
    problems = []
    kvm = _cached_probe(kvm_path)
    if not kvm.usable:
        problems.append(f"hardware KVM is not usable: {kvm.detail}; {_KVM_HINT}")
    if shutil.which(cfg.microvm.binary) is None:
        problems.append(f"the Firecracker binary {cfg.microvm.binary!r} is not on PATH: {_FIRECRACKER_HINT}")
    for field, what in (
        ("kernel", "an uncompressed guest kernel (vmlinux)"),
        ("rootfs", "an ext4 root image"),
    ):
        value = getattr(cfg.microvm, field)
        if not value:
            problems.append(f"sandbox.microvm.{field} is not set: give {what} (docs/sandboxes.md)")
        elif not os.path.isfile(value):
            problems.append(f"sandbox.microvm.{field} = {value!r} is not a file")
    return problems


def microvm_available(cfg: SandboxConfig, kvm_path: str = "/dev/kvm") -> str:
    """Why microVM sandboxes cannot start here: the host's missing pieces, then the missing guest agent.

    In this release the answer is never "they can": the guest image with its command agent is not
    shipped, which the message says last (alone, on a host that has everything else).
    """
    problems = host_problems(cfg, kvm_path)
    problems.append(
        "this release ships no guest image with the vsock command agent, so microVM sandboxes "
        "cannot run commands yet (docs/sandboxes.md, 'MicroVM backend'); use sandbox.type = 'bwrap'"
    )
    return "microVM sandboxes cannot run here: " + "; ".join(problems)


def firecracker_config(
    cfg: SandboxConfig, rootfs: str, vsock_uds: str, network_tap: str | None = None
) -> dict[str, Any]:
    """Firecracker's ``--config-file`` document for one sandbox VM (Firecracker's documented schema)."""
    doc: dict[str, Any] = {
        "boot-source": {
            "kernel_image_path": os.path.abspath(cfg.microvm.kernel),
            "boot_args": "console=ttyS0 reboot=k panic=1 pci=off quiet",
        },
        "drives": [
            {
                "drive_id": "rootfs",
                "path_on_host": os.path.abspath(rootfs),
                "is_root_device": True,
                "is_read_only": False,
            }
        ],
        "machine-config": {
            "vcpu_count": cfg.microvm.vcpus,
            "mem_size_mib": cfg.microvm.mem_mib,
            "smt": False,
        },
        "vsock": {"guest_cid": 3, "uds_path": os.path.abspath(vsock_uds)},
        "network-interfaces": [],
    }
    if network_tap is not None:
        doc["network-interfaces"] = [{"iface_id": "eth0", "host_dev_name": network_tap}]
    return doc


class MicroVMSandbox:
    """A sandbox in a Firecracker microVM; raises :class:`~.base.SandboxUnavailable` where it cannot run."""

    def __init__(self, files: Mapping[str, str] | None, cfg: SandboxConfig, network: bool = False) -> None:
        self.files, self.cfg, self.network = dict(files or {}), cfg, network
        raise SandboxUnavailable(microvm_available(cfg))
