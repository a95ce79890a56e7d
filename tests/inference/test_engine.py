"""Tests of :mod:`shipyard.inference.engine.engine` against transformers on tiny models (and SmolLM2).

Contract checked: greedy output equals ``model.generate(do_sample=False)`` token for token
(single and left-padded batches, dense and MoE, with rows finishing at different steps);
logprobs equal a fresh full forward; seeded sampling does not depend on batch composition; top-p,
stop strings, max_tokens and EOS end rows as documented; a weight update staged from another
thread mid-generation switches ``versions`` and the following tokens match transformers run with
the same in-place swap.

The tiny models get larger random weights (``_lively``) so that greedy decoding does not just
repeat the last prompt token, which would make token-for-token comparisons toothless.

Shape legend: B = batch, T = sequence length, V = vocabulary.
"""

from __future__ import annotations

import copy
import threading
import time
from typing import Any

import numpy as np
import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList

from shipyard.config.schema import ModelConfig
from shipyard.inference.engine.batch import Job
from shipyard.inference.engine.engine import EmbeddedEngine, _write
from shipyard.inference.engine.sampling import sample_tokens
from shipyard.inference.types import GenerateRequest, GenerateResult, SamplingParams
from shipyard.models.loading import load_model
from shipyard.models.router_replay import RouterSeam
from shipyard.models.routes import decode_routes, encode_routes

PROMPTS = [
    [5, 6, 7, 8, 9, 10, 11],
    [100, 200, 300],
    [42, 17, 99, 1000, 2000, 3000, 4, 8, 15, 16, 23, 42],
    [7, 7],
]


