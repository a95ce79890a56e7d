"""Precision from the hardware: whether this process's device computes bf16 fast, and the choice it makes.

bf16 is only faster where the device has bf16 arithmetic. On a CPU without it, torch's bf16 matmul
falls back to converting element by element: measured on this project's 2-core machine held to
AVX2 (``ONEDNN_MAX_CPU_ISA=AVX2``), a 1024x1024 bf16 matmul ran at 0.9 GFLOP/s against 80 GFLOP/s in
fp32 (and at 38 against 99 with oneDNN held to AVX512_CORE, below its BF16 level), while with the
CPU's AVX512-BF16 units it ran at 214. So :func:`bf16_support` answers from what the hardware and
torch's kernels report, never from a guess:

- CUDA: ``torch.cuda.is_bf16_supported()`` (Ampere and newer).
- CPU: the CPU has AVX512-BF16 or AMX-BF16 (``torch.cpu.get_capabilities()``), and oneDNN, which
  runs torch's bf16 matmuls, is allowed to use them: ``ONEDNN_MAX_CPU_ISA`` (or ``DNNL_MAX_CPU_ISA``)
  unset, ``ALL``/``DEFAULT``, or an ISA at ``AVX512_CORE_BF16`` level or above.

:func:`resolve_bf16` turns a setting (``True``, ``False``, ``"auto"``) into the choice for this
process, with a one-line reason that quotes the capability string; an explicit ``True`` on a
device without fast bf16 warns once with the measured consequence.

Contract: each process decides for its own device (in a cluster the trainer and the servers may
run on different hardware); the run records each choice (trainer summary, server ``/stats``).
"""

from __future__ import annotations

import os
import warnings
from dataclasses import asdict, dataclass
from typing import Any, Literal

import torch

ONEDNN_BF16_ISAS = (
    "AVX512_CORE_BF16",
    "AVX512_CORE_FP16",
    "AVX512_CORE_AMX",
    "AVX512_CORE_AMX_FP16",
    "AVX10_1_512",
    "AVX10_1_512_AMX",
    "AVX10_1_512_AMX_FP16",
    "AVX10_2_512",
    "AVX10_2_512_AMX_2",
    "ALL",
    "DEFAULT",
)
"""oneDNN ISA caps at or above the level that uses AVX512-BF16 (or AMX) instructions."""

_warned: set[str] = set()


@dataclass(frozen=True)
class Bf16Support:
    fast: bool
    """Whether bf16 matmuls run on bf16 units of this device."""
    device: str
    """``cpu`` or ``cuda``."""
    capability: str
    """What torch reports, e.g. ``AVX512 (aten); avx512_bf16=yes amx_bf16=no; oneDNN max ISA=AVX2``."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def onednn_isa_cap() -> str | None:
    """The oneDNN ISA cap from the environment (upper case), or None when uncapped."""
    value = os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA")
    return value.strip().upper() if value else None


def bf16_support(device: str = "cpu") -> Bf16Support:
    """Whether ``device`` (``cpu`` or ``cuda``) has fast bf16, and the capability string that says so."""
    if device.startswith("cuda"):
        ok = torch.cuda.is_available() and torch.cuda.is_bf16_supported()
        name = torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA device"
        return Bf16Support(ok, "cuda", f"{name}; bf16 supported={'yes' if ok else 'no'}")
    caps = torch.cpu.get_capabilities() if hasattr(torch.cpu, "get_capabilities") else {}
    units = {k: bool(caps.get(k)) for k in ("avx512_bf16", "amx_bf16")}
    cap = onednn_isa_cap()
    allowed = cap is None or cap in ONEDNN_BF16_ISAS
    text = (
        f"{torch.backends.cpu.get_cpu_capability()} (aten); "
        + " ".join(f"{k}={'yes' if v else 'no'}" for k, v in units.items())
        + f"; oneDNN max ISA={cap or 'unset'}"
    )
    return Bf16Support(any(units.values()) and allowed, "cpu", text)


def resolve_bf16(setting: bool | Literal["auto"], device: str, field: str) -> tuple[bool, str]:
    """(use bf16, reason) for ``field`` (e.g. ``trainer.bf16_decoder``) set to ``setting`` on ``device``.

    ``"auto"`` uses bf16 exactly where :func:`bf16_support` says it is fast. An explicit ``True``
    where it is not warns once per field with the measured consequence, and is honoured.
    """
    support = bf16_support(device)
    if setting == "auto":
        verdict = "fast bf16" if support.fast else "no fast bf16"
        return (
            support.fast,
            f"{field}=auto -> {'bf16' if support.fast else 'fp32'}: {verdict} ({support.capability})",
        )
    if setting and not support.fast and field not in _warned:
        _warned.add(field)
        warnings.warn(
            f"{field}=true on a {support.device} without fast bf16 ({support.capability}): bf16 matmuls "
            "fall back to slow kernels here (measured 0.9 vs 80 GFLOP/s fp32 on an AVX2 CPU; the demo's "
            f"trainer ran ~9x slower). Set {field}=auto (or false) to run in fp32.",
            stacklevel=2,
        )
    return bool(setting), f"{field}={str(bool(setting)).lower()} (set explicitly; {support.capability})"


def resolve_dtype(setting: str, device: str, field: str) -> tuple[torch.dtype, str]:
    """The torch dtype for a ``"auto" | "float32" | "bfloat16"`` setting (``inference.dtype``), with reason."""
    if setting == "auto":
        use, reason = resolve_bf16("auto", device, field)
        return (torch.bfloat16 if use else torch.float32), reason
    if setting == "bfloat16":
        resolve_bf16(True, device, field)  # warns once where the device has no fast bf16
    return getattr(torch, setting), f"{field}={setting} (set explicitly)"
