"""A run owns its data: runs of different names in one store root stay disjoint, another run's store
is refused before any work, the same name resumes, and a foreign rollout is never trained on."""

from __future__ import annotations

import hashlib
import time
from pathlib import Path

import pytest

from shipyard.agent.types import Trajectory
from shipyard.config import load_config
from shipyard.config.schema import StoreConfig
from shipyard.metrics.logger import read_metrics
from shipyard.orchestrate.train import train
from shipyard.rollout.types import RolloutBatch
from shipyard.store import LocalStore, open_store
from shipyard.store.run import RunStoreError, claim_run, list_runs, mirror_run, open_run, stamp_new_run
from shipyard.trainer.feed import RolloutFeed

ROOT = Path(__file__).resolve().parents[2]


def _files(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in root.rglob("*")
        if p.is_file()
    }


def _cfg(tmp: Path, name: str, *extra: str):
    return load_config(
        ROOT / "configs/tiny.toml",
        [
            f"run.name={name}",
            f'run.output_dir="{tmp / "out"}"',
            f'store.root="{tmp / "store"}"',
            f'run.results_dir="{tmp / "results"}"',
            "trainer.steps=2",
            *extra,
        ],
    )


def test_two_runs_in_one_store_root_stay_disjoint(tmp_path: Path) -> None:
    train(_cfg(tmp_path, "a"))
    a_files = _files(tmp_path / "store" / "a")
    assert "RUN.json" in a_files and any(k.startswith("weights/00000002/") for k in a_files)
    a_metrics = read_metrics(tmp_path / "out/a/metrics.jsonl")

    train(_cfg(tmp_path, "b", "trainer.lr=1e-3"))
    assert _files(tmp_path / "store" / "a") == a_files, "run b changed a file of run a's store"
    assert sorted(p.name for p in (tmp_path / "store").iterdir()) == ["a", "b"]
    a_run = open_run(StoreConfig(root=str(tmp_path / "store")), "a")
    b_run = open_run(StoreConfig(root=str(tmp_path / "store")), "b")
    assert a_run.identity.run_id != b_run.identity.run_id
    b_batches = [RolloutBatch.from_bytes(b_run.get(k)) for k in b_run.list("rollouts/")]
    assert b_batches and {x.run_id for x in b_batches} == {b_run.identity.run_id}
    a_groups = {g for r in a_metrics if r.get("kind") == "consumed" for g in r["groups"]}
    b_metrics = read_metrics(tmp_path / "out/b/metrics.jsonl")
    b_train = [r for r in b_metrics if r.get("kind") == "train"]
    assert [r["rollout/foreign_rejected"] for r in b_train] == [0.0, 0.0]
    # b sampled its own rollouts with its own versions: the trainer consumed b's batches only
    b_groups = {g for r in b_metrics if r.get("kind") == "consumed" for g in r["groups"]}
    b_written = {t.group_id for x in b_batches for t in x.trajectories}
    assert b_groups <= b_written and len(b_groups) == 2 * 2
    assert a_groups  # a trained too; its group ids live only in a's store
    a_written = {
        t.group_id
        for k in a_run.list("rollouts/")
        for t in RolloutBatch.from_bytes(a_run.get(k)).trajectories
    }
    assert a_groups <= a_written


def test_another_runs_store_is_refused_naming_store_run_and_field(tmp_path: Path) -> None:
    cfg = StoreConfig(root=str(tmp_path / "store"))
    first = claim_run(cfg, "demo", tmp_path / "runs/demo")
    # the same run again (a crash, Ctrl-C): resumes with the same identity
    assert claim_run(cfg, "demo", tmp_path / "runs/demo").identity == first.identity
    # a new run of the same name elsewhere (its run directory has no record of it): refused
    with pytest.raises(RunStoreError) as e:
        claim_run(cfg, "demo", tmp_path / "elsewhere/demo")
    msg = str(e.value)
    assert str(tmp_path / "store") in msg and first.identity.run_id in msg and "'demo'" in msg
    assert "run.name" in msg and "store.root" in msg
    # a run directory whose store is not this one: refused, naming the field
    with pytest.raises(RunStoreError, match="set store.root to the store that run used"):
        claim_run(StoreConfig(root=str(tmp_path / "other")), "demo", tmp_path / "runs/demo")
    # data under the prefix that no stamp claims (an older layout): refused
    LocalStore(tmp_path / "legacy").put("x/weights/LATEST", b"3")
    with pytest.raises(RunStoreError, match="no run stamp claims"):
        claim_run(StoreConfig(root=str(tmp_path / "legacy")), "x", tmp_path / "runs/x")
    # followers: a name the store does not hold is an error listing the runs it does
    with pytest.raises(RunStoreError, match=r"holds no run named 'nope' \(runs there: \['demo'\]\)"):
        open_run(cfg, "nope")


def test_train_refuses_before_any_work(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, "a")
    claim_run(cfg.store, "a", tmp_path / "someone-else/a")  # another run named `a` owns the prefix
    with pytest.raises(RunStoreError, match="another run's data"):
        train(cfg)
    # refused before any work: not even the run's config was written, no server or model started
    assert not (tmp_path / "out/a/config.json").exists() and not (tmp_path / "out/a/metrics.jsonl").exists()


