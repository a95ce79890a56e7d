"""Generated Python function-writing tasks of graded difficulty (1 = trivial .. 5 = classic puzzles).

Contract: :func:`generated_tasks` is a pure function of ``(n, seed)``: the same arguments give
the same list of :class:`~shipyard.envs.types.Task` records on every machine. Tasks are plain
data. Each comes from one of the families in
:data:`shipyard.envs.tasks.function_families.FAMILIES` (60 families, 12 per difficulty),
parameterised by function name, argument names and constants (about 9,500 distinct prompts).
Families are visited round-robin in a seeded order, so the first ``len(FAMILIES)`` tasks hold
one task of every family and difficulties are equally represented. A task is:

- ``id`` ``gen-00042`` (its index), ``source`` ``"generated"``, ``difficulty`` 1-5;
- ``prompt``: one instruction naming the exact signature, plus one worked example, e.g.
  "Write a Python function `add_numbers(a, b)` that returns the sum of a and b. For example,
  `add_numbers(2, 3)` should return `5`.";
- ``files``: ``{}``: the agent writes ``solution.py`` from scratch (the prompt is the spec);
- ``visible_tests``: a pytest file with 2 example tests ``test_example_<k>``;
- ``hidden_tests``: a pytest file with 6-8 separate tests ``test_case_<k>``: the two examples
  again (so matching the examples earns partial credit, a denser signal for a small policy)
  followed by edge cases (empty inputs, zero, negatives, ...); both files import
  ``from solution import <entry_point>``;
- ``reference``: a correct ``solution.py``.

Expected outputs are computed by running the family's reference on the drawn inputs at
generation time (our own code, in-process); each family also carries hand-checked anchor cases
that the reference must reproduce, so a wrong reference fails generation instead of yielding
wrong tests. :func:`split_tasks` splits deterministically, stratified by difficulty.

Limits: outputs are compared with ``==`` (floats with an absolute tolerance of 1e-6), so ``1``
passes for ``True`` and a tuple does not pass for a list; the pool of distinct tasks is finite
(``generated_tasks`` raises ValueError past it); names such as ``sum_list`` or ``gcd`` recur
across tasks with different wording or constants.

Example::

    tasks = generated_tasks(600, seed=1234)
    train, heldout = split_tasks(tasks, heldout_frac=0.25, seed=1234)
"""

from __future__ import annotations

import copy
import random
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from shipyard.envs.tasks.function_families import FAMILIES, Args, Family, Variant
from shipyard.envs.tasks.kinds import GradingContext, check_hidden_tests, clip_output, file_state
from shipyard.envs.types import RewardResult, Sandbox, Task

if TYPE_CHECKING:
    from shipyard.envs.tasks.repo import RepoCache

_DRAWS = 40
"""Draws tried per family turn before the family counts as exhausted (no new distinct task)."""


# ---------------------------------------------------------------------------------- assembly
def _call(name: str, args: Args) -> str:
    return f"{name}({', '.join(repr(a) for a in args)})"


def _assert(name: str, args: Args, expected: Any, approx: bool) -> str:
    call = _call(name, args)
    if approx:
        return f"abs({call} - {expected!r}) < 1e-6"
    if expected is None:
        return f"{call} is None"
    return f"{call} == {expected!r}"


def _test_file(name: str, prefix: str, asserts: list[str]) -> str:
    tests = "".join(f"\n\ndef {prefix}_{i}():\n    assert {a}\n" for i, a in enumerate(asserts, 1))
    return f"from solution import {name}\n{tests}"


def _load(v: Variant) -> Callable[..., Any]:
    scope: dict[str, Any] = {}
    exec(compile(v.body, f"<reference {v.name}>", "exec"), scope)  # our own reference source
    return scope[v.name]


def _task(v: Variant, family: Family, index: int) -> Task | None:
    """Turn a drawn variant into a Task (None if its inputs give too few distinct cases)."""
    fn = _load(v)
    for args, want in v.anchors:
        got = fn(*copy.deepcopy(args))
        assert got == want, f"family {family.key}: reference gives {got!r} for {args!r}, expected {want!r}"
    cases: list[tuple[Args, Any]] = []
    seen: set[str] = set()
    for args in v.inputs:
        if repr(args) not in seen or not v.params:
            seen.add(repr(args))
            cases.append((args, fn(*copy.deepcopy(args))))
    visible, hidden = cases[:2], cases[:8]  # hidden re-checks the examples, then edge cases
    hidden_asserts = ([_assert(v.name, a, e, v.approx) for a, e in hidden] + list(v.extra))[:8]
    if len(visible) < 2 or len(hidden_asserts) < 4:
        return None  # drawn inputs collided; the caller draws again
    ex_args, ex_out = visible[0]
    prompt = (
        f"Write a Python function `{v.name}({', '.join(v.params)})` that {v.summary}. "
        f"For example, `{_call(v.name, ex_args)}` should return `{ex_out!r}`."
    )
    return Task(
        id=f"gen-{index:05d}",
        prompt=prompt,
        entry_point=v.name,
        files={},
        visible_tests=_test_file(
            v.name, "test_example", [_assert(v.name, a, e, v.approx) for a, e in visible]
        ),
        hidden_tests=_test_file(v.name, "test_case", hidden_asserts),
        difficulty=family.difficulty,
        source="generated",
        reference=v.body,
        family=family.key,
    )


