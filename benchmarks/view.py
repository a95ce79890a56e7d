"""`shipyard view` on a large run: time to first paint, to a full dashboard, to the first page of
rollouts and to open one, in a real Chromium, against loading every rollout before showing anything.

The run: a real tiny training run (its sessions, metrics, weights and adoptions, made here), whose
sessions are replicated under fresh ids into ``--rollouts`` sessions (10,000 by default; 800 with
``--quick``) in batches of 8, with one ``train`` and ``consumed`` record per batch, so the run has
the shape of a long RL run: 1,250 steps of 8 sessions. The baseline is what a viewer that reads
everything first would wait before its first paint: reading and parsing every rollout batch of
the store (our index does the same work, a slice per request, after the page is up).

    python benchmarks/view.py [--quick] [--rollouts 10000]

Writes ``benchmarks/results/view.json``: rollouts, steps, tokens_per_rollout, first_paint_ms,
dashboard_ready_ms, list_first_page_ms, open_rollout_ms, index_complete_s, and the baseline
load_all_rollouts_s.
"""

from __future__ import annotations

import copy
import json
import shutil
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path

import harness

ROOT = Path(__file__).resolve().parents[1]


def make_run(tmp: Path, rollouts: int) -> tuple[Path, int]:
    """A real tiny run, its sessions replicated to ``rollouts`` (module doc); (run dir, steps)."""
    from shipyard.config import load_config
    from shipyard.metrics.logger import read_metrics
    from shipyard.orchestrate.train import train
    from shipyard.rollout.types import RolloutBatch
    from shipyard.store import LocalStore

    over = [f'run.output_dir="{tmp}"', f'store.root="{tmp / "store"}"', f'run.results_dir="{tmp / "res"}"']
    over += ["sampling.max_tokens=160", "agent.max_turns=4", "agent.max_session_tokens=1536"]
    train(load_config(ROOT / "configs/tiny.toml", over))
    run_dir, store = tmp / "tiny", LocalStore(tmp / "store" / "tiny")
    real = [RolloutBatch.from_bytes(store.get(k)) for k in sorted(store.list("rollouts/"))]
    sessions = [t for b in real for t in b.trajectories]
    records = [r for r in read_metrics(run_dir / "metrics.jsonl") if r.get("kind") == "train"]
    steps = rollouts // 8
    lines = []
    for s in range(1, steps + 1):
        batch = _replica(real[0], sessions, s, 8)
        store.put(batch.key(), batch.to_bytes())
        rec = {**copy.deepcopy(records[s % len(records)]), "step": s, "time": time.time() - (steps - s) * 30}
        lines += [rec, {"step": s, "kind": "consumed", "groups": [batch.trajectories[0].group_id]}]
    with open(run_dir / "metrics.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in lines)
    (run_dir / "config.json").write_text(
        json.dumps({**json.loads((run_dir / "config.json").read_text()), "trainer": {"steps": steps}})
    )
    return run_dir, steps


def _replica(template, sessions: list, step: int, n: int):
    """Batch ``x/<step>``: ``n`` sessions (copies of real ones, one group) under fresh ids."""
    from shipyard.rollout.types import RolloutBatch

    group = f"x/{step:08d}/0/task-{step % 97:05d}"
    trajs = []
    for i in range(n):
        t = copy.copy(sessions[(step * n + i) % len(sessions)])
        t.group_id, t.sample_idx, t.session_id, t.segment_idx, t.num_segments = group, i, f"{group}/{i}", 0, 1
        t.task_id = f"task-{step % 97:05d}"
        trajs.append(t)
    return RolloutBatch(f"x/{step:08d}", "x", time.time(), trajs, run=template.run, run_id=template.run_id)


def load_all(run_dir: Path) -> float:
    """The baseline: seconds to read and parse every rollout batch of the run's store."""
    from shipyard.rollout.types import RolloutBatch
    from shipyard.store import LocalStore

    store = LocalStore(run_dir.parent / "store" / run_dir.name)
    t0 = time.perf_counter()
    n = sum(len(RolloutBatch.from_bytes(store.get(k)).trajectories) for k in store.list("rollouts/"))
    assert n > 0
    return time.perf_counter() - t0


def serve(run_dir: Path) -> tuple[int, object]:
    import uvicorn

    from shipyard.view.server import Runs, make_app

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(
        uvicorn.Config(make_app(Runs([run_dir])), host="127.0.0.1", port=port, log_level="warning")
    )
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.02)
    return port, server


