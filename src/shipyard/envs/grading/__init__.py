"""Grading that the graded code cannot forge: the two-sandbox hidden-test grader (``grader``), reward
components and their weighted composite (``rewards``), LLM-as-judge rubrics (``judge``) and the
reward-hacking detectors and canary tasks (``anticheat``). Knows nothing of task kinds
(``envs.tasks`` builds on it)."""
