"""Rollout workers and the batches they write: a worker plays whole GRPO groups against an
inference server and writes one atomic batch per step to ``rollouts/<worker>/`` of its run's store,
stamped with the run id (``types``: the batch record and the control keys the trainer shares).
Promises: a restarted worker continues after its last batch; a crashed session is recorded, not
lost. Does not cover: training, or choosing which server a worker uses (placement does)."""
