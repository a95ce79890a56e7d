"""Rollout worker against a real HTTP server: batches land in the store, crashes are recorded, sync waits."""

import os
import threading
from pathlib import Path
from unittest import mock

from shipyard.agent.spec import session_spec
from shipyard.config import load_config
from shipyard.envs.types import Task
from shipyard.inference.client import HttpInferenceClient
from shipyard.inference.embedded import EmbeddedNode
from shipyard.rollout.types import RolloutBatch
from shipyard.rollout.worker import RolloutWorker
from shipyard.store import LocalStore
from shipyard.store.run import stamp_new_run
from shipyard.trainer.feed import RolloutFeed
from shipyard.weights.snapshot import WeightPublisher

ROOT = Path(__file__).resolve().parents[2]
GOOD = Task(
    id="ok",
    prompt="Write `f()` returning 1.",
    entry_point="f",
    hidden_tests="from solution import f\n\ndef test_f():\n    assert f() == 1\n",
)
BROKEN = Task(id="broken", prompt="x", entry_point="f", hidden_tests="no tests here = \n")


def test_crashing_sessions_are_recorded_and_the_run_goes_on(tmp_path: Path) -> None:
    cfg = load_config(
        ROOT / "configs/tiny.toml",
        [f'store.root="{tmp_path}"', "trainer.groups_per_step=2", "rollout.group_size=2"],
    )
    store = stamp_new_run(LocalStore(tmp_path), "tiny")
    node = EmbeddedNode(cfg, store)
    try:
        spec = session_spec(cfg, HttpInferenceClient(node.url), node.tokenizer)
        worker = RolloutWorker("w0", cfg, store, spec, [BROKEN, GOOD])
        assert worker.run(max_batches=3) == 3
    finally:
        node.stop()
    # Sessions took pre-warmed sandboxes from the worker's pool; commands never exceeded its CPU slots.
    pool = worker.sandbox_stats
    sessions = 3 * 2 * 2
    assert pool["warm_hits"] + pool["cold_creates"] == sessions and pool["warm_hits"] >= 1, pool
    assert pool["created"] >= sessions and pool["peak_running"] <= (os.cpu_count() or 1), pool
    assert worker.sandboxes is None and not list(Path("/tmp").glob(f"shipyard-sb-{os.getpid()}-*"))
    trajs = [
        t for k in store.list("rollouts/w0/") for t in RolloutBatch.from_bytes(store.get(k)).trajectories
    ]
    broken = [t for t in trajs if t.task_id == "broken"]
    good = [t for t in trajs if t.task_id == "ok"]
    assert broken and good, "the seeded task choice should cover both tasks in 3 batches"
    assert all(t.error is not None and "not valid Python" in t.error for t in broken)
    assert all(t.error is None and t.reward_info["total"] == 1 for t in good)
    order = list(trajs)  # batches are listed in write order, groups in order within a batch
    last_good = max(i for i, t in enumerate(order) if t.task_id == "ok")
    crashed_before = sum(t.task_id == "broken" for t in order[:last_good])
    taken = RolloutFeed(store, worker.identity.run_id).take(
        len({t.group_id for t in good}), 0, 0, timeout_s=5
    )
    assert taken.dropped_errors == crashed_before and all(g[0].task_id == "ok" for g in taken.groups)


def test_sync_worker_waits_for_the_next_version(tmp_path: Path) -> None:
    cfg = load_config(
        ROOT / "configs/tiny.toml",
        [
            f'store.root="{tmp_path}"',
            "trainer.mode=sync",
            "rollout.group_size=2",
            "trainer.groups_per_step=1",
        ],
    )
    store = stamp_new_run(LocalStore(tmp_path), "tiny")
    node = EmbeddedNode(cfg, store)
    try:
        spec = session_spec(cfg, HttpInferenceClient(node.url), node.tokenizer)
        worker = RolloutWorker("w0", cfg, store, spec, [GOOD])
        waiting = threading.Event()
        wait_for_version = worker.wait_for_version

        def observed(needed: int) -> bool:
            if needed == 1:
                waiting.set()  # the worker is about to block until the server serves version 1
            return wait_for_version(needed)

        t = threading.Thread(target=worker.run, kwargs={"max_batches": 2})
        with mock.patch.object(worker, "wait_for_version", observed):
            t.start()
            assert waiting.wait(timeout=120), "the worker never asked for version 1"
        for _ in range(20):  # while it waits, the server is at version 0 and batch 1 cannot appear
            assert node.engine.version == 0 and t.is_alive()
            assert len(store.list("rollouts/w0/")) == 1, "sync worker must wait for version 1 before batch 1"
            waiting.wait(0.05)
        WeightPublisher(store).publish(1, _params(node))
        t.join(timeout=60)
        assert not t.is_alive()
    finally:
        node.stop()
    second = RolloutBatch.from_bytes(store.get("rollouts/w0/00000001.json.gz"))
    assert {v for tr in second.trajectories for v, m in zip(tr.versions, tr.loss_mask, strict=True) if m} == {
        1
    }


