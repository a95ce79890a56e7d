"""Rollout worker against a real HTTP server: batches land in the store, crashes are recorded, sync waits."""

import os
import threading
from pathlib import Path
from unittest import mock

import pytest
from tests.conftest import until

from shipyard.agent.spec import session_spec
from shipyard.config import load_config
from shipyard.envs.types import Task
from shipyard.inference.backends.embedded import EmbeddedNode
from shipyard.inference.client import HttpInferenceClient
from shipyard.metrics.logger import read_metrics
from shipyard.models.loading import load_tokenizer
from shipyard.orchestrate.components import assemble_worker
from shipyard.rollout.types import PROGRESS_KEY, RolloutBatch, TrainerProgress
from shipyard.rollout.worker import RolloutWorker, WorkerStopping
from shipyard.store import LocalStore
from shipyard.store.run import claim_run, stamp_new_run
from shipyard.trainer.feed import RolloutFeed
from shipyard.trainer.loop import run_trainer
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
        worker = assemble_worker(cfg, "w0", store, spec, [BROKEN, GOOD])
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


def _refusals(worker: RolloutWorker) -> tuple[list[bool], object]:
    """Record every answer of the worker's version gate (the real gate, called as before)."""
    answers: list[bool] = []
    may_start = worker.may_start

    def observed(started: int, groups: int, version: int) -> bool:
        answers.append(may_start(started, groups, version))
        return answers[-1]

    return answers, mock.patch.object(worker, "may_start", observed)


def _wait_refused(answers: list[bool], times: int = 10) -> None:
    """Until the gate said no ``times`` more times (it is asked every 0.1 s while it says no)."""
    seen = answers.count(False)
    for _ in range(600):
        if answers.count(False) >= seen + times:
            return
        threading.Event().wait(0.05)
    raise AssertionError("the worker's gate was not asked again")


def test_sync_worker_waits_for_the_trainer_and_the_next_version(tmp_path: Path) -> None:
    """Batch 1 starts only once the trainer finished with batch 0 and the server serves version 1."""
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
        worker = assemble_worker(cfg, "w0", store, spec, [GOOD])
        answers, observing = _refusals(worker)
        t = threading.Thread(target=worker.run, kwargs={"max_batches": 2})
        with observing:
            t.start()
            _wait_refused(answers)  # batch 0 written, batch 1 refused: the trainer has not taken it
            assert len(store.list("rollouts/w0/")) == 1 and t.is_alive()
            feed = RolloutFeed(store, worker.identity.run_id)
            assert len(feed.take(1, 0, 0, timeout_s=5).groups) == 1
            store.put(PROGRESS_KEY, TrainerProgress(1, dict(feed.consumed_by)).to_bytes())
            _wait_refused(answers)  # the trainer is done with it, but the server is still at version 0
            assert node.engine.version == 0 and len(store.list("rollouts/w0/")) == 1
            WeightPublisher(store).publish(1, _params(node))
            t.join(timeout=60)
        assert not t.is_alive()
    finally:
        node.stop()
    second = RolloutBatch.from_bytes(store.get("rollouts/w0/00000001.json.gz"))
    assert {v for tr in second.trajectories for v, m in zip(tr.versions, tr.loss_mask, strict=True) if m} == {
        1
    }


def test_a_silent_peer_does_not_stop_the_run(tmp_path: Path) -> None:
    """Two workers are configured, one plays (its peer's region is cut off): the real trainer takes
    the live worker's groups and publishes, the worker paces on the trainer's consumption, and all
    steps complete within the staleness bound (gating on batch numbers stalled at step 2)."""
    cfg = load_config(
        ROOT / "configs/tiny.toml",
        [
            f'store.root="{tmp_path}"',
            f'run.output_dir="{tmp_path}/runs"',
            "rollout.group_size=2",
            "rollout.num_workers=2",
            "trainer.groups_per_step=2",
            "trainer.max_off_policy_steps=1",
            "trainer.steps=4",
            "trainer.wait_timeout_s=120",
        ],
    )
    store = claim_run(cfg.store, cfg.run.name, tmp_path / "runs" / cfg.run.name)
    node = EmbeddedNode(cfg, store)
    try:
        spec = session_spec(cfg, HttpInferenceClient(node.url), node.tokenizer)
        worker = assemble_worker(cfg, "w0", store, spec, [GOOD])
        t = threading.Thread(target=worker.run)
        t.start()
        result = run_trainer(cfg, store, tmp_path / "runs" / cfg.run.name)
        t.join(timeout=120)
        assert not t.is_alive()  # it stops at control/finished
    finally:
        worker.stop_event.set()
        node.stop()
    assert result["final_version"] == 4
    progress = TrainerProgress.from_bytes(store.get(PROGRESS_KEY))
    assert progress.version == 4 and progress.consumed == {"w0": 8}
    # every group trained was within the bound: the trainer's own audit, step by step
    metrics = read_metrics(tmp_path / "runs" / cfg.run.name / "metrics.jsonl")
    trained = [r for r in metrics if r.get("kind") == "train"]
    assert len(trained) == 4 and all(r["rollout/over_bound_trained"] == 0 for r in trained)


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
        worker = assemble_worker(cfg, "w0", store, spec, tasks)
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
        worker = assemble_worker(cfg, "eu-w0", store, spec, [GOOD])
        with mock.patch.object(store, "put", put), mock.patch.object(store, "exists", exists):
            assert worker.run(max_batches=2) == 2
    finally:
        node.stop()
    assert down == {"put": 0, "exists": 0}
    first, second = (RolloutBatch.from_bytes(store.get(k)) for k in store.list("rollouts/eu-w0/"))
    assert first.region == second.region == "eu" and len(first.trajectories) == 2
    assert [a["version"] for a in first.adoptions] == [1] and second.adoptions == []
    assert first.adoptions[0]["at"] >= first.adoptions[0]["published_at"]


