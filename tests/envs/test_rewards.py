"""Tests of :mod:`shipyard.envs.grading`: components, composites and the LLM judge over real HTTP.

Contract checked: the composite is the weighted sum of the computed components and only
weighted components are needed; the config rejects unknown components and a weighted judge
without an endpoint; :func:`parse_scores` reads JSON (fenced or inline), ``aspect: n`` lines and
``"7/10"``, and names what is missing or out of range; against a real Shipyard inference server
on loopback, a tiny model taught one verdict is parsed per aspect (8 and 6 of 10 -> 0.8, 0.6),
while a random tiny model's reply is reported unparseable with every aspect 0, and an
unreachable endpoint is reported as a failed call; ``hidden_tests_reward`` dispatches on the task kind.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from shipyard.config.schema import JudgeConfig, ModelConfig, RewardsConfig, SandboxConfig
from shipyard.envs.grading.judge import RubricJudge, parse_scores
from shipyard.envs.grading.rewards import component_metrics, composite, needed
from shipyard.envs.services.pool import ServicePool
from shipyard.envs.tasks.grade import hidden_tests_reward
from shipyard.envs.tasks.kinds import GradingContext
from shipyard.envs.tasks.repo import RepoCache
from shipyard.envs.types import Task
from shipyard.inference.engine.engine import EmbeddedEngine
from shipyard.inference.serving.server import InferenceServer
from shipyard.models.loading import build_tiny, load_model

TASK_PROMPT = "Fix `format_cents` for negative amounts."
DIFF = "diff --git a/m.py b/m.py\n--- a/m.py\n+++ b/m.py\n@@ -1 +1 @@\n-x = 1\n+x = 2\n"
VERDICT = '{"correctness": 8, "quality": 6}'


def test_composite_and_needed() -> None:
    parts = {"tests": 1.0, "judge": 0.5, "judge/quality": 0.25}
    assert composite({"tests": 0.8, "judge": 0.2}, parts) == pytest.approx(0.9)
    assert composite({"tests": 0.5, "judge/quality": 0.5, "judge": 0.0}, parts) == pytest.approx(0.625)
    assert needed({"tests": 1.0, "judge": 0.0}) == {"tests"}
    assert needed({"tests": 1.0, "judge/quality": 0.1}) == {"tests", "judge/quality", "judge"}

    class S:
        def __init__(self, c: dict[str, float]) -> None:
            self.reward_components = c

    metrics = component_metrics([S({"tests": 1.0}), S({"tests": 0.0, "judge": 0.5})])
    assert metrics == {"reward/component/judge": 0.5, "reward/component/tests": 0.5}


def test_config_validation_names_the_field() -> None:
    with pytest.raises(ValueError, match="unknown component 'judge/style'"):
        RewardsConfig(weights={"tests": 1.0, "judge/style": 0.5})
    with pytest.raises(ValueError, match="base_url must be set"):
        RewardsConfig(weights={"tests": 0.5, "judge": 0.5})
    ok = RewardsConfig(weights={"judge/quality": 1.0}, judge=JudgeConfig(base_url="http://127.0.0.1:1/v1"))
    assert ok.weights == {"judge/quality": 1.0}
    with pytest.raises(ValueError, match="base_url is empty"):
        RubricJudge(JudgeConfig())


@pytest.mark.parametrize(
    ("reply", "expected"),
    [
        (VERDICT, {"correctness": 0.8, "quality": 0.6}),
        ('Sure!\n```json\n{"Correctness": 10, "quality": "7/10"}\n```', {"correctness": 1.0, "quality": 0.7}),
        ("correctness: 3\n- Quality = 4.5", {"correctness": 0.3, "quality": 0.45}),
    ],
)
def test_parse_scores_reads_json_and_lines(reply: str, expected: dict[str, float]) -> None:
    assert parse_scores(reply, ["correctness", "quality"], 10) == pytest.approx(expected)


@pytest.mark.parametrize(
    ("reply", "error"),
    [
        ('{"correctness": 8}', r"no score for \['quality'\]"),
        ('{"correctness": 11, "quality": 2}', r"outside \[0, 10\]"),
        ("looks good to me", "no score for"),
    ],
)
def test_parse_scores_names_what_is_wrong(reply: str, error: str) -> None:
    with pytest.raises(ValueError, match=error):
        parse_scores(reply, ["correctness", "quality"], 10)


def _teach(model: Any, prompt: list[int], target: list[int], max_steps: int = 400) -> int:
    """Fit ``model`` until greedy decoding after ``prompt`` gives ``target``; returns the steps taken."""
    ids = torch.tensor([prompt + target])
    tgt = torch.tensor(target)
    opt = torch.optim.Adam(model.parameters(), lr=5e-3)
    model.train()
    step = 0
    while step < max_steps:
        step += 1
        hidden = model.model(input_ids=ids).last_hidden_state
        logits = model.lm_head(hidden[0, len(prompt) - 1 : -1])
        loss = torch.nn.functional.cross_entropy(logits, tgt)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if bool((logits.argmax(-1) == tgt).all()) and loss.item() < 0.05:
            break
    model.eval()
    return step


@pytest.fixture(scope="module")
def judge_servers() -> Iterator[tuple[str, str]]:
    """URLs of two real Shipyard servers: a tiny model taught :data:`VERDICT`, and a random one."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # two threads on a loaded 2-core machine are many times slower here
    torch.manual_seed(0)
    model, tok = load_model(ModelConfig(source="tiny", tiny="dense"))
    messages = RubricJudge(JudgeConfig(base_url="http://unused/v1")).messages(TASK_PROMPT, DIFF)
    enc = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)
    target = tok(VERDICT, add_special_tokens=False).input_ids + [tok.eos_token_id]
    steps = _teach(model, list(enc["input_ids"]), target)
    assert steps < 400, "the tiny judge did not learn its verdict"
    random_model = build_tiny("dense", len(tok), seed=1).eval()
    with (
        InferenceServer(EmbeddedEngine(model, tok, max_batch=2)) as taught,
        InferenceServer(EmbeddedEngine(random_model, tok, max_batch=2)) as random_server,
    ):
        yield taught.url + "/v1", random_server.url + "/v1"
    torch.set_num_threads(threads)


