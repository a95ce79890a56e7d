"""Verified rollouts against adversarial nodes: who is caught, at what spot-check fraction, at what cost.

Eight nodes play real agent sessions on the run's training tasks (the demo's model and tasks; one
turn of at most 48 tokens, so a batch costs seconds) and submit batches of 2 groups x 4 sessions,
as rollout workers do. Version 0 of the model is published to a local store, as the trainer does.
Four nodes are honest (``h0`` is trusted: its batches calibrate the tolerance; ``h1``-``h3`` are
checked); four cheat, each one way:

- ``wrong_weights``: serves the model with every weight perturbed (relative noise
  ``--noise``, default 2%: a cheaper or tampered model) and claims version 0;
- ``fabricated_logprobs``: real tokens, their logprobs shuffled within each session (a
  plausible distribution at the wrong places: what a node that never ran the sampler would send);
- ``inflated_rewards``: real sessions, every failed one reported as solved;
- ``replay``: resubmits an honest node's batch already trained on, under new group ids.

Stage 1 runs :class:`~shipyard.fleet.verify.RolloutVerifier` as the trainer would, at the
defaults (``rollout_frac`` 0.25, ``token_frac`` 0.25, ``regrade_frac`` 0.25), over ``--batches``
batches per node: ``cheating_nodes_caught`` against ``cheating_nodes``, and
``honest_nodes_quarantined``. Stage 2 checks every session once (all tokens, every reward) and
derives, per cheat, the probability that one batch is caught at spot-check fractions 5-100%
(a batch of ``n`` sessions with ``k`` failing is caught unless the ``m = max(1, round(f n))``
sessions drawn miss all ``k``: ``1 - C(n-k, m) / C(n, m)``). Cost: seconds of checking per
session against seconds of generating it.

    python benchmarks/fleet_verify.py            # SmolLM2-135M (~5 min)
    python benchmarks/fleet_verify.py --quick    # tiny model

Stage 3 measures realistic cheats over many independent trials (issue 41 §4; definitions fixed
before the run). A *trial* is one batch of 8 sessions (2 groups x 4) never used in another trial of
the same kind, admitted by a fresh verifier at the defaults (its own ``seed``, so the sessions and
tokens it checks are drawn anew; the tolerance the trusted node calibrated in stage 1). The batch
is *caught* when the verifier refuses it. Kinds:

- ``altered_session``: one of the 8 sessions has its logprobs fabricated (shuffled within it), the
  other 7 are honest;
- ``wrong_weights_2x``: every session sampled by a model whose weights carry relative noise
  chosen, before the trials, on a calibration batch of its own: the smallest noise of a grid
  (one random direction, scaled) whose median session |claimed - recomputed| logprob reaches
  twice the tolerance;
- ``inflated_reward``: one failed session per batch reported as solved (a batch without a failed
  session cannot carry this cheat and is not a trial);
- ``honest``: an honest batch (a refusal is a false quarantine).

A trial is *caught* only when the check aimed at its cheat names it (the altered session's logprobs,
the inflated session's reward, any session's logprobs for the wrong weights; an honest batch: any
refusal); a refusal for another reason is counted apart. Per kind: ``detect_p`` (caught / trials)
with its Wilson 95% interval, and the expected batches to detection ``1 / detect_p`` (geometric,
the catching batch included), its interval from the interval's ends; beside them the chance that
the one altered session is among those the defaults sample (``p_one_session_sampled``). The four
kinds of a trial share its honest batch, so they are not independent of each other.

Writes ``benchmarks/results/fleet_verify.json`` and the ``verify`` section (with the top-level
``cheating_nodes``, ``cheating_nodes_caught``, ``honest_nodes_quarantined``) of ``fleet.json``.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import random
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import harness
from shipyard.config import load_config
from shipyard.config.schema import ShipyardConfig, VerifyConfig

ROOT = Path(__file__).resolve().parents[1]
HONEST = ["h0", "h1", "h2", "h3"]
CHEATS = ["wrong_weights", "fabricated_logprobs", "inflated_rewards", "replay"]
FRACS = [0.05, 0.1, 0.25, 0.5, 1.0]
GROUPS, GROUP_SIZE = 2, 4


def config(quick: bool) -> ShipyardConfig:
    base = "configs/tiny.toml" if quick else "configs/demo.toml"
    over = ["agent.max_turns=1", "sampling.max_tokens=48"]
    return load_config(ROOT / base, over)


class Node:
    """A node: an engine (honest or not) playing sessions through the agent harness."""

    def __init__(self, cfg: ShipyardConfig, model: Any, tok: Any, env: Any) -> None:
        from shipyard.agent.spec import session_spec
        from shipyard.inference.client import LocalInferenceClient
        from shipyard.inference.engine.engine import EmbeddedEngine
        from shipyard.models.precision import engine_precision

        engine_precision(model, cfg.inference)
        self.client = LocalInferenceClient(EmbeddedEngine(model, tok, max_batch=cfg.inference.max_batch))
        self.spec = session_spec(cfg, self.client, tok)
        self.env = env
        self.gen_s = 0.0

    def play(self, tasks: list[Any], prefix: str, rng: random.Random) -> list[Any]:
        from shipyard.agent.play import play

        jobs = [(rng.choice(tasks), f"{prefix}/{g}") for g in range(GROUPS)]
        t0 = time.perf_counter()
        with ThreadPoolExecutor(GROUPS * GROUP_SIZE) as pool:
            futs = [
                pool.submit(play, self.spec, task, gid, i, self.env)
                for task, gid in jobs
                for i in range(GROUP_SIZE)
            ]
            trajs = [seg for f in futs for seg in f.result()]
        self.gen_s += time.perf_counter() - t0
        return trajs


def cheat(kind: str, trajs: list[Any], rng: random.Random) -> list[Any]:
    """What a cheating node does to the sessions it played (``wrong_weights`` cheats in its engine)."""
    if kind == "fabricated_logprobs":
        out = []
        for t in trajs:
            lps = [lp for lp, m in zip(t.logprobs, t.loss_mask, strict=True) if m]
            rng.shuffle(lps)
            it = iter(lps)
            out.append(dataclasses.replace(t, logprobs=[next(it) if m else 0.0 for m in t.loss_mask]))
        return out
    if kind == "inflated_rewards":
        return [dataclasses.replace(t, reward=1.0) for t in trajs]
    return trajs


def perturbed(model: Any, noise: float, seed: int) -> Any:
    import torch

    out = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in out.parameters():
            p.add_(noise * p.std() * torch.randn(p.shape, generator=gen))
    return out


def play_all(
    cfg: ShipyardConfig, args: Any, store: Any, env: Any
) -> tuple[dict[str, list[Any]], dict[str, float]]:
    """Every node's batches (``RolloutBatch`` list per node) and generation seconds per session."""
    from shipyard.envs.tasks.splits import task_splits
    from shipyard.models.loading import load_model
    from shipyard.rollout.types import RolloutBatch
    from shipyard.weights.publisher import WeightPublisher, named_params
    from shipyard.weights.versions import read_manifest

    model, tok = load_model(cfg.model)
    WeightPublisher(store).publish(0, named_params(model))
    digest = read_manifest(store, 0).state_digest
    honest = Node(cfg, copy.deepcopy(model), tok, env)
    wrong = Node(cfg, perturbed(model, args.noise, 1), tok, env)
    train, _ = task_splits(cfg)
    rng = random.Random(0)
    out: dict[str, list[Any]] = {}
    for k in range(args.batches):
        for node in HONEST + CHEATS:
            if node == "replay":
                src = out["h1"][k]
                trajs = [dataclasses.replace(t, group_id=f"replay/{t.group_id}") for t in src.trajectories]
            else:
                player = wrong if node == "wrong_weights" else honest
                trajs = cheat(node, player.play(train, f"{node}/{k:08d}", rng), rng)
            batch = RolloutBatch(
                f"{node}/{k:08d}", node, time.time(), trajs, run_id="bench", claims={"0": digest}
            )
            out.setdefault(node, []).append(batch)
        harness.console.print(f"batch round {k + 1}/{args.batches} played")
    sessions = args.batches * GROUPS * GROUP_SIZE * (len(HONEST) + len(CHEATS) - 1)
    return out, {"gen_s_per_session": (honest.gen_s + wrong.gen_s) / sessions}


