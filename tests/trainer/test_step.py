"""Token logprobs, micro-batched gradient accumulation and the direction of a GRPO step, on a tiny
random Llama (vocab 49152, the SmolLM2 vocabulary) built in process.

Shape legend: B = sequences, T = positions, V = vocab.
"""

from __future__ import annotations

import copy

import pytest
import torch

from shipyard.agent.types import Trajectory
from shipyard.config.schema import LossConfig, TrainerConfig
from shipyard.models.loading import build_tiny
from shipyard.trainer.logprobs import pad_batch, pad_floats, pad_ints, token_logprobs
from shipyard.trainer.step import make_optimizer, train_step

VOCAB = 49152
PAD_ID = 2


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return build_tiny("dense", VOCAB, seed=0).eval()


def _ref_logprobs(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    """Full-vocab log_softmax gather on one unpadded sequence: [T-1] logprobs of tokens 1..T-1."""
    ids_1T = torch.tensor([ids])
    with torch.no_grad():
        logp_TV = torch.log_softmax(model(input_ids=ids_1T).logits[0].float(), dim=-1)
    return logp_TV[:-1].gather(1, ids_1T[0, 1:, None]).squeeze(1)


def _trajectory(
    model: torch.nn.Module, gen: torch.Generator, length: int, idx: int, noise: float = 0.3
) -> Trajectory:
    """Prompt (5 tokens), then sampled / environment tokens; μ = true logprob + noise on sampled tokens."""
    ids = torch.randint(3, VOCAB, (length,), generator=gen).tolist()
    mask = [0] * 5 + [0 if 10 <= t < 13 else 1 for t in range(5, length)]
    true_T = torch.cat([torch.zeros(1), _ref_logprobs(model, ids)])
    mu_T = true_T + noise * torch.randn(length, generator=gen)
    logprobs = [float(mu_T[t]) if mask[t] else 0.0 for t in range(length)]
    versions = [0 if m else -1 for m in mask]
    return Trajectory("t", f"g{idx // 2}", idx, ids, mask, logprobs, versions, prompt_len=5)


def test_pad_helpers() -> None:
    ids_BT, attn_BT = pad_batch([[5, 6, 7], [8]], pad_id=PAD_ID)
    assert ids_BT.tolist() == [[5, 6, 7], [8, PAD_ID, PAD_ID]]
    assert attn_BT.tolist() == [[1, 1, 1], [1, 0, 0]]
    assert pad_ints([[1], [2, 3]], value=-1).tolist() == [[1, -1], [2, 3]]
    assert pad_floats([[0.5], []]).tolist() == [[0.5], [0.0]]
    with pytest.raises(ValueError):
        pad_batch([], pad_id=PAD_ID)


def test_token_logprobs_match_full_softmax_and_ignore_padding(model: torch.nn.Module) -> None:
    gen = torch.Generator().manual_seed(1)
    seqs = [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in (9, 17, 4)]
    ids_BT, attn_BT = pad_batch(seqs, PAD_ID)
    with torch.no_grad():
        lp_BT = token_logprobs(model, ids_BT, attn_BT, chunk_tokens=7)
    for b, ids in enumerate(seqs):
        torch.testing.assert_close(lp_BT[b, 1 : len(ids)], _ref_logprobs(model, ids), atol=1e-5, rtol=0)
        assert lp_BT[b, 0] == 0 and bool((lp_BT[b, len(ids) :] == 0).all())
        with torch.no_grad():
            alone_1T = token_logprobs(model, *pad_batch([ids], PAD_ID))
        torch.testing.assert_close(lp_BT[b, : len(ids)], alone_1T[0], atol=1e-5, rtol=0)
    score_BT = torch.zeros_like(attn_BT)
    score_BT[1, 3:6] = 1
    with torch.no_grad():
        part_BT = token_logprobs(model, ids_BT, attn_BT, score_mask_BT=score_BT, temperature=1.0)
    torch.testing.assert_close(part_BT, torch.where(score_BT.bool(), lp_BT, 0.0))
    with pytest.raises(ValueError):
        token_logprobs(model, ids_BT, attn_BT.flip(1))


def test_token_logprobs_temperature_and_gradient(model: torch.nn.Module) -> None:
    ids = torch.randint(3, VOCAB, (8,), generator=torch.Generator().manual_seed(2)).tolist()
    ids_1T, attn_1T = pad_batch([ids], PAD_ID)
    with torch.no_grad():
        logits_TV = model(input_ids=ids_1T).logits[0] / 0.7
        ref_T = torch.log_softmax(logits_TV, -1)[:-1].gather(1, ids_1T[0, 1:, None]).squeeze(1)
        hot_1T = token_logprobs(model, ids_1T, attn_1T, temperature=0.7)
    torch.testing.assert_close(hot_1T[0, 1:], ref_T, atol=1e-5, rtol=0)
    # chunked + checkpointed lm head gives the same parameter gradient as the plain full-vocab path
    weights_1T = torch.randn(1, 8, generator=torch.Generator().manual_seed(3))
    model.zero_grad()
    (token_logprobs(model, ids_1T, attn_1T, chunk_tokens=3) * weights_1T).sum().backward()
    grad_chunked = model.lm_head.weight.grad.clone()
    model.zero_grad()
    full_TV = (
        torch.log_softmax(model(input_ids=ids_1T).logits[0], -1)[:-1]
        .gather(1, ids_1T[0, 1:, None])
        .squeeze(1)
    )
    (full_TV * weights_1T[0, 1:]).sum().backward()
    grad_full = model.lm_head.weight.grad
    assert ((grad_chunked - grad_full).norm() / grad_full.norm()).item() < 1e-5
    model.zero_grad(set_to_none=True)


def _param_delta(
    model: torch.nn.Module,
    trajs: list[Trajectory],
    adv: list[float],
    micro_batch: int,
    loss: LossConfig | None = None,
    ref_model: torch.nn.Module | None = None,
) -> tuple[list[torch.Tensor], dict[str, float]]:
    """One SGD(lr=1) step without clipping: the parameter change is exactly minus the gradient."""
    m = copy.deepcopy(model)
    before = [p.detach().clone() for p in m.parameters()]
    loss = loss or LossConfig(clip_low=0.2, clip_high=0.28, tis_cap=1.5)
    cfg = TrainerConfig(micro_batch=micro_batch, grad_clip=1e9, loss=loss)
    opt = torch.optim.SGD(m.parameters(), lr=1.0)
    metrics = train_step(m, opt, trajs, adv, cfg, PAD_ID, ref_model=ref_model)
    return [p.detach() - b for p, b in zip(m.parameters(), before, strict=True)], metrics


def test_micro_batching_gives_same_gradient(model: torch.nn.Module) -> None:
    gen = torch.Generator().manual_seed(4)
    trajs = [_trajectory(model, gen, n, i) for i, n in enumerate((20, 31, 16, 25, 18))]
    adv = [1.0, -0.5, 0.0, 0.8, 0.0]
    d1, m1 = _param_delta(model, trajs, adv, micro_batch=1)
    d4, m4 = _param_delta(model, trajs, adv, micro_batch=4)
    assert max(d.abs().max().item() for d in d1) > 1e-4
    for a, b in zip(d1, d4, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    assert m1["num_tokens"] == m4["num_tokens"] == sum(t.num_sampled() for t in trajs)
    for key in ("loss", "grad_norm", "k1", "k3", "max_abs_dp", "tis_trunc_frac", "mean_rho"):
        assert m1[key] == pytest.approx(m4[key], rel=1e-4, abs=1e-6), key
    assert m1["k3"] > 0 and 0 < m1["tis_trunc_frac"] < 1 and m1["clip_frac"] == 0
    assert m1["num_seqs"] == 5 and m1["mean_adv_abs"] == pytest.approx(2.3 / 5)


def test_sequence_level_loss_correction_and_kl_are_micro_batch_invariant(model: torch.nn.Module) -> None:
    gen = torch.Generator().manual_seed(8)
    trajs = [_trajectory(model, gen, n, i, noise=0.1) for i, n in enumerate((14, 18, 12))]
    ref = copy.deepcopy(model).requires_grad_(False)
    with torch.no_grad():
        ref.lm_head.weight.add_(0.05 * torch.randn(ref.lm_head.weight.shape, generator=gen))
    loss = LossConfig(type="grpo", correction="sequence_mask", mask_low=0.2, mask_high=5.0, kl_coef=0.1)
    d1, m1 = _param_delta(model, trajs, [1.0, -0.5, 0.0], 1, loss, ref)
    d3, m3 = _param_delta(model, trajs, [1.0, -0.5, 0.0], 3, loss, ref)
    assert max(d.abs().max().item() for d in d1) > 1e-4
    for a, b in zip(d1, d3, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    assert m1["kl_ref"] > 0 and m1["kl_ref"] == pytest.approx(m3["kl_ref"], rel=1e-4)
    assert m1["ess"] == pytest.approx(m3["ess"], rel=1e-4) and "token_frac/bucket_0.9-1.0" in m1
    with pytest.raises(ValueError, match="kl_coef"):
        _param_delta(model, trajs, [1.0, -0.5, 0.0], 1, loss)


def _mean_sampled_logprob(model: torch.nn.Module, traj: Trajectory) -> float:
    ids_1T, attn_1T = pad_batch([traj.token_ids], PAD_ID)
    mask_1T = torch.tensor([traj.loss_mask]) == 1
    with torch.no_grad():
        return token_logprobs(model, ids_1T, attn_1T)[mask_1T].mean().item()


def test_train_step_moves_logprobs_with_advantage_sign(model: torch.nn.Module) -> None:
    gen = torch.Generator().manual_seed(5)
    good, bad = _trajectory(model, gen, 24, 0, noise=0.0), _trajectory(model, gen, 24, 1, noise=0.0)
    m = copy.deepcopy(model)
    cfg = TrainerConfig(lr=1e-3, micro_batch=2)
    before = (_mean_sampled_logprob(m, good), _mean_sampled_logprob(m, bad))
    metrics = train_step(m, make_optimizer(m, cfg), [good, bad], [1.0, -1.0], cfg, PAD_ID)
    after = (_mean_sampled_logprob(m, good), _mean_sampled_logprob(m, bad))
    assert after[0] > before[0] + 1e-3 and after[1] < before[1] - 1e-3
    # μ is the trainer's own logprob: no mismatch
    assert abs(metrics["k1"]) < 1e-5 and metrics["k3"] < 1e-5 and metrics["max_abs_dp"] < 1e-5
    assert metrics["mean_rho"] == pytest.approx(1.0, abs=1e-5) and metrics["grad_norm"] > 0


def test_zero_advantages_change_nothing_but_are_measured(model: torch.nn.Module) -> None:
    gen = torch.Generator().manual_seed(6)
    trajs = [_trajectory(model, gen, 15, i) for i in range(3)]
    m = copy.deepcopy(model)
    cfg = TrainerConfig(micro_batch=2)
    metrics = train_step(m, make_optimizer(m, cfg), trajs, [0.0, 0.0, 0.0], cfg, PAD_ID)
    assert all(torch.equal(p, q) for p, q in zip(m.parameters(), model.parameters(), strict=True))
    assert metrics["loss"] == 0 and metrics["grad_norm"] == 0 and metrics["k3"] > 0
    assert metrics["num_tokens"] == sum(t.num_sampled() for t in trajs)


def test_train_step_rejects_bad_batches(model: torch.nn.Module) -> None:
    gen = torch.Generator().manual_seed(7)
    traj = _trajectory(model, gen, 12, 0)
    cfg = TrainerConfig()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with pytest.raises(ValueError):
        train_step(model, opt, [traj], [1.0, 2.0], cfg, PAD_ID)
    with pytest.raises(ValueError):
        train_step(model, opt, [], [], cfg, PAD_ID)
    first_trained = copy.deepcopy(traj)
    first_trained.loss_mask[0] = 1
    with pytest.raises(ValueError):
        train_step(model, opt, [first_trained], [1.0], cfg, PAD_ID)
