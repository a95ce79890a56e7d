"""Self-summarizing sessions on the tiny random model with a deliberately small window: a session far
longer than its context, token-exact segments, the session's reward and advantage on every segment."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import pytest

from shipyard.agent.session import ChatFrame, SessionSpec, first_message, run_session, session_seed
from shipyard.agent.spec import SandboxWorkbench
from shipyard.agent.summarize import SUMMARY_HEADER, carried_state, resume_message, rollout_summary_metrics
from shipyard.agent.types import Trajectory
from shipyard.config import ConfigError, load_config
from shipyard.config.schema import (
    AgentConfig,
    LossConfig,
    ModelConfig,
    SamplingConfig,
    SandboxConfig,
    SummaryConfig,
)
from shipyard.envs.sandbox import BwrapSandbox
from shipyard.envs.tasks.functions import REMINDER
from shipyard.envs.tasks.kinds import clip_output
from shipyard.envs.types import Task
from shipyard.inference.client import LocalInferenceClient
from shipyard.inference.engine.engine import EmbeddedEngine
from shipyard.inference.types import GenerateRequest, SamplingParams
from shipyard.models.loading import load_model
from shipyard.rollout.types import RolloutBatch
from shipyard.store import LocalStore
from shipyard.trainer.advantages import batch_advantages
from shipyard.trainer.feed import RolloutFeed

WINDOW = 300
TURN_TOKENS = 16
SUMMARY_TOKENS = 24
STATE_CHARS = 80
INSTRUCTION = "Summarize your progress."
TASK = Task(
    id="t-add",
    prompt="Write a Python function `add(a, b)` that returns a + b.",
    entry_point="add",
    visible_tests="from solution import add\n\ndef test_one():\n    assert add(1, 2) == 3\n",
    hidden_tests="from solution import add\n\ndef test_a():\n    assert add(2, 2) == 4\n",
)


@pytest.fixture(scope="module")
def engine_tok():
    model, tok = load_model(ModelConfig(source="tiny", tiny="dense"))
    return EmbeddedEngine(model, tok, max_batch=8), tok


def _spec(engine_tok, max_turns: int = 12, summarize_at: int = 220) -> SessionSpec:
    engine, tok = engine_tok
    sb = SandboxConfig(timeout_s=10)
    summary = SummaryConfig(
        instruction=INSTRUCTION, max_tokens=SUMMARY_TOKENS, max_summaries=40, state_chars=STATE_CHARS
    )
    return SessionSpec(
        client=LocalInferenceClient(engine),
        frame=ChatFrame(tok),
        agent=AgentConfig(
            max_turns=max_turns, max_session_tokens=WINDOW, summarize_at_tokens=summarize_at, summary=summary
        ),
        sampling=SamplingConfig(max_tokens=TURN_TOKENS),
        bench=SandboxWorkbench(sb),
    )


@pytest.fixture(scope="module")
def long_session(engine_tok) -> tuple[SessionSpec, list[Trajectory]]:
    spec = _spec(engine_tok)
    return spec, run_session(spec, TASK, "g", 0)


def _runs(mask: list[int]) -> list[tuple[int, int, int]]:
    """(mask value, start, end) of the maximal runs of equal mask values."""
    runs: list[tuple[int, int, int]] = []
    for i, m in enumerate(mask):
        if runs and runs[-1][0] == m:
            runs[-1] = (m, runs[-1][1], i + 1)
        else:
            runs.append((m, i, i + 1))
    return runs


def test_session_runs_past_ten_windows_with_token_exact_segments(long_session) -> None:
    spec, segs = long_session
    tok = spec.frame.tok
    assert all(s.error is None for s in segs) and segs[-1].finish == "max_turns"
    assert sum(len(s.token_ids) for s in segs) >= 10 * WINDOW and len(segs) >= 10
    first = first_message(TASK)
    for k, seg in enumerate(segs):
        assert (seg.session_id, seg.segment_idx, seg.num_segments) == ("g/0", k, len(segs))
        assert len(seg.token_ids) == len(seg.loss_mask) == len(seg.logprobs) == len(seg.versions)
        assert max(i for i, m in enumerate(seg.loss_mask) if m) < WINDOW  # nothing sampled past the window
        runs = _runs(seg.loss_mask)
        assert runs[0] == (0, 0, seg.prompt_len)  # the prompt is environment tokens, tokenized once
        if k == 0:
            assert seg.token_ids[: seg.prompt_len] == spec.frame.prompt_ids(first)
        else:  # the previous summary, re-used as text only, plus the kept state
            prev = segs[k - 1]
            summary = tok.decode(prev.token_ids[-prev.summary_tokens :], skip_special_tokens=True)
            state = f"solution.py has not been written yet.\n\nLast tool output:\n{clip_output(REMINDER, STATE_CHARS)}"
            assert seg.token_ids[: seg.prompt_len] == spec.frame.prompt_ids(
                resume_message(first, summary, state)
            )
        for i, m in enumerate(seg.loss_mask):  # sampled: logprob <= 0, version 0; environment: 0.0, -1
            assert (
                (seg.logprobs[i] <= 0 and seg.versions[i] == 0)
                if m
                else (seg.logprobs[i], seg.versions[i]) == (0.0, -1)
            )
        sampled = [r for r in runs if r[0] == 1]
        assert len(sampled) == seg.num_turns + (seg.summary_tokens > 0)
        if k < len(segs) - 1:  # ends in the summary turn: sampled, right after the request
            assert seg.finish == "summary" and seg.ends_in_summary() and seg.summary_tokens > 0
            assert sampled[-1] == (1, len(seg.token_ids) - seg.summary_tokens, len(seg.token_ids))
            request = tok.decode(seg.token_ids[runs[-2][1] : runs[-2][2]])
            assert REMINDER in request and INSTRUCTION in request and request.rstrip().endswith("assistant")


def test_summary_turn_is_sampled_token_in_with_its_seed(long_session) -> None:
    spec, segs = long_session
    k = 3
    seg = segs[k]
    turn = sum(s.num_turns + 1 for s in segs[:k]) + seg.num_turns  # sampled turns before this summary
    start = len(seg.token_ids) - seg.summary_tokens
    params = SamplingParams(
        temperature=1.0,
        max_tokens=min(SUMMARY_TOKENS, WINDOW - start),
        seed=session_seed("g", 0, turn, 0),
    )
    [again] = spec.client.generate([GenerateRequest(prompt_ids=seg.token_ids[:start], params=params)])
    assert again.token_ids == seg.token_ids[start:]
    assert again.logprobs == pytest.approx(seg.logprobs[start:], abs=1e-5)


def test_every_segment_carries_the_session_reward_metrics_and_advantage(engine_tok, long_session) -> None:
    spec, segs = long_session
    info = segs[0].reward_info
    assert info["total"] == 1 and all(s.reward == 0.0 and s.reward_info == info for s in segs)
    m = segs[0].metrics
    assert all(s.metrics == m for s in segs)
    summaries = [s for s in segs if s.ends_in_summary()]
    summarized = [_runs(s.loss_mask)[-2][1] for s in summaries]  # context length before each request
    assert m["summaries"] == len(segs) - 1 == len(summaries)
    assert m["summary_tokens"] == sum(s.summary_tokens for s in summaries)
    assert m["summarized_tokens"] == sum(summarized)
    assert m["compression"] == pytest.approx(sum(summarized) / m["summary_tokens"])
    assert m["session_tokens"] == sum(len(s.token_ids) for s in segs) and m["hit_budget_unfinished"] == 1.0
    step = rollout_summary_metrics(segs)
    assert step["summary/per_session"] == len(summaries) and step["summary/segments_mean"] == len(segs)
    # a second, unsegmented session that "passed": advantages as for two plain samples
    [short] = run_session(_spec(engine_tok, max_turns=1), TASK, "g", 1)
    assert short.num_segments == 1 and short.session_id == "g/1"
    passed = dataclasses.replace(short, reward=1.0)
    batch = batch_advantages([segs + [passed]], LossConfig())
    plain = batch_advantages([[dataclasses.replace(segs[0], session_id=""), passed]], LossConfig())
    assert batch.advantages == [plain.advantages[0]] * len(segs) + [plain.advantages[1]]
    assert plain.advantages[0] < 0 < plain.advantages[1]


def test_segments_survive_the_store_and_a_restarted_feed(tmp_path: Path, long_session) -> None:
    _, segs = long_session
    other = [dataclasses.replace(s, sample_idx=1, session_id="g/1", reward=1.0) for s in segs]
    store = LocalStore(tmp_path)
    for seq, gid in enumerate(["first", "g"]):
        trajs = [dataclasses.replace(t, group_id=gid) for t in segs + other]
        batch = RolloutBatch(f"w0/{seq:08d}", "w0", time.time() + seq, trajs, run_id="r1")
        store.put(batch.key(), batch.to_bytes())
    feed = RolloutFeed(store, "r1")
    assert [g[0].group_id for g in feed.take(1, 0, 0, timeout_s=5).groups] == ["first"]
    restarted = RolloutFeed(store, "r1", consumed=set(feed.consumed))
    [group] = restarted.take(1, 0, 0, timeout_s=5).groups
    assert group == [dataclasses.replace(t, group_id="g") for t in segs + other]


def test_crash_marks_every_segment(engine_tok) -> None:
    bad = dataclasses.replace(TASK, id="t-bad", hidden_tests="x = 1\n")  # the grader refuses: no tests
    segs = run_session(_spec(engine_tok, max_turns=3), bad, "g", 2)
    assert len(segs) >= 2 and all(s.num_segments == len(segs) for s in segs)
    for s in segs:
        assert s.error is not None and "no top-level test_*" in s.error and s.finish == "error"
        assert s.reward == 0.0 and sum(s.loss_mask) == 0 and s.summary_tokens == 0


def test_carried_state_and_resume_message() -> None:
    with BwrapSandbox({}, SandboxConfig(timeout_s=5)) as sb:
        cfg = SummaryConfig(state_chars=40)
        assert carried_state(sb, "", cfg) == "solution.py has not been written yet."
        sb.write("solution.py", "def add(a, b):\n    return a + b\n")
        state = carried_state(sb, "x" * 100, cfg)
        assert "Current solution.py:\n```python\ndef add(a, b):\n    return a + b\n\n```" in state
        assert "Last tool output:\n" + clip_output("x" * 100, 40) in state and "characters cut" in state
        assert carried_state(sb, "out", SummaryConfig(keep=["last_output"])) == "Last tool output:\nout"
        assert carried_state(sb, "out", SummaryConfig(state_chars=0)) == ""
    with BwrapSandbox({"pkg/a.py": "x = 1\n", "pkg/b.py": "y = 2\n"}, SandboxConfig(timeout_s=5)) as sb:
        cfg = SummaryConfig(keep=["solution"])
        assert carried_state(sb, "", cfg, "db") == "migration.sql has not been written yet."
        assert carried_state(sb, "", cfg, "repo") == "No file has been changed yet."
        sb.write("migration.sql", "ALTER TABLE t ADD COLUMN c int;\n")
        sb.write("pkg/a.py", "x = 2\n")
        assert carried_state(sb, "", cfg, "db") == (
            "Current migration.sql:\n```sql\nALTER TABLE t ADD COLUMN c int;\n\n```"
        )
        repo = carried_state(sb, "", cfg, "repo")
        assert "Changed pkg/a.py:\n```\nx = 2\n\n```" in repo and "Changed migration.sql:" in repo
        assert "pkg/b.py" not in repo
    text = resume_message("Task.", "  did things \n", "")
    assert text == f"Task.\n\n{SUMMARY_HEADER}\ndid things"


def test_summary_config_validates_and_defaults_off() -> None:
    assert AgentConfig().summarize_threshold() == 0 and AgentConfig().summary.segment_advantage == "session"
    assert AgentConfig(max_session_tokens=1000, summarize_at_frac=0.75).summarize_threshold() == 750
    with pytest.raises(ValueError, match="agent.summarize_at_tokens"):
        AgentConfig(max_session_tokens=500, summarize_at_tokens=500)
    with pytest.raises(
        ValueError, match="at most one of agent.summarize_at_tokens and agent.summarize_at_frac"
    ):
        AgentConfig(summarize_at_tokens=100, summarize_at_frac=0.5)
    cfg = load_config(
        None, ["agent.summarize_at_frac=0.6", 'agent.summary.segment_advantage="summary_bonus"']
    )
    assert cfg.agent.summarize_threshold() == int(0.6 * 1536)
    assert cfg.agent.summary.segment_advantage == "summary_bonus"
    with pytest.raises(ConfigError, match="agent.summary.segment_advantage"):
        load_config(None, ["agent.summary.segment_advantage=segment"])
    with pytest.raises(ConfigError, match="agent.summary.keep"):
        load_config(None, ['agent.summary.keep=["everything"]'])


def test_truncation_baseline_drops_the_context_without_a_summary(engine_tok) -> None:
    """`agent.summary.mode = "truncate"`: same trigger, no summary turn, task + kept state only."""
    spec = _spec(engine_tok, max_turns=8)
    agent = spec.agent.model_copy(
        update={"summary": spec.agent.summary.model_copy(update={"mode": "truncate"})}
    )
    segs = run_session(dataclasses.replace(spec, agent=agent), TASK, "g", 0)
    assert len(segs) >= 3 and all(s.error is None for s in segs)
    first = first_message(TASK)
    state = (
        f"solution.py has not been written yet.\n\nLast tool output:\n{clip_output(REMINDER, STATE_CHARS)}"
    )
    for k, seg in enumerate(segs):
        assert seg.summary_tokens == 0 and not seg.ends_in_summary()
        runs = _runs(seg.loss_mask)
        if seg.finish == "truncated":  # prompt, then turns; the tool result that crossed goes to the next
            assert len(runs) == 2 * seg.num_turns and runs[-1][0] == 1
        if k:
            assert segs[k - 1].finish == "truncated"
            assert seg.token_ids[: seg.prompt_len] == spec.frame.prompt_ids(
                resume_message(first, None, state)
            )
            assert SUMMARY_HEADER not in spec.frame.tok.decode(seg.token_ids[: seg.prompt_len])
    m = segs[0].metrics
    assert m["summaries"] == len(segs) - 1 and m["summary_tokens"] == 0 and m["compression"] == 0.0
    assert sum(s.num_turns for s in segs) == 8  # every turn is an action turn


def test_task_set_switch_trains_on_long_tasks() -> None:
    from shipyard.envs.tasks.splits import task_splits

    cfg = load_config(None, ["tasks.set=long", "tasks.num_generated=20", "tasks.long_modules=3"])
    train, heldout = task_splits(cfg)
    assert len(train) + len(heldout) == 20 and len(heldout) == 5
    assert all(t.source == "long" and len([f for f in t.files if f.startswith("part_")]) == 3 for t in train)
    assert {t.id for t in train}.isdisjoint(t.id for t in heldout)
    with pytest.raises(ConfigError, match="tasks.set"):
        load_config(None, ["tasks.set=huge"])
