"""The lean decode step: bit-identical to the model's own forward (logits and the keys/values it caches),
in fp32 and in bf16 with the fp32 head, packed or not, padded rows or not; the engine's tokens and
logprobs unchanged by it; and models it does not cover keep their own forward."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache

from shipyard.config.schema import ModelConfig
from shipyard.inference.engine.attention import use_packed_decode
from shipyard.inference.engine.engine import EmbeddedEngine
from shipyard.inference.engine.kv_cache import slack_cache
from shipyard.inference.engine.lean_decode import lean_decode
from shipyard.inference.engine.packed import can_pack, pack_linears
from shipyard.inference.types import GenerateRequest, SamplingParams
from shipyard.models.loading import build_tiny, load_tokenizer, tiny_config
from shipyard.models.precision import cast_for_sampling

VOCAB = 512


def _model(dtype: torch.dtype, packed: bool, kv_heads: int = 2) -> torch.nn.Module:
    """The tiny Llama (4 query heads; 2 key/value heads: grouped, 4: one per query head)."""
    config = tiny_config("dense", VOCAB)
    config.num_key_value_heads = kv_heads
    torch.manual_seed(3)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    cast_for_sampling(model, dtype, fp32_head=dtype != torch.float32)
    assert use_packed_decode(model)
    if packed:
        if not can_pack(model):
            pytest.skip("PyTorch built without oneDNN")
        pack_linears(model)
    return model


def _prefill(model: torch.nn.Module, lengths: list[int]) -> tuple[DynamicCache, torch.Tensor, torch.Tensor]:
    """Left-padded prompts of ``lengths``: their cache, mask ``[B, T]`` and next positions ``[B]``."""
    width = max(lengths)
    gen = torch.Generator().manual_seed(5)
    ids_BT = torch.randint(0, VOCAB, (len(lengths), width), generator=gen)
    mask_BT = torch.tensor([[0] * (width - n) + [1] * n for n in lengths])
    pos_BT = (mask_BT.cumsum(1) - 1).clamp(min=0)
    cache = slack_cache(model.config, slack=4)
    with torch.no_grad():
        model(input_ids=ids_BT, attention_mask=mask_BT, position_ids=pos_BT, cache=cache, use_cache=True)
    return cache, mask_BT, pos_BT[:, -1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("lengths", [[7, 7, 7], [3, 9, 6, 1]])
@pytest.mark.parametrize("kv_heads", [2, 4])
def test_a_lean_step_is_the_models_forward_bit_for_bit(
    dtype: torch.dtype, packed: bool, lengths: list[int], kv_heads: int
) -> None:
    model = _model(dtype, packed, kv_heads)
    lean = lean_decode(model)
    assert lean is not None
    ref_cache, mask_BT, pos_B = _prefill(model, lengths)
    lean_cache, _, _ = _prefill(model, lengths)
    tokens_B = torch.tensor([11, 200, 37, 400][: len(lengths)])
    for _ in range(6):  # past the buffers' 4 spare positions: a step that regrows them is covered
        mask_BT = torch.cat([mask_BT, torch.ones(len(lengths), 1, dtype=torch.long)], dim=1)
        pos_B = pos_B + 1
        padded = None if bool(mask_BT.all()) else mask_BT  # as the engine's Batch.mask()
        with torch.no_grad():
            ref_BV = model(
                input_ids=tokens_B[:, None],
                attention_mask=padded,
                position_ids=pos_B[:, None],
                cache=ref_cache,
                use_cache=True,
            ).logits[:, -1, :]
        lean_BV = lean(tokens_B, padded, pos_B, lean_cache)
        assert lean_BV.dtype == ref_BV.dtype == torch.float32  # the fp32 head in bf16
        assert torch.equal(lean_BV, ref_BV)
        for ref_layer, lean_layer in zip(ref_cache.layers, lean_cache.layers, strict=True):
            assert torch.equal(ref_layer.keys, lean_layer.keys)
            assert torch.equal(ref_layer.values, lean_layer.values)
        tokens_B = ref_BV.argmax(-1)


def test_the_engine_samples_the_same_tokens_and_logprobs_with_it() -> None:
    tok = load_tokenizer(ModelConfig(source="tiny"))
    results = []
    for lean in (True, False):
        model = build_tiny("dense", len(tok), 0)
        cast_for_sampling(model, torch.bfloat16, fp32_head=True)
        engine = EmbeddedEngine(model, tok, max_batch=3, packed=True, lean=lean)
        assert (engine.lean is not None) == lean
        requests = [
            GenerateRequest(
                prompt_ids=tok.encode("x" * (1 + 3 * i)),
                params=SamplingParams(temperature=[1.0, 0.0, 0.7][i % 3], max_tokens=8 + 5 * i, seed=i),
            )
            for i in range(7)  # more than max_batch: rows join a running batch with padding
        ]
        results.append(engine.generate(requests))
    lean_res, full_res = results
    assert [r.token_ids for r in lean_res] == [r.token_ids for r in full_res]
    assert [r.logprobs for r in lean_res] == [r.logprobs for r in full_res]
    assert sum(len(r.token_ids) for r in lean_res) > 7 * 8


def test_models_it_does_not_cover_keep_their_own_forward() -> None:
    moe = build_tiny("mixtral", VOCAB, 0)
    use_packed_decode(moe)
    assert lean_decode(moe) is None
    hooked = _model(torch.float32, packed=False)
    assert lean_decode(hooked) is not None
    handle = hooked.model.layers[1].mlp.register_forward_hook(lambda *_: None)  # one it would skip
    assert lean_decode(hooked) is None
    handle.remove()
    hooked.model.layers[0].self_attn.k_proj.register_forward_pre_hook(lambda *_: None)  # a linear's too
    assert lean_decode(hooked) is None
    eager = build_tiny("dense", VOCAB, 0)  # never switched to the engine's attention
    assert lean_decode(eager) is None
