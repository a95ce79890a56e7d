"""oneDNN-packed linear layers: the same model (names, parameters, tied storage), the same outputs up to
float summation order, and a packed copy that follows every weight update the engine applies."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from shipyard.config.schema import ModelConfig
from shipyard.inference.engine.engine import EmbeddedEngine
from shipyard.inference.engine.packed import PackedLinear, can_pack, pack_linears, packable
from shipyard.inference.types import GenerateRequest, SamplingParams
from shipyard.models.loading import build_tiny, load_tokenizer

pytestmark = pytest.mark.skipif(
    not torch.backends.mkldnn.is_available(), reason="PyTorch built without oneDNN"
)


def _logits(model: nn.Module, ids_BT: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids_BT).logits


@pytest.mark.parametrize("dtype, atol", [(torch.float32, 1e-4), (torch.bfloat16, 0.1)])
def test_packed_model_is_the_same_model(dtype: torch.dtype, atol: float) -> None:
    if not packable(dtype):
        pytest.skip(f"oneDNN does not pack {dtype} on this CPU (bf16 needs AVX-512 or AVX-NE-CONVERT)")
    ref, packed = build_tiny("dense", 512, 0).to(dtype), build_tiny("dense", 512, 0).to(dtype)
    params = dict(packed.named_parameters())
    layers = pack_linears(packed)
    assert can_pack(packed) and len(layers.layers) == 2 * 7 + 1  # 7 linears a block, and the head
    assert all(type(m) is not nn.Linear for m in packed.modules())
    assert dict(packed.named_parameters()).keys() == params.keys()
    assert all(p is params[n] for n, p in packed.named_parameters())  # the same parameters
    assert packed.lm_head.weight is packed.model.embed_tokens.weight  # tied stays tied
    ids_BT = torch.randint(0, 512, (3, 11))
    diff = (_logits(packed, ids_BT).float() - _logits(ref, ids_BT).float()).abs().max()
    assert 0 <= float(diff) < atol
    # siblings share one GEMM (issue 39); one called alone, on an input of its own, is still itself
    attn, mlp = packed.model.layers[0].self_attn, packed.model.layers[0].mlp
    assert attn.q_proj.group is attn.k_proj.group is attn.v_proj.group is not None
    assert mlp.gate_proj.group is mlp.up_proj.group is not None and mlp.down_proj.group is None
    x_NI = torch.randn(5, attn.k_proj.in_features).to(dtype)
    with torch.no_grad():
        alone = (
            (attn.k_proj(x_NI).float() - nn.functional.linear(x_NI, attn.k_proj.weight).float()).abs().max()
        )
    assert float(alone) < atol


def test_engine_repacks_what_a_version_writes() -> None:
    tok = load_tokenizer(ModelConfig(source="tiny"))
    ref_model, model = build_tiny("dense", len(tok), 0), build_tiny("dense", len(tok), 0)
    ref = EmbeddedEngine(ref_model, tok, max_batch=4)
    eng = EmbeddedEngine(model, tok, max_batch=4, packed=True)
    assert eng.packed is not None and isinstance(model.model.layers[0].mlp.up_proj, PackedLinear)
    new = {k: v + 0.05 * torch.randn_like(v) for k, v in ref_model.state_dict().items() if "layers.1." in k}
    new["model.embed_tokens.weight"] = ref_model.model.embed_tokens.weight * 1.5  # the tied head too
    for e in (ref, eng):
        e.stage_weights(1, new)
        assert e.apply_pending() and e.version == 1
    req = [GenerateRequest([5, 6, 7, 8], SamplingParams(temperature=1.0, max_tokens=6, seed=1))]
    a, b = ref.generate(req)[0], eng.generate(req)[0]
    assert a.token_ids == b.token_ids and a.versions == b.versions == [1] * len(a.token_ids)
    assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)) < 1e-4
    # weights written behind the engine's back (no apply, so no repack) are not what it serves
    stale_model = build_tiny("dense", len(tok), 0)
    stale = EmbeddedEngine(stale_model, tok, max_batch=4, packed=True)
    with torch.no_grad():
        stale_model.load_state_dict(new, strict=False)
    c = stale.generate(req)[0]
    assert max(abs(x - y) for x, y in zip(a.logprobs, c.logprobs, strict=True)) > 1e-2


def test_a_dtype_onednn_cannot_pack_stays_a_plain_linear() -> None:
    model = build_tiny("dense", 512, 0).to(torch.float16)
    assert not packable(torch.float16) and not can_pack(model)
    assert not pack_linears(model).layers
    assert any(type(m) is nn.Linear for m in model.modules())