def _lively(model: Any, seed: int, std: float = 0.15) -> Any:
    """Re-draw every matrix of a tiny random model with a larger std (deterministic per seed)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, std, generator=gen)
    return model


def _tiny(kind: str, seed: int = 0) -> tuple[Any, Any]:
    model, tok = load_model(ModelConfig(source="tiny", tiny=kind))
    return _lively(model, seed), tok


@pytest.fixture(scope="session")
def dense() -> tuple[Any, Any]:
    return _tiny("dense")


@pytest.fixture(scope="session")
def moe() -> tuple[Any, Any]:
    return _tiny("moe")


def _hf_greedy(
    model: Any, prompts: list[list[int]], max_new: int, eos: list[int], pad: int
) -> list[list[int]]:
    """transformers greedy generate on a left-padded batch; each row cut after its EOS."""
    width = max(len(p) for p in prompts)
    ids_BT = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    attn_BT = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    out_BT = model.generate(
        input_ids=ids_BT,
        attention_mask=attn_BT,
        do_sample=False,
        max_new_tokens=max_new,
        eos_token_id=eos,
        pad_token_id=pad,
    )
    rows = []
    for row in out_BT[:, width:].tolist():
        cut = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
        rows.append(row[:cut])
    return rows


def _greedy(max_tokens: int, **kw: Any) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_greedy_matches_hf_generate(kind: str, request: pytest.FixtureRequest) -> None:
    model, tok = request.getfixturevalue(kind)
    engine = EmbeddedEngine(model, tok, max_batch=4)
    eos = sorted(engine.eos_ids)
    max_tokens = [24, 9, 17, 24]
    results = engine.generate(
        [GenerateRequest(p, _greedy(m)) for p, m in zip(PROMPTS, max_tokens, strict=True)]
    )
    batched = _hf_greedy(model, PROMPTS, 24, eos, engine.pad_id)
    for prompt, m, res, hf in zip(PROMPTS, max_tokens, results, batched, strict=True):
        single = _hf_greedy(model, [prompt], m, eos, engine.pad_id)[0]
        assert res.token_ids == hf[:m] == single
        assert res.finish_reason == ("eos" if res.token_ids[-1] in eos else "length")
        assert res.versions == [0] * len(res.token_ids)
    assert len({t for r in results for t in r.token_ids}) > 10, (
        "the model only repeats itself; test is toothless"
    )
    assert engine.stats["compactions"] >= 2 and engine.stats["batches"] == 1
    [alone] = engine.generate([GenerateRequest(PROMPTS[2], _greedy(17))])
    assert alone.token_ids == results[2].token_ids


def test_logprobs_match_full_forward(dense: tuple[Any, Any]) -> None:
    model, tok = dense
    engine = EmbeddedEngine(model, tok)
    params = [
        SamplingParams(temperature=1.0, max_tokens=12, seed=1),
        SamplingParams(temperature=0.7, top_p=0.9, max_tokens=10, seed=2),
        SamplingParams(temperature=0.0, max_tokens=8),
        SamplingParams(temperature=1.3, top_p=0.5, max_tokens=12, seed=3),
    ]
    results = engine.generate([GenerateRequest(p, q) for p, q in zip(PROMPTS, params, strict=True)])
    worst = 0.0
    with torch.no_grad():
        for prompt, q, res in zip(PROMPTS, params, results, strict=True):
            ids_1T = torch.tensor([prompt + res.token_ids])
            logits_TV = model(input_ids=ids_1T).logits[0, len(prompt) - 1 : -1].float()
            temp = q.temperature if q.temperature > 0 else 1.0
            want_T = torch.log_softmax(logits_TV / temp, dim=-1).gather(
                1, torch.tensor(res.token_ids)[:, None]
            )[:, 0]
            worst = max(worst, float((want_T - torch.tensor(res.logprobs)).abs().max()))
    assert worst < 1e-4


def test_seeded_sampling_ignores_batch_composition(dense: tuple[Any, Any]) -> None:
    model, tok = dense
    engine = EmbeddedEngine(model, tok, max_batch=8)
    target = GenerateRequest(
        PROMPTS[0], SamplingParams(temperature=1.0, top_p=0.95, max_tokens=20, seed=1234)
    )
    [alone] = engine.generate([target])
    others = [
        GenerateRequest(p, SamplingParams(temperature=0.8, max_tokens=m))
        for p, m in ((PROMPTS[2], 25), (PROMPTS[3], 5))
    ]
    mixed = engine.generate([others[0], target, others[1], GenerateRequest(PROMPTS[1], _greedy(3))])
    assert mixed[1].token_ids == alone.token_ids
    assert max(abs(a - b) for a, b in zip(mixed[1].logprobs, alone.logprobs, strict=True)) < 1e-4
    [other_seed] = engine.generate(
        [GenerateRequest(PROMPTS[0], SamplingParams(max_tokens=20, top_p=0.95, seed=4321))]
    )
    assert other_seed.token_ids != alone.token_ids


def test_tiny_top_p_is_greedy(dense: tuple[Any, Any]) -> None:
    model, tok = dense
    engine = EmbeddedEngine(model, tok)
    [greedy] = engine.generate([GenerateRequest(PROMPTS[1], _greedy(15))])
    [nucleus] = engine.generate(
        [GenerateRequest(PROMPTS[1], SamplingParams(temperature=1.0, top_p=1e-6, max_tokens=15))]
    )
    assert nucleus.token_ids == greedy.token_ids


def test_stop_string_keeps_completing_token(dense: tuple[Any, Any]) -> None:
    model, tok = dense
    engine = EmbeddedEngine(model, tok)
    [full] = engine.generate([GenerateRequest(PROMPTS[0], _greedy(30))])
    k = 6
    piece = tok.decode(full.token_ids[k : k + 1])
    assert piece.strip(), "pick a token that decodes to visible text"
    stop = piece.strip()[-2:]
    expect = next(i + 1 for i in range(len(full.token_ids)) if stop in tok.decode(full.token_ids[: i + 1]))
    [res] = engine.generate([GenerateRequest(PROMPTS[0], _greedy(30, stop=["never-in-output-zzz", stop]))])
    assert res.finish_reason == "stop"
    assert res.token_ids == full.token_ids[:expect] and expect <= k + 1
    assert stop in tok.decode(res.token_ids) and stop not in tok.decode(res.token_ids[:-1])


def test_max_tokens_and_eos(dense: tuple[Any, Any]) -> None:
    model, tok = dense
    engine = EmbeddedEngine(model, tok)
    [short] = engine.generate([GenerateRequest(PROMPTS[2], _greedy(5))])
    assert len(short.token_ids) == 5 and short.finish_reason == "length"
    [full] = engine.generate([GenerateRequest(PROMPTS[2], _greedy(20))])
    eos = full.token_ids[3]
    first = full.token_ids.index(eos)
    old = model.generation_config.eos_token_id
    model.generation_config.eos_token_id = [tok.eos_token_id, eos]
    try:
        eos_engine = EmbeddedEngine(model, tok)
        [res] = eos_engine.generate([GenerateRequest(PROMPTS[2], _greedy(20))])
        hf = _hf_greedy(model, [PROMPTS[2]], 20, sorted(eos_engine.eos_ids), eos_engine.pad_id)[0]
    finally:
        model.generation_config.eos_token_id = old
    assert res.finish_reason == "eos" and res.token_ids == full.token_ids[: first + 1] == hf


class _SwapAt(LogitsProcessor):
    """Copies ``new`` into ``model`` after the forward pass that produced token ``k - 1``."""

    def __init__(self, model: Any, new: dict[str, torch.Tensor], k: int) -> None:
        self.model, self.new, self.k, self.calls = model, new, k, 0

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        self.calls += 1
        if self.calls == self.k:
            with torch.no_grad():
                for name, t in self.model.state_dict().items():
                    t.copy_(self.new[name])
        return scores


def test_weight_swap_mid_generation() -> None:
    model, tok = _tiny("dense", seed=0)
    new_weights = _tiny("dense", seed=1)[0].state_dict()
    engine = EmbeddedEngine(model, tok)
    staged = threading.Event()

    def stage_when_running() -> None:
        while engine.stats["decode_steps"] < 5:
            time.sleep(0.0005)
        engine.stage_weights(1, new_weights)
        staged.set()

    thread = threading.Thread(target=stage_when_running)
    thread.start()
    [res] = engine.generate([GenerateRequest(PROMPTS[0], _greedy(300))])
    thread.join()
    assert staged.is_set() and engine.version == 1 and len(engine.pauses) == 1
    k = res.versions.index(1)
    assert 5 <= k < len(res.token_ids) and res.versions == [0] * k + [1] * (len(res.token_ids) - k)

    ref_model, _ = _tiny("dense", seed=0)
    out = ref_model.generate(
        input_ids=torch.tensor([PROMPTS[0]]),
        do_sample=False,
        max_new_tokens=len(res.token_ids),
        logits_processor=LogitsProcessorList([_SwapAt(ref_model, new_weights, k)]),
        output_logits=True,
        return_dict_in_generate=True,
        eos_token_id=sorted(engine.eos_ids),
        pad_token_id=engine.pad_id,
    )
    assert out.sequences[0, len(PROMPTS[0]) :].tolist() == res.token_ids
    logits_TV = torch.cat(out.logits).float()
    want_T = torch.log_softmax(logits_TV, -1).gather(1, torch.tensor(res.token_ids)[:, None])[:, 0]
    assert float((want_T - torch.tensor(res.logprobs)).abs().max()) < 1e-4
    old_only = _hf_greedy(
        _tiny("dense", seed=0)[0], [PROMPTS[0]], len(res.token_ids), sorted(engine.eos_ids), engine.pad_id
    )[0]
    assert old_only[:k] == res.token_ids[:k] and old_only != res.token_ids, "the swap changed nothing"


def test_stage_and_apply_when_idle(dense: tuple[Any, Any]) -> None:
    model, tok = _tiny("dense", seed=0)
    engine = EmbeddedEngine(model, tok, version=3)
    assert not engine.apply_pending()
    norm = model.model.norm.weight
    engine.stage_weights(4, {"model.norm.weight": torch.full_like(norm, 2.0)})
    engine.stage_weights(5, {"model.layers.0.input_layernorm.weight": torch.full_like(norm, 3.0)})
    assert engine.version == 3 and float(norm.detach()[0]) == 1.0
    assert engine.apply_pending() and engine.version == 5 and len(engine.pauses) == 1
    assert (
        float(norm.detach()[0]) == 2.0
        and float(model.model.layers[0].input_layernorm.weight.detach()[0]) == 3.0
    )
    with pytest.raises(ValueError, match="not a parameter"):
        engine.stage_weights(6, {"nope.weight": norm})
    with pytest.raises(ValueError, match="shape"):
        engine.stage_weights(6, {"model.norm.weight": torch.ones(3)})
    [res] = engine.generate([GenerateRequest(PROMPTS[3], _greedy(3))])
    assert res.versions == [5, 5, 5]


def test_sparse_staged_writes_merge_against_the_live_weights() -> None:
    """Positions stage only the elements a delta changed, relative to the live weights. An update
    staged while an earlier one is still queued also takes the elements that one would write (all
    of them after a whole tensor), so live ends bit-exact at the newest version; any strides."""
    model, tok = _tiny("dense", seed=0)
    engine = EmbeddedEngine(model, tok, version=0)
    norm, name = model.model.norm.weight, "model.norm.weight"
    n = norm.numel()
    v0 = norm.detach().clone()
    v1, v2 = v0.clone(), v0.clone()
    v1[[0, 5]] = torch.tensor([3.0, 4.0])  # differs from the live v0 at 0 and 5
    v2[[5, 7]] = torch.tensor([-5.0, -7.0])  # differs from the live v0 at 5 and 7 (not at 0)
    engine.stage_weights(1, {name: v1}, positions={name: np.array([0, 5])})
    engine.stage_weights(2, {name: v2}, positions={name: np.array([5, 7])})
    want = v2.clone()
    v2[7] = 99.0  # taken at staging: later changes of the caller's tensor do not leak in
    assert engine.apply_pending() and engine.version == 2 and engine.written_elements[-1] == 3
    assert torch.equal(norm.detach(), want), "element 0 is back at v0's value, as in v2"
    v3, v4 = torch.full((n,), 2.0), want.clone()
    v4[1] = 8.0  # differs from the live v2 at 1 only
    engine.stage_weights(3, {name: v3}, positions={name: None})
    engine.stage_weights(4, {name: v4}, positions={name: torch.tensor([1])})
    assert engine.apply_pending() and engine.written_elements[-1] == n
    assert torch.equal(norm.detach(), v4), "the queued whole tensor is replaced by the whole v4"
    strided = torch.zeros(4, 6).t()  # not contiguous: flat positions are row-major in its shape
    _write(strided, torch.tensor([0, 7, 23]), torch.tensor([1.0, 2.0, 3.0]))
    assert strided.reshape(-1)[[0, 7, 23]].tolist() == [1.0, 2.0, 3.0] and float(strided.sum()) == 6.0


@pytest.mark.parametrize("live_dtype", [torch.bfloat16, torch.float32])
def test_sparse_writes_copy_every_bit_pattern(live_dtype: torch.dtype) -> None:
    """Sparse staging gathers and scatters bits (numpy views where dtypes match): NaN payloads,
    -0.0, infinities and subnormals land exactly; a bf16 update of an fp32 engine is converted."""
    model, tok = _tiny("dense", seed=0)
    model.to(live_dtype)
    engine = EmbeddedEngine(model, tok, version=0)
    name = "model.norm.weight"
    live = dict(model.named_parameters())[name]
    bits = [0x7FC1, 0xFFA3, 0x8000, 0x7F80, 0xFF80, 0x0001, 0x8001, 0x3F80]  # NaNs, -0, inf, subnormals
    patterns = torch.from_numpy(np.array(bits, dtype=np.uint16).view(np.int16))
    new = live.detach().to(torch.bfloat16).clone()
    idx = torch.tensor([0, 3, 4, 9, 10, 17, 20, 31])
    new.view(torch.int16)[idx] = patterns
    engine.stage_weights(1, {name: new}, positions={name: idx.numpy()})
    assert engine.apply_pending() and engine.written_elements[-1] == len(idx)
    if live_dtype == torch.bfloat16:
        assert torch.equal(live.detach().view(torch.int16), new.view(torch.int16))
    else:  # bf16 -> fp32 is exact, NaN payloads included (the high half of the fp32 bits)
        assert torch.equal(live.detach().view(torch.int32) >> 16, new.view(torch.int16).to(torch.int32))


@pytest.mark.parametrize(
    "req",
    [
        GenerateRequest([], _greedy(3)),
        GenerateRequest([1, 49152], _greedy(3)),
        GenerateRequest([1], SamplingParams(temperature=-1.0)),
        GenerateRequest([1], SamplingParams(top_p=0.0)),
        GenerateRequest([1], SamplingParams(max_tokens=0)),
        GenerateRequest([1], SamplingParams(stop=[""])),
        GenerateRequest([1], SamplingParams(seed=2**64)),
    ],
)
def test_malformed_requests_raise(dense: tuple[Any, Any], req: GenerateRequest) -> None:
    engine = EmbeddedEngine(*dense)
    with pytest.raises(ValueError, match="request 0"):
        engine.generate([req])


def test_smollm2_greedy_matches_hf_generate() -> None:
    model, tok = load_model(ModelConfig(source="smollm2"))
    chats = [
        [{"role": "user", "content": "Write a Python function that adds two numbers."}],
        [{"role": "user", "content": "Hi!"}],
    ]
    prompts = [
        list(tok.apply_chat_template(c, add_generation_prompt=True, return_dict=True)["input_ids"])
        for c in chats
    ]
    engine = EmbeddedEngine(model, tok)
    results = engine.generate([GenerateRequest(p, _greedy(12)) for p in prompts])
    hf = _hf_greedy(model, prompts, 12, sorted(engine.eos_ids), engine.pad_id)
    assert [r.token_ids for r in results] == hf
    assert "def" in tok.decode(results[0].token_ids) or "python" in tok.decode(results[0].token_ids).lower()


@pytest.mark.parametrize("vocab", [8, 3000])
def test_sampler_frequencies_and_nucleus(vocab: int) -> None:
    probs_V = torch.full((vocab,), 0.05 / (vocab - 4))
    probs_V[:4] = torch.tensor([0.45, 0.3, 0.15, 0.05])
    if vocab > 1024:
        probs_V = torch.full((vocab,), 0.5 / (vocab - 1))
        probs_V[0] = 0.5
    logits_BV = probs_V.log().expand(4000, vocab).clone()
    gens = [torch.Generator().manual_seed(i) for i in range(4000)]
    top_p = 0.7 if vocab < 1024 else 0.75
    tokens_B, logprobs_B = sample_tokens(logits_BV, torch.ones(4000), torch.full((4000,), top_p), gens)
    assert torch.allclose(logprobs_B, probs_V.log()[tokens_B], atol=1e-5)
    if vocab < 1024:
        assert set(tokens_B.tolist()) == {0, 1}
        assert abs(float((tokens_B == 0).float().mean()) - 0.45 / 0.75) < 0.03
    else:
        kept = int(0.25 / float(probs_V[1])) + 1
        assert abs(float((tokens_B == 0).float().mean()) - 0.5 / (0.5 + kept * float(probs_V[1]))) < 0.03
        assert len(set(tokens_B.tolist())) > 100
    plain_B, _ = sample_tokens(logits_BV[:2000], torch.ones(2000), torch.ones(2000), gens[:2000])
    assert abs(float((plain_B == 0).float().mean()) - float(probs_V[0])) < 0.035


# ------------------------------------------------------------------------------ MoE routes


def _reference_routes(model: Any, ids: list[int]) -> torch.Tensor:
    """``[T, L, K]`` experts a plain full forward of ``ids`` chooses, sorted per token."""
    seam = RouterSeam(model)
    seam.record = True
    try:
        with torch.no_grad():
            model(input_ids=torch.tensor([ids]))
        return torch.stack([r.long() for r in seam.recorded if r is not None], dim=1).sort(dim=-1).values
    finally:
        seam.remove()


@pytest.mark.parametrize("kind", ["moe", "mixtral", "deepseek_v3"])
def test_recorded_routes_equal_reference_top_k(kind: str) -> None:
    model, tok = _tiny(kind, seed=3)
    engine = EmbeddedEngine(model, tok, max_batch=4)
    params = [
        SamplingParams(temperature=1.0, max_tokens=m, seed=s) for m, s in ((9, 1), (6, 2), (12, 3), (4, 4))
    ]
    results = engine.generate([GenerateRequest(p, q) for p, q in zip(PROMPTS, params, strict=True)])
    assert engine.seam is not None
    for prompt, res in zip(PROMPTS, results, strict=True):
        assert res.routes is not None and res.routes["dtype"] == "uint8"
        got_NLK = torch.from_numpy(decode_routes(res.routes).astype("int64"))
        forwarded = prompt + res.token_ids[:-1]  # the last sampled token is never forwarded
        assert got_NLK.shape == (len(forwarded), len(engine.seam.layers), 2)
        assert torch.equal(got_NLK.sort(dim=-1).values, _reference_routes(model, forwarded))


def test_prompt_routes_are_replayed_across_turns(moe: tuple[Any, Any]) -> None:
    model, tok = moe
    engine = EmbeddedEngine(model, tok, max_batch=4)
    [turn1] = engine.generate([GenerateRequest(PROMPTS[2], SamplingParams(max_tokens=8, seed=5))])
    assert turn1.routes is not None
    context = PROMPTS[2] + turn1.token_ids + [11, 12, 13]  # + a tool result
    forced = {**turn1.routes}
    first_NLK = decode_routes(turn1.routes)
    forced["data"] = encode_routes((first_NLK.astype("int64") + 1) % 8, forced["layers"], 8)["data"]
    second = engine.generate(
        [
            GenerateRequest(context, SamplingParams(max_tokens=6, seed=6), prompt_routes=turn1.routes),
            GenerateRequest(context, SamplingParams(max_tokens=6, seed=6), prompt_routes=forced),
            GenerateRequest(context, SamplingParams(max_tokens=6, seed=6)),
            GenerateRequest(context + [5] * 7, SamplingParams(max_tokens=2)),  # the others are left-padded
        ]
    )
    n = turn1.routes["n"]
    for res, given in zip(second[:2], (turn1.routes, forced), strict=True):
        assert res.routes is not None and res.routes["n"] == len(context) + len(res.token_ids) - 1
        assert (decode_routes(res.routes)[:n] == decode_routes(given)).all()
    assert second[1].logprobs != second[2].logprobs  # replayed (wrong) experts change the sampler's output
    foreign = encode_routes(first_NLK.astype("int64"), [0, 5], 8)
    with pytest.raises(ValueError, match="request 0: prompt_routes are for MoE layers \\[0, 5\\]"):
        engine.generate([GenerateRequest(context, SamplingParams(max_tokens=2), prompt_routes=foreign)])


def test_routes_off_for_dense_and_prompt_routes_rejected(dense: tuple[Any, Any]) -> None:
    model, tok = dense
    engine = EmbeddedEngine(model, tok)
    [res] = engine.generate([GenerateRequest(PROMPTS[1], _greedy(3))])
    assert engine.seam is None and res.routes is None
    routes = encode_routes(torch.zeros(2, 2, 2, dtype=torch.long), [0, 1], 8)
    with pytest.raises(ValueError, match="records no MoE routes"):
        engine.generate([GenerateRequest(PROMPTS[1], _greedy(3), prompt_routes=routes)])
    with pytest.raises(ValueError, match="has no MoE router"):
        EmbeddedEngine(model, tok, record_routes=True)


def _target_in_mixes(engine: EmbeddedEngine) -> tuple[GenerateResult, list[GenerateResult]]:
    """The target request alone, then at every position among three others, and with max_batch 2."""
    target = GenerateRequest(PROMPTS[0], SamplingParams(temperature=1.0, max_tokens=6, seed=77))
    others = [
        GenerateRequest(p, SamplingParams(max_tokens=m, seed=m))
        for p, m in zip(PROMPTS[1:], (8, 2, 5), strict=True)
    ]
    [alone] = engine.generate([target])
    mixes = [engine.generate([*others[:i], target, *others[i:]])[i] for i in range(len(others) + 1)]
    engine.max_batch = 2
    mixes.append(engine.generate([others[2], others[0], target])[2])
    return alone, mixes


@pytest.mark.parametrize("kind", [pytest.param("smollm2", marks=pytest.mark.slow), "moe"])
def test_deterministic_mode_is_batch_invariant(kind: str, request: pytest.FixtureRequest) -> None:
    model, tok = (
        load_model(ModelConfig(source="smollm2")) if kind == "smollm2" else request.getfixturevalue(kind)
    )
    model = copy.deepcopy(model).to(torch.bfloat16)  # bf16: where batch shape changes the bits most
    alone, mixes = _target_in_mixes(EmbeddedEngine(model, tok, max_batch=4, deterministic=True))
    for res in mixes:
        assert res.token_ids == alone.token_ids
        assert res.logprobs == alone.logprobs  # bit-identical floats
        assert res.routes == alone.routes
    if kind == "smollm2":  # the test has teeth: batched, the same request's logprobs move
        alone, mixes = _target_in_mixes(EmbeddedEngine(model, tok, max_batch=4))
        assert any(res.logprobs != alone.logprobs for res in mixes)


def test_routes_travel_over_http(moe: tuple[Any, Any]) -> None:
    """Rollout workers talk to the engine over HTTP: routes and prompt routes survive the JSON."""
    from shipyard.inference.client import HttpInferenceClient
    from shipyard.inference.serving.server import InferenceServer

    model, tok = moe
    engine = EmbeddedEngine(model, tok, max_batch=4)
    [local] = engine.generate([GenerateRequest(PROMPTS[2], SamplingParams(max_tokens=5, seed=9))])
    assert local.routes is not None
    context = PROMPTS[2] + local.token_ids
    follow = GenerateRequest(context, SamplingParams(max_tokens=4, seed=10), prompt_routes=local.routes)
    [want] = engine.generate([follow])
    with InferenceServer(engine) as server, HttpInferenceClient(server.url) as client:
        [first, second] = client.generate(
            [GenerateRequest(PROMPTS[2], SamplingParams(max_tokens=5, seed=9)), follow]
        )
    assert first.routes == local.routes and first.token_ids == local.token_ids
    assert second.routes is not None and second.token_ids == want.token_ids  # batched with `first`
    n = local.routes["n"]
    assert (decode_routes(second.routes)[:n] == decode_routes(local.routes)).all()  # replayed exactly
    assert second.logprobs == pytest.approx(want.logprobs, abs=1e-4)


def test_rows_join_a_running_batch_token_exact(dense: tuple[Any, Any]) -> None:
    """Continuous batching: short rows join a running long one (cache padded both ways), and every
    row's tokens and logprobs equal the same request run alone; a straggler holds nobody back."""
    model, tok = dense
    long_prompt = [3 + (7 * i) % 500 for i in range(20)]
    reqs = [
        GenerateRequest(PROMPTS[2], SamplingParams(temperature=1.0, max_tokens=30, seed=7)),
        GenerateRequest(PROMPTS[1], _greedy(4)),
        GenerateRequest(PROMPTS[0], SamplingParams(temperature=0.9, top_p=0.9, max_tokens=5, seed=3)),
        GenerateRequest(long_prompt, _greedy(6)),  # longer than the running cache when it joins
    ]
    engine = EmbeddedEngine(model, tok, max_batch=2)
    alone = [engine.generate([r])[0] for r in reqs]
    lengths = [len(a.token_ids) for a in alone]
    assert lengths[0] == 30 and max(lengths[1:]) < 10, f"precondition: one straggler, got {lengths}"
    before = dict(engine.stats)
    joined = engine.generate(reqs)
    for a, j in zip(alone, joined, strict=True):
        assert j.token_ids == a.token_ids and j.finish_reason == a.finish_reason
        assert max(abs(x - y) for x, y in zip(j.logprobs, a.logprobs, strict=True)) < 1e-4
    steps = engine.stats["decode_steps"] - before["decode_steps"]
    static_steps = max(lengths[0:2]) - 1 + max(lengths[2:4]) - 1  # chunks of 2 that wait for their slowest
    assert engine.stats["joins"] - before["joins"] >= 2
    assert steps == lengths[0] - 1 < static_steps  # the short rows ran inside the straggler's steps