def test_tasks_mix_weighs_the_kinds_a_group_draws(tmp_path: Path) -> None:
    import random

    import pytest

    store = stamp_new_run(LocalStore(tmp_path), "tiny")
    db = [Task(id=f"db{i}", prompt="migrate", entry_point="", kind="db") for i in range(3)]
    funcs = [Task(id=f"f{i}", prompt="write", entry_point="f") for i in range(97)]

    def draws(mix: dict[str, float]) -> float:
        cfg = load_config(ROOT / "configs/tiny.toml", [f'store.root="{tmp_path}"'])
        cfg.tasks.mix = mix
        worker = assemble_worker(cfg, "w0", store, None, funcs + db)  # type: ignore[arg-type]
        rng = random.Random(0)
        return sum(worker.draw_task(rng).kind == "db" for _ in range(4000)) / 4000

    assert abs(draws({}) - 0.03) < 0.015  # uniform over tasks: 3 of 100
    assert abs(draws({"function": 1, "db": 3}) - 0.75) < 0.03  # 4000 draws: sd 0.007
    assert draws({"db": 1}) == 1.0
    with pytest.raises(ValueError, match=r"tasks.mix weighs task kind\(s\) \['repo'\]"):
        draws({"function": 1, "repo": 1})
    with pytest.raises(ValueError, match=r"tasks.mix: unknown task kind\(s\) \['sql'\]"):
        load_config(ROOT / "configs/tiny.toml", ["tasks.mix.sql=1.0"])


def test_the_worker_constructor_does_no_io(tmp_path: Path) -> None:
    """Everything the worker reads is handed to it (build_worker reads it); the store is first
    touched when run() starts, to resume after the worker's last batch."""
    import pytest

    from shipyard.envs.environment import Environment
    from shipyard.store.run import RunIdentity

    class Untouchable:
        def __getattr__(self, name: str) -> object:
            raise AssertionError(f"the constructor called store.{name}")

    cfg = load_config(ROOT / "configs/tiny.toml", [f'store.root="{tmp_path}"'])
    identity = RunIdentity(name="tiny", run_id="r1", created_at=0.0)
    worker = RolloutWorker("w0", cfg, Untouchable(), None, [GOOD], Environment.from_config(cfg), identity)  # type: ignore[arg-type]
    assert worker.next_seq == 0 and worker.identity is identity and worker.tasks == [GOOD]
    with pytest.raises(AssertionError, match="store.list"):
        worker.run(max_batches=1)  # the first store call is run()'s resume point


def test_a_worker_whose_server_does_not_answer_waits_in_a_phase_that_can_stall(tmp_path: Path) -> None:
    """While its server cannot be reached (refused here, or accepting and never answering a version
    query within VERSION_TIMEOUT_S) the worker retries in phase ``unreachable``, which is not idle, so
    its watchdog can name it; once a server answers it goes back to the phase it was in. A stopping
    worker gives up with the error."""
    import socket

    from shipyard.inference import client as client_module
    from shipyard.metrics.health import IDLE_PHASES, Health

    with socket.socket() as s:  # a port nothing listens on (yet)
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = load_config(ROOT / "configs/tiny.toml", [f'store.root="{tmp_path}"'])
    store = stamp_new_run(LocalStore(tmp_path), "tiny")
    client = HttpInferenceClient(f"http://127.0.0.1:{port}")
    spec = session_spec(cfg, client, load_tokenizer(cfg.model))
    worker = assemble_worker(cfg, "w0", store, spec, [GOOD])
    worker.beat = Health(40.0).beat("worker w0")
    worker.beat.enter("waiting")
    got: list[int] = []
    t = threading.Thread(target=lambda: got.append(worker.server_version()))
    t.start()
    assert until(lambda: worker.beat.phase == "unreachable", 30)
    assert "unreachable" not in IDLE_PHASES
    node = EmbeddedNode(cfg, store, port=port)
    try:
        t.join(timeout=30)
        assert got == [0] and worker.beat.phase == "waiting"
        silent = socket.create_server(("127.0.0.1", 0))  # accepts, never answers
        with mock.patch.object(client_module, "VERSION_TIMEOUT_S", 0.5):
            mute = HttpInferenceClient(f"http://127.0.0.1:{silent.getsockname()[1]}")
            with pytest.raises(ConnectionError, match=f"127.0.0.1:{silent.getsockname()[1]}"):
                mute.version()
        silent.close()
    finally:
        node.stop()
    worker.stop_event.set()  # stopping, the worker gives up at once (its run returns)
    with pytest.raises(WorkerStopping):
        worker.server_version()