def make_verifier(cfg: ShipyardConfig, store: Any, env: Any, vcfg: VerifyConfig) -> Any:
    from shipyard.fleet.verify import build_verifier

    return build_verifier(
        cfg.model_copy(update={"fleet": cfg.fleet.model_copy(update={"verify": vcfg})}), store, env
    )


def run_defaults(cfg: ShipyardConfig, store: Any, env: Any, batches: dict[str, list[Any]]) -> dict[str, Any]:
    """Stage 1: the verifier at its default fractions, batches arriving round by round."""
    v = make_verifier(cfg, store, env, VerifyConfig(enabled=True, trusted=["h0"]))
    for k in range(len(batches["h0"])):
        for node in HONEST + CHEATS:
            v.admit(batches[node][k])
    caught = sorted(n for n in v.evidence if n in CHEATS)
    return {
        "cheating_nodes": len(CHEATS),
        "cheating_nodes_caught": len(caught),
        "honest_nodes_quarantined": sum(n in v.evidence for n in HONEST),
        "evidence": {n: dataclasses.asdict(e) for n, e in v.evidence.items()},
        "tolerance": v.tolerance,
        "honest_mismatch_max": max(v.stats.honest_mismatch),
        "check_s": v.stats.seconds,
        "sessions_checked": v.stats.sessions_checked,
        "sessions_regraded": v.stats.sessions_regraded,
    }


