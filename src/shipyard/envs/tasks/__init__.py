"""Task kinds and their sets: generated function tasks (``functions``), long multi-module tasks
(``long``), database migrations (``db``), repository fixes (``repo``), HumanEval (``humaneval``),
task files in the documented format (``files``), each kind's ``tests`` reward (``grade``) and the
train/held-out splits (``splits``). Builds on ``envs.grading``, ``envs.sandbox`` and
``envs.services``; nothing below imports it."""
