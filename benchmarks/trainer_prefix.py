"""Benchmark: a demo trainer step with every row forwarded whole against its group's prompt shared.

Contract: the demo's policy and trainer settings (``configs/demo.toml``: SmolLM2-135M, top 6 of
30 blocks trained, bf16 autocast where the CPU has bf16 units, ``micro_batch`` 4; the tiny dense
model with ``--quick``) take ``--steps`` steps, each from the same starting weights and optimizer
state, once with ``trainer.share_prefix = false`` (every row whole, micro-batches longest first)
and once with it on (:mod:`shipyard.trainer.microbatch`), alternating. The batches are a stored
run's rollouts (``--rollouts RUN_DIR``: the ``runs/store/<name>`` of a demo run, one file a step,
advantages as the trainer computes them) or, by default, synthetic steps shaped like the demo's:
2 groups of 8 sessions, a 136-token prompt (81 tokens of it the same for every group), 70% of the
sessions one turn of 12-40 sampled tokens, the rest two turns (a masked 60-token tool output, then
up to 280 more). Prints a table and writes ``benchmarks/results/trainer_prefix.json``:
``baseline_s_per_step``, ``shared_s_per_step``, ``speedup``, the decoder's forwarded tokens of each
(``*_tokens_per_step``), and what must not change: the trainer logprobs before the update
(``max_abs_logprob_diff``, ``mean_abs_logprob_diff`` between the two; each one's
``mean_abs_logprob_err_*`` against the same step run without bf16 autocast and unshared, since
bf16 rounds the two paths differently but must not round one worse), ``max_rel_loss_diff`` and
``max_rel_grad_norm_diff``.

Limits: one process, ``--threads`` threads; the step only (no feed, publishing or checkpoint).

    .venv/bin/python benchmarks/trainer_prefix.py                       # synthetic, SmolLM2-135M
    .venv/bin/python benchmarks/trainer_prefix.py --rollouts runs/store/demo
    .venv/bin/python benchmarks/trainer_prefix.py --quick               # tiny model, seconds
"""

from __future__ import annotations

import copy
import random
import sys
import time
from pathlib import Path
from typing import Any

import harness

ROOT = Path(__file__).resolve().parents[1]
MODES = {"baseline": False, "shared": True}


def synthetic_steps(steps: int, vocab: int, seed: int = 0) -> list[tuple[list[Any], list[float]]]:
    """Demo-shaped batches (module doc) of random tokens, with advantages of both signs."""
    from shipyard.agent.types import Trajectory

    rng = random.Random(seed)
    system = [rng.randrange(3, vocab) for _ in range(81)]
    out = []
    for _ in range(steps):
        trajs, advs = [], []
        for g in range(2):
            prompt = system + [rng.randrange(3, vocab) for _ in range(55)]
            for i in range(8):
                own = [rng.randrange(3, vocab) for _ in range(rng.randint(12, 40))]
                mask = [0] * len(prompt) + [1] * len(own)
                if rng.random() < 0.3:
                    more = [rng.randrange(3, vocab) for _ in range(rng.randint(60, 280))]
                    own, mask = own + more, mask + [0] * 60 + [1] * (len(more) - 60)
                ids = prompt + own
                logprobs = [-1.0 if m else 0.0 for m in mask]
                versions = [0 if m else -1 for m in mask]
                trajs.append(
                    Trajectory("t", f"s{len(out)}g{g}", i, ids, mask, logprobs, versions, len(prompt))
                )
                advs.append(rng.choice((-1.0, -0.5, 0.5, 1.0)))
        out.append((trajs, advs))
    return out


def stored_steps(run_dir: Path, steps: int, cfg: Any) -> list[tuple[list[Any], list[float]]]:
    """The first ``steps`` rollout files of a stored run, with the trainer's advantages."""
    from shipyard.rollout.types import RolloutBatch
    from shipyard.trainer.advantages import batch_advantages

    files = sorted(run_dir.glob("rollouts/*/*.json.gz"))
    if not files:
        raise ValueError(f"--rollouts {run_dir}: no rollouts/*/*.json.gz (give a runs/store/<name> dir)")
    out = []
    for f in files[:steps]:
        batch = RolloutBatch.from_bytes(f.read_bytes())
        taken = batch_advantages(list(batch.groups().values()), cfg.trainer.loss)
        out.append((taken.trajectories, taken.advantages))
    return out


def run(policy: Any, tcfg: Any, batches: list, pad_id: int) -> dict[str, dict[str, Any]]:
    """Every step in both modes and the fp32 reference, from the same state (module doc)."""
    from rich.progress import Progress

    state = (copy.deepcopy(policy.scorer.state_dict()), copy.deepcopy(policy.optimizer.state_dict()))
    modes = {**MODES, "fp32": False}
    rows: dict[str, dict[str, Any]] = {
        m: {"s": [], "tokens": [], "loss": [], "norm": [], "lp": []} for m in modes
    }
    with Progress(console=harness.console) as bar:
        task = bar.add_task("trainer steps", total=len(batches) * len(modes))
        for trajs, advs in batches:
            for mode, share in modes.items():
                policy.scorer.load_state_dict(state[0])
                policy.optimizer.load_state_dict(state[1])
                update = {"share_prefix": share} | ({"bf16_decoder": False} if mode == "fp32" else {})
                _one_step(policy, tcfg.model_copy(update=update), trajs, advs, pad_id, rows[mode])
                bar.advance(task)
    return rows


