"""MicroVM backend: host detection reports exactly what is missing, and nothing pretends to run a VM.

The KVM probe runs for real on this host (whatever it finds); the error paths use paths that
exist but are not KVM, or do not exist.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest

from shipyard.config.schema import MicroVMConfig, SandboxConfig
from shipyard.envs.sandbox import SandboxUnavailable, make_sandbox
from shipyard.envs.sandbox.microvm import (
    MicroVMSandbox,
    firecracker_config,
    host_problems,
    microvm_available,
    probe_kvm,
)


def test_probe_of_this_hosts_kvm_is_consistent() -> None:
    probe = probe_kvm()
    assert probe.exists == os.path.exists("/dev/kvm")
    if probe.usable:  # every step passed, down to a guest instruction run through KVM_RUN
        assert probe.opened and probe.api_version == 12 and probe.created_vm and probe.detail == ""
    else:
        assert probe.detail  # the first failing step, named
    assert (not any("hardware KVM" in p for p in host_problems(SandboxConfig()))) == probe.usable


def test_missing_and_wrong_devices_are_named(tmp_path: os.PathLike[str]) -> None:
    missing = probe_kvm("/nonexistent/kvm")
    assert not missing.usable and missing.detail == "/nonexistent/kvm does not exist"
    not_kvm = probe_kvm("/dev/null")
    assert not_kvm.exists and not_kvm.opened and not not_kvm.usable
    assert "KVM_GET_API_VERSION on /dev/null failed" in not_kvm.detail
    msg = microvm_available(SandboxConfig(), kvm_path="/nonexistent/kvm")
    assert "hardware KVM is not usable: /nonexistent/kvm does not exist" in msg and "VT-x" in msg


def test_unavailability_is_reported_not_faked(tmp_path: os.PathLike[str]) -> None:
    cfg = SandboxConfig(
        type="microvm", microvm=MicroVMConfig(binary="firecracker-not-here", kernel="/no/vmlinux")
    )
    with pytest.raises(SandboxUnavailable) as info:
        make_sandbox(cfg, {"a.py": "print(1)"})
    msg = str(info.value)
    assert "'firecracker-not-here' is not on PATH" in msg and "releases" in msg
    assert "sandbox.microvm.kernel = '/no/vmlinux' is not a file" in msg
    assert "sandbox.microvm.rootfs is not set" in msg
    assert msg.endswith("use sandbox.type = 'bwrap'")  # and even a full host has no guest agent yet
    with pytest.raises(SandboxUnavailable):
        MicroVMSandbox(None, cfg)
    if shutil.which("firecracker") is None:
        assert any("Firecracker binary" in p for p in host_problems(SandboxConfig()))


def test_firecracker_config_follows_the_documented_schema(tmp_path: os.PathLike[str]) -> None:
    cfg = SandboxConfig(microvm=MicroVMConfig(kernel="vmlinux", vcpus=2, mem_mib=256))
    doc = firecracker_config(cfg, "rootfs.ext4", "v.sock")
    assert set(doc) == {"boot-source", "drives", "machine-config", "vsock", "network-interfaces"}
    assert (
        os.path.isabs(doc["boot-source"]["kernel_image_path"])
        and "console=ttyS0" in doc["boot-source"]["boot_args"]
    )
    assert doc["drives"] == [
        {
            "drive_id": "rootfs",
            "path_on_host": os.path.abspath("rootfs.ext4"),
            "is_root_device": True,
            "is_read_only": False,
        }
    ]
    assert doc["machine-config"] == {"vcpu_count": 2, "mem_size_mib": 256, "smt": False}
    assert doc["vsock"]["guest_cid"] == 3 and doc["network-interfaces"] == []  # no network unless asked
    assert (
        firecracker_config(cfg, "r", "v", network_tap="tap0")["network-interfaces"][0]["host_dev_name"]
        == "tap0"
    )
    json.dumps(doc)
