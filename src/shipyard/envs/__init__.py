"""envs subsystem."""
