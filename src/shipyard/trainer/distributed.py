"""The trainer as a group of ranks: process group, FSDP2-sharded policy, a step's batch split.

Contract:
- :class:`Ranks` is this process's place in the trainer group (``rank``, ``world``). With world 1
  every collective is the identity and nothing touches ``torch.distributed``, so the one-process
  trainer runs the very same code path.
- :func:`join_group` initialises ``torch.distributed`` (gloo on CPU, NCCL on CUDA) from the
  ``tcp://`` address rank 0 chose (:func:`free_address`).
- :func:`shard_policy` applies ``fully_shard`` to every decoder block, then to the
  :class:`~shipyard.trainer.logprobs.TokenScorer` around the model (the root: embeddings, final
  norm, LM head). The gradient divide factor is 1: each rank's loss is already divided by the
  whole step's denominators (:class:`~shipyard.trainer.loss.StepNorm`), so the sum of the ranks'
  gradients is the one-process gradient.
- :func:`~shipyard.trainer.microbatch.plan_micro_batches` deals a step's trajectories to ranks
  (balanced by tokens, the same on every rank) and gives each rank the same number of
  micro-batches (a rank with fewer runs zero-weight filler ones), so FSDP's collectives line up.
- :func:`full_params` gathers every parameter whole (a collective), as CPU tensors named as in
  the unwrapped model: what a published version holds. :func:`rank_tensors` splits them into the
  share each rank encodes and uploads (sharded publishing; rank 0 writes the one manifest).
Limits: data parallel only (one mesh dimension; no tensor, pipeline or expert parallelism); the KL
reference model is a full unsharded copy on every rank; cross-node runs need the checkpoint
directory on a file system every rank sees.

Shape legend: none; this module moves whole modules, lists and state dicts.
"""

from __future__ import annotations

import os
import socket
import sys
from dataclasses import dataclass
from typing import Any

import torch

from shipyard.config.schema import FsdpConfig
from shipyard.models.router_replay import RouterSeam
from shipyard.trainer.mismatch import MismatchAccumulator


