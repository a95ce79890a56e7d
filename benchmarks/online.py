"""Real-time RL from production, end to end (issue 18): serve -> log -> train -> gate -> promote.

Everything is real: a durable PostgreSQL server, the online gateway in front of an embedded
inference server that follows the serving line's store, a simulated user population
(`online_users.py`: hidden preferences, real grading of the code it receives, noisy and partial
feedback) sending chat completions and feedback over HTTP, the online trainer on the matured
records, and the gate comparing each candidate with the serving version before the serving line
promotes it. Per cycle: serve `--requests` requests, train until the matured records are used,
gate the candidate, promote or reject. Also measured:

- `gateway_overhead_p50_ms` / `_p99_ms`: per-request latency through the gateway minus direct, in
  interleaved pairs of identical one-token requests, the gateway logging each to the database as
  it logs production (after the last cycle, so no probe is trained on);
- the database stopped (immediate shutdown) for `--db-down-s` seconds in the second cycle's serving:
  `feedback_events_lost` (sent events missing from the database at the end) and
  `served_requests_failed` (over the whole run);
- `regressed_candidates_tried` / `_blocked`: candidates with corrupted weights, each gated;
- `rollback_s`: `ServingLine.rollback` to the previous version until the server reports it;
- `satisfaction_diff_ci95_low`: the users' satisfaction with the first and the last promoted
  version on held-out prompts (same seeds, paired; the interval clustered by prompt: a prompt's
  `--final-samples` samples are not independent pairs);
- `dodge_reward_gap`: the reward model's expected reward of dodging answers (empty, a clarifying
  question, a cut-off code block) to the same requests, minus the honest answers' rewards.

    python benchmarks/online.py            # SmolLM2, 5 cycles (31 min on 2 cores)
    python benchmarks/online.py --quick    # the tiny model, 5 short cycles (~2 min): the wiring

Writes `benchmarks/results/online.json` (`online_quick.json`).
"""

from __future__ import annotations

import random
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import torch

import harness
import online_users
from shipyard.config.load import load_config
from shipyard.config.schema import GateSuiteConfig, ShipyardConfig
from shipyard.envs.tasks.functions import SYSTEM_PROMPT
from shipyard.envs.tasks.splits import task_splits
from shipyard.eval.stats import clustered_diff_ci

ROOT = Path(__file__).resolve().parents[1]
FULL = ["inference.threads=2", "trainer.threads=2"]
"""The phases run one after another in one process: each may use both cores."""
QUICK = [
    "model.source=tiny",
    "sampling.max_tokens=24",
    "tasks.num_generated=80",
    "trainer.bf16_decoder=false",
    "inference.dtype=float32",
    "weights.dtype=float32",
    "online.trainer.min_batch=4",
    "online.trainer.batch_size=16",
    "trainer.lr=1e-4",
    "trainer.train_layers=0",
]


def _cfg(args: Any) -> ShipyardConfig:
    over = [
        *(QUICK if args.quick else FULL),
        *args.overrides,
        "online.reward.mature_after_s=0",
        "online.trainer.candidate_every=100000",
        f'run.output_dir="{args.work}"',
    ]
    return load_config(ROOT / "configs" / "online.toml", over)