def generated_tasks(n: int, seed: int) -> list[Task]:
    """``n`` distinct tasks, deterministic for ``seed``, cycling through all families in a seeded order."""
    if n < 1:
        raise ValueError(f"n={n} must be >= 1 (number of generated tasks; see tasks.num_generated)")
    rng = random.Random(seed)
    order = list(range(len(FAMILIES)))
    rng.shuffle(order)
    seen: set[tuple[str, ...]] = set()
    exhausted: set[int] = set()
    tasks: list[Task] = []
    pos = 0
    while len(tasks) < n:
        if len(exhausted) == len(FAMILIES):
            raise ValueError(
                f"n={n} is more than the families yield (no new distinct task after {len(tasks)}); lower tasks.num_generated"
            )
        fi = order[pos % len(order)]
        pos += 1
        if fi in exhausted:
            continue
        for _ in range(_DRAWS):
            v = FAMILIES[fi].build(rng)
            key = (FAMILIES[fi].key, v.name, *v.params, v.summary)
            task = None if key in seen else _task(v, FAMILIES[fi], len(tasks))
            if task is not None:
                seen.add(key)
                tasks.append(task)
                break
        else:
            exhausted.add(fi)
    return tasks


def split_tasks(tasks: Sequence[Task], heldout_frac: float, seed: int) -> tuple[list[Task], list[Task]]:
    """(train, heldout): per difficulty, a seeded shuffle puts ``round(frac * count)`` tasks in heldout.

    Both lists keep the input order; they are disjoint and together hold every task.
    """
    if not 0 < heldout_frac < 1:
        raise ValueError(
            f"heldout_frac={heldout_frac} must be strictly between 0 and 1 (see tasks.heldout_frac)"
        )
    ids = [t.id for t in tasks]
    if len(set(ids)) != len(ids):
        raise ValueError("tasks have duplicate ids; split_tasks needs unique Task.id values")
    rng = random.Random(seed)
    held: set[str] = set()
    for level in sorted({t.difficulty for t in tasks}):
        group = sorted(t.id for t in tasks if t.difficulty == level)
        rng.shuffle(group)
        held.update(group[: round(heldout_frac * len(group))])
    return [t for t in tasks if t.id not in held], [t for t in tasks if t.id in held]


SYSTEM_PROMPT = (
    "You are a coding agent in a Linux sandbox. Act by replying with exactly one of:\n"
    "- a ```python block with the complete contents of solution.py (the visible tests then run),\n"
    "- a ```bash block with one shell command to run,\n"
    "- SUBMIT on its own line when you are done."
)
"""The system prompt of function tasks (unchanged since the first trained runs)."""
REMINDER = (
    "No action found. Reply with a ```python block holding the complete solution.py, "
    "a ```bash block with one command, or SUBMIT."
)
"""The reminder of function tasks (unchanged)."""
VISIBLE_TESTS_FILE = "test_visible.py"
RUN_VISIBLE = f"PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 python -m pytest -q -x --no-header -p no:cacheprovider {VISIBLE_TESTS_FILE}"
"""What runs after each write of a function task with visible tests. Third-party pytest plugins
are not loaded: those installed beside the sandbox's Python (anyio, pytest-timeout) are this
project's test dependencies, not the task's, and importing them took half of every run (median
398 -> 184 ms in a sandbox here, ``benchmarks/sandbox.py``; the demo runs ~1,200 of them). The
report is pytest's own either way."""


class FunctionKind:
    """Write ``solution.py`` (generated tasks, long tasks, HumanEval): visible tests run after each
    write; graded by the two-sandbox hidden-test grader. See :mod:`shipyard.envs.tasks.kinds`."""

    name = "function"

    def system_prompt(self) -> str:
        return SYSTEM_PROMPT

    def reminder(self) -> str:
        return REMINDER

    def default_files(self) -> dict[str, str]:
        return {"python": "solution.py"}

    def asks_for_path(self) -> bool:
        return False

    def first_message(self, task: Task) -> str:
        """The message the trained runs saw (token records unchanged); long tasks (``source ==
        "long"``) also say how to read the modules first (told only to reply with solution.py, a
        small policy guesses instead of reading)."""
        if task.source == "long":
            return (
                f"{task.prompt}\n\nRead one module per reply with a ```bash block (e.g. `cat part_00.py`). "
                "Once you know every rule and constant, reply with the complete solution.py in a ```python block."
            )
        return f"{task.prompt}\n\nReply with the complete solution.py in a ```python block."

    def after_write(
        self, task: Task, sb: Sandbox, path: str, limit: int, end_on_pass: bool
    ) -> tuple[str, str]:
        if not task.visible_tests:
            return f"{path} written.", "written" if end_on_pass and path == "solution.py" else ""
        res = sb.exec(RUN_VISIBLE)
        if res.returncode == 0 and not res.timed_out:
            return f"{path} written. Visible tests passed.", "passed" if end_on_pass else ""
        out = clip_output(res.stdout + res.stderr, limit)
        return f"{path} written. Visible tests failed:\n{out}", ""

    def work_state(self, sb: Sandbox, chars: int) -> str:
        return file_state(sb, "solution.py", "python", chars)

    def check(self, task: Task, where: str) -> None:
        check_hidden_tests(task, where)
        if not task.entry_point:
            raise ValueError(f"{where}: a function task needs `entry_point` (the function's name)")

    def workspace_base(self, task: Task, repos: RepoCache) -> str | None:
        return None

    def ignored_flags(self) -> frozenset[str]:
        return frozenset()

    def reference_files(self, task: Task) -> dict[str, str]:
        return {**task.files, "solution.py": task.reference}

    def grade(self, task: Task, files: dict[str, str], ctx: GradingContext) -> RewardResult:
        if ctx.function_grader is not None:
            return ctx.function_grader(task, files)
        from shipyard.envs.grading.grader import grade

        return grade(task, files, ctx.sandbox)
