"""Records of agent sessions: token-exact trajectories.

Contract: ``token_ids`` is the whole session as the model saw it (prompt, every sampled token,
every environment token) without re-tokenization of model output. ``loss_mask[i] = 1`` exactly
for sampled tokens; ``logprobs[i]`` is the sampler's logprob for sampled tokens and 0.0
elsewhere; ``versions[i]`` is the weight version that sampled token i (-1 for prompt and
environment tokens). All four lists have the same length. ``reward`` is the session's reward;
``error`` records a crashed or timed-out session (its reward is 0 and it is still written).

Segments (self-summarization, see :mod:`shipyard.agent.summarize`): a session that summarized
itself is recorded as ``num_segments`` trajectories, one per context, each token-exact on its own
(the contract above holds per segment; ``prompt_len`` is that segment's environment prompt). They
share ``session_id`` and are numbered by ``segment_idx`` (0-based). A segment that ended by asking
for a summary has ``finish == "summary"`` and its last ``summary_tokens`` tokens are the sampled
summary turn (``loss_mask`` 1); the last segment holds the session's finish. ``reward``,
``reward_info``, ``error`` and ``metrics`` are the session's, on every segment. Records written
before segments existed load with ``session_id = ""``: each such trajectory is a whole session
by itself (see :func:`group_sessions`).

Example::

    traj = Trajectory(task_id="gen-0001", group_id="s3-gen-0001", sample_idx=0, token_ids=[...], ...)
    traj.min_version()      # oldest policy version that sampled a token in it
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class Trajectory:
    task_id: str
    group_id: str
    sample_idx: int
    token_ids: list[int]
    loss_mask: list[int]
    logprobs: list[float]
    versions: list[int]
    prompt_len: int
    reward: float = 0.0
    reward_info: dict[str, Any] = field(default_factory=dict)
    num_turns: int = 0
    finish: str = ""
    error: str | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    session_id: str = ""
    """The session this segment belongs to ("" = a one-segment session of its own)."""
    segment_idx: int = 0
    """Position of this segment in its session (0-based)."""
    num_segments: int = 1
    """Segments of the session."""
    summary_tokens: int = 0
    """Sampled tokens of the summary turn that ends this segment (0 when it does not end in one)."""
    routes: dict[str, Any] | None = None
    """MoE experts the sampler used for positions ``[0, routes["n"])`` of ``token_ids`` (a
    :mod:`shipyard.models.routes` record: base64 of uint8/uint16 ids per MoE layer), for router
    replay in the trainer; None for a dense policy or an engine that does not record routes."""
    reward_components: dict[str, float] = field(default_factory=dict)
    """Every reward component computed for the session (``tests``, ``judge``, ``judge/<aspect>``; see
    :mod:`shipyard.envs.grading.rewards`); ``reward`` is their weighted composite."""
    flags: list[str] = field(default_factory=list)
    """Anti-cheat flags that fired on the session (:data:`shipyard.envs.grading.anticheat.FLAGS`)."""
    turns: list[dict[str, Any]] = field(default_factory=list)
    """The segment turn by turn, for people (``shipyard view``): each ``{"role", "start", "end",
    "text", ...}`` covers ``token_ids[start:end]``. Roles: ``prompt`` (with ``system``), ``assistant``
    (with ``action``: ``run`` + ``command``, ``write`` + ``path``, ``submit`` or ``none``),
    ``tool`` (the harness's reply), ``summary`` (the sampled summary that ends a segment). Timings,
    wall seconds: sampled turns carry ``gen_s`` (the inference call) and ``env_s`` (from its return
    to the next call or the session's end: the action, the tool output, grading) and ``cached``
    (prompt tokens the engine reused from its prefix cache); the first
    segment's prompt carries ``setup_s`` (sandbox start). :mod:`shipyard.fleet.calibrate` reads them."""
    changes: str = ""
    """Unified diff of the workspace files the session changed (last segment only; "" elsewhere)."""
    grade: dict[str, Any] = field(default_factory=dict)
    """The grader's report (per-test outcomes, log tail, reason, judge verdict), last segment only."""

    def __post_init__(self) -> None:
        n = len(self.token_ids)
        assert len(self.loss_mask) == n and len(self.logprobs) == n and len(self.versions) == n
        if not 0 <= self.segment_idx < self.num_segments:
            raise ValueError(
                f"segment_idx={self.segment_idx} must be in [0, num_segments={self.num_segments})"
            )
        if not 0 <= self.summary_tokens <= n:
            raise ValueError(
                f"summary_tokens={self.summary_tokens} must be in [0, {n}] (the segment's length)"
            )

    def ends_in_summary(self) -> bool:
        """Whether this segment ended by summarizing (a later segment of the session continues it)."""
        return self.finish == "summary"

    def min_version(self) -> int:
        vs = [v for v, m in zip(self.versions, self.loss_mask, strict=True) if m]
        return min(vs) if vs else -1

    def max_version(self) -> int:
        return max(self.versions, default=-1)

    def num_sampled(self) -> int:
        return sum(self.loss_mask)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @staticmethod
    def from_json(d: dict[str, Any]) -> Trajectory:
        return Trajectory(**d)


def group_sessions(trajs: list[Trajectory]) -> list[list[Trajectory]]:
    """Split trajectories into sessions, in order of first appearance, each sorted by ``segment_idx``.

    Trajectories sharing a non-empty ``session_id`` form one session; one with ``session_id == ""``
    (a record from before segments) is a session by itself.
    """
    sessions: dict[str | int, list[Trajectory]] = {}
    for i, t in enumerate(trajs):
        sessions.setdefault(t.session_id or i, []).append(t)
    return [sorted(s, key=lambda t: t.segment_idx) for s in sessions.values()]


def session_complete(segments: list[Trajectory]) -> bool:
    """Whether ``segments`` (one session, sorted) hold exactly segments 0 .. num_segments - 1."""
    n = segments[0].num_segments
    return [t.segment_idx for t in segments] == list(range(n)) and all(t.num_segments == n for t in segments)