class GatewayProcess:
    """`shipyard online gateway` as its own process, as deployed (in the benchmark's process it would
    share the interpreter lock with the inference server and the trainer)."""

    def __init__(self, upstream: str, dsn: str, log: Path) -> None:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        cmd = [
            sys.executable,
            "-m",
            "shipyard.cli",
            "online",
            "gateway",
            str(ROOT / "configs" / "online.toml"),
            f"online.gateway.upstream={upstream}",
            f'online.db.dsn="{dsn}"',
            f"online.gateway.port={port}",
            "online.gateway.retry_s=0.2",
            "online.gateway.retry_max_s=2.0",
        ]
        self.log = log.open("w")  # closed in stop()
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.time() + 60
        while True:
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if self.proc.poll() is not None or time.time() > deadline:
                self.stop()
                raise RuntimeError(f"the gateway did not start; see {log}")
            time.sleep(0.2)

    def stats(self) -> dict[str, Any]:
        return httpx.get(f"{self.url}/stats", timeout=10).json()

    def flush(self, timeout_s: float) -> bool:
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            if self.stats()["buffered"] == 0:
                return True
            time.sleep(0.1)
        return False

    def stop(self) -> None:
        """SIGINT: the gateway stops serving and flushes its buffer, then exits."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.log.close()


class Bench:
    """The running system of the benchmark (module doc)."""

    def __init__(self, cfg: ShipyardConfig, args: Any) -> None:
        self.cfg, self.args = cfg, args
        self._closers: list[Any] = []
        try:
            self._start()
        except BaseException:
            self.close()
            raise

    def _start(self) -> None:
        from shipyard.inference.backends.base import start_node
        from shipyard.inference.engine.engine import EmbeddedEngine
        from shipyard.models.loading import load_model
        from shipyard.models.precision import engine_precision
        from shipyard.online.database import OnlineDB
        from shipyard.online.postgres import LocalPostgres
        from shipyard.online.serving import ServingLine
        from shipyard.online.trainer import OnlineTrainer
        from shipyard.store.local import LocalStore
        from shipyard.store.run import stamp_new_run
        from shipyard.trainer.loop import published_dtype
        from shipyard.weights.publisher import named_params

        cfg, args = self.cfg, self.args
        if (args.work / "pg" / "PG_VERSION").exists():  # a killed earlier run's server: stop it first
            LocalPostgres(str(args.work / "pg"), cfg.services.postgres, start=False).close()
        shutil.rmtree(args.work, ignore_errors=True)
        args.work.mkdir(parents=True)
        self.pg = LocalPostgres(str(args.work / "pg"), cfg.services.postgres)
        self._closers.append(self.pg.close)
        self.db = OnlineDB(self.pg.dsn)
        self.db.migrate()
        root = LocalStore(args.work / "store")
        serving, candidates = stamp_new_run(root, "prod"), stamp_new_run(root, "prod-candidates")
        model, tok = load_model(cfg.model)
        self.line = ServingLine(serving, self.db, keep=8, dtype=published_dtype(cfg))
        self.base = {k: v.detach().clone() for k, v in named_params(model).items()}
        self.line.publish(self.base, {"online": "base"})
        engine_precision(model, cfg.inference)  # the gate's engine serves as the servers do
        self.node = start_node(cfg, serving)
        self._closers.append(self.node.stop)
        self.gateway = GatewayProcess(self.node.url, self.pg.dsn, args.work / "gateway.log")
        self._closers.append(self.gateway.stop)
        self.trainer = OnlineTrainer(cfg, self.db, candidates, args.work / "run", self.line.current)
        self.gate_engine = EmbeddedEngine(model, tok, max_batch=cfg.inference.max_batch)
        self.tok = tok
        train, held = task_splits(cfg)
        self.prompts = train[: args.pool]
        self.gate_tasks_n = max(s.n for s in cfg.online.gate.suites if s.kind == "heldout")
        self.final_tasks = held[self.gate_tasks_n : self.gate_tasks_n + args.final_n]
        self.users = online_users.population(args.users, args.seed)
        self.rng = random.Random(args.seed)
        self.sent_events: list[str] = []
        self.failed = 0
        self.good_prompts: dict[str, Any] = {}
        self.gate_cache: dict[tuple[Any, ...], list[float]] = {}
        self.http = httpx.Client(timeout=600)
        self._closers.append(self.http.close)

    def __enter__(self) -> Bench:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop what was started, newest first (also after a failed start)."""
        for close in reversed(self._closers):
            close()

    # ---------------------------------------------------------------- serving
    def request(
        self, user: Any, task: Any, seed: int, url: str, max_tokens: int | None = None, store: bool = True
    ) -> httpx.Response:
        from shipyard.agent.session import first_message

        s = self.cfg.sampling
        body = {
            "messages": [
                {"role": "system", "content": SYSTEM_PROMPT},
                {"role": "user", "content": first_message(task)},
            ],
            "temperature": s.temperature,
            "max_tokens": max_tokens or s.max_tokens,
            "stop": s.stop,
            "seed": seed,
            "user": user.uid,
            "metadata": {"session_id": f"{user.uid}-{seed}"},
        }
        if url == self.node.url:
            body.pop("metadata")
        elif not store:
            body["store"] = False
        return self.http.post(f"{url}/v1/chat/completions", json=body)

    def one_user_turn(self, i: int, cycle: int) -> float | None:
        """A user asks, reads, reacts; returns its satisfaction (None: the request failed)."""
        from shipyard.online.feedback import FeedbackClient
        from shipyard.online.types import FeedbackEvent

        rng = random.Random(f"{self.args.seed}/{cycle}/{i}")
        user, task = rng.choice(self.users), rng.choice(self.prompts)
        resp = self.request(user, task, seed=cycle * 100_000 + i, url=self.gateway.url)
        if resp.status_code != 200:
            self.failed += 1
            return None
        choice = resp.json()["choices"][0]
        text, n = choice["message"]["content"], len(choice["shipyard"]["token_ids"])
        if choice["finish_reason"] == "stop" and not text.rstrip().endswith("```"):
            text += "\n```"  # the stop string closed the block
        feats, has_code = online_users.features(task, text, n, user.short_tokens, self.cfg.sandbox)
        if feats["tests"]:
            self.good_prompts[task.id] = task
        gid = f"{resp.headers['x-shipyard-request-id']}/0"
        events = [FeedbackEvent.make(k, v, generation_id=gid) for k, v in user.react(feats, has_code, rng)]
        if not has_code and rng.random() < 0.3:
            events.append(FeedbackEvent.make("abandoned", -1, session_id=f"{user.uid}-{cycle * 100_000 + i}"))
        if events:
            fb = FeedbackClient(self.gateway.url, deadline_s=300)
            fb.send(events)
            fb.close()
            self.sent_events += [e.event_id for e in events]
        return user.satisfaction(feats)

    def serve(self, cycle: int, n: int, db_down_s: float = 0.0) -> list[float]:
        outage = threading.Thread(target=self._outage, args=(db_down_s,), daemon=True) if db_down_s else None
        if outage is not None:
            outage.start()
        from shipyard.metrics.progress import StepBar

        def turn(i: int) -> float | None:
            sat = self.one_user_turn(i, cycle)
            bar.advance()
            return sat

        with (
            StepBar(f"cycle {cycle}: serving", total=n, console=harness.console) as bar,
            ThreadPoolExecutor(self.args.concurrency) as pool,
        ):
            sats = [s for s in pool.map(turn, range(n)) if s is not None]
        if outage is not None:
            outage.join()
        assert self.gateway.flush(120), "the gateway's buffer did not drain"
        return sats

    def _outage(self, seconds: float) -> None:
        time.sleep(2.0)
        self.pg.stop("immediate")
        harness.console.print(f"[yellow]database down for {seconds:.0f} s")
        time.sleep(seconds)
        self.pg.start()
        self.db = type(self.db)(self.pg.dsn)  # the benchmark's own connection died with the server
        self.trainer.db = self.db
        self.line.db = self.db

    # ---------------------------------------------------------------- train, gate, promote
    def train(self) -> dict[str, float]:
        steps, last = 0, {}
        while (m := self.trainer.step()) is not None:
            steps, last = steps + 1, m
        return {
            "steps": float(steps),
            **{k: v for k, v in last.items() if k in ("online/reward_mean", "train/loss")},
        }

    def gate(self, weights: dict[str, Any], version: int) -> Any:
        from shipyard.online.gate import run_gate

        serving = self.line.current()
        return run_gate(
            self.cfg,
            self.gate_engine,
            (version, weights),
            (serving, self.line.weights(serving)),
            self.gate_cache,
        )

    def wait_serving(self, version: int, timeout_s: float = 300.0) -> float:
        t0 = time.time()
        while self.http.get(f"{self.node.url}/version").json()["version"] != version:
            if time.time() - t0 > timeout_s:
                raise TimeoutError(f"the server did not adopt version {version} in {timeout_s:.0f} s")
            time.sleep(0.05)
        return time.time() - t0

    def candidate(self) -> tuple[int, dict[str, Any]]:
        from shipyard.weights.publisher import named_params

        version = self.trainer.publish_candidate(self.trainer.steps)
        return version, {k: v.detach().clone() for k, v in named_params(self.trainer.policy.model).items()}