def per_session(
    cfg: ShipyardConfig, store: Any, env: Any, batches: dict[str, list[Any]], tol: float
) -> dict[str, Any]:
    """Stage 2: every session of every node's first batch checked once; failing counts per batch."""
    from shipyard.agent.types import group_sessions

    v = make_verifier(cfg, store, env, VerifyConfig(enabled=True, token_frac=1.0, tolerance=tol))
    rng = random.Random(0)
    seen = {k for b in batches["h1"] for k in _prints(b)}
    out: dict[str, Any] = {}
    t_lp = t_rg = 0.0
    n_lp = n_rg = 0
    for node in HONEST[1:] + CHEATS:
        b = batches[node][0]
        fails = 0
        for s in group_sessions(b.trajectories):
            t0 = time.perf_counter()
            mismatch, _ = v.mismatch(s, rng)
            t1 = time.perf_counter()
            task = v.tasks[s[0].task_id]
            regraded = v.regrade(task, s)
            t_lp, t_rg, n_lp, n_rg = t_lp + t1 - t0, t_rg + time.perf_counter() - t1, n_lp + 1, n_rg + 1
            replayed = node == "replay" and _print(s) in seen
            fails += mismatch > tol or abs(regraded - s[-1].reward) > 1e-6 or replayed
        n = len(group_sessions(b.trajectories))
        out[node] = {
            "sessions": n,
            "failing": fails,
            "p_catch_per_batch": {str(f): p_catch(n, fails, f) for f in FRACS},
        }
    out["cost"] = {"logprob_check_s_per_session": t_lp / n_lp, "regrade_s_per_session": t_rg / n_rg}
    return out


def _print(s: list[Any]) -> str:
    from shipyard.fleet.verify import session_fingerprint

    return session_fingerprint(s)


def _prints(b: Any) -> list[str]:
    from shipyard.agent.types import group_sessions

    return [_print(s) for s in group_sessions(b.trajectories)]


def p_catch(n: int, k: int, frac: float) -> float:
    """Probability that ``m = max(1, round(frac n))`` sessions drawn from ``n`` include one of ``k``."""
    m = max(1, round(frac * n))
    return 1.0 - math.comb(n - k, m) / math.comb(n, m) if k else 0.0


NOISE_GRID = [0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.06, 0.08, 0.12, 0.25, 0.5, 1.0, 2.0, 4.0]
"""Relative weight noise levels tried, smallest first (the tiny random model of --quick needs the top)."""
TRIAL_KINDS = ["altered_session", "wrong_weights_2x", "inflated_reward", "honest"]


def calibrate_noise(
    cfg: ShipyardConfig, model: Any, tok: Any, env: Any, check: Any, tol: float
) -> tuple[dict[str, Any], Node]:
    """The smallest noise of :data:`NOISE_GRID` whose model's median session mismatch (every sampled
    token compared, on one calibration batch, never a trial's) reaches ``2 x tol``, and the node
    serving that model (the one the trials use). Every level scales the same random direction and
    plays the same tasks, so the mismatch grows with the noise rather than with the draw."""
    import statistics

    from shipyard.envs.tasks.splits import task_splits

    train, _ = task_splits(cfg)
    medians: dict[str, float] = {}
    for i, noise in enumerate(NOISE_GRID):
        node = Node(cfg, perturbed(model, noise, 1), tok, env)
        trajs = node.play(train, f"calib/{i}", random.Random(1000))
        medians[str(noise)] = statistics.median(check(s) for s in _sessions(trajs))
        harness.console.print(f"noise {noise}: median session mismatch {medians[str(noise)]:.3f}")
        if medians[str(noise)] >= 2 * tol:
            return {"noise": noise, "median_mismatch": medians, "target": 2 * tol}, node
    raise RuntimeError(f"no noise in {NOISE_GRID} moves logprobs to 2 x {tol}: {medians}")


