"""LLM-as-judge rubric rewards through any OpenAI-compatible chat endpoint.

Contract: :class:`RubricJudge` sends one ``POST {base_url}/chat/completions`` per session: a
system message with the rubric (each aspect's name and what it covers, scored 0..``scale``) and
a user message with the task and the session's changes (a unified diff, clipped to
``max_chars`` with head and tail kept), asking for a JSON object ``{"aspect": score, ...}``. It
works with Shipyard's own server (:mod:`shipyard.inference.serving.server`) and any other that speaks
the chat-completions shape. :func:`parse_scores` reads the reply: the first JSON object in it
(fenced or not), else ``aspect: score`` lines; every rubric aspect must be present with a
number in [0, scale] (``"7/10"`` is read as 7), otherwise the verdict is unparseable. Scores
are divided by ``scale``.

:meth:`RubricJudge.score` never raises for the judge's sake: an HTTP error, a timeout or an
unparseable verdict gives every aspect 0.0 and a ``error`` saying why, with the raw reply kept
for inspection, so a flaky judge costs reward, not the session.

``base_url = "self"`` (:data:`SELF`) names the run's own inference server: the rollout worker
resolves it to ``<its server's URL>/v1`` (:func:`resolve_self`, called by
:func:`shipyard.orchestrate.components.build_worker`), so the policy being trained is also the
judge. Its verdicts then move with the weights (a judge that learns alongside the policy it
grades); give a separate, fixed server's URL for a stable judge. A :class:`RubricJudge` built
from an unresolved ``"self"`` is a ValueError.

Limits: one judge call per session, at the judge's temperature; the judge sees the diff, not the
test results (it scores what tests cannot: quality, scope, clarity); no retries.

Example::

    judge = RubricJudge(JudgeConfig(base_url="http://127.0.0.1:8000/v1"))
    verdict = judge.score(task.prompt, diff)       # Verdict(scores={"correctness": 0.8, ...}, error=None)
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from typing import Any

import httpx

from shipyard.config.schema import JudgeConfig

_NUMBER = r"(-?\d+(?:\.\d+)?)(?:\s*/\s*\d+(?:\.\d+)?)?"
SELF = "self"
"""``rewards.judge.base_url`` meaning the run's own inference server (see the module docstring)."""


def resolve_self(cfg: JudgeConfig, server_url: str) -> JudgeConfig:
    """``cfg`` with ``base_url = "self"`` replaced by ``<server_url>/v1``; ``cfg`` itself otherwise.

    ``server_url`` is an inference server's base URL (``http://host:port``, as
    :attr:`shipyard.inference.serving.server.InferenceServer.url` gives it).
    """
    if cfg.base_url.strip() != SELF:
        return cfg
    if not server_url.startswith(("http://", "https://")):
        raise ValueError(
            f"cannot resolve rewards.judge.base_url = 'self': server URL {server_url!r} is not http(s)"
        )
    return cfg.model_copy(update={"base_url": server_url.rstrip("/") + "/v1"})


@dataclass
class Verdict:
    """Per-aspect scores in [0, 1] (every rubric aspect), or why there are none."""

    scores: dict[str, float]
    error: str | None = None
    raw: str = ""
    details: dict[str, Any] = field(default_factory=dict)

    def components(self) -> dict[str, float]:
        """``judge/<aspect>`` per aspect and ``judge`` (their mean)."""
        out = {f"judge/{k}": v for k, v in self.scores.items()}
        out["judge"] = sum(self.scores.values()) / len(self.scores) if self.scores else 0.0
        return out


