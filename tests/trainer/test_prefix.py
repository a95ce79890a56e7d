"""A group's shared prompt forwarded once (``token_logprobs(prefix=...)``, ``trainer.share_prefix``)
against every row forwarded whole, on tiny random models built in process.

Tolerances: fp32 throughout. The shared path computes the same sums in another order (the prompt's
keys and values in a batch of one, the rows' attention over the cache and their own tokens in a
second call), so values agree to float rounding: logprobs to 2e-6 (observed <= 1e-6), parameter
gradients to 1e-5 of the largest entry, weights after a step to 1e-5.

Shape legend: B = rows, T = positions.
"""

from __future__ import annotations

import pytest
import torch
from transformers import MistralConfig, MistralForCausalLM

from shipyard.agent.types import Trajectory
from shipyard.config.schema import FsdpConfig, LossConfig, TrainerConfig
from shipyard.models.loading import build_tiny
from shipyard.trainer.distributed import Ranks, full_params, shard_policy, spawn_ranks
from shipyard.trainer.logprobs import TokenScorer, pad_batch, token_logprobs
from shipyard.trainer.microbatch import (
    CALL_TOKENS,
    MIN_SHARED_PREFIX,
    forwarded_tokens,
    plan_micro_batches,
    rank_split,
    shared_prefix,
)
from shipyard.trainer.step import make_optimizer, train_step

VOCAB = 512
PAD_ID = 2
PROMPT = 40