def browse(port: int, steps: int) -> dict[str, float]:
    """Milliseconds to first paint, a full reward chart, the first rollout page, an opened rollout."""
    from playwright.sync_api import sync_playwright

    chromium = shutil.which("chromium") or "chromium"
    out: dict[str, float] = {}
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        t0 = time.perf_counter()
        page.goto(f"http://127.0.0.1:{port}/?poll=1000#/")
        page.wait_for_selector(f'[data-testid=chart-reward][data-points="{steps}"]', timeout=120_000)
        out["dashboard_ready_ms"] = (time.perf_counter() - t0) * 1000
        out["first_paint_ms"] = page.evaluate(
            "performance.getEntriesByName('first-contentful-paint')[0].startTime"
        )
        t0 = time.perf_counter()
        page.goto(f"http://127.0.0.1:{port}/?poll=1000#/rollouts/tiny")
        page.wait_for_selector("[data-testid=rollout-table] tr[data-rollout-id]", timeout=120_000)
        out["list_first_page_ms"] = (time.perf_counter() - t0) * 1000
        t0 = time.perf_counter()
        page.click("[data-testid=rollout-table] tr[data-rollout-id] >> nth=3")
        page.wait_for_selector("[data-testid=segment]", timeout=120_000)
        out["open_rollout_ms"] = (time.perf_counter() - t0) * 1000
        browser.close()
    return out


def index_complete(run_dir: Path) -> float:
    """Seconds until a fresh viewer's index holds every batch, polled as the list page polls it."""
    from shipyard.view.run import RunReader
    from shipyard.view.types import RolloutQuery

    reader, t0 = RunReader(run_dir), time.perf_counter()
    while True:
        page = reader.rollouts(RolloutQuery(limit=1))
        if page["indexed"] >= page["batches"]:
            return time.perf_counter() - t0


def main() -> int:
    p = harness.parser(__doc__)
    p.add_argument("--rollouts", type=int, default=None, help="sessions in the run (10000; 800 with --quick)")
    args = p.parse_args()
    n = args.rollouts or (800 if args.quick else 10_000)
    with tempfile.TemporaryDirectory(prefix="shipyard-view-bench-") as d:
        run_dir, steps = make_run(Path(d), n)
        baseline = load_all(run_dir)
        index_s = index_complete(run_dir)
        port, server = serve(run_dir)
        ours = {**browse(port, steps), "index_complete_s": index_s}
        server.should_exit = True  # type: ignore[attr-defined]
        tokens = _tokens_per_rollout(run_dir)
    harness.table(
        f"shipyard view on {n} rollouts ({steps} steps, {tokens:.0f} tokens each)",
        {
            "baseline: load all first": {
                "first paint ms": baseline * 1000,
                "open a rollout ms": baseline * 1000,
            },
            "shipyard view": {
                "first paint ms": ours["first_paint_ms"],
                "open a rollout ms": ours["open_rollout_ms"],
                "dashboard ready ms": ours["dashboard_ready_ms"],
                "first list page ms": ours["list_first_page_ms"],
                "index complete s": ours["index_complete_s"],
            },
        },
    )
    figures = {
        "rollouts": n,
        "steps": steps,
        "tokens_per_rollout": tokens,
        **ours,
        "load_all_rollouts_s": baseline,
    }
    harness.write_results(args, "view", figures)
    return 0


def _tokens_per_rollout(run_dir: Path) -> float:
    from shipyard.view.run import RunReader
    from shipyard.view.types import RolloutQuery

    rows = RunReader(run_dir).rollouts(RolloutQuery(limit=100), budget_s=5.0)["rows"]
    return sum(r["length"] for r in rows) / max(1, len(rows))


if __name__ == "__main__":
    sys.exit(main())
