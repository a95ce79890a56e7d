"""Tests of :mod:`shipyard.envs.environment`: per-session hooks for every task kind, with anti-cheat.

Contract checked: the hooks' sandbox records every command; the grader returns the weighted
composite of the components, the flags that fired on the files and commands, and ``annotate``
puts components, flags and the task's source on trajectories; a function-task session that
exits early and edits its tests is flagged and earns 0; a repo-task session works in a
copy-on-write sandbox over the squashed repository (``git diff`` there is not flagged) and is
graded from its diff; a db-task session reaches its own database clone, which is gone when the
hooks close; a weighted but unreachable judge costs its weight, not the session; and a real
rollout worker mixes canaries at the configured rate, so the trainer's metrics carry
``hack/canary_pass_rate`` (0: the grader is not breached) and per-flag rates.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from shipyard.agent.spec import session_spec
from shipyard.agent.types import Trajectory
from shipyard.config import load_config
from shipyard.config.schema import AntiCheatConfig, JudgeConfig, RewardsConfig, SandboxConfig
from shipyard.envs.environment import Environment
from shipyard.envs.grading.anticheat import FLAGS
from shipyard.envs.services.postgres import postgres_available
from shipyard.envs.tasks.db import APPLY, MIGRATION_FILE, db_tasks
from shipyard.envs.tasks.repo import apply_patch_locally, repo_tasks
from shipyard.envs.types import Task
from shipyard.inference.backends.embedded import EmbeddedNode
from shipyard.inference.client import HttpInferenceClient
from shipyard.orchestrate.components import assemble_worker
from shipyard.rollout.types import RolloutBatch
from shipyard.store import LocalStore
from shipyard.store.run import stamp_new_run
from shipyard.trainer.feed import Taken
from shipyard.trainer.loop import _rollout_metrics

ROOT = Path(__file__).resolve().parents[2]
CFG = SandboxConfig(timeout_s=30)
ADD = Task(
    id="env-add",
    prompt="Write `add(a, b)`.",
    entry_point="add",
    visible_tests="from solution import add\n\ndef test_v():\n    assert add(1, 2) == 3\n",
    hidden_tests="from solution import add\n\ndef test_a():\n    assert add(2, 2) == 4\n\n\n"
    "def test_b():\n    assert add(-1, 1) == 0\n",
)
VISIBLE = {"test_visible.py": ADD.visible_tests}


def _traj() -> Trajectory:
    return Trajectory("t", "g", 0, [1], [0], [0.0], [-1], prompt_len=1)


def test_function_session_cheating_is_flagged_and_earns_nothing() -> None:
    with Environment(CFG) as env, env.session(ADD) as hooks:
        sb = hooks.sandbox(dict(VISIBLE))
        sb.exec("git log --all; echo 'def test_v(): pass' > test_visible.py")
        sb.write("solution.py", "import sys\n\ndef add(a, b):\n    sys.exit(0)\n")
        res = hooks.grade(ADD, sb.files())
        sb.close()
    assert res.reward == 0.0 and res.details["components"] == {"tests": 0.0}
    assert hooks.flags == ["early_exit", "git_history", "test_tampering"]
    assert hooks.commands == ["git log --all; echo 'def test_v(): pass' > test_visible.py"]
    traj = _traj()
    hooks.annotate([traj])
    assert traj.reward_components == {"tests": 0.0} and traj.flags == hooks.flags
    assert traj.reward_info["source"] == "generated"


def test_honest_session_is_clean_and_the_callers_factory_is_used() -> None:
    made: list[dict[str, str]] = []

    def factory(files: dict[str, str]):  # the run's own factory for function tasks
        from shipyard.envs.sandbox import BwrapSandbox

        made.append(files)
        return BwrapSandbox(files, CFG)

    with Environment(CFG) as env, env.session(ADD, factory) as hooks:
        sb = hooks.sandbox(dict(VISIBLE))
        sb.write("solution.py", "def add(a, b):\n    return a + b\n")
        assert sb.exec("python -m pytest -q -p no:cacheprovider test_visible.py").returncode == 0
        res = hooks.grade(ADD, sb.files())
        sb.close()
    assert made == [VISIBLE] and res.reward == 1.0 and hooks.flags == []


def test_repo_session_on_the_squashed_repository() -> None:
    task = repo_tasks(1, seed=0)[0]
    fixed = apply_patch_locally(task.files, task.reference)
    with Environment(CFG) as env, env.session(task) as hooks:
        sb = hooks.sandbox(dict(task.files))
        assert sb.exec("git log --oneline --all").stdout.count("\n") == 1
        for path, text in fixed.items():
            if text != task.files.get(path):
                sb.write(path, text)
        assert sb.exec("git diff --stat").stdout.strip()
        res = hooks.grade(task, sb.files())
        sb.close()
    assert res.reward == 1.0 and hooks.flags == [] and res.details["patch_lines"] > 0


@pytest.mark.skipif(postgres_available() is not None, reason=str(postgres_available()))
def test_db_session_gets_its_own_clone_dropped_after() -> None:
    task = db_tasks(1, seed=0)[0]
    with Environment(CFG) as env:
        with env.session(task) as hooks:
            sb = hooks.sandbox(dict(task.files))
            sb.write(MIGRATION_FILE, task.reference)
            assert sb.exec(APPLY).returncode == 0
            res = hooks.grade(task, sb.files())
            sb.close()
            pg = env.services.get("postgres")
            [mine] = [d for d in pg.databases() if d.startswith("r_")]  # type: ignore[attr-defined]
            assert ".pg_service.conf" in hooks.original
        assert mine not in pg.databases()  # type: ignore[attr-defined]
    assert res.reward == 1.0 and hooks.flags == []


def test_unreachable_judge_costs_its_weight_only() -> None:
    rewards = RewardsConfig(
        weights={"tests": 0.6, "judge": 0.4}, judge=JudgeConfig(base_url="http://127.0.0.1:9/v1", timeout_s=5)
    )
    env = Environment(CFG, rewards=rewards, anticheat=AntiCheatConfig(detect=False))
    with env, env.session(ADD) as hooks:
        sb = hooks.sandbox(dict(VISIBLE))
        sb.write("solution.py", "def add(a, b):\n    return a + b\n")
        res = hooks.grade(ADD, sb.files())
        sb.close()
    assert res.reward == pytest.approx(0.6)
    assert hooks.components == {"tests": 1.0, "judge/correctness": 0.0, "judge/quality": 0.0, "judge": 0.0}
    assert res.details["judge"]["error"].startswith("judge call failed") and "flags" not in res.details


def test_judge_self_is_the_workers_own_server(tmp_path: Path) -> None:
    from shipyard.envs.grading.judge import RubricJudge, resolve_self
    from shipyard.orchestrate.components import build_worker

    judge = JudgeConfig(base_url="self")
    assert resolve_self(judge, "http://127.0.0.1:8123/").base_url == "http://127.0.0.1:8123/v1"
    other = JudgeConfig(base_url="http://judge.internal:9000/v1")
    assert resolve_self(other, "http://127.0.0.1:8123") is other
    with pytest.raises(ValueError, match="'self' .* is resolved by the rollout worker"):
        RubricJudge(judge)
    with pytest.raises(ValueError, match="server URL 'unix:/x' is not http"):
        resolve_self(judge, "unix:/x")
    cfg = load_config(
        ROOT / "configs/tiny.toml",
        [
            f'store.root="{tmp_path}"',
            'rewards.judge.base_url="self"',
            "rewards.weights={tests=0.5, judge=0.5}",
        ],
    )
    store = stamp_new_run(LocalStore(tmp_path), "tiny")
    node = EmbeddedNode(cfg, store)
    try:
        worker = build_worker(cfg, "w0", node.url, store)
        assert worker.env.judge is not None and worker.env.judge.url == f"{node.url}/v1/chat/completions"
        assert cfg.rewards.judge.base_url == "self"  # the caller's config is not rewritten
        [traj] = worker.play_session(ADD, "g", 0)
        verdict = worker.env.judge.score(ADD.prompt, "")
    finally:
        node.stop()
    # the random tiny policy answered the judge's request: a reply that is no verdict, not a failed call
    assert traj.error is None and set(traj.reward_components) == {
        "tests",
        "judge",
        "judge/correctness",
        "judge/quality",
    }
    assert traj.reward == pytest.approx(
        0.5 * traj.reward_components["tests"] + 0.5 * traj.reward_components["judge"]
    )
    assert verdict.error is not None and verdict.error.startswith("unparseable verdict") and verdict.raw


def test_worker_mixes_canaries_and_the_trainer_logs_hack_metrics(tmp_path: Path) -> None:
    cfg = load_config(
        ROOT / "configs/tiny.toml",
        [
            f'store.root="{tmp_path}"',
            "trainer.groups_per_step=2",
            "rollout.group_size=2",
            "anticheat.canary_rate=0.5",
        ],
    )
    store = stamp_new_run(LocalStore(tmp_path), "tiny")
    node = EmbeddedNode(cfg, store)
    try:
        spec = session_spec(cfg, HttpInferenceClient(node.url), node.tokenizer)
        worker = assemble_worker(cfg, "w0", store, spec, [ADD])
        assert worker.run(max_batches=3) == 3
    finally:
        node.stop()
    trajs = [
        t for k in store.list("rollouts/w0/") for t in RolloutBatch.from_bytes(store.get(k)).trajectories
    ]
    canary = [t for t in trajs if t.reward_info.get("source") == "canary"]
    assert canary and len(canary) < len(trajs)  # seeded draw at rate 0.5 over 6 groups
    assert all(t.task_id.startswith("canary-") for t in canary)
    graded = [t for t in trajs if t.error is None]
    assert graded and all(set(t.reward_components) == {"tests"} for t in graded)
    assert all(t.reward == t.reward_components["tests"] for t in graded)
    groups: dict[str, list[Trajectory]] = {}
    for t in trajs:
        groups.setdefault(t.group_id, []).append(t)
    metrics = _rollout_metrics(Taken(list(groups.values()), 0.0), trajs)
    assert metrics["hack/canary_sessions"] == len(canary) and metrics["hack/canary_pass_rate"] == 0.0
    assert {f"hack/flag/{f}" for f in FLAGS} <= set(metrics) and 0.0 <= metrics["hack/flagged_frac"] <= 1.0
    assert metrics["reward/component/tests"] == pytest.approx(
        sum(t.reward_components["tests"] for t in graded) / len(graded)
    )


@pytest.mark.skipif(postgres_available() is not None, reason=str(postgres_available()))
def test_worker_plays_db_tasks_on_per_rollout_clones(tmp_path: Path) -> None:
    cfg = load_config(
        ROOT / "configs/tiny.toml",
        [f'store.root="{tmp_path}"', "trainer.groups_per_step=1", "rollout.group_size=2", "tasks.num_db=1"],
    )
    store = stamp_new_run(LocalStore(tmp_path), "tiny")
    node = EmbeddedNode(cfg, store)
    try:
        spec = session_spec(cfg, HttpInferenceClient(node.url), node.tokenizer)
        worker = assemble_worker(cfg, "w0", store, spec, [])
        assert [t.kind for t in worker.tasks] == ["db"]
        assert worker.run(max_batches=1) == 1
        assert worker.env.services._services == {}  # the pool's server was stopped when run ended
    finally:
        node.stop()
    [batch] = [RolloutBatch.from_bytes(store.get(k)) for k in store.list("rollouts/w0/")]
    sessions = [t for t in batch.trajectories if t.segment_idx == 0]
    assert len(sessions) == 2 and all(t.error is None for t in sessions), [t.error for t in sessions]
    assert all(t.task_id.startswith("db-") and set(t.reward_components) == {"tests"} for t in sessions)
    assert all(t.reward_info["source"] == "db" and "total" in t.reward_info for t in sessions)
    [(gid, means)] = batch.group_components().items()
    assert gid == sessions[0].group_id and means == {"tests": sum(t.reward for t in sessions) / 2}