@dataclass(frozen=True)
class Ranks:
    """This process's rank in a trainer group of ``world`` processes (rank 0 leads: it reads the
    feed, publishes, logs and commits checkpoints)."""

    rank: int = 0
    world: int = 1

    @property
    def leader(self) -> bool:
        return self.rank == 0

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank (pickled); the identity at world 1."""
        if self.world == 1:
            return obj
        box = [obj]
        torch.distributed.broadcast_object_list(box, src=0)
        return box[0]

    def gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` in rank order, on rank 0 (other ranks get an empty list)."""
        if self.world == 1:
            return [obj]
        out: list[Any] | None = [None] * self.world if self.leader else None
        torch.distributed.gather_object(obj, out, dst=0)
        return out or []

    def sum(self, values: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Element-wise sums over ranks of same-keyed scalar tensors (every rank gets them)."""
        if self.world == 1 or not values:
            return values
        keys = sorted(values)
        flat = torch.stack([values[k].detach().double().reshape(()).cpu() for k in keys])
        flat = flat.to(_comm_device())
        torch.distributed.all_reduce(flat)
        return dict(zip(keys, flat.cpu().unbind(), strict=True))

    def barrier(self) -> None:
        if self.world > 1:
            torch.distributed.barrier()


ONE_PROCESS = Ranks()
"""The one-process trainer (rank 0 of 1): every collective is the identity."""


def _comm_device() -> torch.device:
    """Where collective tensors live: the current GPU under NCCL, else the CPU."""
    if torch.distributed.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def free_address(host: str) -> str:
    """``tcp://host:port`` with a port free on ``host`` now (rank 0 binds it in :func:`join_group`)."""
    with socket.socket() as s:
        s.bind((host, 0))
        port = s.getsockname()[1]
    return f"tcp://{host}:{port}"


def join_group(rank: int, world: int, address: str, device: str, timeout_s: float = 600.0) -> Ranks:
    """Join the trainer's process group; returns this rank. ``device`` ``cuda`` uses NCCL and one GPU
    per rank (under Ray the one it was given; in local processes GPU ``rank``)."""
    import datetime

    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"rank {rank} is not in a trainer group of world size {world}")
    if world == 1:
        return Ranks()
    backend = "nccl" if device == "cuda" else "gloo"
    if device == "cuda":  # Ray shows each rank its own GPU as device 0; local spawns see them all
        torch.cuda.set_device(rank % torch.cuda.device_count())
    torch.distributed.init_process_group(
        backend,
        init_method=address,
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    return Ranks(rank, world)


def decoder_blocks(model: Any) -> list[torch.nn.Module]:
    """The decoder blocks of an HF causal LM (``model.<base_model_prefix>.layers``)."""
    base = getattr(model, getattr(model, "base_model_prefix", ""), None)
    layers = getattr(base, "layers", None)
    if layers is None:
        raise ValueError("trainer.world_size > 1 needs a model with decoder blocks at model.<prefix>.layers")
    return list(layers)


def shard_policy(scorer: torch.nn.Module, cfg: FsdpConfig, bf16: bool) -> torch.nn.Module:
    """Shard ``scorer`` (a TokenScorer) in place with FSDP2 (module doc); returns it.

    Blocks gather their parameters in bf16 when ``bf16`` (the trainer's ``bf16_decoder``) and reduce
    gradients in fp32; the root (embeddings, final norm, LM head) stays fp32, as the one-process
    trainer's head does."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    offload = CPUOffloadPolicy() if cfg.cpu_offload else OffloadPolicy()
    block_mp = MixedPrecisionPolicy(
        param_dtype=torch.bfloat16 if bf16 else None, reduce_dtype=torch.float32, cast_forward_inputs=False
    )
    model = scorer.model
    if cfg.activation_checkpointing:
        _checkpoint_blocks(model)
    for block in decoder_blocks(model):
        fully_shard(
            block, reshard_after_forward=cfg.reshard_after_forward, mp_policy=block_mp, offload_policy=offload
        )
    fully_shard(scorer, offload_policy=offload)
    for module in scorer.modules():
        if hasattr(module, "set_gradient_divide_factor"):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)  # a plain SUM (gloo has no PREMUL_SUM)
    return scorer


def _checkpoint_blocks(model: Any) -> None:
    """Recompute each block in the backward (non-reentrant). The method was renamed in transformers
    5.24 (the old name warns); older releases, such as the GPU image's, have only the old one."""
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def rank_tensors(tensors: dict[str, torch.Tensor], world: int) -> list[list[str]]:
    """The names of the tensors each rank encodes and publishes: largest first, each to the rank
    with the fewest bytes so far (ties to the lower rank). Depends only on names and sizes, so it
    is the same on every rank and for every version (each rank's delta parent stays its own)."""
    loads = [0] * world
    owned: list[list[str]] = [[] for _ in range(world)]
    for name in sorted(tensors, key=lambda n: (-tensors[n].numel() * tensors[n].element_size(), n)):
        r = min(range(world), key=lambda k: (loads[k], k))
        owned[r].append(name)
        loads[r] += tensors[name].numel() * tensors[name].element_size()
    return owned


def merge_rank_metrics(ranks: Ranks, mismatch: MismatchAccumulator, seam: RouterSeam | None) -> None:
    """Gather every rank's mismatch tokens and routing counts into rank 0's accumulators (a
    collective; a no-op at world 1), so rank 0's metrics are the whole step's."""
    if ranks.world == 1:
        return
    states = ranks.gather((mismatch.state(), seam.disagreement_state() if seam is not None else None))
    for other, route_state in states[1:]:
        mismatch.absorb(other)
        if seam is not None:
            seam.absorb(route_state)


def full_params(model: torch.nn.Module, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every parameter whole, detached, on the CPU, named as in ``model`` without ``prefix`` (a
    collective when sharded: every rank must call it; every rank gets the tensors)."""
    from torch.distributed.tensor import DTensor

    out = {}
    for name, p in model.named_parameters():
        full = p.full_tensor() if isinstance(p, DTensor) else p
        out[name.removeprefix(prefix)] = full.detach().cpu()
    return out


def spawn_ranks(fn: Any, world: int, *args: Any, device: str = "cpu", threads: int = 1) -> list[Any]:
    """Run ``fn(ranks, *args)`` in ``world`` fresh local processes joined as one trainer group;
    every rank's return value, in rank order. For tests, benchmarks and one-machine jobs; a run
    places its ranks with Ray instead (:mod:`shipyard.orchestrate.ray_placement`). ``fn`` must be
    importable (a module-level function) and its result picklable."""
    import tempfile

    import torch.multiprocessing as mp

    address = free_address("127.0.0.1")
    with tempfile.TemporaryDirectory(prefix="shipyard-ranks-") as tmp:
        mp.start_processes(
            _spawned,
            args=(fn, world, address, device, threads, tmp, args),
            nprocs=world,
            start_method="spawn",
        )
        return [torch.load(f"{tmp}/rank-{r}.pt", weights_only=False) for r in range(world)]


def _spawned(
    rank: int, fn: Any, world: int, address: str, device: str, threads: int, out_dir: str, args: tuple
) -> None:
    torch.set_num_threads(threads)
    ranks = join_group(rank, world, address, device)
    torch.save(fn(ranks, *args), f"{out_dir}/rank-{rank}.pt")
    if world > 1:  # no rank tears its group down while another is still in a collective
        ranks.barrier()
        torch.distributed.destroy_process_group()
    # The result is on disk and the group is gone: leave without interpreter teardown. Once in about 40
    # runs of tests/trainer/test_fsdp.py a rank died at the end with SIGABRT ("terminate called without
    # an active exception", a C++ thread object destroyed while still joinable), which failed a run
    # whose work was complete.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
