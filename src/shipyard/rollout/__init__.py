"""rollout subsystem."""
