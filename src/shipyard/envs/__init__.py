"""Everything a session runs against: environment = harness's world + operating system + reward.

Packages, each a reader can find by name:
- ``sandbox/``: isolated places to run commands (bubblewrap, microVM, remote provider; a pool);
  stands alone (imports only ``envs.types`` and the config);
- ``services/``: servers tasks declare (PostgreSQL), leased per rollout; stands alone too;
- ``grading/``: the hidden-test grader (two sandboxes), reward components and their composite,
  LLM-as-judge rubrics, reward-hacking detectors and canaries;
- ``tasks/``: the task kinds (generated functions, long tasks, database migrations, repository
  fixes, HumanEval, task files), the ``tests`` reward of each kind, and the train/held-out splits;
- ``environment.py``: one pool's sandboxes, services and rewards for every task kind;
- ``processes.py``: process facts sandbox and services share (is a pid alive).

Promises: deterministic task generation from seeds; grading never runs in the session's sandbox.
Does not cover: playing a session (``shipyard.agent``), or anything about models and weights.
"""
