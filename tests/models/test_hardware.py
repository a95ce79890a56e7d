"""Precision follows the hardware: `auto` picks bf16 only where bf16 units are usable, on this CPU as
it is and held to AVX2 kernels; an explicit bf16 on a CPU without them warns once."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from shipyard.config import load_config
from shipyard.models import hardware
from shipyard.models.hardware import bf16_support, resolve_bf16, resolve_dtype

ROOT = Path(__file__).resolve().parents[2]
AVX2 = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}

PROBE = """
import json, torch
from shipyard.models.hardware import bf16_support, resolve_bf16
s = bf16_support("cpu")
print(json.dumps({"fast": s.fast, "capability": s.capability, "auto": resolve_bf16("auto", "cpu", "f")[0],
                  "aten": torch.backends.cpu.get_cpu_capability()}))
"""


def _probe(env: dict[str, str]) -> dict:
    base = {k: v for k, v in os.environ.items() if k not in ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA")}
    out = subprocess.run(
        [sys.executable, "-c", PROBE],
        env={**base, **env},
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    return json.loads(out.stdout)


def _has_units() -> bool:
    caps = torch.cpu.get_capabilities()
    return bool(caps.get("avx512_bf16") or caps.get("amx_bf16"))


def test_auto_follows_the_cpus_bf16_units_natively() -> None:
    got = _probe({})
    assert got["fast"] == got["auto"] == _has_units()
    assert ("avx512_bf16=yes" in got["capability"]) == bool(torch.cpu.get_capabilities().get("avx512_bf16"))
    assert "oneDNN max ISA=unset" in got["capability"]


def test_auto_picks_fp32_when_torch_is_held_to_avx2() -> None:
    got = _probe(AVX2)
    assert got["auto"] is False and got["fast"] is False
    assert got["aten"] == "AVX2" and "oneDNN max ISA=AVX2" in got["capability"]


@pytest.mark.parametrize(
    ("cap", "fast_if_units"),
    [
        ("AVX2", False),
        ("AVX512_CORE", False),
        ("AVX512_CORE_BF16", True),
        ("AVX512_CORE_AMX", True),
        ("ALL", True),
    ],
)
def test_onednn_isa_cap_decides(monkeypatch: pytest.MonkeyPatch, cap: str, fast_if_units: bool) -> None:
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", cap)
    assert bf16_support("cpu").fast == (fast_if_units and _has_units())


def test_explicit_true_without_units_warns_once_and_is_honoured(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    monkeypatch.setattr(hardware, "_warned", set())
    with pytest.warns(UserWarning, match=r"trainer.bf16_decoder=true .*0.9 vs 80 GFLOP/s.*=auto"):
        use, reason = resolve_bf16(True, "cpu", "trainer.bf16_decoder")
    assert use is True and "set explicitly" in reason
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        resolve_bf16(True, "cpu", "trainer.bf16_decoder")  # once per field
    assert resolve_bf16(False, "cpu", "trainer.bf16_decoder")[0] is False


def test_engine_dtype_auto_and_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    dtype, reason = resolve_dtype("auto", "cpu", "inference.dtype")
    assert dtype == torch.float32 and reason.startswith("inference.dtype=auto -> fp32: no fast bf16 (")
    assert resolve_dtype("float32", "cpu", "inference.dtype")[0] == torch.float32


def test_shipped_configs_default_to_auto() -> None:
    for name in ("demo", "long", "tiny_moe"):
        cfg = load_config(ROOT / f"configs/{name}.toml")
        assert cfg.trainer.bf16_decoder == "auto", name


def test_cuda_reports_without_a_device() -> None:
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    s = bf16_support("cuda")
    assert not s.fast and "no CUDA device" in s.capability


def test_engine_precision_casts_the_decoder_and_keeps_the_head_fp32(monkeypatch: pytest.MonkeyPatch) -> None:
    from shipyard.config.schema import InferenceConfig, ModelConfig
    from shipyard.inference.engine.engine import EmbeddedEngine
    from shipyard.models.loading import load_model
    from shipyard.models.precision import engine_precision

    model, tok = load_model(ModelConfig(source="tiny", tiny="dense"))
    record = engine_precision(model, InferenceConfig(dtype="bfloat16"))
    assert record["dtype"] == "bfloat16" and model.get_output_embeddings().weight.dtype == torch.float32
    assert model.model.layers[0].mlp.up_proj.weight.dtype == torch.bfloat16
    engine = EmbeddedEngine(model, tok)
    assert engine.precision["dtype"] == "bfloat16"  # the bulk of the weights, fp32 head aside
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    fp32, _ = load_model(ModelConfig(source="tiny", tiny="dense"))
    assert engine_precision(fp32, InferenceConfig(dtype="auto"))["dtype"] == "float32"
    assert all(p.dtype == torch.float32 for p in fp32.parameters())