def test_judge_parses_per_aspect_scores_from_a_real_server(judge_servers: tuple[str, str]) -> None:
    judge = RubricJudge(JudgeConfig(base_url=judge_servers[0], max_tokens=32))
    verdict = judge.score(TASK_PROMPT, DIFF)
    assert verdict.error is None and verdict.raw == VERDICT
    assert verdict.scores == {"correctness": 0.8, "quality": 0.6}
    assert verdict.components() == pytest.approx(
        {"judge/correctness": 0.8, "judge/quality": 0.6, "judge": 0.7}
    )


def test_unparseable_and_unreachable_judges_score_zero(judge_servers: tuple[str, str]) -> None:
    verdict = RubricJudge(JudgeConfig(base_url=judge_servers[1], max_tokens=16)).score(TASK_PROMPT, DIFF)
    assert verdict.error is not None and verdict.error.startswith("unparseable verdict")
    assert verdict.scores == {"correctness": 0.0, "quality": 0.0} and verdict.raw
    gone = RubricJudge(JudgeConfig(base_url="http://127.0.0.1:9/v1", timeout_s=5)).score(TASK_PROMPT, DIFF)
    assert (
        gone.error is not None
        and gone.error.startswith("judge call failed")
        and gone.components()["judge"] == 0.0
    )


def test_hidden_tests_reward_dispatches_on_kind() -> None:
    calls: list[str] = []

    def grader(task: Task, files: dict[str, str]) -> Any:
        calls.append(task.id)
        from shipyard.envs.grading.grader import grade

        return grade(task, files, SandboxConfig())

    task = Task("k1", "", "f", hidden_tests="from solution import f\n\ndef test_f():\n    assert f() == 2\n")
    with ServicePool() as pool, RepoCache() as repos:
        ctx = GradingContext(SandboxConfig(), pool, repos, grader)
        res = hidden_tests_reward(task, {"solution.py": "def f():\n    return 2\n"}, ctx)
        assert (res.reward, calls) == (1.0, ["k1"])
        with pytest.raises(ValueError, match="kind 'video'"):
            hidden_tests_reward(Task("k2", "", "f", kind="video"), {}, ctx)