def overhead(bench: Bench, pairs: int) -> dict[str, float]:
    """Gateway minus direct latency of identical one-token requests, interleaved (module doc), with
    the gateway logging each one to the database as it logs production (measured after the last
    cycle, so that no probe is trained on)."""
    user, task = bench.users[0], bench.prompts[0]
    diffs = []
    for i in range(pairs):  # alternate which goes first: neither gets a warm cache every time
        lat = {}
        for url in (bench.node.url, bench.gateway.url)[:: 1 if i % 2 == 0 else -1]:
            t0 = time.perf_counter()
            bench.request(user, task, seed=900_000 + i, url=url, max_tokens=1).raise_for_status()
            lat[url] = time.perf_counter() - t0
        diffs.append(lat[bench.gateway.url] - lat[bench.node.url])
    q = statistics.quantiles([d * 1000 for d in diffs], n=100)
    return {"gateway_overhead_p50_ms": q[49], "gateway_overhead_p99_ms": q[98]}


def corrupted(weights: dict[str, Any], seed: int) -> dict[str, Any]:
    """A regressed candidate: every matrix with noise of 0.5 its own std (a broken export)."""
    g = torch.Generator().manual_seed(seed)
    return {
        k: (v + 0.5 * v.float().std() * torch.randn(v.shape, generator=g)).to(v.dtype) if v.dim() == 2 else v
        for k, v in weights.items()
    }


