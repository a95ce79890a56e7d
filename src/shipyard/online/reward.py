"""The reward model of online RL: user signals of one served generation -> one reward, with its how.

Contract: :meth:`RewardModel.combine` takes a generation and every feedback event joined to it
(its own and its session's) and returns ``(reward, breakdown)``:

- per signal kind the user's latest event counts (a thumb changed from down to up is up); a
  ``score`` in [0, 1] maps to ``2 * score - 1``; every other kind is already in [-1, 1];
- the reward is the weighted mean over the kinds present, with ``online.reward.weights``;
- a generation without any signal is ``None`` (not trained on) or 0, per ``no_feedback``;
- a generation that dodges judgement (:func:`dodge_kind`: an empty answer, a broken tool call or
  code block, a clarifying question instead of an attempt) gets ``dodge_penalty`` whatever its
  signals, and also when it has none. Dodging is the hack real-time RL is known for: a response
  nobody can judge draws no negative signal, so skipping silent generations would make it the
  safest thing to say. With ``dodge_penalty`` at most the worst signal an honest attempt can draw
  (-1 by default), a dodge's expected reward is below an honest attempt's.

``breakdown`` records the signals used (kind -> value, weight, event id), the dodge verdict and
the rule that decided, and is stored with the reward (``rewards.breakdown``).

Example::

    model = RewardModel(OnlineRewardConfig())
    reward, how = model.combine(record, [FeedbackEvent.make("thumb", 1, generation_id=record.generation_id)])
"""

from __future__ import annotations

import re
from typing import Any

from shipyard.config.schema import OnlineRewardConfig
from shipyard.online.types import FeedbackEvent, GenerationRecord

_FENCE = re.compile(r"^\s*```", re.MULTILINE)
_CODE_LINE = re.compile(r"^\s*(def |class |import |from \S+ import |return |for |if |while )", re.MULTILINE)


def dodge_kind(record: GenerationRecord) -> str | None:
    """Why ``record`` dodges judgement, or None for an attempt: ``empty`` (no visible text),
    ``broken_call`` (cut off by the length limit inside a code block or tool call: nothing usable
    came out; a block closed by a stop string or left open at EOS is still an attempt, as the
    harness reads it), ``clarifying_question`` (no code at all, and the answer asks the user
    something)."""
    text = record.completion.strip()
    if not text:
        return "empty"
    fences = len(_FENCE.findall(text))
    unclosed = fences % 2 == 1 or ("<tool_call>" in text and "</tool_call>" not in text)
    if unclosed and record.finish_reason == "length":
        return "broken_call"
    has_code = fences >= 2 or _CODE_LINE.search(text) is not None
    if not has_code and "?" in text:
        return "clarifying_question"
    return None


class RewardModel:
    """Signals -> reward (module doc)."""

    def __init__(self, cfg: OnlineRewardConfig) -> None:
        self.cfg = cfg
        self.name = "signals-v1:" + ",".join(f"{k}={w:g}" for k, w in sorted(cfg.weights.items()))

    def combine(
        self, record: GenerationRecord, events: list[FeedbackEvent]
    ) -> tuple[float | None, dict[str, Any]]:
        latest: dict[str, FeedbackEvent] = {}
        for ev in sorted(events, key=lambda e: (e.occurred_at, e.received_at)):
            latest[ev.kind] = ev
        used = {
            kind: {"value": _signed(ev), "weight": self.cfg.weights.get(kind, 0.0), "event_id": ev.event_id}
            for kind, ev in latest.items()
        }
        total = sum(u["weight"] for u in used.values())
        dodge = dodge_kind(record)
        breakdown: dict[str, Any] = {"signals": used, "dodge": dodge, "events": len(events)}
        if dodge is not None:
            return self.cfg.dodge_penalty, {**breakdown, "rule": "dodge_penalty"}
        if total > 0:
            reward = sum(u["value"] * u["weight"] for u in used.values()) / total
            return reward, {**breakdown, "rule": "weighted_mean"}
        if self.cfg.no_feedback == "neutral":
            return 0.0, {**breakdown, "rule": "no_feedback_neutral"}
        return None, {**breakdown, "rule": "no_feedback_skip"}


def _signed(ev: FeedbackEvent) -> float:
    """The event's value in [-1, 1] (a score in [0, 1] is stretched)."""
    return 2.0 * ev.value - 1.0 if ev.kind == "score" else float(ev.value)