def test_deterministic_mode_admits_one_request_at_a_time(dense: tuple[Any, Any]) -> None:
    model, tok = dense
    engine = EmbeddedEngine(model, tok, max_batch=8, deterministic=True)
    engine.generate([GenerateRequest(p, _greedy(3)) for p in PROMPTS])
    assert engine.stats["largest_batch"] == 1 and engine.stats["joins"] == 0
    assert engine.stats["batches"] == len(PROMPTS)


def test_prefix_cache_reuses_a_turn_and_matches_a_cold_prefill(dense: tuple[Any, Any]) -> None:
    """An agent's next turn extends the last one: with the prefix cache only the new tokens are
    forwarded, and tokens and logprobs equal a cold prefill; after new weights go live nothing stale
    is reused: the next turn equals a cold run of the new weights."""
    model, tok = dense
    cold = EmbeddedEngine(model, tok, max_batch=4)
    warm = EmbeddedEngine(copy.deepcopy(model), tok, max_batch=4, prefix_cache_mb=64)
    turn1 = [
        GenerateRequest(p, SamplingParams(temperature=1.0, max_tokens=8, seed=i))
        for i, p in enumerate(PROMPTS)
    ]
    first = warm.generate(turn1)
    assert [r.token_ids for r in first] == [r.token_ids for r in cold.generate(turn1)]
    assert warm.stats["prefix_hits"] == 0 and warm.prefix is not None and len(warm.prefix) == len(PROMPTS)
    turn2 = [
        GenerateRequest(
            req.prompt_ids + res.token_ids + [17, 18, 19],
            SamplingParams(temperature=1.0, max_tokens=8, seed=9),
        )
        for req, res in zip(turn1, first, strict=True)
    ]
    reused, fresh = warm.generate(turn2), cold.generate(turn2)
    for r, f in zip(reused, fresh, strict=True):
        assert r.token_ids == f.token_ids
        assert max(abs(a - b) for a, b in zip(r.logprobs, f.logprobs, strict=True)) < 1e-4
    assert warm.stats["prefix_hits"] == len(PROMPTS)
    assert warm.stats["prefix_tokens"] == sum(
        len(q.prompt_ids) + len(s.token_ids) - 1 for q, s in zip(turn1, first, strict=True)
    )
    assert len(warm.prefix) == len(PROMPTS)  # each session's newer turn superseded its older one
    new_model = _lively(copy.deepcopy(model), seed=1)
    warm.stage_weights(1, new_model.state_dict())
    warm.apply_pending()
    assert len(warm.prefix) == 0
    after = warm.generate(turn2)
    assert warm.stats["prefix_hits"] == len(PROMPTS)  # nothing reused across a weight update
    expected = EmbeddedEngine(new_model, tok, max_batch=4).generate(turn2)
    assert [r.token_ids for r in after] == [r.token_ids for r in expected]
    assert [r.token_ids for r in after] != [r.token_ids for r in reused]  # the new weights do differ