def _params(node: EmbeddedNode) -> dict:
    return {n: p.detach().clone() for n, p in node.engine.model.named_parameters()}


SLOW = Task(
    id="slow",
    prompt="Write `f()` returning 1.",
    entry_point="f",
    hidden_tests="import time\n\ndef test_slow():\n    time.sleep(4)\n",
)


def test_streaming_worker_writes_groups_in_finishing_order_under_the_version_gate(tmp_path: Path) -> None:
    """A slow group holds back only itself; version 0 allows groups 0-5 (lag 2, 2 groups a batch)."""
    import random

    cfg = load_config(
        ROOT / "configs/tiny.toml",
        [
            f'store.root="{tmp_path}"',
            "trainer.groups_per_step=2",
            "rollout.group_size=2",
            "rollout.concurrency=8",
            "rollout.streaming=true",
        ],
    )
    tasks = [SLOW, GOOD, GOOD]
    picks = [random.Random(f"0/w0/g{g}").choice(tasks).id for g in range(6)]
    first_slow = picks.index("slow")
    assert first_slow < 5 and "ok" in picks[first_slow + 1 :], picks  # the seeds give the test its shape
    store = stamp_new_run(LocalStore(tmp_path), "tiny")
    node = EmbeddedNode(cfg, store)
    try:
        spec = session_spec(cfg, HttpInferenceClient(node.url), node.tokenizer)
        worker = RolloutWorker("w0", cfg, store, spec, tasks)
        assert worker.run(max_batches=3) == 3
    finally:
        node.stop()
    batches = [RolloutBatch.from_bytes(store.get(k)) for k in sorted(store.list("rollouts/w0/"))]
    order = [int(gid.split("/")[1][1:]) for b in batches for gid in b.groups()]
    assert sorted(order) == list(range(6)) and all(len(g) == 2 for b in batches for g in b.groups().values())
    assert order.index(first_slow) > order.index(picks.index("ok", first_slow + 1)), order  # overtaken


def test_a_worker_cut_off_from_the_store_keeps_its_batch_and_reports_its_region(tmp_path: Path) -> None:
    cfg = load_config(
        ROOT / "configs/tiny.toml",
        [f'store.root="{tmp_path}"', "rollout.group_size=2", "trainer.groups_per_step=1", "fleet.region=eu"],
    )
    store = stamp_new_run(LocalStore(tmp_path), "tiny")
    node = EmbeddedNode(cfg, store)
    real_put, real_exists = store.put, store.exists
    down = {"put": 2, "exists": 3}  # the link is down for the first writes and checks

    def put(key: str, data: bytes) -> None:
        if key.startswith("rollouts/") and down["put"]:
            down["put"] -= 1
            raise ConnectionError("store call failed: link down")
        real_put(key, data)

    def exists(key: str) -> bool:
        if down["exists"]:
            down["exists"] -= 1
            raise TimeoutError("store call got no answer")
        return real_exists(key)

    try:
        WeightPublisher(store).publish(1, _params(node))
        for _ in range(200):
            if node.engine.version == 1:
                break
            threading.Event().wait(0.05)
        spec = session_spec(cfg, HttpInferenceClient(node.url), node.tokenizer)
        worker = RolloutWorker("eu-w0", cfg, store, spec, [GOOD])
        with mock.patch.object(store, "put", put), mock.patch.object(store, "exists", exists):
            assert worker.run(max_batches=2) == 2
    finally:
        node.stop()
    assert down == {"put": 0, "exists": 0}
    first, second = (RolloutBatch.from_bytes(store.get(k)) for k in store.list("rollouts/eu-w0/"))
    assert first.region == second.region == "eu" and len(first.trajectories) == 2
    assert [a["version"] for a in first.adoptions] == [1] and second.adoptions == []
    assert first.adoptions[0]["at"] >= first.adoptions[0]["published_at"]