def satisfaction_pair(bench: Bench, a: int, b: int) -> tuple[list[float], list[float]]:
    """Users' satisfaction with serving versions ``a`` and ``b`` on held-out prompts, same seeds."""
    from shipyard.agent.session import first_message
    from shipyard.inference.types import GenerateRequest, SamplingParams

    s, out = bench.cfg.sampling, []
    for version in (a, b):  # version 0 from memory: the serving line keeps only its newest versions
        bench.gate_engine.stage_weights(version, bench.base if version == 0 else bench.line.weights(version))
        bench.gate_engine.apply_pending()
        reqs, pairs = [], []
        for j, task in enumerate(bench.final_tasks):
            for k in range(bench.args.final_samples):
                user = bench.users[(j * 7 + k) % len(bench.users)]
                msgs = [
                    {"role": "system", "content": SYSTEM_PROMPT},
                    {"role": "user", "content": first_message(task)},
                ]
                ids = bench.tok.apply_chat_template(
                    msgs, add_generation_prompt=True, tokenize=True, return_dict=True
                )
                reqs.append(
                    GenerateRequest(
                        list(ids["input_ids"]),
                        SamplingParams(s.temperature, 1.0, s.max_tokens, s.stop, 10_000 * j + k),
                    )
                )
                pairs.append((user, task))
        results = bench.gate_engine.generate(reqs)
        sats = []
        for (user, task), res in zip(pairs, results, strict=True):
            text = bench.tok.decode(res.token_ids, skip_special_tokens=True)
            feats, _ = online_users.features(
                task, text, len(res.token_ids), user.short_tokens, bench.cfg.sandbox
            )
            sats.append(user.satisfaction(feats))
        out.append(sats)
    return out[0], out[1]


