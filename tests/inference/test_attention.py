"""The CPU engine's decode attention (shipyard.inference.engine.attention) against transformers' SDPA."""

from __future__ import annotations

import pytest
import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from shipyard.inference.engine.attention import NAME, packed_decode_sdpa, use_packed_decode
from shipyard.models.loading import build_tiny


class _Module(torch.nn.Module):
    num_key_value_groups = 3
    is_causal = True


def _qkv(q_len: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    q = torch.randn(4, 9, q_len, 64, generator=g) * 2
    k = torch.randn(4, 3, 40, 64, generator=g) * 2
    v = torch.randn(4, 3, 40, 64, generator=g)
    return q.to(dtype), k.to(dtype), v.to(dtype)


@pytest.mark.parametrize("masked", [False, True])
def test_decode_step_matches_sdpa(masked: bool) -> None:
    q, k, v = _qkv(1, torch.float32)
    mask = None
    if masked:  # rows 0 and 2 are left-padded by 7 and 19 positions
        mask = torch.ones(4, 1, 1, 40, dtype=torch.bool)
        mask[0, ..., :7] = False
        mask[2, ..., :19] = False
    ours, _ = packed_decode_sdpa(_Module(), q, k, v, mask, scaling=0.125)
    theirs, _ = sdpa_attention_forward(_Module(), q, k, v, mask, scaling=0.125)
    assert ours.shape == theirs.shape == (4, 1, 9, 64)
    assert (ours - theirs).abs().max().item() < 1e-5


def test_bf16_decode_error_is_that_of_sdpa() -> None:
    """In bf16, against the exact attention of the same inputs, ours errs as little as SDPA's."""
    q, k, v = _qkv(1, torch.bfloat16)
    exact, _ = sdpa_attention_forward(_Module(), q.double(), k.double(), v.double(), None)
    ours, _ = packed_decode_sdpa(_Module(), q, k, v, None)
    theirs, _ = sdpa_attention_forward(_Module(), q, k, v, None)
    err_ours = (ours.double() - exact).abs().max().item()
    err_theirs = (theirs.double() - exact).abs().max().item()
    assert err_ours <= 1.5 * err_theirs, (err_ours, err_theirs)


def test_longer_queries_are_sdpa_exactly() -> None:
    q, k, v = _qkv(5, torch.float32)
    ours, _ = packed_decode_sdpa(_Module(), q, k[:, :, :5], v[:, :, :5], None)
    theirs, _ = sdpa_attention_forward(_Module(), q, k[:, :, :5], v[:, :, :5], None)
    assert torch.equal(ours, theirs)


def test_model_greedy_tokens_unchanged() -> None:
    """A tiny GQA model decodes the same greedy tokens, with logits within 1e-4, after the switch."""
    model = build_tiny("dense", 512, seed=3).eval()
    ids = torch.randint(0, 512, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        before = model.generate(
            ids, max_new_tokens=12, do_sample=False, output_logits=True, return_dict_in_generate=True
        )
        assert use_packed_decode(model) and model.config._attn_implementation == NAME
        after = model.generate(
            ids, max_new_tokens=12, do_sample=False, output_logits=True, return_dict_in_generate=True
        )
    assert torch.equal(before.sequences, after.sequences)
    diff = max((a - b).abs().max().item() for a, b in zip(before.logits, after.logits, strict=True))
    assert diff < 1e-4


def test_softcap_is_refused_as_transformers_refuses_it() -> None:
    """A decode step with logit soft-capping goes to transformers' SDPA, which refuses it: never
    silently computed without the cap."""
    q, k, v = _qkv(1, torch.float32)
    with pytest.raises(ValueError, match="softcap"):
        packed_decode_sdpa(_Module(), q, k, v, None, softcap=30.0)
