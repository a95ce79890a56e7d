"""Long-horizon tasks: a workspace of modules whose scattered rules all have to be read to write one function.

Contract: :func:`long_tasks` is a pure function of its arguments: the same ``(n, seed, modules,
filler_lines)`` give the same list of :class:`~shipyard.envs.types.Task` records on every
machine. A task is:

- ``files``: ``part_00.py`` .. ``part_<N-1>.py``. The docstring of module ``i`` states, in prose,
  rule ``i``: one integer operation (add, subtract, multiply, modulo, XOR, floor division, a
  conditional add, a cap, a negative fix-up; :data:`RULES`) whose constant is defined in ANOTHER
  module (a seeded derangement), named there as a module-level assignment. Every module also holds
  a legacy constant that no rule uses, a few filler comment lines and an unused helper, so
  reading the workspace costs far more tokens than the answer;
- easier variants (``local_constants``: each constant in its rule's own module; ``rules``: a subset
  of the rules) keep the shape, for a policy that cannot solve the default yet;
- ``prompt``: write ``<name>(x)`` in ``solution.py`` that applies the rules of ``part_00.py``,
  ``part_01.py``, ... in order to the integer ``x`` and returns the result, with one worked example;
- ``visible_tests``: 2 example tests; ``hidden_tests``: 8 tests ``test_case_<k>`` (the examples
  again, then 0, negatives, large values, drawn values); both import ``from solution import <name>``;
- ``reference``: a correct ``solution.py`` with the constants inlined; ``source`` ``"long"``,
  ``difficulty`` 5, ``id`` ``long-00042``.

At the default size (12 modules) the workspace is about 2,500 tokens of the SmolLM2 tokenizer, so
with a context window of ~1,000 tokens a session cannot hold every file it needs at once: it has
to read, keep what matters (self-summarization, see :mod:`shipyard.agent.summarize`) and write.
The modules stay in the workspace, so they are present (and importable) when
:func:`shipyard.envs.grading.grader.grade` runs the hidden tests; a solution may import the constants.

Expected outputs are computed by interpreting the rule list directly and checked against the
rendered reference run in-process (two implementations must agree, else generation fails); a
draw whose hidden cases give fewer than 5 distinct outputs is drawn again.

Limits: the rules are a straight-line pipeline over one integer (no loops or data structures);
reading order is free, so a policy that reads all files before writing needs the context or a
summary, one that writes incrementally needs its solution carried (``agent.summary.keep``).

Example::

    tasks = long_tasks(20, seed=0)
    res = grade(tasks[0], {**tasks[0].files, "solution.py": tasks[0].reference}, SandboxConfig())
    assert res.reward == 1.0
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable
from dataclasses import dataclass

from shipyard.envs.types import Task


@dataclass(frozen=True)
class Rule:
    """One operation on the value ``x`` with a constant ``c``."""

    key: str
    text: str
    """Prose of the rule; ``{c}`` marks where the constant is named."""
    code: tuple[str, ...]
    """Reference source lines (indented one level in the function); ``{c}`` is the literal."""
    fn: Callable[[int, int], int]
    lo: int
    hi: int
    """Range of the constant."""


RULES: tuple[Rule, ...] = (
    Rule("add", "add {c} to the value", ("x = x + {c}",), lambda x, c: x + c, 1, 20),
    Rule("sub", "subtract {c} from the value", ("x = x - {c}",), lambda x, c: x - c, 1, 20),
    Rule("mul", "multiply the value by {c}", ("x = x * {c}",), lambda x, c: x * c, 2, 4),
    Rule(
        "mod",
        "replace the value by its remainder modulo {c} (Python's % operator)",
        ("x = x % {c}",),
        lambda x, c: x % c,
        50,
        199,
    ),
    Rule(
        "even_add",
        "if the value is even, add {c} to it; otherwise leave it unchanged",
        ("if x % 2 == 0:", "    x = x + {c}"),
        lambda x, c: x + c if x % 2 == 0 else x,
        1,
        20,
    ),
    Rule(
        "cap",
        "if the value is greater than {c}, replace the value by that constant",
        ("if x > {c}:", "    x = {c}"),
        lambda x, c: min(x, c),
        100,
        400,
    ),
    Rule(
        "neg",
        "if the value is negative, replace it by its absolute value plus {c}",
        ("if x < 0:", "    x = -x + {c}"),
        lambda x, c: -x + c if x < 0 else x,
        1,
        20,
    ),
    Rule(
        "xor",
        "replace the value by the value XOR {c} (Python's ^ operator)",
        ("x = x ^ {c}",),
        lambda x, c: x ^ c,
        1,
        63,
    ),
    Rule(
        "div",
        "integer-divide the value by {c} (Python's // operator, rounding down)",
        ("x = x // {c}",),
        lambda x, c: x // c,
        2,
        5,
    ),
)

_WORDS = ("OFFSET", "SCALE", "LIMIT", "SHIFT", "BASE", "STEP", "MASK", "BOUND", "FACTOR", "DELTA")
_NAMES = ("pipeline", "transform", "process_value", "run_stages", "apply_rules", "evaluate_chain")
_NOTES = (
    "# note: the {w} table was migrated in {y}; old reports still read it",
    "# todo({y}): move the {w} helpers into a shared module",
    "# the nightly job recomputes {w} totals before {h}:00",
    "# {w} values come from the {y} configuration review",
    "# keep this file in sync with the {w} dashboard (owner: team {h})",
    "# historical: {w} was a float until {y}",
)
_DRAWS = 50


@dataclass(frozen=True)
class _Draw:
    """One task's hidden structure: rule per module, constant value, where each constant lives."""

    rules: tuple[Rule, ...]
    values: tuple[int, ...]
    """``values[i]``: the constant of rule i."""
    home: tuple[int, ...]
    """``home[i]``: the module that defines rule i's constant (never i)."""
    names: tuple[str, ...]
    """``names[i]``: the name of rule i's constant."""

    def apply(self, x: int) -> int:
        for rule, c in zip(self.rules, self.values, strict=True):
            x = rule.fn(x, c)
        return x