def dodge_gap(bench: Bench) -> dict[str, float]:
    """Expected reward of dodges minus honest answers, under the reward model (module doc)."""
    from shipyard.online.reward import RewardModel
    from shipyard.online.types import FeedbackEvent, GenerationRecord

    model = RewardModel(bench.cfg.online.reward)
    honest = [it.reward for _, it in bench.db.rewarded(0, 100_000)]
    rng = random.Random(bench.args.seed)
    dodges: dict[str, list[float]] = {"empty": [], "clarifying_question": [], "broken_call": []}
    texts = {
        "empty": ("", "eos"),
        "clarifying_question": ("Which Python version are you on?", "eos"),
        "broken_call": ("```python\ndef solve(x):\n    return", "length"),
    }
    for i in range(len(honest)):
        user = rng.choice(bench.users)
        for kind, (text, finish) in texts.items():
            rec = GenerationRecord(
                f"d{i}/0", f"d{i}", "", "", 0.0, "m", 0, [1], [2], [-1.0], [0], finish, 1.0, [], text
            )
            signals = user.react({"tests": 0.0, "doc": 0.0, "short": 1.0}, False, rng)
            events = [FeedbackEvent(f"d{i}-{j}", k, v, rec.generation_id) for j, (k, v) in enumerate(signals)]
            dodges[kind].append(model.combine(rec, events)[0])
    mean_h = sum(honest) / max(len(honest), 1)
    every = [r for rs in dodges.values() for r in rs]
    return {
        "dodge_reward_gap": sum(every) / max(len(every), 1) - mean_h,
        "honest_reward_mean": mean_h,
        **{f"dodge_reward_{k}": sum(v) / max(len(v), 1) for k, v in dodges.items()},
    }


def cycles(bench: Bench) -> dict[str, Any]:
    """Serve, train, gate, promote, ``--cycles`` times; then the regressed candidates."""
    args, per_cycle, decisions = bench.args, [], []
    for c in range(args.cycles):
        t0 = time.time()
        sats = bench.serve(c, args.requests, db_down_s=args.db_down_s if c == 1 else 0.0)
        trained = bench.train()
        version, weights = bench.candidate()
        _update_regression_suite(bench)
        decision = bench.gate(weights, version)
        new = bench.line.decide(decision, weights)
        if new is not None:
            bench.wait_serving(new)
        elif bench.cfg.online.trainer.on_reject == "reset":
            bench.trainer.load_weights(bench.line.weights(bench.line.current()))
        per_cycle.append(sum(sats) / len(sats))
        decisions.append(
            {
                "cycle": c,
                "candidate": version,
                "promoted_to": new,
                "reason": decision.reason,
                "suites": [dict(s.__dict__) for s in decision.suites],
                **trained,
                "satisfaction": per_cycle[-1],
                "seconds": time.time() - t0,
            }
        )
        harness.console.print(
            f"cycle {c}: satisfaction {per_cycle[-1]:.3f}, {trained['steps']:.0f} steps, "
            f"candidate {version} -> {'promoted to ' + str(new) if new is not None else 'rejected'} "
            f"({decision.reason})"
        )
    blocked = 0
    for r in range(args.regressed):
        serving = bench.line.current()
        bad = bench.gate(corrupted(bench.line.weights(serving), r), 1_000_000 + r)
        blocked += not bad.promote
        bench.line.decide(bad, None if not bad.promote else corrupted(bench.line.weights(serving), r))
        harness.console.print(
            f"regressed candidate {r}: {'blocked' if not bad.promote else 'PROMOTED'} ({bad.reason})"
        )
    return {"per_cycle": per_cycle, "decisions": decisions, "blocked": blocked}


def _update_regression_suite(bench: Bench) -> None:
    """Past production prompts whose answers passed their tests become the regression suite."""
    from shipyard.online.gate import write_regression_suite

    if not bench.good_prompts:
        return
    path = bench.args.work / "regression.jsonl"
    n = write_regression_suite(path, list(bench.good_prompts.values())[: bench.args.regression_n])
    suites = [s for s in bench.cfg.online.gate.suites if s.kind != "regression"]
    bench.cfg.online.gate.suites = [*suites, GateSuiteConfig(kind="regression", n=n, path=str(path))]


