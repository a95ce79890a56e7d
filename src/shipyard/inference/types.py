"""Records and interfaces of inference: token-in / token-out generation with versions.

Contract: a :class:`GenerateRequest` carries prompt token ids (never text) and sampling
parameters; the :class:`GenerateResult` returns the sampled ids exactly as sampled, the logprob
of each sampled token under the distribution it was sampled from (after temperature, before
top-p truncation), and the weight version that was live when each token was sampled. A result
never contains tokens after the stop condition that ended it, and always contains the token
that completed a stop string or the EOS token (so trajectories stay token-exact).

Example::

    client = HttpInferenceClient("http://127.0.0.1:8000")
    [res] = client.generate([GenerateRequest(prompt_ids=[1, 2, 3], params=SamplingParams(max_tokens=8))])
    res.token_ids, res.logprobs, res.versions, res.finish_reason
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Literal, Protocol

FinishReason = Literal["eos", "stop", "length", "abort"]
"""``abort``: the caller cancelled the request (its client went away, or the server shut down)."""

Priority = Literal["production", "scavenger"]
"""A request's tier on a server that shares capacity (``inference.scavenge``): ``production`` is served
first; ``scavenger`` work (RL rollouts) fills what production leaves idle and yields when it rises.
A server without ``inference.scavenge.enabled`` serves both tiers alike."""


@dataclass
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int = 256
    stop: list[str] = field(default_factory=list)
    seed: int | None = None
    top_logprobs: int = 0
    """Also return, per sampled token, this many most likely tokens with their logprobs."""
    presence_penalty: float = 0.0
    """Subtracted from the logit of every token already generated (OpenAI's definition)."""
    frequency_penalty: float = 0.0
    """Subtracted from a token's logit once per time it was generated (OpenAI's definition)."""
    logit_bias: dict[int, float] = field(default_factory=dict)
    """Added to the logits of these token ids before sampling."""
    ignore_eos: bool = False
    """Sample on past end-of-sequence tokens (vLLM's extension of the same name): the row ends at
    ``max_tokens``, the context's end or a stop string. For measurements at fixed lengths."""

    def __post_init__(self) -> None:
        self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}  # JSON keys are strings


@dataclass
class GenerateRequest:
    prompt_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    prompt_routes: dict[str, Any] | None = None
    """MoE routes of a prefix of ``prompt_ids`` (a :mod:`shipyard.models.routes` record, e.g. an earlier
    turn's ``GenerateResult.routes``): an engine that records routes replays them in the prefill, so a
    token keeps the experts of its first forward across turns. None: route every prompt token freely."""
    priority: Priority = "production"
    """The request's tier where the server shares capacity (:data:`Priority`)."""
    reuse_prefix: bool = True
    """May the engine start from a cached prefix of the prompt (:mod:`shipyard.inference.engine.prefix_cache`)?
    False: the prompt is prefilled whole, as the first time it was seen, so a seeded request alone
    on a server repeats its tokens exactly (the OpenAI surface's seeded requests: a warm prefill's
    logits differ from a cold one's in the last bits, enough to change a draw)."""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @staticmethod
    def from_json(d: dict[str, Any]) -> GenerateRequest:
        priority = d.get("priority", "production")
        if priority not in ("production", "scavenger"):
            raise ValueError(f"priority={priority!r}; expected 'production' or 'scavenger'")
        return GenerateRequest(
            prompt_ids=list(d["prompt_ids"]),
            params=SamplingParams(**d.get("params", {})),
            prompt_routes=d.get("prompt_routes"),
            priority=priority,
            reuse_prefix=bool(d.get("reuse_prefix", True)),
        )


@dataclass
class GenerateResult:
    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: FinishReason
    routes: dict[str, Any] | None = None
    """MoE experts used for every forwarded position of prompt + sampled tokens (all but the last
    sampled token, which is never forwarded), a :mod:`shipyard.models.routes` record; None for a
    dense model or an engine that does not record routes."""
    top_logprobs: list[list[tuple[int, float]]] | None = None
    """Per sampled token, the ``params.top_logprobs`` most likely (token id, logprob) (None when 0)."""
    cached_tokens: int = 0
    """Prompt tokens whose keys/values came from the prefix cache (not forwarded; 0 where the
    engine does not say)."""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @staticmethod
    def from_json(d: dict[str, Any]) -> GenerateResult:
        return GenerateResult(**d)


VERSION_TIMEOUT_S = 10.0
"""How long a version query (a few bytes) may take before the server counts as unreachable."""
UNAVAILABLE = frozenset({502, 503, 504})
"""HTTP statuses of a version query that mean the server behind a gateway cannot be reached."""


class InferenceClient(Protocol):
    """What rollout workers and evaluators need from an inference server."""

    def generate(self, requests: list[GenerateRequest]) -> list[GenerateResult]:
        """Sample a continuation for every request (batched by the server)."""

    def version(self) -> int:
        """The weight version the server serves now; ``ConnectionError`` naming the server when it
        does not answer within :data:`VERSION_TIMEOUT_S`."""

    def stats(self) -> dict[str, Any]:
        """The server's counters; an embedded server's ``adoptions`` lists the versions it went live
        with (``{"server", "version", "at", "published_at"}``, newest last)."""

    def wait_ready(self, timeout_s: float = 60.0) -> int:
        """Block until the server answers (TimeoutError after ``timeout_s``); its version."""

    async def agenerate(self, requests: list[GenerateRequest], http: Any) -> list[GenerateResult]:
        """:meth:`generate` over the caller's ``httpx.AsyncClient`` (base URL: the client's ``url``;
        None for an in-process client, which has no ``url``); cancelling the awaiting task cancels
        the requests at the server."""

    def close(self) -> None:
        """Release the connections."""