def test_prefix_hits_admitted_together_prefill_in_one_forward(dense: tuple[Any, Any]) -> None:
    """Turns extending cached prefixes of different lengths by different numbers of new tokens (a
    resumed row adds one, an agent's turn many) share one padded forward; each row's tokens and
    logprobs equal a cold prefill of its whole prompt."""
    model, tok = dense
    cold = EmbeddedEngine(model, tok, max_batch=4)
    warm = EmbeddedEngine(copy.deepcopy(model), tok, max_batch=4, prefix_cache_mb=64)
    turn1 = [GenerateRequest(p, _greedy(6)) for p in PROMPTS]
    first = warm.generate(turn1)
    suffixes = [[], [17], [17, 18, 19, 20, 21], [30, 31]][: len(PROMPTS)]
    turn2 = [
        GenerateRequest(
            q.prompt_ids + r.token_ids + extra, SamplingParams(temperature=1.0, max_tokens=6, seed=3)
        )
        for q, r, extra in zip(turn1, first, suffixes, strict=True)
    ]
    batches = warm.stats["batches"]
    reused, fresh = warm.generate(turn2), cold.generate(turn2)
    assert warm.stats["batches"] == batches + 1 and warm.stats["prefix_hits"] == len(turn2)
    for r, f in zip(reused, fresh, strict=True):
        assert r.token_ids == f.token_ids and r.cached_tokens > 0
        assert max(abs(a - b) for a, b in zip(r.logprobs, f.logprobs, strict=True)) < 1e-4


