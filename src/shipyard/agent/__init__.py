"""The harness: the action format (``actions``), the multi-turn session loop with token-exact
trajectories (``session``), self-summarization (``summarize``), ``play`` (the one path every session
takes, through an environment or not), the run's session spec (``spec``) and a scripted expert for
demonstrations (``demonstrate``). Promises: sampled ids and logprobs are kept as sampled, nothing is
re-tokenized. Does not cover: sandboxes, tasks or grading (``shipyard.envs``), serving (``inference``)."""
