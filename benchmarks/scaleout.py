"""Benchmark: the sharded trainer against the one-process trainer, on this machine.

Contract, one run, each figure measured here:
- golden: three :func:`~shipyard.trainer.step.train_step` steps on the same batches at world size 2
  (FSDP2 over gloo, :func:`~shipyard.trainer.distributed.spawn_ranks`) and 1, tiny dense and MoE
  models: ``fsdp_golden_max_abs_loss_diff`` and ``fsdp_golden_max_abs_weight_diff`` (max over both);
- ``dcp_resume_across_world_sizes``: two steps and a DCP checkpoint at world 2, the third step after
  resuming at world 1, and the reverse, each within the golden tolerances of three straight steps;
- ``trainer_tokens_per_s_world1`` / ``_world2``: trained tokens/s of a step on SmolLM2-135M (the
  demo's top 6 blocks, bf16 as ``auto`` resolves here), the same cores either way (world 1: 2
  threads; world 2: 1 thread per rank). On 2 cores the ratio is the overhead of sharding
  (all-gathers, reduce-scatters, a second process), not a speed-up;
- ``ray_multinode_steps``: steps a two-rank trainer ran on a real two-node Ray cluster on loopback
  (:mod:`shipyard.orchestrate.loopback_cluster`), ranks on different nodes (``ray_multinode_nodes``);
- ``sharded_publish_sync_s`` next to ``single_publish_sync_s`` and ``sync_bound_s``: read from
  ``benchmarks/results/weight_sync.json`` (its ``sharded`` and ``ours`` modes, the same regions and
  links), which ``benchmarks/weight_sync.py`` measures (it needs root for its network namespaces).
Writes ``benchmarks/results/scaleout.json``.

Limits: ``--quick`` uses the tiny dense model for throughput and leaves out the Ray cluster
(it takes minutes to start); tolerances are those of ``tests/trainer/test_fsdp.py``.

Usage::

    .venv/bin/python benchmarks/scaleout.py            # ~8 min
    .venv/bin/python benchmarks/scaleout.py --quick    # < 1 min
    python benchmarks/scaleout.py --device cuda --model-dir .gpu/smollm2-1.7b   # the RL step on the GPU(s)
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import RESULTS, parser, table, write_results  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
VOCAB = 512
LOSS_TOL, WEIGHT_TOL = 1e-5, 1e-5


def _batch(step: int, vocab: int, lengths: tuple[int, ...]) -> tuple[list[Any], list[float]]:
    import torch

    from shipyard.agent.types import Trajectory

    gen = torch.Generator().manual_seed(100 + step)
    trajs, advs = [], []
    for i, length in enumerate(lengths):
        ids = torch.randint(3, vocab, (length,), generator=gen).tolist()
        mask = [0] * 3 + [1] * (length - 3)
        logprobs = [(-2.0 + 0.3 * float(torch.randn(1, generator=gen))) if m else 0.0 for m in mask]
        trajs.append(
            Trajectory(
                "t", f"g{i // 2}", i, ids, mask, logprobs, [0 if m else -1 for m in mask], prompt_len=3
            )
        )
        advs.append((1.0, -0.5, 0.0, 0.75, -1.0, 0.5, -0.25, 0.25)[i % 8])
    return trajs, advs


def _policy(ranks: Any, kind: str, ckpt: str | None) -> tuple[Any, Any, Any, int]:
    """(scorer, optimizer, trainer config, first step) for a golden run, resumed from ``ckpt`` if any."""
    from shipyard.config.schema import FsdpConfig, LossConfig, TrainerConfig
    from shipyard.models.loading import build_tiny
    from shipyard.trainer.checkpoint import load_latest_checkpoint
    from shipyard.trainer.distributed import shard_policy
    from shipyard.trainer.logprobs import TokenScorer
    from shipyard.trainer.step import make_optimizer

    cfg = TrainerConfig(lr=1e-3, micro_batch=2, loss=LossConfig(type="grpo", correction="tis"))
    scorer = TokenScorer(build_tiny(kind, VOCAB, seed=0).train())
    if ranks.world > 1:
        shard_policy(scorer, FsdpConfig(), bf16=False)
    opt = make_optimizer(scorer, cfg)
    state = load_latest_checkpoint(Path(ckpt), scorer, opt, ranks) if ckpt else None
    return scorer, opt, cfg, (state or {"step": 0})["step"]


def golden_rank(ranks: Any, kind: str, ckpt: str | None = None, save_after: int = 0, steps: int = 3) -> dict:
    """Steps up to ``steps`` (after resuming from ``ckpt``), checkpointing after ``save_after``; the
    losses by step and the final full weights."""
    from shipyard.trainer.checkpoint import save_checkpoint
    from shipyard.trainer.distributed import full_params
    from shipyard.trainer.step import train_step

    scorer, opt, cfg, first = _policy(ranks, kind, ckpt)
    losses = {}
    for step in range(first, steps):
        trajs, advs = _batch(step, VOCAB, (23, 9, 31, 14, 6))
        losses[step] = train_step(scorer, opt, trajs, advs, cfg, 2, ranks=ranks)["loss"]
        if ckpt and step + 1 == save_after:
            save_checkpoint(Path(ckpt), step + 1, scorer, opt, {"step": step + 1}, keep=3, ranks=ranks)
    return {"losses": losses, "weights": full_params(scorer, "model.")}


def _at(world: int, fn: Any, *args: Any, device: str = "cpu") -> dict:
    from shipyard.trainer.distributed import ONE_PROCESS, spawn_ranks

    return fn(ONE_PROCESS, *args) if world == 1 else spawn_ranks(fn, world, *args, device=device)[0]


def _diffs(a: dict, b: dict) -> tuple[float, float]:
    loss = max(abs(a["losses"][s] - b["losses"][s]) for s in b["losses"])
    weight = max(float((a["weights"][n] - b["weights"][n]).abs().max()) for n in a["weights"])
    return loss, weight


def golden() -> dict[str, Any]:
    out: dict[str, Any] = {}
    for kind in ("dense", "moe"):
        out[kind] = _diffs(_at(1, golden_rank, kind), _at(2, golden_rank, kind))
    straight = _at(1, golden_rank, "dense")
    resumes = {}
    for save_world, resume_world in ((2, 1), (1, 2)):
        with tempfile.TemporaryDirectory() as ckpt:
            _at(save_world, golden_rank, "dense", ckpt, 2, 2)
            resumes[f"{save_world}->{resume_world}"] = _diffs(
                straight, _at(resume_world, golden_rank, "dense", ckpt)
            )
    return {
        "fsdp_golden_max_abs_loss_diff": max(d[0] for d in out.values()),
        "fsdp_golden_max_abs_weight_diff": max(d[1] for d in out.values()),
        "golden_by_model": {k: {"loss": d[0], "weight": d[1]} for k, d in out.items()},
        "dcp_resume_across_world_sizes": all(d[0] < LOSS_TOL and d[1] < WEIGHT_TOL for d in resumes.values()),
        "dcp_resume_diffs": {k: {"loss": d[0], "weight": d[1]} for k, d in resumes.items()},
    }


def throughput_rank(ranks: Any, model: dict, threads: int, device: str = "cpu", steps: int = 4) -> dict:
    """Trained tokens/s of train_step at this world size on ``device`` for the model of the
    ``ModelConfig`` fields ``model`` (median of the steps after the first)."""
    import torch

    from shipyard.config.schema import FsdpConfig, ModelConfig, TrainerConfig
    from shipyard.models.hardware import resolve_bf16
    from shipyard.models.loading import load_model
    from shipyard.trainer.distributed import shard_policy
    from shipyard.trainer.logprobs import TokenScorer
    from shipyard.trainer.step import freeze_lower_layers, make_optimizer, train_step

    torch.set_num_threads(threads)
    quick, on_gpu = model.get("source") == "tiny", device == "cuda"
    model, tok = load_model(ModelConfig(**model))
    model = model.to(device)
    bf16 = resolve_bf16("auto", device, "trainer.bf16_decoder")[0]
    layers = 0 if quick or on_gpu else 6  # a GPU trains every block; the CPU the demo's top 6
    cfg = TrainerConfig(lr=1e-6, micro_batch=4 if on_gpu else 2, train_layers=layers, bf16_decoder=bf16)
    freeze_lower_layers(model.train(), cfg.train_layers)
    scorer = TokenScorer(model)
    if ranks.world > 1:
        shard_policy(scorer, FsdpConfig(), bf16=bf16)
    opt = make_optimizer(scorer, cfg)
    lengths = (128,) * 8 if quick else (2048,) * 16 if on_gpu else (384,) * 8
    times = []
    for step in range(steps):
        trajs, advs = _batch(step, len(tok), lengths)
        t0 = time.perf_counter()
        train_step(scorer, opt, trajs, advs, cfg, tok.pad_token_id, ranks=ranks)
        times.append(time.perf_counter() - t0)
    tokens = sum(lengths) - 3 * len(lengths)
    out = {"tokens_per_s": tokens / statistics.median(times[1:]), "step_s": times, "bf16": bf16}
    if on_gpu:
        from shipyard.trainer.midtrain import PEAK_BF16_FLOPS, flops_per_token

        name = torch.cuda.get_device_name()
        peak = next((v for k, v in PEAK_BF16_FLOPS.items() if k in name), None)
        per_token = flops_per_token(model, lengths[0])
        out |= {"flops_per_token": per_token, "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30}
        out["mfu"] = out["tokens_per_s"] * per_token / peak if peak else None
    return out


def multinode(work: Path) -> dict[str, Any]:
    """A two-rank trainer on a head + worker loopback cluster (tiny model, 3 steps)."""
    import os

    from shipyard.metrics.logger import read_metrics
    from shipyard.orchestrate.loopback_cluster import loopback_cluster

    with loopback_cluster(workers=1, log_dir=work / "ray") as cluster:
        overrides = [
            "run.placement=ray",
            f'run.ray_address="{cluster.address}"',
            f'run.output_dir="{work}"',
            f'store.root="{work / "store"}"',
            "trainer.steps=3",
            "trainer.world_size=2",
            'trainer.placement_strategy="STRICT_SPREAD"',
        ]
        shipyard = str(Path(sys.executable).with_name("shipyard"))
        run = subprocess.run(
            [shipyard, "train", str(ROOT / "configs/tiny.toml"), *overrides],
            env={**os.environ, **cluster.env},
            capture_output=True,
            text=True,
            timeout=900,
        )
    if run.returncode != 0:
        raise RuntimeError(run.stdout[-2000:] + run.stderr[-2000:])
    summary = json.loads((work / "tiny/summary.json").read_text())
    steps = [r for r in read_metrics(work / "tiny/metrics.jsonl") if r.get("kind") == "train"]
    return {"ray_multinode_steps": len(steps), "ray_multinode_nodes": len(set(summary["trainer"]["nodes"]))}


def sharded_publish() -> dict[str, Any]:
    path = RESULTS / "weight_sync.json"
    if not path.is_file():
        return {"sharded_publish_sync_s": None, "sharded_publish_note": "run benchmarks/weight_sync.py first"}
    ws = json.loads(path.read_text())
    return {
        "sharded_publish_sync_s": ws.get("sharded_publish_sync_s"),
        "single_publish_sync_s": ws["sync_s"],
        "sync_bound_s": ws["bound_s"],
        "sharded_publish_s": ws.get("sharded_publish_s"),
        "single_publish_s": ws.get("single_publish_s"),
        "publish_ranks": ws.get("publish_ranks"),
        "weight_sync_date": ws.get("machine", {}).get("date")
        if isinstance(ws.get("machine"), dict)
        else None,
    }


def gpu(args: Any) -> None:
    """``--device cuda``: the RL trainer's step on the GPUs here (world 1, and world 2 over NCCL
    when there are two); writes ``scaleout_gpu.json``."""
    import torch

    count = torch.cuda.device_count()
    results: dict[str, Any] = {"gpus": count, "gpu": torch.cuda.get_device_name()}
    model = (
        {"source": "tiny"}
        if args.quick
        else {"source": "hf", "path": str(args.model_dir), "random_init": True}
    )
    w1 = _at(1, throughput_rank, model, 8, "cuda")
    results |= {
        "trainer_tokens_per_s_gpu_world1": w1["tokens_per_s"],
        "trainer_mfu_gpu_world1": w1.get("mfu"),
        "mfu_formula": "tokens/s x (6N + 12 L d T) / dense bf16 peak (H100/H200: 989.4 TFLOP/s)",
        "step_s": w1["step_s"],
        "peak_memory_gib": w1.get("peak_memory_gib"),
        "sequences_per_step": 16,
        "tokens_per_sequence": 2048,
    }
    if count >= 2:
        w2 = _at(2, throughput_rank, model, 8, "cuda", device="cuda")
        results["trainer_tokens_per_s_gpu_world2"] = w2["tokens_per_s"]
    table("scale-out on GPU", {k: {"value": v} for k, v in results.items()})
    write_results(args, "scaleout_gpu", results)


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="cuda: the GPU figures only")
    p.add_argument(
        "--model-dir", type=Path, default=Path(".gpu/smollm2-1.7b"), help="cuda: config + tokenizer"
    )
    args = p.parse_args()
    if args.device == "cuda":
        return gpu(args)
    results: dict[str, Any] = {**golden()}
    model = {"source": "tiny"} if args.quick else {"source": "smollm2"}
    w1 = _at(1, throughput_rank, model, 2)
    w2 = _at(2, throughput_rank, model, 1)
    results.update(
        trainer_tokens_per_s_world1=w1["tokens_per_s"],
        trainer_tokens_per_s_world2=w2["tokens_per_s"],
        trainer_world2_over_world1=w2["tokens_per_s"] / w1["tokens_per_s"],
        trainer_bf16=w1["bf16"],
    )
    if not args.quick:
        with tempfile.TemporaryDirectory() as work:
            results.update(multinode(Path(work)))
    results.update(sharded_publish())
    rows = {k: {"value": v} for k, v in results.items() if not isinstance(v, dict)}
    table("scale-out", rows)
    write_results(args, "scaleout", results)


if __name__ == "__main__":
    main()
