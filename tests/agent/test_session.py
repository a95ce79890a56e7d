"""Agent sessions against a real engine and real sandboxes: token exactness, limits, crashes."""

from pathlib import Path

import pytest

from shipyard.agent.session import ChatFrame, SessionSpec, run_session, session_seed
from shipyard.agent.spec import SandboxWorkbench
from shipyard.config.schema import AgentConfig, ModelConfig, SamplingConfig, SandboxConfig
from shipyard.envs.types import RewardResult, Task
from shipyard.inference.client import LocalInferenceClient
from shipyard.inference.engine.engine import EmbeddedEngine
from shipyard.inference.types import GenerateRequest, SamplingParams
from shipyard.models.loading import load_model

ROOT = Path(__file__).resolve().parents[2]
TASK = Task(
    id="t-add",
    prompt="Write a Python function `add(a, b)` that returns a + b.",
    entry_point="add",
    visible_tests="from solution import add\n\ndef test_one():\n    assert add(1, 2) == 3\n",
    hidden_tests="from solution import add\n\ndef test_a():\n    assert add(2, 2) == 4\n\ndef test_b():\n    assert add(-1, 1) == 0\n",
)


@pytest.fixture(scope="module")
def engine_tok():
    model, tok = load_model(ModelConfig(source="tiny", tiny="dense"))
    return EmbeddedEngine(model, tok, max_batch=8), tok


def _spec(engine_tok, **agent) -> SessionSpec:
    engine, tok = engine_tok
    sb = SandboxConfig(timeout_s=10)
    return SessionSpec(
        client=LocalInferenceClient(engine),
        frame=ChatFrame(tok),
        agent=AgentConfig(**{"max_turns": 3, "max_session_tokens": 600, **agent}),
        sampling=SamplingConfig(max_tokens=20),
        bench=SandboxWorkbench(sb),
    )


def test_trajectory_is_token_exact_and_masks_environment(engine_tok) -> None:
    spec = _spec(engine_tok)
    [traj] = run_session(spec, TASK, "g", 0)  # summarization off: one segment
    assert traj.session_id == "g/0" and traj.num_segments == 1 and traj.metrics == {}
    assert traj.error is None and traj.num_turns == 3 and traj.finish == "max_turns"
    n = len(traj.token_ids)
    assert len(traj.loss_mask) == len(traj.logprobs) == len(traj.versions) == n
    prompt = spec.frame.prompt_ids(
        f"{TASK.prompt}\n\nReply with the complete solution.py in a ```python block."
    )
    assert traj.token_ids[: traj.prompt_len] == prompt and not any(traj.loss_mask[: traj.prompt_len])
    # sampled spans carry logprobs <= 0 and version 0; environment spans are the reminder, tokenized once
    runs, cur = [], None
    for i, m in enumerate(traj.loss_mask):
        if cur is None or m != cur[0]:
            cur = (m, [i])
            runs.append(cur)
        else:
            cur[1].append(i)
    sampled = [idx for m, idx in runs if m == 1]
    env = [idx for m, idx in runs if m == 0][1:]
    assert len(sampled) == 3 and len(env) == 2
    for idx in sampled:
        assert all(traj.logprobs[i] <= 0 and traj.versions[i] == 0 for i in idx)
    for idx in env:
        text = spec.frame.tok.decode([traj.token_ids[i] for i in idx])
        assert "No action found" in text and text.rstrip().endswith("assistant")
    # token-in: replaying turn 3's prefix with its seed reproduces exactly the recorded tokens
    start = sampled[2][0]
    params = SamplingParams(temperature=1.0, max_tokens=20, seed=session_seed("g", 0, 2, 0))
    [again] = spec.client.generate([GenerateRequest(prompt_ids=traj.token_ids[:start], params=params)])
    assert again.token_ids == [traj.token_ids[i] for i in sampled[2]]
    assert again.logprobs == pytest.approx([traj.logprobs[i] for i in sampled[2]], abs=1e-5)
    assert traj.reward == 0.0 and traj.reward_info["passed"] == 0 and traj.reward_info["total"] == 2
    assert "collection" in traj.reward_info["reason"]  # no solution.py was ever written


def test_session_budget_and_crash_are_recorded(engine_tok) -> None:
    [traj] = run_session(_spec(engine_tok, max_session_tokens=170), TASK, "g", 1)
    last_sampled = max(i for i, m in enumerate(traj.loss_mask) if m)
    assert traj.error is None and traj.finish == "budget" and last_sampled < 170
    bad = Task(id="t-bad", prompt="x", entry_point="f", hidden_tests="x = 1\n")  # grader refuses: no tests
    [crashed] = run_session(_spec(engine_tok), bad, "g", 2)
    assert crashed.error is not None and "no top-level test_*" in crashed.error
    assert crashed.reward == 0.0 and sum(crashed.loss_mask) == 0 and crashed.finish == "error"


class _SlowGrading(SandboxWorkbench):
    """The run's sandboxes, but hidden tests graded with a 1.5 s limit."""

    def grade(self, task: Task, files: dict[str, str]) -> RewardResult:
        return SandboxWorkbench(SandboxConfig(timeout_s=1.5)).grade(task, files)


def test_hidden_test_timeout_scores_zero_with_reason(engine_tok) -> None:
    slow = Task(
        id="t-slow",
        prompt="x",
        entry_point="f",
        hidden_tests="import time\n\ndef test_slow():\n    time.sleep(60)\n",
    )
    spec = _spec(engine_tok, max_turns=1)
    spec.bench = _SlowGrading(spec.bench.cfg)
    [traj] = run_session(spec, slow, "g", 3)
    assert traj.error is None and traj.reward == 0.0 and "tim" in traj.reward_info["reason"]


def test_turns_carry_where_the_session_spent_its_time(engine_tok) -> None:
    """Timings the fleet simulator is calibrated from: the inference call and what follows it."""
    import time

    t0 = time.perf_counter()
    [traj] = run_session(_spec(engine_tok), TASK, "g", 1)
    wall = time.perf_counter() - t0
    sampled = [t for t in traj.turns if t["role"] == "assistant"]
    assert len(sampled) == traj.num_turns == 3
    assert all(t["gen_s"] > 0 and t["env_s"] >= 0 and 0 <= t["cached"] < t["start"] for t in sampled)
    setup = traj.turns[0]["setup_s"]
    total = setup + sum(t["gen_s"] + t["env_s"] for t in sampled)
    assert 0 < total <= wall and total > 0.9 * wall  # the spans tile the session
    assert sampled[-1]["env_s"] > 0.01  # the last one holds grading: pytest in a sandbox