def _rows(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Four rows on one 40-token prompt: own tails of 30, 5, 17 and 30 tokens (the second repeats the
    first's first five, so the rows agree beyond the prompt), right-padded; scored from 35 on."""
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(3, VOCAB, (PROMPT,), generator=gen).tolist()
    seqs = [prompt + torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in (30, 5, 17, 30)]
    seqs[1] = seqs[0][: PROMPT + 5]
    ids_BT, attn_BT = pad_batch(seqs, PAD_ID)
    score_BT = torch.zeros_like(ids_BT)
    score_BT[:, 35:] = 1
    return ids_BT, attn_BT, score_BT


def _sliding_mistral() -> torch.nn.Module:
    cfg = MistralConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        sliding_window=16,  # shorter than the shared prompt: the cache keeps only its last window
    )
    torch.manual_seed(0)
    return MistralForCausalLM(cfg)


def _values_and_grads(model: torch.nn.Module, prefix: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    ids_BT, attn_BT, score_BT = _rows(1)
    model.zero_grad(set_to_none=True)
    lp_BT = token_logprobs(model, ids_BT, attn_BT, score_mask_BT=score_BT, prefix=prefix)
    weights_BT = torch.randn(lp_BT.shape, generator=torch.Generator().manual_seed(5))
    (lp_BT * weights_BT).sum().backward()
    return lp_BT.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("kind", ["dense", "moe", "mixtral", "deepseek_v3", "sliding"])
def test_shared_prefix_gives_the_same_logprobs_and_gradients(kind: str) -> None:
    model = (_sliding_mistral() if kind == "sliding" else build_tiny(kind, VOCAB, seed=0)).train()
    whole_BT, whole_grads = _values_and_grads(model, prefix=0)
    shared_BT, shared_grads = _values_and_grads(model, prefix=PROMPT)
    assert bool((whole_BT != 0).any())
    torch.testing.assert_close(shared_BT, whole_BT, atol=2e-6, rtol=0)
    assert shared_grads.keys() == whole_grads.keys() and len(whole_grads) > 5
    for name, grad in whole_grads.items():
        scale = float(grad.abs().max())
        assert float((shared_grads[name] - grad).abs().max()) <= 1e-5 * max(scale, 1e-6), name


def _decoder_tokens(model: torch.nn.Module, prefix: int) -> int:
    """Tokens the decoder's embedding saw for one scoring of :func:`_rows`."""
    seen = []
    hook = model.get_input_embeddings().register_forward_hook(lambda m, inp, out: seen.append(inp[0].numel()))
    ids_BT, attn_BT, _ = _rows(1)
    with torch.no_grad():
        token_logprobs(model, ids_BT, attn_BT, prefix=prefix)
    hook.remove()
    return sum(seen)


def test_the_prompt_runs_once_and_not_under_activation_checkpointing() -> None:
    model = build_tiny("dense", VOCAB, seed=0).train()
    rows, length = 4, PROMPT + 30
    assert _decoder_tokens(model, 0) == rows * length
    assert _decoder_tokens(model, PROMPT) == PROMPT + rows * (length - PROMPT)
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    assert _decoder_tokens(model, PROMPT) == rows * length  # recomputed blocks would re-append to the cache


def test_a_prefix_the_rows_do_not_share_is_refused() -> None:
    model = build_tiny("dense", VOCAB, seed=0)
    ids_BT, attn_BT, _ = _rows(1)
    with pytest.raises(ValueError, match="prefix=41"):  # row 1's 41st token differs from row 3's
        token_logprobs(model, ids_BT, attn_BT, prefix=PROMPT + 1)
    with pytest.raises(ValueError, match="prefix=45"):  # row 1 (45 tokens) would have none of its own
        token_logprobs(model, ids_BT[:2], attn_BT[:2], prefix=PROMPT + 5)


def _traj(ids: list[int], group: str, idx: int, prompt: int) -> Trajectory:
    mask = [0] * prompt + [1] * (len(ids) - prompt)
    logprobs = [-1.5 if m else 0.0 for m in mask]
    return Trajectory("t", group, idx, ids, mask, logprobs, [0 if m else -1 for m in mask], prompt_len=prompt)


def _group(gen: torch.Generator, group: str, prompt: int, lengths: tuple[int, ...]) -> list[Trajectory]:
    head = torch.randint(3, VOCAB, (prompt,), generator=gen).tolist()
    return [
        _traj(head + torch.randint(3, VOCAB, (n,), generator=gen).tolist(), group, i, prompt)
        for i, n in enumerate(lengths)
    ]


def test_the_cut_keeps_groups_apart_and_a_long_session_alone() -> None:
    gen = torch.Generator().manual_seed(7)
    trajs = _group(gen, "a", 136, (24,) * 3 + (351,) + (24,) * 4) + _group(gen, "b", 120, (30, 10, 50))
    plan = plan_micro_batches(trajs, 1, 0, 4, share_prefix=True)
    runs = [mb.indices for mb in plan]
    assert sorted(i for r in runs for i in r) == list(range(len(trajs)))
    assert all(len(r) <= 4 and len({trajs[i].group_id for i in r}) == 1 for r in runs)
    assert runs[0] == [3]  # the two-turn session does not pad seven short ones to 487 tokens
    assert sorted(len(r) for r in runs) == [1, 3, 3, 4]
    assert [mb.prefix for mb in plan] == [shared_prefix([trajs[i].token_ids for i in r]) for r in runs]
    assert {mb.prefix for mb in plan if len(mb.indices) > 1} == {120, 136}
    shared = sum(forwarded_tokens([trajs[i].token_ids for i in r], True) for r in runs)
    whole = sum(
        forwarded_tokens([trajs[i].token_ids for i in mb.indices], False)
        for mb in plan_micro_batches(trajs, 1, 0, 4, share_prefix=False)
    )
    # 487 alone, 136 + 4 * 24, 136 + 3 * 24, 120 + 3 * 50; whole: 487 + 3 * 160 (one of the 4-row
    # batches holds the long session), then the rest padded longest first
    assert shared == 487 + (136 + 4 * 24) + (136 + 3 * 24) + (120 + 3 * 50)
    assert shared < 0.5 * whole
    assert CALL_TOKENS > 0 and MIN_SHARED_PREFIX == 16


def test_shared_prefix_needs_sixteen_tokens_and_one_own_token_per_row() -> None:
    assert shared_prefix([[1] * 20 + [2], [1] * 20 + [3]]) == 20
    assert shared_prefix([[1] * 15 + [2], [1] * 15 + [3]]) == 0  # under MIN_SHARED_PREFIX
    assert shared_prefix([[1] * 20, [1] * 20 + [3]]) == 19  # the first row keeps its last token
    assert shared_prefix([[1] * 20]) == 0 and shared_prefix([]) == 0


def _step_batch(seed: int) -> tuple[list[Trajectory], list[float]]:
    gen = torch.Generator().manual_seed(seed)
    trajs = _group(gen, "a", 24, (23, 9, 31)) + _group(gen, "b", 30, (14, 6, 12, 19))
    return trajs, [1.0, -0.5, 0.0, 0.75, -1.0, 0.5, -0.25]


def _train(ranks: Ranks, kind: str, share: bool, checkpointing: bool = False, tokens: int = 0) -> dict:
    """Three AdamW steps (lr 1e-3) on shared-prompt groups; losses, norms, logprobs, weights.
    ``tokens``: ``trainer.micro_batch_tokens``."""
    torch.manual_seed(0)
    scorer = TokenScorer(build_tiny(kind, VOCAB, seed=0).train())
    if ranks.world > 1:
        shard_policy(scorer, FsdpConfig(activation_checkpointing=checkpointing), bf16=False)
    cfg = TrainerConfig(
        lr=1e-3,
        micro_batch=3,
        micro_batch_tokens=tokens,
        share_prefix=share,
        loss=LossConfig(correction="tis"),
    )
    opt = make_optimizer(scorer, cfg)
    out: dict = {"losses": [], "norms": [], "lps": []}
    for step in range(3):
        trajs, advs = _step_batch(step)
        lps: dict[str, list[float]] = {}
        stats = train_step(scorer, opt, trajs, advs, cfg, PAD_ID, ranks=ranks, trainer_logprobs=lps)
        out["losses"].append(stats["loss"])
        out["norms"].append(stats["grad_norm"])
        out["lps"].append(lps)
    out["weights"] = full_params(scorer, "model.")
    return out


def _assert_same_update(a: dict, b: dict) -> None:
    assert b["losses"] == pytest.approx(a["losses"], abs=1e-6)
    assert b["norms"] == pytest.approx(a["norms"], rel=1e-5)
    for x, y in zip(a["lps"], b["lps"], strict=True):
        if y:  # rank 0 of a group records every rank's
            assert x.keys() == y.keys()
            diffs = [abs(p - q) for k in x for p, q in zip(x[k], y[k], strict=True)]
            assert max(diffs) <= 1.0001e-4  # recorded rounded to 1e-4: 2e-6 may cross one rounding step
            assert sum(d > 0 for d in diffs) <= 0.05 * len(diffs)
    assert max(float((a["weights"][n] - b["weights"][n]).abs().max()) for n in a["weights"]) < 1e-5


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_train_step_with_shared_prompts_equals_rows_whole(kind: str) -> None:
    whole = _train(Ranks(), kind, share=False)
    _assert_same_update(whole, _train(Ranks(), kind, share=True))
    initial = build_tiny(kind, VOCAB, seed=0)
    moved = max(float((whole["weights"][n] - p.detach()).abs().max()) for n, p in initial.named_parameters())
    assert moved > 1e-3  # the steps moved the weights far beyond the tolerance


def test_ranks_agree_on_every_micro_batch_prefix() -> None:
    trajs, _ = _step_batch(0)
    plans = [plan_micro_batches(trajs, 2, r, 2, share_prefix=True) for r in range(2)]
    assert len(plans[0]) == len(plans[1])
    assert [mb.prefix for mb in plans[0]] == [mb.prefix for mb in plans[1]]
    assert sorted(i for p in plans for mb in p for i in mb.indices) == list(range(len(trajs)))
    for k, (mine, theirs) in enumerate(zip(*plans, strict=True)):
        own = [shared_prefix([trajs[i].token_ids for i in mb.indices]) for mb in (mine, theirs)]
        assert mine.prefix == min(own), k  # FSDP: both ranks make the same decoder calls
    assert any(mb.prefix > 0 for mb in plans[0])


def test_sharded_step_with_shared_prompts_equals_one_process() -> None:
    """FSDP2 over gloo, both ranks sharing prompts (and with activation checkpointing, not sharing)."""
    one = _train(Ranks(), "dense", share=False)
    for checkpointing in (False, True):
        two = spawn_ranks(_train, 2, "dense", True, checkpointing)
        _assert_same_update(one, two[0])


def _padded(trajs: list[Trajectory], idx: list[int]) -> int:
    return len(idx) * max(len(trajs[i].token_ids) for i in idx)


@pytest.mark.parametrize("share", [False, True])
@pytest.mark.parametrize("world", [1, 2])
def test_a_token_budget_caps_every_micro_batch(world: int, share: bool) -> None:
    gen = torch.Generator().manual_seed(3)
    trajs = (
        _group(gen, "a", 60, (20, 250, 35, 35, 12, 90, 20, 20))
        + _group(gen, "b", 40, (300, 5, 8, 60))
        + _group(gen, "c", 24, (10,) * 6)
    )
    budget, rows = 240, 4  # the 310- and 340-token sessions are each longer than the budget

    def plans(tokens: int) -> list[list[list[int]]]:
        return [
            [mb.indices for mb in plan_micro_batches(trajs, world, r, rows, share, tokens)]
            for r in range(world)
        ]

    capped, free = plans(budget), plans(0)
    for plan in (capped, free):
        assert len({len(p) for p in plan}) == 1  # every rank runs as many micro-batches
        assert sorted(i for p in plan for idx in p for i in idx) == list(range(len(trajs)))
        assert all(len(idx) <= rows for p in plan for idx in p)
    batches = [idx for p in capped for idx in p if idx]
    assert all(len(idx) == 1 or _padded(trajs, idx) <= budget for idx in batches)
    alone = [idx for idx in batches if _padded(trajs, idx) > budget]
    assert sorted(len(trajs[i].token_ids) for idx in alone for i in idx) == [310, 340]
    assert max(_padded(trajs, idx) for p in free for idx in p if len(idx) > 1) > budget  # the cap bit
    if not share:  # no budget: each rank's list (longest first) in slices of `rows`, padded with fillers
        split = rank_split(trajs, world)
        count = max(-(-len(mine) // rows) for mine in split)
        assert free == [[mine[k * rows : (k + 1) * rows] for k in range(count)] for mine in split]
    if world == 1 and not share:  # longest first, as many rows as both caps allow
        lengths = [[len(trajs[i].token_ids) for i in idx] for idx in capped[0]]
        assert lengths == [[340], [310], [150], [100, 95], [95, 80], [80, 80, 72], [48, 45, 34, 34], [34] * 4]


@pytest.mark.parametrize("share", [False, True])
def test_a_token_budget_keeps_the_update(share: bool) -> None:
    trajs, _ = _step_batch(0)  # 55, 49, 47, 44, 42, 36, 33 tokens
    cut = plan_micro_batches(trajs, 1, 0, 3, share, token_budget=100)
    assert len(cut) > len(plan_micro_batches(trajs, 1, 0, 3, share))
    assert all(_padded(trajs, mb.indices) <= 100 for mb in cut if len(mb.indices) > 1)
    _assert_same_update(_train(Ranks(), "dense", share), _train(Ranks(), "dense", share, tokens=100))


def test_a_token_budget_keeps_the_sharded_update() -> None:
    one = _train(Ranks(), "dense", share=True)
    two = spawn_ranks(_train, 2, "dense", True, False, 100)
    _assert_same_update(one, two[0])
