"""trainer subsystem."""
