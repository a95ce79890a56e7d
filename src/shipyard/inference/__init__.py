"""inference subsystem."""
