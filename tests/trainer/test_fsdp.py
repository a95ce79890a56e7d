"""The sharded trainer (FSDP2 over gloo) against the one-process trainer: same seed, same groups,
three steps, tiny dense and MoE models.

Tolerances: every rank computes in fp32 and sums the same per-token terms as the one-process step;
what differs is the order of floating-point reductions (sequences sit in other micro-batches, and
the ranks' gradients are summed by a reduce-scatter). fp32 rounds at 6e-8 relative per operation:
- losses and gradient norms agree to 1e-5 (relative 1e-5 for norms). The norm is what catches a
  wrong normalisation: averaging instead of summing the ranks' gradients halves it, and Adam
  with clipping would hide that in the weights (its update is nearly scale-invariant);
- weights agree to 1e-5 absolute after three AdamW steps at lr 1e-3: Adam divides each gradient
  by its running RMS, so a parameter whose gradient is near zero (an expert that one token in
  another micro-batch reaches) carries the rounding of that gradient into an update of up to lr;
  1e-5 is 1% of one step's largest update and at least 100x below how far the weights moved.

Shape legend: none.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch

from shipyard.agent.types import Trajectory
from shipyard.config.schema import FsdpConfig, LossConfig, TrainerConfig
from shipyard.models.loading import build_tiny
from shipyard.trainer.distributed import Ranks, full_params, shard_policy, spawn_ranks
from shipyard.trainer.logprobs import TokenScorer
from shipyard.trainer.microbatch import rank_split
from shipyard.trainer.step import make_optimizer, train_step

VOCAB = 512
PAD_ID = 2
LOSS_TOL = 1e-5
WEIGHT_TOL = 1e-5


def _batches(step: int) -> tuple[list[Trajectory], list[float]]:
    """Step ``step``'s batch: 5 sequences of uneven lengths (so ranks get unequal counts and one
    micro-batch is a filler), sampler logprobs with noise, advantages of both signs and one zero."""
    gen = torch.Generator().manual_seed(100 + step)
    trajs, advs = [], []
    for i, length in enumerate((23, 9, 31, 14, 6)):
        ids = torch.randint(3, VOCAB, (length,), generator=gen).tolist()
        mask = [0] * 3 + [1] * (length - 3)
        logprobs = [(-2.0 + 0.3 * float(torch.randn(1, generator=gen))) if m else 0.0 for m in mask]
        versions = [0 if m else -1 for m in mask]
        trajs.append(Trajectory("t", f"g{i // 2}", i, ids, mask, logprobs, versions, prompt_len=3))
        advs.append((1.0, -0.5, 0.0, 0.75, -1.0)[i])
    return trajs, advs


def _cfg() -> TrainerConfig:
    return TrainerConfig(
        lr=1e-3, micro_batch=2, grad_clip=1.0, loss=LossConfig(type="grpo", correction="tis")
    )


def _train(ranks: Ranks, kind: str, fsdp: FsdpConfig | None = None) -> dict[str, Any]:
    """Three steps on ``kind``; the losses, grad norms and final full weights (every rank)."""
    torch.manual_seed(0)
    model = build_tiny(kind, VOCAB, seed=0).train()
    scorer = TokenScorer(model)
    if ranks.world > 1:
        shard_policy(scorer, fsdp or FsdpConfig(), bf16=False)
    cfg = _cfg()
    opt = make_optimizer(scorer, cfg)
    losses, norms, k1 = [], [], []
    for step in range(3):
        trajs, advs = _batches(step)
        stats = train_step(scorer, opt, trajs, advs, cfg, PAD_ID, ranks=ranks)
        losses.append(stats["loss"])
        norms.append(stats["grad_norm"])
        k1.append(stats["k1"])
    return {"losses": losses, "norms": norms, "k1": k1, "weights": full_params(scorer, "model.")}


def test_rank_split_balances_tokens_longest_first() -> None:
    trajs, _ = _batches(0)
    split = rank_split(trajs, 2)
    assert sorted(i for s in split for i in s) == list(range(5))
    loads = [sum(len(trajs[i].token_ids) for i in s) for s in split]
    assert abs(loads[0] - loads[1]) <= 31  # greedy longest-first: within the longest sequence
    lengths = [len(t.token_ids) for t in trajs]
    assert rank_split(trajs, 1) == [sorted(range(5), key=lambda i: (-lengths[i], i))]  # longest first


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_world_2_step_equals_world_1(kind: str) -> None:
    one = _train(Ranks(), kind)
    two = spawn_ranks(_train, 2, kind)
    assert two[0]["losses"] == pytest.approx(
        two[1]["losses"], abs=0
    )  # rank 0 reports, rank 1 agrees on totals
    diff_loss = max(abs(a - b) for a, b in zip(one["losses"], two[0]["losses"], strict=True))
    assert diff_loss < LOSS_TOL, (one["losses"], two[0]["losses"])
    assert two[0]["norms"] == pytest.approx(one["norms"], rel=1e-5)
    assert two[0]["k1"] == pytest.approx(one["k1"], rel=1e-5)
    assert one["weights"].keys() == two[0]["weights"].keys()
    diff_w = max(float((one["weights"][n] - two[0]["weights"][n]).abs().max()) for n in one["weights"])
    assert diff_w < WEIGHT_TOL
    moved = max(float((one["weights"][n] - w0).abs().max()) for n, w0 in _initial(kind).items())
    assert moved > 100 * WEIGHT_TOL  # the steps changed the weights far beyond the tolerance
    for n in one["weights"]:  # both ranks hold the same full weights
        assert torch.equal(two[0]["weights"][n], two[1]["weights"][n])


def test_activation_checkpointing_and_no_reshard_change_nothing() -> None:
    """The FSDP options trade memory for compute; the update is the same."""
    one = _train(Ranks(), "dense")
    opts = FsdpConfig(activation_checkpointing=True, reshard_after_forward=False)
    two = spawn_ranks(_train, 2, "dense", opts)[0]
    assert max(abs(a - b) for a, b in zip(one["losses"], two["losses"], strict=True)) < LOSS_TOL
    assert (
        max(float((one["weights"][n] - two["weights"][n]).abs().max()) for n in one["weights"]) < WEIGHT_TOL
    )


def _initial(kind: str) -> dict[str, torch.Tensor]:
    model = build_tiny(kind, VOCAB, seed=0)
    return {n: p.detach().clone() for n, p in copy.deepcopy(model).named_parameters()}


def _resume(
    ranks: Ranks, kind: str, ckpt: str, save_after: int, steps: int, crash_in_save: bool = False
) -> dict:
    """Resume from the newest checkpoint under ``ckpt`` (if any), train up to ``steps`` steps,
    checkpointing after step ``save_after``; losses of the steps run here and the final weights."""
    from shipyard.trainer.checkpoint import load_latest_checkpoint, save_checkpoint

    torch.manual_seed(0)
    seed = 5 if list(Path(ckpt).glob("step-*")) else 0  # resuming: another init, the checkpoint must win
    scorer = TokenScorer(build_tiny(kind, VOCAB, seed=seed).train())
    if ranks.world > 1:
        shard_policy(scorer, FsdpConfig(), bf16=False)
    cfg = _cfg()
    opt = make_optimizer(scorer, cfg)
    state = load_latest_checkpoint(Path(ckpt), scorer, opt, ranks) or {"step": 0}
    losses = {}
    for step in range(state["step"], steps):
        trajs, advs = _batches(step)
        losses[step] = train_step(scorer, opt, trajs, advs, cfg, PAD_ID, ranks=ranks)["loss"]
        if step + 1 == save_after:
            if crash_in_save:
                _die_after_first_shard()
            save_checkpoint(Path(ckpt), step + 1, scorer, opt, {"step": step + 1}, keep=3, ranks=ranks)
    return {"losses": losses, "weights": full_params(scorer, "model.")}


def _die_after_first_shard() -> None:
    """Make this process die (os._exit, as SIGKILL would) right after DCP writes its shard file."""
    import os

    from torch.distributed.checkpoint import FileSystemWriter

    write = FileSystemWriter.write_data

    def write_then_die(self: Any, plan: Any, planner: Any) -> Any:
        fut = write(self, plan, planner)
        fut.wait()
        os._exit(9)

    FileSystemWriter.write_data = write_then_die  # type: ignore[method-assign]


@pytest.mark.parametrize(("save_world", "resume_world"), [(2, 1), (1, 2)])
def test_dcp_checkpoint_resumes_across_world_sizes(
    tmp_path: Path, save_world: int, resume_world: int
) -> None:
    """Two steps and a checkpoint at one world size, the third step after resuming at the other: the
    same loss and weights as three uninterrupted steps (optimizer moments included: a lost Adam
    state changes step 3's update by far more than the tolerance)."""
    straight = _train(Ranks(), "dense")
    ckpt = str(tmp_path / "ckpt")
    _run(save_world, _resume, "dense", ckpt, 2, 2)
    resumed = _run(resume_world, _resume, "dense", ckpt, 0, 3)
    assert list(resumed["losses"]) == [2]  # only the third step ran after the resume
    assert abs(resumed["losses"][2] - straight["losses"][2]) < LOSS_TOL
    diff_w = max(
        float((straight["weights"][n] - resumed["weights"][n]).abs().max()) for n in straight["weights"]
    )
    assert diff_w < WEIGHT_TOL


def test_trainer_killed_mid_save_resumes_from_the_previous_checkpoint(tmp_path: Path) -> None:
    ckpt = str(tmp_path / "ckpt")
    _run(2, _resume, "dense", ckpt, 1, 1)  # step 1 checkpointed
    with pytest.raises(Exception, match="exit|signal|terminated"):
        _run(2, _resume, "dense", ckpt, 2, 2, True)  # both ranks die while writing step 2
    assert (tmp_path / "ckpt/step-000001/meta.json").is_file()
    assert not (tmp_path / "ckpt/step-000002").exists() and list(
        (tmp_path / "ckpt").glob(".tmp-step-000002-*")
    )
    resumed = _run(1, _resume, "dense", ckpt, 0, 3)
    assert sorted(resumed["losses"]) == [1, 2]  # resumed after step 1
    straight = _train(Ranks(), "dense")
    assert abs(resumed["losses"][2] - straight["losses"][2]) < LOSS_TOL


def _run(world: int, fn: Any, *args: Any) -> Any:
    """``fn`` at ``world`` ranks (world 1 in this process); rank 0's result."""
    return fn(Ranks(), *args) if world == 1 else spawn_ranks(fn, world, *args)[0]


def test_checkpoint_of_another_model_is_a_clear_error(tmp_path: Path) -> None:
    from shipyard.trainer.checkpoint import load_latest_checkpoint, save_checkpoint

    dense = TokenScorer(build_tiny("dense", VOCAB))
    save_checkpoint(tmp_path, 1, dense, make_optimizer(dense, _cfg()), {"step": 1})
    moe = TokenScorer(build_tiny("moe", VOCAB))
    with pytest.raises(ValueError, match=r"checkpoint .*step-000001 does not fit this model"):
        load_latest_checkpoint(tmp_path, moe, make_optimizer(moe, _cfg()))
