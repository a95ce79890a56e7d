"""metrics subsystem."""