def _sessions(trajs: list[Any]) -> list[list[Any]]:
    from shipyard.agent.types import group_sessions

    return group_sessions(trajs)


def trial_batch(
    kind: str, honest: list[Any], wrong: list[Any], rng: random.Random
) -> tuple[list[Any], str | None] | None:
    """One trial of ``kind`` (module doc): its sessions and the altered session's id (None: every
    session, or none, is the cheat); None when the batch cannot carry the cheat."""
    if kind == "honest":
        return honest, None
    if kind == "wrong_weights_2x":
        return wrong, None
    sessions = _sessions(honest)
    if kind == "altered_session":
        changed = [(v, cheat("fabricated_logprobs", v, rng)) for v in sessions]
        changed = [
            (v, a) for v, a in changed if any(x.logprobs != y.logprobs for x, y in zip(v, a, strict=True))
        ]
        if not changed:
            return None
        victim, altered = rng.choice(changed)
        swap = {id(t): a for t, a in zip(victim, altered, strict=True)}
        return [swap.get(id(t), t) for t in honest], victim[0].session_id
    assert kind == "inflated_reward", kind
    failed = [s for s in sessions if s[-1].reward < 1.0]
    if not failed:
        return None
    victim = rng.choice(failed)
    ids = {id(t) for t in victim}
    return [dataclasses.replace(t, reward=1.0) if id(t) in ids else t for t in honest], victim[0].session_id


CAUGHT_BY = {"altered_session": "logprobs", "wrong_weights_2x": "logprobs", "inflated_reward": "rewards"}
"""The check that must name a cheat for its batch to count as caught (an honest batch: any refusal)."""


def caught(kind: str, evidence: Any, victim: str | None) -> bool:
    """Whether the refusal (``evidence``, None when admitted) caught this trial's cheat itself."""
    if evidence is None or kind == "honest":
        return evidence is not None
    return evidence.check == CAUGHT_BY[kind] and (victim is None or evidence.session_id == victim)


def summarize(hits: list[bool], refused_otherwise: int) -> dict[str, Any]:
    """``detect_p`` with its Wilson interval; the expected batches until the first caught one
    (``1 / p``, the caught batch included; "unbounded" when none was caught)."""
    from shipyard.eval.stats import wilson_ci

    k, n = sum(hits), len(hits)
    if not n:
        return {"trials": 0, "caught": 0, "detect_p": None}
    lo, hi = wilson_ci(k, n)
    return {
        "trials": n,
        "caught": k,
        "refused_for_another_reason": refused_otherwise,
        "detect_p": k / n,
        "detect_p_ci95": [lo, hi],
        "expected_batches_to_detection": n / k if k else "unbounded",
        "expected_batches_ci95": [1 / hi, 1 / lo if lo else "unbounded"],
    }


def run_trials(cfg: ShipyardConfig, args: Any, store: Any, env: Any, tol: float) -> dict[str, Any]:
    """Stage 3 (module doc): ``args.trials`` trials per kind, fresh batches each."""
    from shipyard.envs.tasks.splits import task_splits
    from shipyard.fleet.verify import RolloutVerifier
    from shipyard.models.loading import load_model
    from shipyard.rollout.types import RolloutBatch
    from shipyard.weights.versions import read_manifest

    model, tok = load_model(cfg.model)
    base = make_verifier(cfg, store, env, VerifyConfig(enabled=True, token_frac=1.0, tolerance=tol))

    def check(session: list[Any]) -> float:  # every sampled token compared
        return base.mismatch(session, random.Random(0))[0]

    noise, wrong_node = calibrate_noise(cfg, model, tok, env, check, tol)
    honest_node = Node(cfg, copy.deepcopy(model), tok, env)
    train, _ = task_splits(cfg)
    digest = read_manifest(store, 0).state_digest
    hits: dict[str, list[bool]] = {k: [] for k in TRIAL_KINDS}
    other = dict.fromkeys(TRIAL_KINDS, 0)
    skipped = dict.fromkeys(TRIAL_KINDS, 0)
    for t in range(args.trials):
        honest = honest_node.play(train, f"trial-h/{t}", random.Random(2000 + t))
        wrong = wrong_node.play(train, f"trial-w/{t}", random.Random(3000 + t))
        for kind in TRIAL_KINDS:
            made = trial_batch(kind, honest, wrong, random.Random(f"{kind}/{t}"))
            if made is None:
                skipped[kind] += 1
                continue
            trajs, victim = made
            vcfg = VerifyConfig(enabled=True, tolerance=tol, seed=10_000 + t)
            v = RolloutVerifier(vcfg, store, base.models, base.tasks, base.regrade, base.temperature)
            b = RolloutBatch(
                f"{kind}/{t:08d}", kind, time.time(), trajs, run_id="bench", claims={"0": digest}
            )
            v.admit(b)
            ev = v.evidence.get(kind)
            hits[kind].append(caught(kind, ev, victim))
            other[kind] += ev is not None and not hits[kind][-1]
        harness.console.print(
            f"trial {t + 1}/{args.trials}: " + ", ".join(f"{k} {sum(h)}/{len(h)}" for k, h in hits.items())
        )
    vd = VerifyConfig()
    out: dict[str, Any] = {
        "noise": noise,
        "tolerance": tol,
        "skipped": skipped,
        "p_one_session_sampled": p_catch(GROUPS * GROUP_SIZE, 1, vd.rollout_frac),
        "p_one_session_regraded": p_catch(GROUPS * GROUP_SIZE, 1, vd.regrade_frac),
    }
    for kind in TRIAL_KINDS:
        out[kind] = summarize(hits[kind], other[kind])
    out["honest_false_quarantine_rate"] = out["honest"]["detect_p"]
    out["honest_false_quarantine_ci95"] = out["honest"].get("detect_p_ci95")
    return out


