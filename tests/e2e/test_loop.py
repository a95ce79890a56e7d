"""The whole loop on a tiny model: async and sync runs, kill-and-resume, through the real store."""

import itertools
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shipyard.config import load_config
from shipyard.metrics.logger import read_metrics
from shipyard.orchestrate.train import train
from shipyard.rollout.types import RolloutBatch
from shipyard.store import LocalStore
from shipyard.weights.snapshot import latest_version, published_versions, read_manifest

ROOT = Path(__file__).resolve().parents[2]


def _overrides(tmp: Path, *extra: str) -> list[str]:
    return [
        f'run.output_dir="{tmp}"',
        f'store.root="{tmp / "store"}"',
        f'run.results_dir="{tmp / "results"}"',
        *extra,
    ]


def _trajectories(store: LocalStore) -> dict[str, list]:
    out: dict[str, list] = {}
    for key in store.list("rollouts/"):
        for gid, group in RolloutBatch.from_bytes(store.get(key)).groups().items():
            out[gid] = group
    return out


def _consumed(records: list[dict]) -> dict[int, list[str]]:
    return {r["step"]: r["groups"] for r in records if r.get("kind") == "consumed"}


def test_async_run_end_to_end(tmp_path: Path) -> None:
    cfg = load_config(ROOT / "configs/tiny.toml", _overrides(tmp_path, "fleet.region=eu-west"))
    train(cfg)
    store = LocalStore(tmp_path / "store" / "tiny")
    records = read_metrics(tmp_path / "tiny/metrics.jsonl")
    steps = [r for r in records if r.get("kind") == "train"]
    assert [r["step"] for r in steps] == [1, 2, 3]
    # the region's staleness and its server's adoptions reach the trainer's metrics
    assert all(r["region/eu-west/groups"] == cfg.trainer.groups_per_step for r in steps)
    assert all(r["rollout/over_bound_trained"] == 0 for r in steps)
    # a step reports the lag of the adoptions its batches carried; on a loaded machine the worker can
    # queue every trained batch (version 0, within max_off_policy_steps) before the first adoption,
    # so the lags are checked on the stored batches, and on the steps only where they carried any
    lags = [r["region/eu-west/adoption_lag_s"] for r in steps if "region/eu-west/adoption_lag_s" in r]
    assert all(0 <= lag < 60 for lag in lags)
    batches = [RolloutBatch.from_bytes(store.get(k)) for k in store.list("rollouts/")]
    stored = [a["at"] - a["published_at"] for b in batches for a in b.adoptions if a.get("published_at")]
    assert stored and all(0 <= lag < 60 for lag in stored)
    assert {b.region for b in batches} == {"eu-west"}
    adopted = sorted(a["version"] for b in batches for a in b.adoptions)
    assert adopted == sorted(set(adopted)) and adopted[0] >= 1  # each adoption reported once
    assert latest_version(store) == 3 and store.exists("control/finished")
    # the watchdog watched every component and named none (issue 40)
    health = [json.loads(x) for x in (tmp_path / "tiny/health.jsonl").read_text().splitlines()]
    assert not [h for h in health if h["kind"] == "stall"]
    watched = {c["component"] for h in health if h["kind"] == "snapshot" for c in h["components"]}
    assert {"trainer", "worker w0", "server 0"} <= watched, watched
    shipped = [read_manifest(store, v) for v in (1, 2, 3)]  # versions after 0 ship as deltas only
    assert [(m.kind, m.parent, set(m.encodings)) for m in shipped] == [
        ("delta", v, {"delta"}) for v in (0, 1, 2)
    ]
    assert all(m.encodings["delta"].nbytes < m.raw_bytes / 2 for m in shipped), (
        "a delta costs < half the state"
    )
    assert all(r["staleness/max"] <= cfg.trainer.max_off_policy_steps for r in steps)
    assert all(r["mismatch/k3"] < 1e-3 for r in steps), "fp32 engine and trainer should agree closely"
    groups = [g for gs in _consumed(records).values() for g in gs]
    assert len(groups) == len(set(groups)) == 3 * cfg.trainer.groups_per_step
    trajs = _trajectories(store)
    for gid in groups:
        assert len(trajs[gid]) == cfg.rollout.group_size
        for t in trajs[gid]:
            assert t.error is None and t.reward_info["total"] > 0
            assert all((v >= 0) == bool(m) for v, m in zip(t.versions, t.loss_mask, strict=True))
            assert (
                t.num_sampled() > 0 and t.token_ids[: t.prompt_len] == trajs[gid][0].token_ids[: t.prompt_len]
            )
    assert (tmp_path / "tiny/reward.png").stat().st_size > 10_000
    assert any((tmp_path / "tiny/tb").iterdir())


