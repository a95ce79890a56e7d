"""Evaluation: pass@1 of a policy on held-out generated tasks, HumanEval and held-out db/repo tasks
(``evaluate``, ``command``: ``shipyard eval``) with confidence intervals of rates and paired
differences (``stats``). Promises: the same seeded sessions before and after, so differences are
paired. Does not cover: choosing the tasks (``shipyard.envs.tasks.splits``)."""
