"""Records of agent sessions: token-exact trajectories.

Contract: ``token_ids`` is the whole session as the model saw it (prompt, every sampled token,
every environment token) without re-tokenization of model output. ``loss_mask[i] = 1`` exactly
for sampled tokens; ``logprobs[i]`` is the sampler's logprob for sampled tokens and 0.0
elsewhere; ``versions[i]`` is the weight version that sampled token i (-1 for prompt and
environment tokens). All four lists have the same length. ``reward`` is the session's reward;
``error`` records a crashed or timed-out session (its reward is 0 and it is still written).

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

    def __post_init__(self) -> None:
        n = len(self.token_ids)
        assert len(self.loss_mask) == n and len(self.logprobs) == n and len(self.versions) == n

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
