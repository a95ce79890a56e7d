"""The trainer process: the rollout feed (groups in arrival order, stale and foreign ones dropped),
advantages, the loss family and its mismatch corrections, log-prob recompute, the optimizer step,
checkpoints, and the loop that publishes each version (``loop``; ``sft`` for the warm start).
Promises: a restarted trainer resumes without losing a version or training a group twice; it never
trains on another run's rollouts. Does not cover: more than one process (FSDP is planned), sampling."""
