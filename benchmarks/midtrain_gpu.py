"""Benchmark: mid-training on one GPU in bf16 and in FP8, the same steps on the same data.

Contract: builds the code corpus from the machine's own Python sources (``shipyard.trainer.corpus``,
as ``shipyard midtrain`` does), then runs :func:`shipyard.trainer.midtrain.midtrain_rank` once per
variant (``bf16``: bf16 autocast; ``fp8``: the decoder blocks' linears as torchao ``Float8Linear``
with dynamic tensor-wise scales, under the same autocast), each from the same seeded random
initialisation, with the same schedule and data order, optionally ``torch.compile``-d per block.
Per variant: tokens/s (median of the steps after the first ``warmup`` ones), MFU against the GPU's
dense bf16 peak (``6·N + 12·L·d·T`` FLOPs a token, :func:`~shipyard.trainer.midtrain.flops_per_token`),
peak GPU memory, the loss curve and the held-out loss before and after. Writes
``benchmarks/results/midtrain_gpu.json`` (``bf16_tokens_per_s``, ``fp8_tokens_per_s``, ``bf16_mfu``,
``fp8_mfu``, ``fp8_speedup``, ``max_abs_loss_gap`` between the curves, ``final_heldout_loss_*``)
and ``midtrain_gpu_loss.png``. The scorer's LM head is fp32 (as in the RL trainer); by default it
runs on TF32 tensor cores (``midtrain.tf32``), ``--no-tf32`` in full fp32.

Limits: one GPU, so one rank (FSDP's sharding is a no-op at world size 1); the weights of the model
do not travel to the GPU machine, so the model is the architecture of ``--model-dir`` with random
weights (``model.random_init``): the loss curves are those of training from scratch on code.
``--quick``: the tiny dense model on the CPU, a few steps, bf16 only (a smoke test, seconds).

Usage::

    python benchmarks/midtrain_gpu.py --model-dir .gpu/smollm2-1.7b --compile   # on a GPU machine
    python benchmarks/midtrain_gpu.py --model-dir .gpu/smollm2-1.7b --compile --no-tf32  # full-fp32 head
    python benchmarks/midtrain_gpu.py --quick
"""

from __future__ import annotations

import json
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import console, parser, table, write_results  # noqa: E402


def _cfg(args: Any, variant: str, work: Path) -> Any:
    from shipyard.config.schema import ShipyardConfig

    quick = args.quick
    model = (
        {"source": "tiny"} if quick else {"source": "hf", "path": str(args.model_dir), "random_init": True}
    )
    return ShipyardConfig.model_validate(
        {
            "run": {"seed": 0, "results_dir": str(work / "results")},
            "model": model,
            "trainer": {
                "device": "cpu" if quick else "cuda",
                "bf16_decoder": not quick,
                "threads": 2 if quick else 8,
            },
            "midtrain": {
                "max_files": 300 if quick else args.max_files,
                "seq_len": 128 if quick else args.seq_len,
                "batch_seqs": 4 if quick else args.batch,
                "micro_batch": 2 if quick else args.micro,
                "steps": 4 if quick else args.steps,
                "lr": 1e-3 if quick else args.lr,
                "warmup_steps": 1 if quick else max(args.steps // 10, 1),
                "heldout_seqs": 4 if quick else 32,
                "eval_every": 1000,
                "checkpoint_every": 1000,
                "fp8": variant == "fp8",
                "compile": args.compile and not quick,
                "tf32": args.tf32,
                "output_dir": str(work / variant),
            },
        }
    )


def _run(args: Any, variant: str, work: Path) -> dict[str, Any]:
    import torch

    from shipyard.metrics.logger import read_metrics
    from shipyard.trainer.distributed import ONE_PROCESS
    from shipyard.trainer.midtrain import midtrain_rank

    cfg = _cfg(args, variant, work)
    if cfg.trainer.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    report = midtrain_rank(ONE_PROCESS, cfg)
    steps = [r for r in read_metrics(work / variant / "metrics.jsonl") if r["step"] > 0]
    timed = steps[args.warmup :] or steps
    out = {
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in timed),
        "mfu": statistics.median(r["mfu"] for r in timed) if "mfu" in timed[0] else None,
        "loss_curve": [r["loss"] for r in steps],
        "heldout_before": report["heldout_code_loss_before"],
        "heldout_after": report["heldout_code_loss_after"],
        "seconds": time.perf_counter() - t0,
        "first_step_s": steps[0]["step_s"],
    }
    if cfg.trainer.device == "cuda":
        out["peak_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30
    return out


def _plot(results: dict[str, dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, r in results.items():
        ax.plot(range(1, len(r["loss_curve"]) + 1), r["loss_curve"], label=name)
    ax.set(xlabel="step", ylabel="train loss (next-token NLL)", title="mid-training: bf16 vs FP8")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--model-dir", type=Path, default=Path(".gpu/smollm2-1.7b"))
    p.add_argument("--variants", default="bf16,fp8")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--micro", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--max-files", type=int, default=2000)
    p.add_argument("--warmup", type=int, default=5, help="steps left out of the timing (compile, warm-up)")
    p.add_argument("--compile", action="store_true")
    p.add_argument(
        "--no-tf32",
        dest="tf32",
        action="store_false",
        help="fp32 matmuls (the scorer's fp32 LM head) in full fp32",
    )
    p.add_argument("--work", type=Path, default=Path("/tmp/midtrain_gpu"))
    args = p.parse_args()
    variants = ["bf16"] if args.quick else args.variants.split(",")
    results: dict[str, dict[str, Any]] = {}
    failed: dict[str, str] = {}
    args.out.mkdir(parents=True, exist_ok=True)
    for i, v in enumerate(variants):
        if i:  # one corpus for all variants: the first one's, reused (its record matches)
            shutil.copytree(args.work / variants[0] / "corpus", args.work / v / "corpus", dirs_exist_ok=True)
        try:
            results[v] = _run(args, v, args.work)
        except Exception as e:  # a variant this GPU or torch cannot run is recorded, the others go on
            console.print_exception()
            failed[v] = f"{type(e).__name__}: {e}"
            continue
        (args.out / f"midtrain_gpu_{v}.partial.json").write_text(
            json.dumps(results[v])
        )  # survives a later crash
    table(
        "mid-training on one device",
        {k: {c: v for c, v in r.items() if c != "loss_curve"} for k, r in results.items()},
    )
    summary: dict[str, Any] = {
        "variants": results,
        "failed": failed,
        "model_dir": str(args.model_dir),
        "steps": args.steps,
        "seq_len": args.seq_len,
        "batch": args.batch,
        "compile": args.compile,
        "tf32": args.tf32,
    }
    for v, r in results.items():
        summary[f"{v}_tokens_per_s"] = r["tokens_per_s"]
        summary[f"{v}_mfu"] = r["mfu"]
        summary[f"final_heldout_loss_{v}"] = r["heldout_after"]
    if "bf16" in results and "fp8" in results:
        a, b = results["bf16"]["loss_curve"], results["fp8"]["loss_curve"]
        summary["fp8_speedup"] = results["fp8"]["tokens_per_s"] / results["bf16"]["tokens_per_s"]
        summary["max_abs_loss_gap"] = max(abs(x - y) for x, y in zip(a, b, strict=True))
        summary["last10_mean_loss_gap"] = statistics.mean(
            y - x for x, y in zip(a[-10:], b[-10:], strict=True)
        )
    _plot(results, args.out / ("midtrain_gpu_loss_quick.png" if args.quick else "midtrain_gpu_loss.png"))
    write_results(args, "midtrain_gpu", summary)


if __name__ == "__main__":
    main()