def system_prompt(rubric: dict[str, str], scale: int) -> str:
    aspects = "\n".join(f"- {name}: {what}" for name, what in rubric.items())
    example = json.dumps({name: scale // 2 for name in rubric})
    return (
        f"You are a strict code reviewer. Score the change below on each aspect, an integer from 0 to {scale}:\n"
        f"{aspects}\nReply with only a JSON object mapping every aspect to its score, for example {example}."
    )


def user_prompt(task_prompt: str, changes: str, max_chars: int) -> str:
    if len(changes) > max_chars:
        half = max_chars // 2
        changes = f"{changes[:half]}\n[... {len(changes) - 2 * half} characters cut ...]\n{changes[-half:]}"
    return f"Task:\n{task_prompt}\n\nChange (unified diff):\n{changes or '(no change)'}"


def parse_scores(text: str, rubric: list[str], scale: int) -> dict[str, float]:
    """Aspect -> score / scale from a judge reply; ValueError naming what is wrong when unparseable."""
    found: dict[str, float] = {}
    match = re.search(r"\{[^{}]*\}", text, re.DOTALL)
    if match is not None:
        try:
            obj = json.loads(match.group(0))
        except ValueError:
            obj = None
        if isinstance(obj, dict):
            for k, v in obj.items():
                value = v if isinstance(v, int | float) and not isinstance(v, bool) else None
                if value is None and isinstance(v, str) and re.fullmatch(_NUMBER, v.strip()):
                    value = float(re.fullmatch(_NUMBER, v.strip()).group(1))  # type: ignore[union-attr]
                if value is not None:
                    found[str(k).strip().lower()] = float(value)
    if not all(a.lower() in found for a in rubric):
        for a in rubric:
            m = re.search(rf"(?im)^\W*{re.escape(a)}\W*[:=-]\s*{_NUMBER}", text)
            if m is not None:
                found.setdefault(a.lower(), float(m.group(1)))
    missing = [a for a in rubric if a.lower() not in found]
    if missing:
        raise ValueError(f"judge reply has no score for {missing}: {text[:200]!r}")
    out = {}
    for a in rubric:
        value = found[a.lower()]
        if not 0 <= value <= scale:
            raise ValueError(f"judge score {a}={value} is outside [0, {scale}]")
        out[a] = value / scale
    return out


class RubricJudge:
    """Scores a session's changes against the configured rubric; see the module docstring."""

    def __init__(self, cfg: JudgeConfig, client: httpx.Client | None = None) -> None:
        if not cfg.base_url:
            raise ValueError("rewards.judge.base_url is empty; set the judge's OpenAI-compatible /v1 URL")
        if cfg.base_url.strip() == SELF:
            raise ValueError(
                "rewards.judge.base_url = 'self' (the run's own inference server) is resolved by the rollout "
                "worker (shipyard.orchestrate.components.build_worker); outside a training run give the "
                "judge's OpenAI-compatible /v1 URL"
            )
        if not cfg.rubric:
            raise ValueError("rewards.judge.rubric is empty; name at least one aspect")
        self.cfg = cfg
        headers = {}
        if cfg.api_key_env:
            key = os.environ.get(cfg.api_key_env)
            if not key:
                raise ValueError(
                    f"rewards.judge.api_key_env={cfg.api_key_env!r} is not set in the environment"
                )
            headers["Authorization"] = f"Bearer {key}"
        self.headers = headers
        self._client = client
        """An injected client (connection reuse); None: one plain request per verdict."""
        self.url = cfg.base_url.rstrip("/") + "/chat/completions"

    def messages(self, task_prompt: str, changes: str) -> list[dict[str, str]]:
        return [
            {"role": "system", "content": system_prompt(self.cfg.rubric, self.cfg.scale)},
            {"role": "user", "content": user_prompt(task_prompt, changes, self.cfg.max_chars)},
        ]

    def score(self, task_prompt: str, changes: str) -> Verdict:
        """The verdict on ``changes`` (never raises for a failing judge; see :class:`Verdict`)."""
        zero = {a: 0.0 for a in self.cfg.rubric}
        body = {
            **({"model": self.cfg.model} if self.cfg.model else {}),
            "messages": self.messages(task_prompt, changes),
            "temperature": self.cfg.temperature,
            "max_tokens": self.cfg.max_tokens,
        }
        try:
            if self._client is not None:
                resp = self._client.post(self.url, json=body, headers=self.headers)
            else:
                resp = httpx.post(self.url, json=body, headers=self.headers, timeout=self.cfg.timeout_s)
            resp.raise_for_status()
            raw = str(resp.json()["choices"][0]["message"]["content"])
        except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as exc:
            return Verdict(zero, error=f"judge call failed: {type(exc).__name__}: {str(exc)[:300]}")
        try:
            return Verdict(parse_scores(raw, list(self.cfg.rubric), self.cfg.scale), raw=raw)
        except ValueError as exc:
            return Verdict(zero, error=f"unparseable verdict: {exc}", raw=raw)
