"""eval subsystem."""
