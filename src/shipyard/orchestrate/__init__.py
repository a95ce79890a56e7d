"""orchestrate subsystem."""