def _serve_in_waves(engine: EmbeddedEngine, waves: list[list[GenerateRequest]]) -> list[GenerateResult]:
    """Serve ``waves`` of requests, one wave admitted per step boundary; results in request order."""
    starts = [sum(map(len, waves[:w])) for w in range(len(waves))]
    pending = [list(enumerate(wave, start)) for wave, start in zip(waves, starts, strict=True)]
    got: dict[int, GenerateResult] = {}

    def take(free: int, idle: bool) -> list[Job] | None:
        if not pending:
            return None
        wave = pending.pop(0)
        assert len(wave) <= free
        return [Job(req, lambda res, i=i: got.__setitem__(i, res)) for i, req in wave]

    engine.serve(take)
    return [got[i] for i in sorted(got)]


def _tokens_embedded(model: Any) -> tuple[list[int], Any]:
    """A running count of the tokens the model embeds (every forward), and the hook's handle."""
    seen = [0]
    handle = model.get_input_embeddings().register_forward_hook(
        lambda _m, args, _out: seen.__setitem__(0, seen[0] + args[0].numel())
    )
    return seen, handle


@pytest.mark.parametrize("system_cached", [False, True])
def test_a_groups_shared_prompt_is_prefilled_once(dense: tuple[Any, Any], system_cached: bool) -> None:
    """A GRPO group: 5 sessions of one prompt admitted together and 3 more a step later, while the
    first still run. The prompt is forwarded once (from a cached system prompt when an earlier
    session left one); every other row forwards its last token only, and samples what a cold
    engine samples (tokens equal, logprobs within 1e-4)."""
    model, tok = dense
    system = [(7 * i) % 200 + 3 for i in range(36)]
    prompt = system + [(5 * i) % 190 + 3 for i in range(24)]
    reqs = [GenerateRequest(prompt, SamplingParams(temperature=1.0, max_tokens=6, seed=i)) for i in range(8)]
    warm = EmbeddedEngine(copy.deepcopy(model), tok, max_batch=8, prefix_cache_mb=64)
    cold = EmbeddedEngine(model, tok, max_batch=8)
    if system_cached:  # another task's session under the same system prompt ran before
        warm.generate([GenerateRequest(system + [9, 8, 7], _greedy(3))])
    hits = warm.stats["prefix_hits"]
    seen_warm, h1 = _tokens_embedded(warm.model)
    seen_cold, h2 = _tokens_embedded(cold.model)
    try:
        got = _serve_in_waves(warm, [reqs[:5], reqs[5:]])
        want = _serve_in_waves(cold, [reqs[:5], reqs[5:]])
    finally:
        h1.remove()
        h2.remove()
    for g, w in zip(got, want, strict=True):
        assert g.token_ids == w.token_ids
        assert max(abs(a - b) for a, b in zip(g.logprobs, w.logprobs, strict=True)) < 1e-4
    first = len(system) if system_cached else 0
    assert [g.cached_tokens for g in got] == [first] + [len(prompt) - 1] * 7
    # repeats within an admission: 4 of the first wave, 2 of the second (whose first row hits too)
    assert warm.stats["shared_prompts"] == 6 and warm.stats["prefix_hits"] - hits == 7 + system_cached
    assert seen_cold[0] - seen_warm[0] == first + 7 * (len(prompt) - 1)
    assert cold.stats["shared_prompts"] == 0
    # the engine's own count: every cold row its whole prompt; the warm engine's first row what the
    # cache lacked, the seven others their last token (the system-prompt session's prefill aside)
    assert cold.stats["prefilled_tokens"] == 8 * len(prompt)
    before = len(system) + 3 if system_cached else 0
    assert warm.stats["prefilled_tokens"] - before == len(prompt) - first + 7