def test_resume_keeps_the_run_and_its_versions(tmp_path: Path) -> None:
    train(_cfg(tmp_path, "r"))
    before = _files(tmp_path / "store" / "r")
    summary = train(_cfg(tmp_path, "r", "trainer.steps=3"))  # the same run given one more step
    assert summary["trainer"]["final_version"] == 3
    precision = summary["trainer"]["precision"]  # what each component chose, and why
    assert (
        precision["trainer"]["bf16_decoder"] is False
        and "trainer.bf16_decoder=false" in precision["trainer"]["reason"]
    )
    assert precision["inference"] == {
        "dtype": "float32",
        "reason": "inference.dtype=float32 (set explicitly)",
    }
    after = _files(tmp_path / "store" / "r")
    assert before["RUN.json"] == after["RUN.json"]
    v1 = [k for k in before if k.startswith("weights/00000001/")]
    assert v1 and all(after.get(k) == before[k] for k in v1), "a published version was rewritten"
    steps = [r["step"] for r in read_metrics(tmp_path / "out/r/metrics.jsonl") if r.get("kind") == "train"]
    assert steps == [1, 2, 3]


def _traj(group: str, i: int) -> Trajectory:
    return Trajectory(
        task_id="t",
        group_id=group,
        sample_idx=i,
        token_ids=[1, 2, 3],
        logprobs=[0.0, -0.5, -0.5],
        loss_mask=[0, 1, 1],
        versions=[-1, 0, 0],
        prompt_len=1,
        reward=float(i),
    )


def test_a_foreign_rollout_is_rejected_and_counted(tmp_path: Path) -> None:
    store = stamp_new_run(LocalStore(tmp_path), "mine")
    own, other = store.identity.run_id, "0123456789abcdef"
    for seq, (run_id, gid) in enumerate([(other, "x/0"), (own, "y/0"), ("", "z/0")]):
        batch = RolloutBatch(
            f"w0/{seq:08d}", "w0", time.time() + seq, [_traj(gid, 0), _traj(gid, 1)], run_id=run_id
        )
        store.put(batch.key(), batch.to_bytes())
    feed = RolloutFeed(store, own)
    taken = feed.take(1, current_version=0, max_off_policy_steps=0, timeout_s=5)
    assert [g[0].group_id for g in taken.groups] == ["y/0"]
    assert taken.foreign_rejected == 2 and feed.foreign_rejected == 2  # another run's and an unstamped one
    with pytest.raises(TimeoutError):
        feed.take(1, current_version=0, max_off_policy_steps=0, timeout_s=0.5)


def test_runs_are_disjoint_on_s3_and_the_mirror_keeps_the_identity(
    s3_cfg: StoreConfig, tmp_path: Path
) -> None:
    a = claim_run(s3_cfg, "a", tmp_path / "a")
    b = claim_run(s3_cfg, "b", tmp_path / "b")
    a.put("weights/LATEST", b"1")
    b.put("weights/LATEST", b"2")
    assert a.get("weights/LATEST") == b"1" and b.get("weights/LATEST") == b"2"
    root = open_store(s3_cfg)
    assert list_runs(root) == ["a", "b"]
    assert sorted(root.list("a/")) == ["a/RUN.json", "a/weights/LATEST"]
    with pytest.raises(RunStoreError, match="another run's data"):
        claim_run(s3_cfg, "a", tmp_path / "new-a")
    mirror_cfg = StoreConfig(root=str(tmp_path / "mirror"))
    assert mirror_run(mirror_cfg, a.identity).identity == a.identity
    assert open_run(mirror_cfg, "a").identity == a.identity  # region servers attach to the mirror
    b_in_place_of_a = type(a.identity)(name="a", run_id=b.identity.run_id, created_at=0.0)
    with pytest.raises(RunStoreError, match="relay.mirror.root"):
        mirror_run(mirror_cfg, b_in_place_of_a)


def test_the_before_evaluation_scores_only_the_runs_own_base(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    """A run whose store already holds a trained version (resumed) and no eval_before.json does not
    score whatever the servers follow as its "before": it says so and skips the comparison; a run
    with its eval_before.json reuses it, unless it scored other tasks."""
    import json

    import torch

    from shipyard.envs.types import Task
    from shipyard.orchestrate.train import _eval_once
    from shipyard.weights.publisher import WeightPublisher

    store = stamp_new_run(LocalStore(tmp_path / "store"), "r")
    cfg = _cfg(tmp_path, "r")
    pub = WeightPublisher(store)
    pub.publish(0, {"w": torch.zeros(4)})
    pub.publish(1, {"w": torch.ones(4)})
    assert _eval_once(tmp_path / "eval_before.json", None, [], cfg, store) is None
    assert "skipped: this run resumed at version 1" in capsys.readouterr().out.replace("\n", " ")
    saved = {"task_ids": ["a"], "passed": [1], "rewards": [1.0], "errors": 0}
    (tmp_path / "eval_before.json").write_text(json.dumps(saved))
    tasks = [Task(id="a", prompt="p", entry_point="f")]
    reused = _eval_once(tmp_path / "eval_before.json", None, tasks, cfg, store)
    assert reused is not None and reused.passed == [1]
    other = [Task(id="b", prompt="p", entry_point="f")]  # e.g. eval.split changed since it was written
    with pytest.raises(ValueError, match="scored other tasks than this run evaluates"):
        _eval_once(tmp_path / "eval_before.json", None, other, cfg, store)
