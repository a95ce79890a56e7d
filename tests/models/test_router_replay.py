"""Router replay seam on Qwen3-MoE, Mixtral and DeepSeek-V3 tiny models, the routes codec, and the
adapters for vLLM's and SGLang's returned routed experts (hand-built samples in their formats)."""

import base64

import numpy as np
import pytest
import torch

from shipyard.models.loading import build_tiny
from shipyard.models.router_replay import RouterSeam, gate_weights, moe_routers, route_mismatch, route_plan
from shipyard.models.routes import decode_routes, encode_routes, routes_from_sglang, routes_from_vllm

KINDS = ("moe", "mixtral", "deepseek_v3")
VOCAB = 300


def _model(kind: str) -> torch.nn.Module:
    model = build_tiny(kind, VOCAB, seed=5)
    for _, router in moe_routers(model):  # DeepSeek-V3: a selection bias that changes the choice
        if hasattr(router, "e_score_correction_bias"):
            router.e_score_correction_bias.copy_(torch.linspace(-0.3, 0.3, router.num_experts))
    return model.eval()


def _experts_index_spy(model: torch.nn.Module) -> list[torch.Tensor]:
    """Capture the top_k_index every experts module is called with (what the block really used)."""
    seen: list[torch.Tensor] = []
    for _, router in moe_routers(model):
        parent = next(m for m in model.modules() if getattr(m, "gate", None) is router)
        parent.experts.register_forward_hook(lambda _m, args, _o: seen.append(args[1].detach().clone()))
    return seen


def _random_plan(model_seam: RouterSeam, b: int, t: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand(b, t, len(model_seam.layers), model_seam.num_experts, generator=g)
    return scores.topk(model_seam.top_k, dim=-1).indices


@pytest.mark.parametrize("kind", KINDS)
def test_dense_layers_are_skipped_and_ids_are_recorded(kind: str) -> None:
    model = _model(kind)
    seam = RouterSeam(model)
    expected = [1, 2] if kind == "deepseek_v3" else [0, 1]  # DeepSeek-V3: first layer dense
    assert seam.layers == expected and seam.top_k == 2 and seam.num_experts == 8
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(0))
    seam.record = True
    with torch.no_grad():
        model(input_ids=ids)
    for (_, router), got in zip(moe_routers(model), seam.recorded, strict=True):
        assert got is not None and got.dtype == torch.int16 and got.shape == (18, 2)
        hidden = _router_inputs(model, router, ids)
        _, _, ref = router(hidden)  # a reference forward of the same router on the same inputs
        assert torch.equal(got.long().sort(dim=-1).values, ref.sort(dim=-1).values)