def test_prefilled_tokens_count_the_padded_batch(dense: tuple[Any, Any]) -> None:
    """Prompts of 10 and 25 tokens admitted together forward a [2, 25] batch: 50 positions, not 35."""
    model, tok = dense
    engine = EmbeddedEngine(model, tok, max_batch=4)
    engine.generate([GenerateRequest([3 + i for i in range(n)], _greedy(1)) for n in (10, 25)])
    assert engine.stats["batches"] == 1 and engine.stats["prefilled_tokens"] == 2 * 25


def test_prefix_cache_is_off_for_sliding_window_models() -> None:
    """A sliding-window cache drops old positions, so rows can neither be kept nor joined: the engine
    runs such a model with the prefix cache off and static admission, and still samples."""
    from transformers import MistralConfig, MistralForCausalLM

    _, tok = load_model(ModelConfig(source="tiny", tiny="dense"))
    cfg = MistralConfig(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        sliding_window=4,
        max_position_embeddings=256,
    )
    engine = EmbeddedEngine(MistralForCausalLM(cfg), tok, max_batch=4, prefix_cache_mb=64)
    assert engine.prefix is None
    results = engine.generate([GenerateRequest(p, _greedy(6)) for p in PROMPTS] * 2)
    assert all(len(r.token_ids) == 6 or r.finish_reason == "eos" for r in results)
    assert engine.stats["joins"] == 0 and engine.stats["batches"] == 2


