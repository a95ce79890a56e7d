"""weights subsystem."""
