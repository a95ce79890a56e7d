"""What `shipyard view` reads from a real run: session turns, diffs and grades recorded by the
harness, the trainer's per-token logprobs, server adoptions, and the JSON API over them (paging,
filters, live metrics, bad input)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from shipyard.config.schema import ModelConfig, StoreConfig
from shipyard.eval.stats import paired_diff_ci
from shipyard.metrics.logger import read_metrics
from shipyard.models.loading import load_tokenizer
from shipyard.rollout.types import RolloutBatch
from shipyard.store.run import open_run
from shipyard.trainer.records import read_step_logprobs, token_key
from shipyard.view.run import RunReader
from shipyard.view.server import Runs, make_app
from shipyard.weights.snapshot import read_manifest


def _store(run_dir: Path):
    return open_run(StoreConfig(root=str(run_dir.parent / "store")), run_dir.name)


def _segments(run_dir: Path) -> list:
    store = _store(run_dir)
    return [
        t for key in store.list("rollouts/") for t in RolloutBatch.from_bytes(store.get(key)).trajectories
    ]


def test_turns_tile_each_segment_and_carry_tool_calls_summaries_diff_and_grade(tiny_run) -> None:
    run_dir, expert_ids = tiny_run
    tok = load_tokenizer(ModelConfig(source="tiny"))
    segs = _segments(run_dir)
    for t in segs:
        spans = [(turn["start"], turn["end"]) for turn in t.turns]
        assert spans[0][0] == 0 and spans[-1][1] == len(t.token_ids), t.session_id
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:], strict=False)), "turns are contiguous"
        assert t.turns[0]["role"] == "prompt" and t.turns[0]["end"] == t.prompt_len
        for turn in t.turns:
            sampled = {t.loss_mask[i] for i in range(turn["start"], turn["end"])}
            assert sampled == ({1} if turn["role"] in ("assistant", "summary") else {0}), turn["role"]
            if turn["role"] == "assistant":
                ids = t.token_ids[turn["start"] : turn["end"]]
                assert turn["text"] == tok.decode(ids, skip_special_tokens=True)
    expert = [t for t in segs if t.session_id in expert_ids]
    last = [t for t in expert if t.segment_idx == t.num_segments - 1]
    assert len(last) == 2 and all(t.num_segments >= 2 for t in last)
    for t in last:
        assert t.grade["tests"] and all(v["outcome"] == "passed" for v in t.grade["tests"].values())
        [write] = [turn for turn in t.turns if turn.get("action") == "write"]
        assert write["path"] == "solution.py" and t.changes.startswith("--- /dev/null\n+++ b/solution.py\n")
        added = "".join(line[1:] + "\n" for line in t.changes.splitlines()[3:])
        assert added.strip() in write["text"], "the diff holds exactly the file the agent wrote"
    runs = [turn for t in expert for turn in t.turns if turn.get("action") == "run"]
    assert [turn["command"] for turn in runs[:2]] == ["cat part_00.py", "cat part_01.py"]
    summaries = [t for t in expert if t.finish == "summary"]
    assert summaries and all(t.turns[-1]["role"] == "summary" for t in summaries)
    assert all(t.changes == "" and t.grade == {} for t in expert if t.finish == "summary")


def test_trainer_logprobs_cover_every_sampled_token_and_reproduce_k1(tiny_run) -> None:
    run_dir, _ = tiny_run
    by_key = {token_key(t): t for t in _segments(run_dir)}
    train = [r for r in read_metrics(run_dir / "metrics.jsonl") if r.get("kind") == "train"]
    for rec in train:
        record = read_step_logprobs(run_dir, rec["step"])
        assert len(record) == 8, "2 groups x 4 sessions, one segment each"
        diffs = []
        for key, trainer in record.items():
            t = by_key[key]
            sampler = [lp for lp, m in zip(t.logprobs, t.loss_mask, strict=True) if m]
            assert len(trainer) == len(sampler) == t.num_sampled()
            diffs += [s - tr for s, tr in zip(sampler, trainer, strict=True)]
        assert sum(diffs) / len(diffs) == pytest.approx(rec["mismatch/k1"], abs=1e-4)
    assert read_step_logprobs(run_dir, 99) == {}


def test_servers_record_each_adoption_with_its_time_from_publication(tiny_run) -> None:
    run_dir, _ = tiny_run
    [server] = RunReader(run_dir).servers()
    assert [a["version"] for a in server["adoptions"]] == [1, 2, 3] and server["version"] == 3
    store = _store(run_dir)
    for a in server["adoptions"]:
        assert a["published_at"] == read_manifest(store, a["version"]).created_at
        assert 0 <= a["sync_s"] < 60 and a["bytes"] > 0


def test_rollout_list_pages_filters_and_sorts(tiny_run) -> None:
    run_dir, expert_ids = tiny_run
    c = TestClient(make_app(Runs([run_dir])))
    every = c.get("/api/runs/tiny/rollouts", params={"limit": 1000}).json()
    sessions = {t.session_id for t in _segments(run_dir)}
    assert every["total"] == len(sessions) and every["indexed"] == every["batches"]
    assert set(every["families"]) == {"gen", "long"}
    trained = c.get("/api/runs/tiny/rollouts", params={"trained": "true", "limit": 1000}).json()
    assert trained["total"] == 3 * 2 * 4
    consumed = [r for r in read_metrics(run_dir / "metrics.jsonl") if r.get("kind") == "consumed"]
    for rec in consumed:
        rows = c.get("/api/runs/tiny/rollouts", params={"step": rec["step"], "limit": 100}).json()["rows"]
        assert sorted({r["group_id"] for r in rows}) == sorted(rec["groups"])
        assert all(r["staleness"] == rec["step"] - 1 - r["version_min"] for r in rows)
    best = c.get("/api/runs/tiny/rollouts", params={"sort": "-reward", "limit": 2}).json()["rows"]
    assert {r["id"] for r in best} == set(expert_ids) and all(r["reward"] == 1.0 for r in best)
    longs = c.get("/api/runs/tiny/rollouts", params={"family": "long", "min_reward": 1}).json()
    assert longs["total"] == 2
    pages = [
        c.get("/api/runs/tiny/rollouts", params={"offset": o, "limit": 5, "sort": "length"}).json()["rows"]
        for o in range(0, every["total"], 5)
    ]
    flat = [r for page in pages for r in page]
    assert [r["length"] for r in flat] == sorted(r["length"] for r in every["rows"])
    assert len(flat) == len({r["id"] for r in flat}) == len(sessions), "pages neither overlap nor skip"


def test_a_rollout_opens_with_turns_tokens_diff_and_grade(tiny_run) -> None:
    run_dir, expert_ids = tiny_run
    c = TestClient(make_app(Runs([run_dir])))
    d = c.get("/api/runs/tiny/rollout", params={"id": expert_ids[0]}).json()
    assert d["reward"] == 1.0 and d["step"] is None and d["trainer_logprobs"] is False
    assert "+++ b/solution.py" in d["changes"] and d["grade"]["tests"]
    roles = [turn["role"] for seg in d["segments"] for turn in seg["turns"]]
    assert roles.count("summary") == len(d["segments"]) - 1 and roles.count("prompt") == len(d["segments"])
    sampled = sum(len(turn.get("tokens", [])) for seg in d["segments"] for turn in seg["turns"])
    assert sampled == d["sampled"]
    trained = c.get("/api/runs/tiny/rollouts", params={"trained": "true", "limit": 1}).json()["rows"][0]
    d = c.get("/api/runs/tiny/rollout", params={"id": trained["id"]}).json()
    assert d["trainer_logprobs"] is True
    toks = [tk for seg in d["segments"] for turn in seg["turns"] for tk in turn.get("tokens", [])]
    assert toks and all(tk[2] is not None and abs(tk[2] - tk[1]) < 1e-3 for tk in toks), (
        "fp32 engine = trainer"
    )
    assert (
        min(tk[3] for tk in toks) == trained["version_min"]
        and max(tk[3] for tk in toks) == trained["version_max"]
    )


def test_metrics_are_read_incrementally_and_a_torn_line_waits(tiny_run, tmp_path: Path) -> None:
    run_dir, _ = tiny_run
    copy = tmp_path / "copy"
    shutil.copytree(run_dir, copy, ignore=shutil.ignore_patterns("checkpoints", "tb"))
    lines = (copy / "metrics.jsonl").read_text().splitlines(keepends=True)
    train = [i for i, line in enumerate(lines) if '"kind": "train"' in line]
    (copy / "metrics.jsonl").write_text("".join(lines[: train[-1]]) + "not json\n" + lines[train[-1]][:40])
    reader = RunReader(copy)
    first = reader.metrics()
    assert [r["step"] for r in first["records"]] == [1, 2] and first["next"] == 2
    assert any("could not be parsed" in p for p in reader.status()["problems"])
    with open(copy / "metrics.jsonl", "a") as f:
        f.write(lines[train[-1]][40:])
    later = reader.metrics(after=first["next"])
    assert [r["step"] for r in later["records"]] == [3] and later["next"] == 3
    assert not any("/bucket_" in k for k in later["records"][0])


def test_bad_input_gets_messages_not_tracebacks(tiny_run, tmp_path: Path) -> None:
    run_dir, _ = tiny_run
    with pytest.raises(ValueError, match="does not exist"):
        RunReader(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="not a Shipyard run directory"):
        RunReader(tmp_path / "empty")
    half = tmp_path / "half"
    half.mkdir()
    (half / "run.json").write_text((run_dir / "run.json").read_text())
    c = TestClient(make_app(Runs([run_dir, half])))
    status = c.get("/api/runs/half/status").json()
    assert status["state"] == "starting" and status["steps_done"] == 0
    assert any("no config.json" in p for p in status["problems"])
    assert c.get("/api/runs/half/metrics").json() == {"records": [], "next": 0}
    assert "store is unknown" in c.get("/api/runs/half/rollouts").json()["problem"]
    answers = [
        (c.get("/api/runs/tiny/rollout", params={"id": "w9/nope"}), 404, "has no rollout 'w9/nope'"),
        (c.get("/api/runs/tiny/rollout"), 400, "needs ?id="),
        (c.get("/api/runs/other/metrics"), 404, "no run 'other' in this viewer (it shows: tiny, half)"),
        (
            c.get("/api/runs/tiny/rollouts", params={"min_reward": "x"}),
            400,
            "min_reward='x' is not a valid float",
        ),
        (c.get("/api/runs/tiny/rollouts", params={"colour": "red"}), 400, "unknown rollout filter 'colour'"),
        (c.get("/api/runs/tiny/rollouts", params={"limit": 0}), 400, "1 <= limit <= 1000"),
        (c.post("/api/runs", json={"dir": str(tmp_path / "gone")}), 400, "does not exist"),
        (c.post("/api/runs", content=b"{"), 400, 'takes JSON {"dir"'),
    ]
    for response, code, message in answers:
        body = response.json()
        assert response.status_code == code and message in body["error"], body
        assert "Traceback" not in body["error"]


def test_evals_come_with_their_intervals(tiny_run, tmp_path: Path) -> None:
    run_dir, _ = tiny_run
    copy = tmp_path / "r"
    shutil.copytree(run_dir, copy, ignore=shutil.ignore_patterns("checkpoints", "tb", "logprobs"))
    (copy / "eval_before.json").write_text(
        json.dumps({"task_ids": ["a"] * 100, "passed": [1] * 60 + [0] * 40})
    )
    summary = json.loads((copy / "summary.json").read_text())
    summary["demo"] = {
        "heldout_n": 100,
        "heldout_after": 0.7,
        "heldout_diff": 0.1,
        "heldout_diff_ci95_low": 0.02,
        "heldout_diff_ci95_high": 0.18,
    }
    (copy / "summary.json").write_text(json.dumps(summary))
    before, after, diff = RunReader(copy).evals()
    assert (
        before["value"] == 0.6
        and before["low"] == pytest.approx(0.502, abs=1e-3)
        and before["high"] == pytest.approx(0.691, abs=1e-3)
    )
    assert after["value"] == 0.7 and after["low"] < 0.7 < after["high"]
    assert (diff["value"], diff["low"], diff["high"]) == (0.1, 0.02, 0.18)
    after_passed = [1] * 60 + [1] * 15 + [0] * 25  # 15 tasks fixed, 5 broken below
    after_passed[:5] = [0] * 5
    (copy / "eval_after.json").write_text(json.dumps({"task_ids": ["a"] * 100, "passed": after_passed}))
    _, after, diff = RunReader(copy).evals()
    assert after["value"] == 0.7 and diff["name"] == "held-out (validation) difference (paired)"
    expected = paired_diff_ci([1.0] * 60 + [0.0] * 40, [float(p) for p in after_passed])
    assert (diff["value"], diff["low"], diff["high"]) == pytest.approx(expected) and expected[
        0
    ] == pytest.approx(0.1)


def test_cli_refuses_a_directory_that_is_not_a_run(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "shipyard.cli", "view", str(tmp_path / "missing")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2 and "does not exist" in out.stderr and "Traceback" not in out.stderr


def test_cli_serves_the_runs_on_loopback(tiny_run) -> None:
    import socket
    import urllib.request

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "shipyard.cli", "view", str(tiny_run[0]), "--port", str(port)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert f"tiny at http://127.0.0.1:{port}/" in line, line
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/runs", timeout=60) as r:
            runs = json.loads(r.read())  # it listens before it prints: no retry needed
        assert [r["label"] for r in runs] == ["tiny"] and runs[0]["steps_done"] == 3
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=5) as r:
            assert b"shipyard view" in r.read()
    finally:
        proc.terminate()
        assert proc.wait(30) == 0


def test_health_counts_each_components_stalls_and_crashes(tmp_path: Path) -> None:
    """Issue 40: a component's row carries its stall and crash records (the Ray driver records a
    worker whose actor died as a crash) and the last one; a component with none has no event."""
    run = tmp_path / "run"
    run.mkdir()
    comp = {"phase": "sessions", "ticks": 4, "deadline_s": 300.0, "last_progress_at": 1000.0}
    lines = [
        {
            "kind": "snapshot",
            "at": 1001.0,
            "components": [
                {"component": "worker w0", **comp},
                {"component": "trainer", **comp, "phase": "wait_rollouts"},
            ],
        },
        {
            "kind": "stall",
            "component": "worker w0",
            "reason": "silent",
            "action": "restarting it",
            "at": 1300.0,
            **comp,
        },
        {
            "kind": "crash",
            "component": "worker w0",
            "error": "ActorDiedError: killed",
            "action": "starting a new actor",
            "at": 1301.0,
        },
    ]
    (run / "metrics.jsonl").write_text("")
    (run / "health.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines) + '{"kind": "sna')
    rows = {r["component"]: r for r in RunReader(run).health()}
    w0, trainer = rows["worker w0"], rows["trainer"]
    assert (w0["state"], w0["stalls"], w0["crashes"]) == ("stalled", 1, 1)
    assert w0["last_event"] == {
        "kind": "crash",
        "at": 1301.0,
        "what": "ActorDiedError: killed",
        "action": "starting a new actor",
    }
    assert (trainer["state"], trainer["stalls"], trainer["crashes"], trainer["last_event"]) == (
        "ok",
        0,
        0,
        None,
    )