def test_prefix_cache_lru_budget_and_longest_match() -> None:
    from shipyard.inference.engine.prefix_cache import PrefixCache, PrefixEntry

    def entry(tokens: list[int]) -> PrefixEntry:
        kv = [torch.zeros(2, len(tokens), 4)]  # 32 bytes per token
        return PrefixEntry(tokens, kv, [t.clone() for t in kv])

    cache = PrefixCache(budget_bytes=64 * 10)
    cache.put(entry([1, 2]))
    cache.put(entry([1, 2, 3, 4]))  # supersedes [1, 2]
    cache.put(entry([7, 8, 9]))
    assert len(cache) == 2 and cache.nbytes == 64 * 7
    hit = cache.lookup([1, 2, 3, 4, 5])
    assert hit is not None and hit.tokens == [1, 2, 3, 4]
    assert cache.lookup([1, 2, 3, 4]) is None  # a proper prefix only: one token must stay to prefill
    assert cache.cached_len([1, 2, 3, 4, 5]) == 4 and cache.cached_len([1, 2, 3, 4]) == 0
    assert cache.lookup([7, 8]) is None
    cache.put(entry([5, 5, 5, 5]))  # over budget: evicts the least recently used ([7, 8, 9])
    assert cache.lookup([7, 8, 9, 1]) is None and cache.lookup([1, 2, 3, 4, 0]) is not None
    cache.put(entry(list(range(11))))  # larger than the whole budget: not stored
    assert cache.nbytes <= cache.budget_bytes and cache.lookup(list(range(12))) is None
    with pytest.raises(ValueError, match="budget_bytes"):
        PrefixCache(0)
    shared = PrefixCache(budget_bytes=1 << 20, min_shared=3)
    shared.put(entry([1, 2, 3, 4, 5, 6]))
    part = shared.lookup([1, 2, 3, 4, 9, 9])  # same first four tokens, then another prompt
    assert part is not None and part.tokens == [1, 2, 3, 4] and part.keys_HND[0].shape == (2, 4, 4)
    assert shared.shared_hits == 1 and len(shared) == 1  # a view: the stored entry is untouched
    assert shared.lookup([1, 2, 9, 9]) is None  # two shared tokens: below min_shared
    assert shared.lookup([1, 2, 3, 4, 5, 6, 7]).tokens == [1, 2, 3, 4, 5, 6]  # a turn: the whole entry