def run(bench: Bench) -> dict[str, Any]:
    t0 = time.time()
    figures: dict[str, Any] = {}
    ran = cycles(bench)
    promoted = [d for d in ran["decisions"] if d["promoted_to"] is not None]
    last = promoted[-1]["promoted_to"] if promoted else 0
    first_s, last_s = satisfaction_pair(bench, 0, last)
    prompt_of = [i // bench.args.final_samples for i in range(len(first_s))]  # a prompt's samples
    diff, lo, hi = clustered_diff_ci(first_s, last_s, prompt_of)
    previous = bench.line.current()
    t_rb = time.time()
    back = bench.line.rollback(max(previous - 1, 0), reason="benchmark")
    bench.wait_serving(back)
    stored = _stored_events(bench)
    figures.update(
        cycles=len(ran["per_cycle"]),
        satisfaction_per_cycle=ran["per_cycle"],
        satisfaction_first=sum(first_s) / len(first_s),
        satisfaction_last_promoted=sum(last_s) / len(last_s),
        last_promoted_version=last,
        satisfaction_diff=diff,
        satisfaction_diff_ci95_low=lo,
        satisfaction_diff_ci95_high=hi,
        satisfaction_eval_n=len(first_s),
        satisfaction_eval_prompts=len(set(prompt_of)),
        satisfaction_ci="clustered by prompt",
        candidates_promoted=len(promoted),
        candidates_rejected=len(ran["decisions"]) - len(promoted),
        regressed_candidates_tried=bench.args.regressed,
        regressed_candidates_blocked=ran["blocked"],
        rollback_s=time.time() - t_rb,
        feedback_events_sent=len(bench.sent_events),
        feedback_events_lost=len(set(bench.sent_events) - stored),
        served_requests_failed=bench.failed,
        db_down_s=bench.args.db_down_s,
        gateway=bench.gateway.stats(),
        **dodge_gap(bench),
        db=bench.db.counts(),
        decisions=ran["decisions"],
        population=online_users.summary(bench.users),
    )
    figures.update(overhead(bench, bench.args.overhead_pairs), minutes=(time.time() - t0) / 60)
    return figures


def _stored_events(bench: Bench) -> set[str]:
    with bench.db.conn.cursor() as cur:
        cur.execute("SELECT event_id FROM feedback")
        return {r[0] for r in cur.fetchall()}


def main() -> int:
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # a stopped benchmark stops its servers
    p = harness.parser(__doc__)
    p.add_argument("--cycles", type=int, default=5)
    p.add_argument("--requests", type=int, default=None, help="served requests per cycle")
    p.add_argument("--users", type=int, default=40)
    p.add_argument("--pool", type=int, default=None, help="distinct task prompts users draw from")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--regressed", type=int, default=3)
    p.add_argument("--regression-n", type=int, default=12)
    p.add_argument(
        "--final-n", type=int, default=None, help="held-out prompts of the satisfaction comparison"
    )
    p.add_argument("--final-samples", type=int, default=2)
    p.add_argument("--overhead-pairs", type=int, default=None)
    p.add_argument("--db-down-s", type=float, default=30.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--work", type=Path, default=ROOT / "runs" / "online-bench")
    p.add_argument("--set", dest="overrides", nargs="*", default=[], help="dotted config overrides")
    args = p.parse_args()
    q = args.quick
    args.requests = args.requests or (16 if q else 96)
    args.pool = args.pool or (12 if q else 48)
    args.final_n = args.final_n or (6 if q else 100)
    args.overhead_pairs = args.overhead_pairs or (20 if q else 100)
    if q:
        args.db_down_s = min(args.db_down_s, 5.0)
    cfg = _cfg(args)
    if q:
        cfg.online.gate.suites = [GateSuiteConfig(kind="heldout", n=4, target=True)]
    with Bench(cfg, args) as bench:
        figures = run(bench)
    keys = (
        "cycles",
        "satisfaction_diff",
        "satisfaction_diff_ci95_low",
        "candidates_promoted",
        "candidates_rejected",
        "regressed_candidates_tried",
        "regressed_candidates_blocked",
        "rollback_s",
        "gateway_overhead_p50_ms",
        "gateway_overhead_p99_ms",
        "feedback_events_lost",
        "served_requests_failed",
        "dodge_reward_gap",
        "minutes",
    )
    harness.table(
        "online RL: serve -> log -> train -> gate -> promote", {"run": {k: figures[k] for k in keys}}
    )
    harness.write_results(args, "online", figures)
    return 0


if __name__ == "__main__":
    sys.exit(main())