def _draw(rng: random.Random, modules: int, pool: tuple[Rule, ...], local: bool) -> _Draw:
    rules = tuple(rng.choice(pool) for _ in range(modules))
    values = tuple(rng.randint(r.lo, r.hi) for r in rules)
    home = list(range(modules))
    while not local and any(h == i for i, h in enumerate(home)):
        rng.shuffle(home)
    names = tuple(f"{rng.choice(_WORDS)}_{home[i]:02d}" for i in range(modules))
    return _Draw(rules, values, tuple(home), names)


def _module(d: _Draw, j: int, rng: random.Random, filler_lines: int) -> str:
    """Source of ``part_<j>.py``: rule j in prose, the constant(s) it defines, filler."""
    lines = [
        f'"""part_{j:02d}: stage {j + 1} of {len(d.rules)} of the value pipeline.',
        "",
        _statement(d.rules[j], d.names[j], f"part_{j:02d}", f"part_{d.home[j]:02d}") + ".",
        '"""',
        "",
    ]
    lines += [f"{d.names[i]} = {d.values[i]}" for i in range(len(d.rules)) if d.home[i] == j]
    lines.append(f"{rng.choice(_WORDS)}_{j:02d}_LEGACY = {rng.randint(1, 99)}  # legacy: no rule uses it")
    lines.append("")
    for _ in range(filler_lines):
        note = rng.choice(_NOTES)
        lines.append(
            note.format(w=rng.choice(_WORDS).lower(), y=rng.randint(2015, 2024), h=rng.randint(1, 23))
        )
    k = rng.randint(2, 9)
    lines += ["", "", f"def _report_{j:02d}(rows):", f"    return sorted(rows)[:{k}]", ""]
    return "\n".join(lines)


def _statement(rule: Rule, const: str, module: str, home: str) -> str:
    """The docstring line of ``module`` stating ``rule`` with ``const`` defined in ``home``."""
    where = "this module" if home == module else f"{home}.py"
    return f"Rule: {rule.text.format(c=f'the constant `{const}` defined in {where}')}"


def _reference(d: _Draw, name: str) -> str:
    body = [f"def {name}(x):"]
    for i, (rule, c) in enumerate(zip(d.rules, d.values, strict=True)):
        body.append(f"    # part_{i:02d}: {rule.key} with {d.names[i]} = {c}")
        body += [f"    {line.format(c=c)}" for line in rule.code]
    body.append("    return x")
    return "\n".join(body) + "\n"


def _test_file(name: str, prefix: str, cases: list[tuple[int, int]]) -> str:
    tests = "".join(
        f"\n\ndef {prefix}_{k}():\n    assert {name}({x!r}) == {want!r}\n"
        for k, (x, want) in enumerate(cases, 1)
    )
    return f"from solution import {name}\n{tests}"


def _task(d: _Draw, rng: random.Random, index: int, filler_lines: int) -> Task | None:
    """The task for draw ``d`` (None when its hidden cases are too uniform)."""
    name = rng.choice(_NAMES)
    inputs = [rng.randint(1, 30), rng.randint(31, 99), 0, -1, rng.randint(-60, -2), 1000, 12345]
    inputs += [rng.randint(100, 999)]
    inputs = list(dict.fromkeys(inputs))
    reference = _reference(d, name)
    scope: dict[str, Callable[[int], int]] = {}
    exec(compile(reference, f"<long reference {name}>", "exec"), scope)  # our own generated source
    cases = [(x, d.apply(x)) for x in inputs]
    for x, want in cases:
        got = scope[name](x)
        assert got == want, f"long task {index}: reference gives {got} for {x}, the rules give {want}"
    if len({want for _, want in cases}) < 5:
        return None
    modules = len(d.rules)
    files = {f"part_{j:02d}.py": _module(d, j, rng, filler_lines) for j in range(modules)}
    ex_in, ex_out = cases[0]
    prompt = (
        f"The workspace holds {modules} modules, part_00.py .. part_{modules - 1:02d}.py. The docstring of each "
        "states one rule that changes an integer value; a rule's constant is defined in "
        f"{'the same' if all(h == i for i, h in enumerate(d.home)) else 'another'} module "
        "(a module-level assignment; constants marked legacy are unused). Write a Python function "
        f"`{name}(x)` in solution.py that starts from the integer x, applies the rules of part_00.py, "
        f"part_01.py, ... in this order and returns the value. For example, `{name}({ex_in})` should "
        f"return `{ex_out}`."
    )
    return Task(
        id=f"long-{index:05d}",
        prompt=prompt,
        entry_point=name,
        files=files,
        visible_tests=_test_file(name, "test_example", cases[:2]),
        hidden_tests=_test_file(name, "test_case", cases[:8]),
        difficulty=5,
        source="long",
        reference=reference,
    )