def test_prefix_cache_shares_a_system_prompt_between_sessions(dense: tuple[Any, Any]) -> None:
    """Two sessions under one long shared prompt: the second forwards only its own tokens, and
    samples what a cold engine samples."""
    model, tok = dense
    system = [(7 * i) % 200 + 3 for i in range(48)]
    prompts = [system + [11, 12, 13], system + [21, 22, 23, 24]]
    reqs = [
        GenerateRequest(p, SamplingParams(temperature=1.0, max_tokens=8, seed=i))
        for i, p in enumerate(prompts)
    ]
    warm = EmbeddedEngine(copy.deepcopy(model), tok, max_batch=4, prefix_cache_mb=64)
    cold = EmbeddedEngine(model, tok, max_batch=4)
    got = [warm.generate([r])[0] for r in reqs]  # one after the other: the first one is stored
    want = cold.generate(reqs)
    assert warm.stats["prefix_hits"] == 1 and warm.stats["prefix_tokens"] == len(system)
    assert warm.prefix is not None and warm.prefix.shared_hits == 1
    assert [g.cached_tokens for g in got] == [0, len(system)]  # what the caller learns per request
    for g, w in zip(got, want, strict=True):
        assert g.token_ids == w.token_ids
        assert max(abs(a - b) for a, b in zip(g.logprobs, w.logprobs, strict=True)) < 1e-4
