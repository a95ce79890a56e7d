"""Real-time RL from production traffic: the logging gateway, user feedback, the PostgreSQL database
of record and the reward model over user signals (`docs/online.md`)."""