def test_sync_mode_samples_each_step_with_the_previous_version(tmp_path: Path) -> None:
    cfg = load_config(ROOT / "configs/tiny.toml", _overrides(tmp_path, "trainer.mode=sync"))
    train(cfg)
    records = read_metrics(tmp_path / "tiny/metrics.jsonl")
    trajs = _trajectories(LocalStore(tmp_path / "store" / "tiny"))
    for step, gids in _consumed(records).items():
        versions = {
            v for gid in gids for t in trajs[gid] for v, m in zip(t.versions, t.loss_mask, strict=True) if m
        }
        assert versions == {step - 1}, f"step {step} trained on versions {versions}"
    # versions 1 and 2 exist only as deltas, so the server sampled them by applying deltas
    store = LocalStore(tmp_path / "store" / "tiny")
    assert [read_manifest(store, v).kind for v in (1, 2)] == ["delta", "delta"]


def test_verified_streaming_run_trains_an_untrusted_honest_worker(tmp_path: Path) -> None:
    """``fleet.verify`` on, the only worker untrusted, every session checked and re-graded, groups
    streamed: the run trains on all of it, and quarantines nothing."""
    over = [
        "fleet.verify.enabled=true",
        "fleet.verify.rollout_frac=1.0",
        "fleet.verify.regrade_frac=1.0",
        "rollout.streaming=true",
    ]
    train(load_config(ROOT / "configs/tiny.toml", _overrides(tmp_path, *over)))
    store = LocalStore(tmp_path / "store" / "tiny")
    steps = [r for r in read_metrics(tmp_path / "tiny/metrics.jsonl") if r.get("kind") == "train"]
    assert [r["step"] for r in steps] == [1, 2, 3] and not store.list("fleet/quarantine/")
    assert sum(r["rollout/refused_groups"] + r["rollout/dropped_quarantined"] for r in steps) == 0
    batches = [RolloutBatch.from_bytes(store.get(k)) for k in store.list("rollouts/")]
    digests = {v: read_manifest(store, int(v)).state_digest for b in batches for v in b.claims}
    assert all(b.claims == {v: digests[v] for v in b.claims} and b.claims for b in batches)
    assert all("/g" in gid for b in batches for gid in b.groups())  # streamed group ids


@pytest.mark.timeout(600)
def test_killed_run_resumes_without_losing_versions_or_reusing_rollouts(tmp_path: Path) -> None:
    cmd = [
        sys.executable,
        "-m",
        "shipyard.cli",
        "train",
        str(ROOT / "configs/tiny.toml"),
        "trainer.steps=6",
        *_overrides(tmp_path),
    ]
    metrics = tmp_path / "tiny/metrics.jsonl"
    proc = subprocess.Popen(
        cmd, cwd=tmp_path, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    deadline = time.time() + 300
    while not any(r.get("kind") == "train" and r["step"] >= 2 for r in read_metrics(metrics)):
        assert proc.poll() is None and time.time() < deadline, "first run ended or stalled before step 2"
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    before_kill = {r["step"]: r["digest"] for r in read_metrics(metrics) if r.get("kind") == "consumed"}
    assert max(before_kill) < 6
    subprocess.run(
        cmd, cwd=tmp_path, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=400
    )
    records = read_metrics(metrics)
    steps = [r["step"] for r in records if r.get("kind") == "train"]
    assert sorted(set(steps)) == list(range(1, 7)) and len(steps) == len(set(steps)), steps
    groups = [g for gs in _consumed(records).values() for g in gs]
    assert len(groups) == len(set(groups)), "a rollout group was trained on twice"
    store = LocalStore(tmp_path / "store" / "tiny")
    assert latest_version(store) == 6
    digests = {r["step"]: r["digest"] for r in records if r.get("kind") == "consumed"}
    for v in published_versions(
        store
    ):  # version 0 (the base model, kept as the delta chain's root) has no step
        assert v == 0 or read_manifest(store, v).state_digest == digests[v]
    for step, digest in before_kill.items():
        assert digests[step] == digest, f"version {step} was republished with different weights"
    elapsed = [
        r["time/elapsed_s"] for r in sorted(records, key=lambda r: r["step"]) if r.get("kind") == "train"
    ]
    assert all(b > a for a, b in itertools.pairwise(elapsed)), f"the clock restarted on resume: {elapsed}"
