"""agent subsystem."""
