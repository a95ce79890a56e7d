"""Sampler precision (models/precision.py): a bf16 model with an fp32 head (and routers) is closer to
the fp32 model than plain bf16, keeps full-precision head weights, and composes with router replay."""

import copy

import pytest
import torch

from shipyard.config.schema import ModelConfig
from shipyard.inference.engine.engine import EmbeddedEngine
from shipyard.models.loading import build_tiny, load_tokenizer
from shipyard.models.precision import apply_inference_precision, cast_for_sampling
from shipyard.models.router_replay import RouterSeam, moe_routers

VOCAB = 512


def _model(kind: str) -> torch.nn.Module:
    """A tiny random model with confident, trained-like logits (|logit| up to ~15: random init gives
    ~0.1, where bf16 rounding of the logits is too small to matter)."""
    model = build_tiny(kind, VOCAB, seed=3).eval()
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(10.0)  # tied: the embedding grows too (then normed)
    return model


def _ids() -> torch.Tensor:
    return torch.randint(0, VOCAB, (3, 24), generator=torch.Generator().manual_seed(0))


def _logprob_error(model: torch.nn.Module, ref_BTV: torch.Tensor) -> float:
    with torch.no_grad():
        logp_BTV = model(input_ids=_ids()).logits.double().log_softmax(-1)
    return float((logp_BTV - ref_BTV).abs().mean())


@pytest.mark.parametrize("kind", ["dense", "moe", "mixtral", "deepseek_v3"])
def test_fp32_head_is_closer_to_the_fp32_model_than_plain_bf16(kind: str) -> None:
    model = _model(kind)
    with torch.no_grad():
        ref_BTV = model(input_ids=_ids()).logits.double().log_softmax(-1)
    plain, head = copy.deepcopy(model), copy.deepcopy(model)
    assert cast_for_sampling(plain, torch.bfloat16) == []
    cast_for_sampling(head, torch.bfloat16, fp32_head=True)
    err_plain, err_head = _logprob_error(plain, ref_BTV), _logprob_error(head, ref_BTV)
    assert err_plain > 1e-3  # bf16 logits really are off at this logit scale
    assert err_head < 0.5 * err_plain, (err_head, err_plain)
    with torch.no_grad():
        assert head(input_ids=_ids()).logits.dtype == torch.float32


def test_no_part_is_exactly_model_to_bf16() -> None:
    model = _model("moe")
    ours, ref = copy.deepcopy(model), copy.deepcopy(model).to(torch.bfloat16)
    cast_for_sampling(ours, torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(ours(input_ids=_ids()).logits, ref(input_ids=_ids()).logits)


def test_head_keeps_full_fp32_weights_and_the_tied_lookup_stays_bf16() -> None:
    model = _model("dense")
    fp32_head_W = model.lm_head.weight.detach().clone()
    ref = copy.deepcopy(model).to(torch.bfloat16)
    names = cast_for_sampling(model, torch.bfloat16, fp32_head=True)
    assert set(names) == {"lm_head.weight", "model.embed_tokens.weight", "model.norm.weight"}
    assert model.lm_head.weight is model.model.embed_tokens.weight  # still tied
    assert torch.equal(model.lm_head.weight, fp32_head_W)  # not the bf16-rounded values
    assert model.model.layers[0].mlp.up_proj.weight.dtype == torch.bfloat16
    with torch.no_grad():
        emb = model.get_input_embeddings()(_ids())
        assert emb.dtype == torch.bfloat16 and torch.equal(emb, ref.get_input_embeddings()(_ids()))


def test_hidden_of_the_decoder_is_the_plain_bf16_one() -> None:
    model = _model("moe")
    ref = copy.deepcopy(model).to(torch.bfloat16)
    cast_for_sampling(model, torch.bfloat16, fp32_head=True)
    with torch.no_grad():
        got = model(input_ids=_ids(), output_hidden_states=True).hidden_states
        want = ref(input_ids=_ids(), output_hidden_states=True).hidden_states
    for g, w in zip(got[:-1], want[:-1], strict=True):  # the last entry is after the (fp32) norm
        assert torch.equal(g, w)


@pytest.mark.parametrize("kind", ["moe", "mixtral", "deepseek_v3"])
def test_fp32_router_composes_with_replay(kind: str) -> None:
    model = _model(kind)
    names = cast_for_sampling(model, torch.bfloat16, fp32_head=True, fp32_router=True)
    for i, router in moe_routers(model):
        assert router.weight.dtype == torch.float32 and f"model.layers.{i}.mlp.gate.weight" in names
    seam = RouterSeam(model)
    seam.record = True
    with torch.no_grad():
        plain = model(input_ids=_ids()).logits
        plan = torch.stack([r.long() for r in seam.recorded], dim=1).reshape(3, 24, len(seam.layers), 2)
        with seam.plan(plan, replay=True):
            replayed = model(input_ids=_ids()).logits
    assert torch.equal(plain, replayed)  # replaying its own fp32-router choice changes nothing


def test_engine_stages_fp32_weights_into_the_fp32_head() -> None:
    model = _model("dense")
    update = {k: v.detach().clone() * 1.001 for k, v in model.state_dict().items()}
    cast_for_sampling(model, torch.bfloat16, fp32_head=True)
    engine = EmbeddedEngine(model, load_tokenizer(ModelConfig(source="tiny")), max_batch=2)
    engine.stage_weights(1, update)
    assert engine.apply_pending()
    assert torch.equal(model.lm_head.weight, update["lm_head.weight"])  # full fp32 precision
    up = "model.layers.0.mlp.up_proj.weight"
    assert torch.equal(model.get_parameter(up), update[up].to(torch.bfloat16))


def test_bad_requests_are_refused() -> None:
    with pytest.raises(ValueError, match="no MoE router"):
        cast_for_sampling(_model("dense"), torch.bfloat16, fp32_router=True)
    model = _model("dense")
    cast_for_sampling(model, torch.bfloat16, fp32_head=True)
    with pytest.raises(ValueError, match="already applied"):
        cast_for_sampling(model, torch.bfloat16, fp32_head=True)
    with pytest.raises(ValueError, match="floating"):
        cast_for_sampling(_model("dense"), torch.int8)


def test_inference_config_applies_only_to_a_low_precision_engine() -> None:
    fp32 = _model("moe")
    assert apply_inference_precision(fp32, fp32_lm_head=True, fp32_router=True) == []
    assert all(p.dtype == torch.float32 for p in fp32.parameters())
    dense = _model("dense").to(torch.bfloat16)
    assert "lm_head.weight" in apply_inference_precision(dense, fp32_lm_head=True, fp32_router=True)
    moe = _model("moe").to(torch.bfloat16)
    names = apply_inference_precision(moe, fp32_lm_head=False, fp32_router=True)
    assert "model.layers.0.mlp.gate.weight" in names and "lm_head.weight" not in names
