"""The online reward model: signals -> one reward, and dodging never pays.

Checked: what counts as a dodge (empty, an unclosed code block or tool call, a clarifying question
with no attempt) and what does not (code, a plain prose answer); the latest event of a kind wins; a
score is stretched to [-1, 1]; the weighted mean uses `online.reward.weights`; a silent generation
is skipped or neutral per `no_feedback`; and a dodge earns `dodge_penalty` whatever it drew, so on
a population where honest attempts draw mixed signals and dodges draw the signals users give them
(often none, sometimes a polite thumbs up), the expected reward of dodging is below honesty's.
"""

from __future__ import annotations

import random

import pytest

from shipyard.config.schema import OnlineRewardConfig
from shipyard.online.reward import RewardModel, dodge_kind
from shipyard.online.types import FeedbackEvent, GenerationRecord

CODE = "Here it is:\n```python\ndef add(a, b):\n    return a + b\n```"


def rec(text: str, gid: str = "r/0", finish: str = "stop") -> GenerationRecord:
    return GenerationRecord(gid, "r", "s", "", 0.0, "m", 0, [1], [2], [-0.1], [0], finish, 1.0, [], text)


def ev(kind: str, value: float, at: float, gid: str = "r/0") -> FeedbackEvent:
    return FeedbackEvent(f"{kind}-{at}", kind, value, gid, occurred_at=at, received_at=at)


@pytest.mark.parametrize(
    ("text", "finish", "kind"),
    [
        ("", "stop", "empty"),
        ("   \n ", "eos", "empty"),
        ("```python\ndef add(a, b):\n    return a +", "length", "broken_call"),
        ('<tool_call>{"name": "run", "arguments": {', "length", "broken_call"),
        ("```python\ndef add(a, b):\n    return a + b", "stop", None),  # closed by the stop string
        ("Which language would you like this in?", "stop", "clarifying_question"),
        (
            "Could you share more details about the inputs? Do they fit in memory?",
            "eos",
            "clarifying_question",
        ),
        (CODE, "stop", None),
        ("def add(a, b):\n    return a + b", "eos", None),
        ("Use the built-in sum() function.", "eos", None),
        (CODE + "\nDoes this help?", "eos", None),  # an attempt that also asks is still an attempt
    ],
)
def test_dodge_kind(text: str, finish: str, kind: str | None) -> None:
    assert dodge_kind(rec(text, finish=finish)) == kind


def test_latest_event_per_kind_weighted_mean() -> None:
    model = RewardModel(OnlineRewardConfig(weights={"thumb": 1.0, "tests": 3.0, "score": 1.0}))
    reward, how = model.combine(rec(CODE), [ev("thumb", -1, 1), ev("tests", 1, 2), ev("thumb", 1, 3)])
    assert reward == pytest.approx((1 * 1 + 1 * 3) / 4) and how["rule"] == "weighted_mean"
    assert how["signals"]["thumb"]["value"] == 1.0 and how["events"] == 3
    reward, _ = model.combine(rec(CODE), [ev("score", 0.25, 1)])
    assert reward == pytest.approx(-0.5)  # 2 * 0.25 - 1
    reward, how = model.combine(rec(CODE), [ev("edit", 1, 1)])  # weight 0 here: as if silent
    assert reward is None and how["rule"] == "no_feedback_skip"
    neutral = RewardModel(OnlineRewardConfig(no_feedback="neutral"))
    assert neutral.combine(rec(CODE), [])[0] == 0.0


def test_a_dodge_earns_the_penalty_with_or_without_signals() -> None:
    model = RewardModel(OnlineRewardConfig(dodge_penalty=-0.8))
    for text in ("", "What do you mean?"):
        assert model.combine(rec(text), [ev("thumb", 1, 1)])[0] == -0.8
        assert model.combine(rec(text), [])[0] == -0.8  # silence does not protect it


def test_dodging_has_a_lower_expected_reward_than_trying() -> None:
    rng = random.Random(0)
    model = RewardModel(OnlineRewardConfig())
    honest, dodges = [], []
    for i in range(400):
        gid = f"g{i}/0"
        solved = rng.random() < 0.3  # a weak policy: most honest attempts fail
        signals = [ev("tests", 1 if solved else -1, 1, gid)] if rng.random() < 0.6 else []
        if rng.random() < 0.3:
            signals.append(ev("thumb", 1 if (solved or rng.random() < 0.1) else -1, 2, gid))
        r, _ = model.combine(rec(CODE, gid), signals)
        if r is not None:
            honest.append(r)
        # a dodge: users rarely judge it, and when they do they are sometimes polite
        dodge_signals = [ev("thumb", 1 if rng.random() < 0.5 else -1, 1, gid)] if rng.random() < 0.2 else []
        r, _ = model.combine(rec("Which version of Python are you using?", gid), dodge_signals)
        assert r is not None  # never skipped
        dodges.append(r)
    gap = sum(dodges) / len(dodges) - sum(honest) / len(honest)
    assert gap < -0.2, gap