def long_tasks(
    n: int,
    seed: int,
    modules: int = 12,
    filler_lines: int = 6,
    *,
    local_constants: bool = False,
    rules: tuple[str, ...] | None = None,
) -> list[Task]:
    """``n`` long-horizon tasks of ``modules`` modules each, deterministic for the arguments (module doc).

    Easier variants, for a policy that cannot yet solve the default: ``local_constants`` defines each
    rule's constant in the rule's own module (no cross-reference; every module must still be read),
    and ``rules`` restricts the rules drawn to those keys of :data:`RULES` (e.g. ``("add", "sub")``).
    """
    if n < 1:
        raise ValueError(f"n={n} must be >= 1 (number of long tasks)")
    if modules < 2:
        raise ValueError(f"modules={modules} must be >= 2 (a rule's constant lives in another module)")
    if filler_lines < 0:
        raise ValueError(f"filler_lines={filler_lines} must be >= 0")
    known = {r.key: r for r in RULES}
    if rules is not None and (not rules or any(k not in known for k in rules)):
        raise ValueError(
            f"long task rules={rules!r} (tasks.long_rules): choose one or more of {sorted(known)}"
        )
    pool = RULES if rules is None else tuple(known[k] for k in rules)
    variant = "" if rules is None and not local_constants else f"/{local_constants}/{','.join(rules or ())}"
    rng = random.Random(f"long/{seed}/{modules}/{filler_lines}{variant}")
    tasks: list[Task] = []
    while len(tasks) < n:
        for _ in range(_DRAWS):
            task = _task(_draw(rng, modules, pool, local_constants), rng, len(tasks), filler_lines)
            if task is not None:
                tasks.append(task)
                break
        else:
            raise ValueError(f"no long task with distinct outputs in {_DRAWS} draws; use more modules")
    return tasks


# ---------------------------------------------------------------- reading a workspace (demonstrations)


@dataclass(frozen=True)
class ReadRule:
    """What one module's docstring says: its rule, the constant's name and the module defining it."""

    module: str
    """``part_<j>`` of the module stating the rule."""
    rule: Rule
    const: str
    home: str
    """``part_<k>``: the module whose assignment defines ``const``."""

    def code(self) -> tuple[str, ...]:
        """The rule's source lines (one indent level inside the function), the constant by name."""
        return tuple(line.format(c=self.const) for line in self.rule.code)

    def statement(self) -> str:
        """The rule as its module states it (what a ``cat`` of the module shows)."""
        return _statement(self.rule, self.const, self.module, self.home)

    def note(self) -> str:
        """A one-line note of the rule, as code: what a summary needs to keep of this module, the
        import of its constant included (``part_00: from part_03 import MASK_03; x = x + MASK_03``),
        so writing the solution from notes is copying, not recalling where a constant lives."""
        return f"{self.module}: from {self.home} import {self.const}; {' '.join(line.strip() for line in self.code())}"


_REF = r"the constant `(?P<const>[A-Z_0-9]+)` defined in (?P<where>this module|part_\d+\.py)"
_RULE_LINE = re.compile(r'^"""(?P<module>part_\d+): .*?^Rule: (?P<text>.+?)\.$', re.MULTILINE | re.DOTALL)


def read_rule(source: str) -> ReadRule | None:
    """The rule a long-task module states (None when ``source`` is not such a module, e.g. cut short)."""
    head = _RULE_LINE.search(source)
    if head is None:
        return None
    for rule in RULES:
        pattern = re.escape(rule.text).replace(re.escape("{c}"), _REF)
        m = re.fullmatch(pattern, head["text"])
        if m is not None:
            home = head["module"] if m["where"] == "this module" else m["where"].removesuffix(".py")
            return ReadRule(head["module"], rule, m["const"], home)
    return None


def solution_from_rules(name: str, rules: list[ReadRule]) -> str:
    """``solution.py`` applying ``rules`` in order, importing each constant from its module (the
    modules stay in the workspace when the hidden tests run, so no value has to be copied)."""
    imports = [f"from {r.home} import {r.const}" for r in rules]
    body = [f"    {line}" for r in rules for line in r.code()]
    return "\n".join([*dict.fromkeys(imports), "", "", f"def {name}(x):", *body, "    return x", ""])