def _one_step(
    policy: Any, cfg: Any, trajs: list, advs: list[float], pad_id: int, row: dict[str, Any]
) -> None:
    from shipyard.trainer.microbatch import forwarded_tokens, plan_micro_batches
    from shipyard.trainer.step import train_step

    plan = plan_micro_batches(trajs, 1, 0, cfg.micro_batch, cfg.share_prefix)
    lps: dict[str, list[float]] = {}
    t0 = time.perf_counter()
    stats = train_step(policy.scorer, policy.optimizer, trajs, advs, cfg, pad_id, trainer_logprobs=lps)
    row["s"].append(time.perf_counter() - t0)
    row["tokens"].append(
        sum(forwarded_tokens([trajs[i].token_ids for i in mb.indices], cfg.share_prefix) for mb in plan)
    )
    row["loss"].append(stats["loss"])
    row["norm"].append(stats["grad_norm"])
    row["lp"].append(lps)


def _logprob_diffs(a: list[dict[str, list[float]]], b: list[dict[str, list[float]]]) -> list[float]:
    return [abs(x - y) for p, q in zip(a, b, strict=True) for k in p for x, y in zip(p[k], q[k], strict=True)]


def summary(rows: dict[str, dict[str, Any]], skip: int) -> dict[str, Any]:
    """Means over the steps after the first ``skip`` (warm-up) and the agreement of the two modes."""
    base, ours, exact = rows["baseline"], rows["shared"], rows["fp32"]

    def mean(xs: list[float]) -> float:
        return sum(xs[skip:]) / len(xs[skip:])

    def rel(a: list[float], b: list[float]) -> float:
        return max(abs(x - y) / max(abs(x), 1e-12) for x, y in zip(a, b, strict=True))

    between = _logprob_diffs(base["lp"], ours["lp"])
    err_base, err_ours = _logprob_diffs(exact["lp"], base["lp"]), _logprob_diffs(exact["lp"], ours["lp"])
    return {
        "steps_timed": len(base["s"]) - skip,
        "baseline_s_per_step": mean(base["s"]),
        "shared_s_per_step": mean(ours["s"]),
        "speedup": mean(base["s"]) / mean(ours["s"]),
        "baseline_tokens_per_step": mean(base["tokens"]),
        "shared_tokens_per_step": mean(ours["tokens"]),
        "max_abs_logprob_diff": max(between),
        "mean_abs_logprob_diff": sum(between) / len(between),
        "mean_abs_logprob_err_baseline": sum(err_base) / len(err_base),
        "mean_abs_logprob_err_shared": sum(err_ours) / len(err_ours),
        "max_rel_loss_diff": rel(base["loss"], ours["loss"]),
        "max_rel_grad_norm_diff": rel(base["norm"], ours["norm"]),
    }


def main() -> int:
    p = harness.parser(__doc__)
    p.add_argument("--steps", type=int, default=6, help="steps timed in each mode (plus one warm-up)")
    p.add_argument("--rollouts", type=Path, default=None, help="a stored run dir: runs/store/<name>")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    import torch

    from shipyard.config.load import load_config
    from shipyard.trainer.distributed import ONE_PROCESS
    from shipyard.trainer.loop import build_policy

    overrides = [f"trainer.threads={args.threads}"] + (
        ["model.source=tiny", "trainer.train_layers=1"] if args.quick else []
    )
    cfg = load_config(str(ROOT / "configs" / "demo.toml"), overrides)
    policy = build_policy(cfg, ONE_PROCESS)
    steps = 2 if args.quick else args.steps + 1
    vocab = policy.model.get_input_embeddings().num_embeddings
    batches = stored_steps(args.rollouts, steps, cfg) if args.rollouts else synthetic_steps(steps, vocab)
    torch.manual_seed(0)
    rows = run(policy, policy.tcfg, batches, policy.tok.pad_token_id or 0)
    figures = summary(rows, skip=1)
    figures["data"] = str(args.rollouts) if args.rollouts else "synthetic"
    harness.table(
        "trainer step: rows whole vs group prompt shared",
        {
            m: {"s/step": figures[f"{m}_s_per_step"], "tokens/step": figures[f"{m}_tokens_per_step"]}
            for m in MODES
        },
    )
    harness.console.print({k: v for k, v in figures.items() if "diff" in k or "err" in k or k == "speedup"})
    harness.write_results(args, "trainer_prefix", figures)
    return 0


if __name__ == "__main__":
    sys.exit(main())