def _router_inputs(model: torch.nn.Module, router: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    captured: list[torch.Tensor] = []
    handle = router.register_forward_pre_hook(lambda _m, args: captured.append(args[0].detach().clone()))
    with torch.no_grad():
        model(input_ids=ids)
    handle.remove()
    return captured[0].reshape(-1, captured[0].shape[-1])


@pytest.mark.parametrize("kind", KINDS)
def test_replaying_own_choice_is_bit_identical(kind: str) -> None:
    model = _model(kind)
    ids = torch.randint(0, VOCAB, (3, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        plain = model(input_ids=ids).logits
        seam = RouterSeam(model)
        seam.record = True
        model(input_ids=ids)
        plan = torch.stack([r.long() for r in seam.recorded], dim=1).reshape(3, 11, len(seam.layers), 2)
        with seam.plan(plan, replay=True):
            replayed = model(input_ids=ids).logits
    assert torch.equal(plain, replayed)
    assert seam.disagreement()["route_disagree"] == 0.0


@pytest.mark.parametrize("kind", KINDS)
def test_replay_uses_the_plan_and_router_keeps_its_gradient(kind: str) -> None:
    model = _model(kind)
    seam = RouterSeam(model)
    ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(2))
    plan = _random_plan(seam, 2, 8, seed=3)
    plan[1, 5:] = -1  # unrecorded positions route freely
    spy = _experts_index_spy(model)
    with seam.plan(plan, replay=True):
        logits = model(input_ids=ids).logits
    used = torch.stack(spy, dim=1).reshape(2, 8, len(seam.layers), 2)
    recorded = plan >= 0
    assert torch.equal(used[recorded], plan[recorded])  # zero disagreement on replayed tokens
    dis = seam.disagreement()
    assert dis["route_disagree"] == 0.0 and dis["route_token_disagree"] == 0.0  # the plan was used
    assert 0.0 < dis["route_own_disagree"] <= 1.0  # a random plan differs from the model's own choice
    assert {f"route_disagree/layer_{i}" for i in seam.layers} <= set(dis)
    logits.logsumexp(-1).mean().backward()
    for _, router in moe_routers(model):
        assert router.weight.grad is not None and router.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("kind", KINDS)
def test_gate_weights_match_the_router_on_its_own_choice(kind: str) -> None:
    router = moe_routers(_model(kind))[0][1]
    hidden = torch.randn(13, 64, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        logits, weights, index = router(hidden)
        assert torch.equal(gate_weights(router, logits, index), weights)


def test_compare_mode_counts_without_replaying() -> None:
    model = _model("moe")
    seam = RouterSeam(model)
    ids = torch.randint(0, VOCAB, (1, 6), generator=torch.Generator().manual_seed(6))
    plan = _random_plan(seam, 1, 6, seed=7)
    with torch.no_grad():
        plain = model(input_ids=ids).logits
        with seam.plan(plan, replay=False):
            compared = model(input_ids=ids).logits
    assert torch.equal(plain, compared)
    dis = seam.disagreement()
    assert dis["route_disagree"] == dis["route_own_disagree"] > 0
    assert 0 < dis["route_disagree"] <= dis["route_token_disagree"] <= 1
    seam.reset_disagreement()
    assert seam.disagreement() == {}


def test_route_mismatch_counts_set_differences() -> None:
    own = torch.tensor([[0, 1], [2, 3], [4, 5]])
    plan = torch.tensor([[1, 0], [2, 7], [6, 7]])
    assert route_mismatch(own, plan).tolist() == [0, 1, 2]


def test_plan_shape_is_checked() -> None:
    seam = RouterSeam(_model("moe"))
    with pytest.raises(ValueError, match="route plan must be"), seam.plan(torch.zeros(1, 4, 3, 2), True):
        pass


def test_dense_model_has_no_seam() -> None:
    with pytest.raises(ValueError, match="no MoE router"):
        RouterSeam(build_tiny("dense", VOCAB))


@pytest.mark.parametrize(("experts", "dtype"), [(8, "uint8"), (256, "uint8"), (384, "uint16")])
def test_routes_round_trip(experts: int, dtype: str) -> None:
    ids = np.random.default_rng(0).integers(0, experts, size=(17, 3, 4))
    record = encode_routes(ids, [1, 2, 4], experts)
    assert record["dtype"] == dtype and record["n"] == 17 and record["layers"] == [1, 2, 4]
    back = decode_routes(record)
    assert back.dtype == np.dtype(dtype) and np.array_equal(back, ids)
    assert len(record["data"]) == 4 * ((17 * 3 * 4 * back.itemsize + 2) // 3)  # base64 of the packed bytes


def test_routes_reject_bad_records() -> None:
    record = encode_routes(np.zeros((2, 1, 2), dtype=np.int64), [0], 8)
    with pytest.raises(ValueError, match="expected n\\*layers\\*k"):
        decode_routes({**record, "n": 3})
    with pytest.raises(ValueError, match="lacks field"):
        decode_routes({"v": 1})
    with pytest.raises(ValueError, match="must be in \\[0, 8\\)"):
        encode_routes(np.full((1, 1, 2), 8), [0], 8)


def test_vllm_adapter_maps_prompt_and_generated_routes() -> None:
    # vLLM /v1/completions with --enable-return-routed-experts: nested lists, MoE layers only
    response = {
        "prompt_routed_experts": [
            [[0, 3], [5, 1]],
            [[2, 7], [4, 6]],
            [[1, 0], [7, 6]],
        ],  # 3 prompt tokens
        "choices": [{"routed_experts": [[[6, 2], [0, 1]], [[3, 4], [2, 5]]]}],  # 2 generated tokens
    }
    record = routes_from_vllm(
        response["prompt_routed_experts"], response["choices"][0]["routed_experts"], [1, 3], 8
    )
    ids = decode_routes(record)
    assert record["layers"] == [1, 3] and record["n"] == 4  # the last generated token is never forwarded
    assert ids.tolist() == [[[0, 3], [5, 1]], [[2, 7], [4, 6]], [[1, 0], [7, 6]], [[6, 2], [0, 1]]]
    with pytest.raises(ValueError, match="MoE layers"):
        routes_from_vllm(response["prompt_routed_experts"], response["choices"][0]["routed_experts"], [1], 8)


def test_sglang_adapter_decodes_base64_and_keeps_moe_layers() -> None:
    # SGLang meta_info: base64 of flat int32 [positions, all 3 decoder layers, top_k 2]; layer 0 dense
    flat = np.array(
        [[[-1, -1], [1, 2], [3, 4]], [[-1, -1], [5, 6], [7, 0]], [[-1, -1], [2, 3], [4, 5]]],
        dtype=np.int32,
    )
    meta_info = {"routed_experts": base64.b64encode(flat.tobytes()).decode(), "prompt_tokens": 2}
    record = routes_from_sglang(meta_info, num_layers=3, top_k=2, moe_layers=[1, 2], num_experts=8)
    assert record["n"] == 3 and record["dtype"] == "uint8"
    assert decode_routes(record).tolist() == flat[:, 1:, :].tolist()
    as_u16 = {
        "routed_experts": base64.b64encode(flat[:, 1:].astype("<u2").tobytes()).decode(),
        "routed_experts_dtype": "uint16",
    }
    assert decode_routes(routes_from_sglang(as_u16, 2, 2, [0, 1], 8)).tolist() == flat[:, 1:, :].tolist()
    with pytest.raises(ValueError, match="return_routed_experts=True"):
        routes_from_sglang({}, 3, 2, [1, 2], 8)
    with pytest.raises(ValueError, match="not a multiple"):
        routes_from_sglang(meta_info, num_layers=4, top_k=2, moe_layers=[1], num_experts=8)


def test_upcycled_moe_without_jitter_computes_the_dense_model() -> None:
    from shipyard.models.loading import upcycle_to_moe

    dense = build_tiny("dense", VOCAB, seed=8).eval()
    ids = torch.randint(0, VOCAB, (2, 10), generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        want = dense(input_ids=ids).logits
        same = upcycle_to_moe(dense, experts=4, noise=0.0)(input_ids=ids).logits
        jittered = upcycle_to_moe(dense, experts=4, noise=0.05, seed=1)
        moved = jittered(input_ids=ids).logits
    assert (same - want).abs().max() < 1e-5  # identical experts: routing cannot matter
    assert (moved - want).abs().max() > 1e-3 and [i for i, _ in moe_routers(jittered)] == [0, 1]
    again = upcycle_to_moe(dense, experts=4, noise=0.05, seed=1)
    assert all(torch.equal(a, b) for a, b in zip(jittered.parameters(), again.parameters(), strict=True))


def test_route_plan_places_records_and_rejects_foreign_ones() -> None:
    seam = RouterSeam(_model("moe"))
    ids = np.arange(3 * 2 * 2).reshape(3, 2, 2) % 8
    record = encode_routes(ids, seam.layers, 8)
    plan = route_plan([record, None], 5, seam)
    assert plan.shape == (2, 5, 2, 2) and plan[0, :3].tolist() == ids.tolist()
    assert bool((plan[0, 3:] == -1).all()) and bool((plan[1] == -1).all())
    left = route_plan([record], 5, seam, starts=[2])  # the engine's left-padded prefill
    assert left[0, 2:].tolist() == ids.tolist() and bool((left[0, :2] == -1).all())
    with pytest.raises(ValueError, match="MoE layers"):
        route_plan([encode_routes(ids, [0, 5], 8)], 5, seam)
    with pytest.raises(ValueError, match="cover 3 positions"):
        route_plan([record], 2, seam)