def main() -> None:
    ap = harness.parser(__doc__)
    ap.add_argument("--batches", type=int, default=None, help="batches per node (default 4, quick 2)")
    ap.add_argument(
        "--noise", type=float, default=None, help="relative weight noise of wrong_weights (0.02; quick 0.5)"
    )
    ap.add_argument("--trials", type=int, default=None, help="stage 3 trials per kind (default 24, quick 3)")
    args = ap.parse_args()
    args.batches = args.batches or (2 if args.quick else 4)
    args.noise = args.noise or (0.5 if args.quick else 0.02)  # the tiny random model is near-uniform
    args.trials = args.trials or (3 if args.quick else 24)
    cfg = config(args.quick)
    from shipyard.envs.environment import Environment
    from shipyard.store.local import LocalStore

    with tempfile.TemporaryDirectory() as d, Environment.from_config(cfg) as env:
        store = LocalStore(d)
        batches, gen = play_all(cfg, args, store, env)
        stage1 = run_defaults(cfg, store, env, batches)
        stage2 = per_session(cfg, store, env, batches, stage1["tolerance"])
        stage3 = run_trials(cfg, args, store, env, stage1["tolerance"])
    rows = {
        node: {
            "failing": f"{r['failing']}/{r['sessions']}",
            **{f"{f:.0%}": r["p_catch_per_batch"][str(f)] for f in FRACS},
        }
        for node, r in stage2.items()
        if node != "cost"
    }
    harness.table("probability that one batch is caught, by spot-check fraction", rows)
    cost = {**stage2.pop("cost"), **gen}
    cost["check_over_generation"] = cost["logprob_check_s_per_session"] / cost["gen_s_per_session"]
    harness.table("cost per session (s)", {"": cost})
    harness.table(
        f"stage 3: {args.trials} trials per kind (noise {stage3['noise']['noise']}, tolerance {stage3['tolerance']:.3f})",
        {
            k: {
                "caught": f"{stage3[k]['caught']}/{stage3[k]['trials']}",
                "p per batch": stage3[k]["detect_p"],
                "95% CI": "[{:.2f}, {:.2f}]".format(*stage3[k].get("detect_p_ci95", [0, 1])),
                "E[batches]": stage3[k]["expected_batches_to_detection"],
            }
            for k in TRIAL_KINDS
        },
    )
    caught = f"{stage1['cheating_nodes_caught']}/{stage1['cheating_nodes']}"
    harness.console.print(
        f"defaults: caught {caught}, honest quarantined {stage1['honest_nodes_quarantined']}"
    )
    figures = {
        **stage1,
        "detection": stage2,
        "cost": cost,
        "trials": stage3,
        "honest_false_quarantine_rate": stage3["honest_false_quarantine_rate"],
        "batches_per_node": args.batches,
        "noise": args.noise,
    }
    harness.write_results(args, "fleet_verify", figures)
    top = ("cheating_nodes", "cheating_nodes_caught", "honest_nodes_quarantined")
    harness.merge_fleet(args, "verify", figures, {k: figures[k] for k in top})


if __name__ == "__main__":
    main()
