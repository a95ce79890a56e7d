"""Generated Python function-writing tasks of graded difficulty (1 = trivial .. 5 = classic puzzles).

Contract: :func:`generated_tasks` is a pure function of ``(n, seed)``: the same arguments give
the same list of :class:`~shipyard.envs.types.Task` records on every machine. Tasks are plain
data. Each comes from one of the families in :data:`FAMILIES` (60 families, 12 per difficulty),
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
from dataclasses import dataclass
from typing import Any

from shipyard.envs.types import Task

Args = tuple[Any, ...]


@dataclass(frozen=True)
class Variant:
    """One concrete function to write: what a family builder returns for one draw."""

    name: str
    params: tuple[str, ...]
    summary: str
    """Completes "Write a Python function `f(a, b)` that ..." (no final period)."""
    body: str
    """Reference source: the full ``solution.py``."""
    inputs: list[Args]
    """Argument tuples; the first two are the visible examples, the rest (edge cases) hidden."""
    anchors: tuple[tuple[Args, Any], ...] = ()
    """Hand-checked (args, expected) pairs the reference must reproduce."""
    extra: tuple[str, ...] = ()
    """Additional hidden assert expressions (for functions without arguments)."""
    approx: bool = False


Builder = Callable[[random.Random], Variant]


@dataclass(frozen=True)
class Family:
    key: str
    difficulty: int
    build: Builder


FAMILIES: list[Family] = []
"""Every task family, registered in definition order by :func:`_family`."""
_DRAWS = 40
"""Draws tried per family turn before the family counts as exhausted (no new distinct task)."""


def _family(key: str, difficulty: int) -> Callable[[Builder], Builder]:
    def register(fn: Builder) -> Builder:
        FAMILIES.append(Family(key, difficulty, fn))
        return fn

    return register


def _make(
    rng: random.Random,
    names: Sequence[str],
    params: Sequence[tuple[str, ...]],
    summary: str,
    body: str,
    inputs: list[Args],
    **kw: Any,
) -> Variant:
    """Pick a name and argument names, then fill ``$0, $1, ...`` (arguments) and ``$f`` (name)."""
    name = rng.choice(list(names))
    ps = rng.choice(list(params))

    def fill(text: str) -> str:
        for i in reversed(range(len(ps))):
            text = text.replace(f"${i}", ps[i])
        return text.replace("$f", name)

    src = f"def {name}({', '.join(ps)}):\n" + fill(body).rstrip() + "\n"
    kw["extra"] = tuple(fill(e) for e in kw.get("extra", ()))
    return Variant(name, ps, fill(summary), src, inputs, **kw)


def _ints(rng: random.Random, k: int, lo: int = -20, hi: int = 20) -> list[int]:
    return [rng.randint(lo, hi) for _ in range(k)]


def _words(rng: random.Random, k: int) -> list[str]:
    return [rng.choice(_VOCAB) for _ in range(k)]


_VOCAB = [
    "apple",
    "banana",
    "cat",
    "dog",
    "egg",
    "fish",
    "grape",
    "house",
    "ice",
    "jam",
    "kite",
    "lemon",
    "moon",
    "nest",
    "orange",
    "pear",
    "queen",
    "river",
    "sun",
    "tree",
    "umbrella",
    "violin",
    "water",
    "box",
    "yarn",
    "zebra",
    "level",
    "noon",
    "radar",
    "stats",
]
_ONE = [("x",), ("n",), ("value",), ("num",)]
_TWO = [("a", "b"), ("x", "y"), ("m", "n"), ("first", "second")]
_STR = [("s",), ("text",), ("word",), ("string",)]
_LIST = [("nums",), ("numbers",), ("values",), ("items",)]
_SENT = [("s",), ("text",), ("sentence",), ("line",)]
_EXPR = [("s",), ("text",), ("expr",)]


# ---------------------------------------------------------------------------------- difficulty 1
@_family("add", 1)
def _add(rng: random.Random) -> Variant:
    ins = [(rng.randint(1, 9), rng.randint(1, 9)) for _ in range(2)] + [(0, 0), (-3, 3), (-7, -8)]
    ins += [tuple(_ints(rng, 2, -100, 100)) for _ in range(3)]
    names = ["add_numbers", "add", "sum_two", "plus", "add_values", "add_two"]
    return _make(
        rng, names, _TWO, "returns the sum of $0 and $1", "    return $0 + $1", ins, anchors=(((2, 3), 5),)
    )


@_family("constant", 1)
def _constant(rng: random.Random) -> Variant:
    k = rng.randint(0, 999)
    names = ["get_answer", "magic_number", "constant_value", "favorite_number", "lucky_number", "the_number"]
    extra = ("isinstance($f(), int)", "$f() == $f()", f"$f() + 1 == {k + 1}")
    summary = f"takes no arguments and returns the integer {k}"
    return _make(rng, names, [()], summary, f"    return {k}", [(), (), ()], extra=extra, anchors=(((), k),))


@_family("multiply_by_k", 1)
def _times(rng: random.Random) -> Variant:
    k = rng.randint(2, 12)
    ins = [(rng.randint(2, 10),), (rng.randint(11, 30),), (0,), (-4,), (1,), (rng.randint(100, 999),), (-25,)]
    names = [f"times_{k}", f"multiply_by_{k}", "scale", "multiply", f"mul{k}"]
    return _make(
        rng,
        names,
        _ONE,
        f"returns $0 multiplied by {k}",
        f"    return $0 * {k}",
        ins,
        anchors=(((3,), 3 * k),),
    )


@_family("is_even", 1)
def _is_even(rng: random.Random) -> Variant:
    ins = [
        (rng.randrange(2, 40, 2),),
        (rng.randrange(1, 40, 2),),
        (0,),
        (-4,),
        (-7,),
        (rng.randint(100, 999),),
    ]
    names = ["is_even", "check_even", "even", "is_even_number", "evenness"]
    summary = "returns True if the integer $0 is even and False otherwise"
    return _make(
        rng, names, _ONE, summary, "    return $0 % 2 == 0", ins, anchors=(((4,), True), ((7,), False))
    )


@_family("is_odd", 1)
def _is_odd(rng: random.Random) -> Variant:
    ins = [
        (rng.randrange(1, 40, 2),),
        (rng.randrange(2, 40, 2),),
        (0,),
        (-3,),
        (-10,),
        (rng.randint(100, 999),),
    ]
    names = ["is_odd", "check_odd", "odd", "is_odd_number", "oddness"]
    summary = "returns True if the integer $0 is odd and False otherwise"
    return _make(
        rng, names, _ONE, summary, "    return $0 % 2 == 1", ins, anchors=(((3,), True), ((-2,), False))
    )


@_family("subtract", 1)
def _subtract(rng: random.Random) -> Variant:
    ins = [
        (rng.randint(10, 20), rng.randint(1, 9)),
        (rng.randint(1, 9), rng.randint(10, 20)),
        (0, 0),
        (5, -5),
    ]
    ins += [tuple(_ints(rng, 2, -100, 100)) for _ in range(3)]
    names = ["subtract", "minus", "sub", "take_away", "subtract_numbers"]
    return _make(rng, names, _TWO, "returns $0 minus $1", "    return $0 - $1", ins, anchors=(((7, 2), 5),))


@_family("add_k", 1)
def _add_k(rng: random.Random) -> Variant:
    k = rng.randint(1, 100)
    ins = [(rng.randint(1, 10),), (rng.randint(11, 50),), (0,), (-k,), (-1000,), (rng.randint(100, 999),)]
    names = [f"add_{k}", f"plus_{k}", "increase", "bump", "add_constant"]
    return _make(rng, names, _ONE, f"returns $0 plus {k}", f"    return $0 + {k}", ins, anchors=(((0,), k),))


@_family("square", 1)
def _square(rng: random.Random) -> Variant:
    ins = [(rng.randint(2, 9),), (rng.randint(10, 30),), (0,), (1,), (-5,), (rng.randint(100, 999),)]
    names = ["square", "squared", "square_number", "sq", "power_two"]
    return _make(
        rng, names, _ONE, "returns $0 multiplied by itself", "    return $0 * $0", ins, anchors=(((3,), 9),)
    )


@_family("negate", 1)
def _negate(rng: random.Random) -> Variant:
    ins = [
        (rng.randint(2, 20),),
        (-rng.randint(2, 20),),
        (0,),
        (1000,),
        (-1,),
        (rng.randint(100, 999),),
        (-77,),
    ]
    names = ["negate", "negative", "flip_sign", "opposite", "invert_sign"]
    return _make(
        rng,
        names,
        _ONE,
        "returns the negative of $0 (that is, -$0)",
        "    return -$0",
        ins,
        anchors=(((5,), -5),),
    )


@_family("greet", 1)
def _greet(rng: random.Random) -> Variant:
    g = rng.choice(["Hello", "Hi", "Hey", "Welcome", "Good morning", "Greetings"])
    people = ["Alice", "Bob", "Carol", "Dan", "Eve", "Zoe", "Sam"]
    ins = [(p,) for p in rng.sample(people, 3)] + [("",), ("Mary Ann",), ("x",)]
    names = ["greet", "make_greeting", "say_hello", "greeting", "welcome"]
    params = [("name",), ("person",), ("who",)]
    summary = f"returns the string '{g}, ' followed by $0 and then '!' (for example '{g}, Ann!' for 'Ann')"
    return _make(
        rng,
        names,
        params,
        summary,
        f"    return '{g}, ' + $0 + '!'",
        ins,
        anchors=((("Ann",), f"{g}, Ann!"),),
    )


@_family("string_length", 1)
def _length(rng: random.Random) -> Variant:
    ins = [(w,) for w in _words(rng, 2)] + [("",), ("a b c",), ("  ",), ("".join(_words(rng, 4)),), ("x",)]
    names = ["string_length", "length_of", "text_length", "count_chars", "size_of_text"]
    summary = "returns the number of characters in the string $0"
    return _make(rng, names, _STR, summary, "    return len($0)", ins, anchors=((("abc",), 3),))


@_family("is_positive", 1)
def _is_positive(rng: random.Random) -> Variant:
    ins = [
        (rng.randint(2, 50),),
        (-rng.randint(2, 50),),
        (0,),
        (1,),
        (-1,),
        (rng.randint(100, 999),),
        (-1000,),
    ]
    names = ["is_positive", "positive", "check_positive", "greater_than_zero", "above_zero"]
    summary = "returns True if $0 is greater than 0 and False otherwise"
    return _make(rng, names, _ONE, summary, "    return $0 > 0", ins, anchors=(((0,), False), ((2,), True)))


# ---------------------------------------------------------------------------------- difficulty 2
@_family("reverse_string", 2)
def _reverse(rng: random.Random) -> Variant:
    ins = [(w,) for w in _words(rng, 2)] + [("",), ("a",), ("ab cd",), (" ".join(_words(rng, 3)),), ("Hi!",)]
    names = ["reverse_string", "reverse_text", "reversed_word", "flip_text", "backwards"]
    summary = "returns the string $0 reversed"
    return _make(rng, names, _STR, summary, "    return $0[::-1]", ins, anchors=((("abc",), "cba"),))


@_family("change_case", 2)
def _case(rng: random.Random) -> Variant:
    upper = rng.random() < 0.5
    ins = [
        ("Hello World",),
        (rng.choice(_VOCAB).capitalize(),),
        ("",),
        ("MiXeD 123!",),
        ("already",),
        ("ABC",),
    ]
    names = (
        ["to_upper", "shout", "make_upper", "upper_case"] if upper else ["to_lower", "whisper", "make_lower"]
    )
    summary = f"returns $0 with every letter converted to {'uppercase' if upper else 'lowercase'}"
    body = f"    return $0.{'upper' if upper else 'lower'}()"
    anchor = ((("aB",), "AB" if upper else "ab"),)
    return _make(rng, names, _SENT, summary, body, ins, anchors=anchor)


@_family("count_char", 2)
def _count_char(rng: random.Random) -> Variant:
    c = rng.choice("aeinorst")
    ins = [
        (" ".join(_words(rng, 3)),),
        (" ".join(_words(rng, 2)) + c,),
        ("",),
        (c * 5,),
        ("xyz",),
        (c.upper() + c,),
    ]
    names = [f"count_{c}", "count_letter", "char_count", "letter_frequency", "how_many"]
    summary = f"returns how many times the lowercase character '{c}' appears in $0"
    return _make(rng, names, _SENT, summary, f"    return $0.count('{c}')", ins, anchors=(((c * 3,), 3),))


@_family("list_max", 2)
def _list_max(rng: random.Random) -> Variant:
    ins = [(_ints(rng, 5),), (_ints(rng, 4, 0, 99),), ([7],), ([-5, -2, -9],), ([3, 3, 3],), (_ints(rng, 8),)]
    names = ["largest", "find_max", "max_value", "biggest", "maximum"]
    summary = "returns the largest number in the non-empty list $0"
    return _make(rng, names, _LIST, summary, "    return max($0)", ins, anchors=((([1, 9, 4],), 9),))


@_family("list_min", 2)
def _list_min(rng: random.Random) -> Variant:
    ins = [(_ints(rng, 5),), (_ints(rng, 4, 0, 99),), ([7],), ([-5, -2, -9],), ([3, 3, 3],), (_ints(rng, 8),)]
    names = ["smallest", "find_min", "min_value", "tiniest", "minimum"]
    summary = "returns the smallest number in the non-empty list $0"
    return _make(rng, names, _LIST, summary, "    return min($0)", ins, anchors=((([4, 1, 9],), 1),))


@_family("list_sum", 2)
def _list_sum(rng: random.Random) -> Variant:
    ins = [(_ints(rng, 4, 0, 20),), (_ints(rng, 5),), ([],), ([5],), ([-1, 1],), (_ints(rng, 9, -100, 100),)]
    names = ["sum_list", "total", "list_total", "add_all", "sum_of_numbers"]
    summary = "returns the sum of the numbers in the list $0 (0 for an empty list)"
    body = "    total = 0\n    for v in $0:\n        total += v\n    return total"
    return _make(rng, names, _LIST, summary, body, ins, anchors=((([1, 2, 3],), 6), (([],), 0)))


@_family("abs_difference", 2)
def _abs_diff(rng: random.Random) -> Variant:
    ins = [
        (rng.randint(10, 20), rng.randint(1, 9)),
        (rng.randint(1, 9), rng.randint(10, 20)),
        (4, 4),
        (-3, 5),
    ]
    ins += [tuple(_ints(rng, 2, -100, 100)) for _ in range(3)]
    names = ["abs_difference", "distance", "absolute_difference", "gap", "diff"]
    summary = "returns the absolute value of the difference between $0 and $1"
    return _make(rng, names, _TWO, summary, "    return abs($0 - $1)", ins, anchors=(((3, 8), 5),))


@_family("max_of_three", 2)
def _max3(rng: random.Random) -> Variant:
    ins = [
        tuple(_ints(rng, 3, 0, 30)),
        tuple(_ints(rng, 3, 0, 30)),
        (1, 1, 1),
        (-1, -2, -3),
        (5, 9, 2),
        (9, 2, 5),
        (2, 5, 9),
    ]
    names = ["max_of_three", "largest_of_three", "biggest_of_three", "max3", "top_of_three"]
    params = [("a", "b", "c"), ("x", "y", "z"), ("first", "second", "third")]
    summary = "returns the largest of the three numbers $0, $1 and $2"
    return _make(rng, names, params, summary, "    return max($0, $1, $2)", ins, anchors=(((1, 7, 3), 7),))


@_family("last_element", 2)
def _last(rng: random.Random) -> Variant:
    ins = [(_ints(rng, 4),), (_words(rng, 3),), ([42],), ([1, 2, 3, 4, 5, 6, 7],), (["only"],), ([0, 0, -1],)]
    names = ["last_element", "get_last", "final_item", "last", "tail_item"]
    summary = "returns the last element of the non-empty list $0"
    return _make(rng, names, _LIST, summary, "    return $0[-1]", ins, anchors=((([1, 2, 3],), 3),))


@_family("join_two", 2)
def _join(rng: random.Random) -> Variant:
    sep = rng.choice(["-", ", ", " ", "_", " and ", "/", "+"])
    ins = [
        tuple(_words(rng, 2)),
        tuple(_words(rng, 2)),
        ("", ""),
        ("a", ""),
        ("x y", "z"),
        ("", "b"),
        ("1", "2"),
    ]
    names = ["join_words", "combine", "join_two", "connect", "glue"]
    params = [("first", "second"), ("a", "b"), ("left", "right"), ("s1", "s2")]
    summary = f"returns the strings $0 and $1 joined with '{sep}' between them"
    return _make(
        rng, names, params, summary, f"    return $0 + '{sep}' + $1", ins, anchors=((("p", "q"), f"p{sep}q"),)
    )


@_family("count_greater", 2)
def _count_greater(rng: random.Random) -> Variant:
    k = rng.randint(-5, 20)
    ins = [
        (_ints(rng, 6, -10, 30),),
        (_ints(rng, 5, -10, 30),),
        ([],),
        ([k],),
        ([k + 1, k - 1],),
        (_ints(rng, 10),),
    ]
    names = [f"count_above_{k}".replace("-", "minus_"), "count_greater", "how_many_above", "above_limit"]
    summary = f"returns how many numbers in the list $0 are strictly greater than {k}"
    body = f"    return sum(1 for v in $0 if v > {k})"
    return _make(rng, names, _LIST, summary, body, ins, anchors=((([k + 1, k, k + 2],), 2),))


@_family("average", 2)
def _average(rng: random.Random) -> Variant:
    ins = [(_ints(rng, 4, 0, 20),), (_ints(rng, 3, 0, 20),), ([5],), ([1, 2],), ([-3, 3],), (_ints(rng, 7),)]
    names = ["average", "mean", "list_average", "mean_value", "avg"]
    summary = "returns the average (arithmetic mean) of the numbers in the non-empty list $0"
    body = "    return sum($0) / len($0)"
    return _make(rng, names, _LIST, summary, body, ins, anchors=((([1, 2],), 1.5),), approx=True)


# ---------------------------------------------------------------------------------- difficulty 3
@_family("filter_parity", 3)
def _filter(rng: random.Random) -> Variant:
    even = rng.random() < 0.5
    kind = "even" if even else "odd"
    ins = [(_ints(rng, 6, 0, 20),), (_ints(rng, 5),), ([],), ([1, 3, 5],), ([2, 4, 6],), (_ints(rng, 10),)]
    names = [f"filter_{kind}s", f"only_{kind}", f"keep_{kind}", f"{kind}_numbers", f"select_{kind}"]
    summary = f"returns a new list with only the {kind} numbers of the list $0, in their original order"
    body = f"    return [v for v in $0 if v % 2 == {0 if even else 1}]"
    return _make(
        rng, names, _LIST, summary, body, ins, anchors=((([1, 2, 3, 4],), [2, 4] if even else [1, 3]),)
    )


@_family("count_vowels", 3)
def _vowels(rng: random.Random) -> Variant:
    ins = [
        (" ".join(_words(rng, 2)),),
        (rng.choice(_VOCAB),),
        ("",),
        ("rhythm",),
        ("AEIOU aeiou",),
        ("Banana",),
    ]
    names = ["count_vowels", "vowel_count", "num_vowels", "vowels_in", "how_many_vowels"]
    summary = "returns the number of vowels (a, e, i, o, u, in upper or lower case) in $0"
    body = "    return sum(1 for ch in $0.lower() if ch in 'aeiou')"
    return _make(rng, names, _SENT, summary, body, ins, anchors=((("Apple",), 2),))


@_family("fizzbuzz_one", 3)
def _fizzbuzz(rng: random.Random) -> Variant:
    (d1, w1), (d2, w2) = rng.choice(
        [
            ((3, "Fizz"), (5, "Buzz")),
            ((2, "Ping"), (7, "Pong")),
            ((3, "Foo"), (4, "Bar")),
            ((5, "Tic"), (7, "Tac")),
        ]
    )
    ins = [(d1 * d2,), (d1,), (d2,), (1,), (d1 * d2 * 2,), (d1 * d2 + 1,), (d2 * 2,), (d1 * 2,)]
    names = ["fizzbuzz", "fizz_buzz", "play_fizzbuzz", f"{w1.lower()}_{w2.lower()}", "word_for"]
    summary = (
        f"returns '{w1}{w2}' if $0 is divisible by both {d1} and {d2}, '{w1}' if it is divisible only by "
        f"{d1}, '{w2}' if it is divisible only by {d2}, and otherwise $0 as a string (for example '1')"
    )
    body = (
        f"    if $0 % {d1} == 0 and $0 % {d2} == 0:\n        return '{w1}{w2}'\n"
        f"    if $0 % {d1} == 0:\n        return '{w1}'\n    if $0 % {d2} == 0:\n        return '{w2}'\n"
        "    return str($0)"
    )
    return _make(
        rng,
        names,
        [("n",), ("number",), ("i",)],
        summary,
        body,
        ins,
        anchors=(((d1 * d2,), w1 + w2), ((1,), "1")),
    )


@_family("palindrome", 3)
def _palindrome(rng: random.Random) -> Variant:
    fold = rng.random() < 0.5
    ins = [
        ("level",),
        (rng.choice(["apple", "house", "river"]),),
        ("",),
        ("a",),
        ("Noon",),
        ("ab",),
        ("racecar",),
    ]
    names = ["is_palindrome", "palindrome", "reads_same_backwards", "check_palindrome", "mirror_word"]
    how = "ignoring upper/lower case" if fold else "exactly (case matters)"
    summary = f"returns True if $0 reads the same forwards and backwards, compared {how}, else False"
    body = "    t = $0.lower()\n    return t == t[::-1]" if fold else "    return $0 == $0[::-1]"
    return _make(rng, names, _STR, summary, body, ins, anchors=((("Noon",), fold), (("abc",), False)))


@_family("factorial", 3)
def _factorial(rng: random.Random) -> Variant:
    ins = [(rng.randint(3, 6),), (rng.randint(7, 10),), (0,), (1,), (2,), (15,)]
    names = ["factorial", "fact", "product_up_to", "compute_factorial", "factorial_of"]
    summary = "returns the factorial of the non-negative integer $0 (the factorial of 0 is 1)"
    body = "    result = 1\n    for i in range(2, $0 + 1):\n        result *= i\n    return result"
    return _make(rng, names, _ONE, summary, body, ins, anchors=(((5,), 120), ((0,), 1)))


@_family("digit_sum", 3)
def _digit_sum(rng: random.Random) -> Variant:
    ins = [
        (rng.randint(10, 99),),
        (rng.randint(100, 9999),),
        (0,),
        (7,),
        (1000,),
        (rng.randint(10**6, 10**9),),
    ]
    names = ["digit_sum", "sum_of_digits", "add_digits", "digits_total", "cross_sum"]
    summary = "returns the sum of the decimal digits of the non-negative integer $0"
    body = "    return sum(int(d) for d in str($0))"
    return _make(rng, names, _ONE, summary, body, ins, anchors=(((123,), 6),))


@_family("count_words", 3)
def _count_words(rng: random.Random) -> Variant:
    ins = [
        (" ".join(_words(rng, 3)),),
        (" ".join(_words(rng, 5)),),
        ("",),
        ("   ",),
        ("one",),
        ("  two  spaces\there ",),
    ]
    names = ["count_words", "word_count", "num_words", "how_many_words", "words_in"]
    summary = "returns the number of words in $0, where words are separated by any amount of whitespace"
    return _make(rng, names, _SENT, summary, "    return len($0.split())", ins, anchors=((("a  b c",), 3),))


@_family("power_list", 3)
def _power_list(rng: random.Random) -> Variant:
    p = rng.choice([2, 3])
    ins = [(_ints(rng, 4, 0, 9),), (_ints(rng, 3, -9, 9),), ([],), ([0],), ([-2],), (_ints(rng, 7),)]
    names = ["squares" if p == 2 else "cubes", f"power_{p}", f"raise_to_{p}", "powers", "map_power"]
    summary = (
        f"returns a new list with every number of the list $0 raised to the power {p}, in the same order"
    )
    return _make(
        rng, names, _LIST, summary, f"    return [v ** {p} for v in $0]", ins, anchors=((([2],), [2**p]),)
    )


@_family("gcd", 3)
def _gcd(rng: random.Random) -> Variant:
    g = rng.randint(2, 9)
    ins = [
        (g * 4, g * 6),
        (rng.randint(1, 50), rng.randint(1, 50)),
        (7, 7),
        (1, 99),
        (13, 17),
        (100, 75),
        (48, 180),
    ]
    names = ["gcd", "greatest_common_divisor", "highest_common_factor", "common_divisor", "hcf"]
    summary = "returns the greatest common divisor of the positive integers $0 and $1"
    body = "    while $1:\n        $0, $1 = $1, $0 % $1\n    return $0"
    return _make(rng, names, _TWO, summary, body, ins, anchors=(((12, 18), 6),))


@_family("index_of", 3)
def _index_of(rng: random.Random) -> Variant:
    xs = _ints(rng, 6, 0, 9)
    ins = [(xs, xs[3]), (xs, 42), ([], 1), ([5, 5, 5], 5), ([1, 2, 3], 3), (_ints(rng, 9, 0, 5), 2)]
    names = ["index_of", "find_index", "position_of", "first_index", "locate"]
    params = [("items", "target"), ("nums", "value"), ("values", "x"), ("lst", "item")]
    summary = "returns the index of the first occurrence of $1 in the list $0, or -1 if it does not occur"
    body = "    for i, v in enumerate($0):\n        if v == $1:\n            return i\n    return -1"
    return _make(rng, names, params, summary, body, ins, anchors=((([4, 7, 7], 7), 1), (([1], 2), -1)))


@_family("sum_multiples", 3)
def _sum_multiples(rng: random.Random) -> Variant:
    d1, d2 = rng.choice([(3, 5), (2, 7), (3, 4), (5, 7), (2, 3)])
    ins = [(10,), (rng.randint(11, 40),), (0,), (1,), (d1 + 1,), (rng.randint(100, 500),)]
    names = ["sum_multiples", "sum_of_multiples", "multiples_total", f"sum_{d1}_{d2}", "euler_one"]
    summary = f"returns the sum of all positive integers below $0 that are divisible by {d1} or {d2}"
    body = f"    return sum(i for i in range(1, $0) if i % {d1} == 0 or i % {d2} == 0)"
    anchor = (((10,), sum(i for i in range(1, 10) if i % d1 == 0 or i % d2 == 0)),)
    return _make(rng, names, [("n",), ("limit",), ("below",)], summary, body, ins, anchors=anchor)


@_family("capitalize_words", 3)
def _capitalize(rng: random.Random) -> Variant:
    ins = [
        (" ".join(_words(rng, 3)),),
        (" ".join(w.upper() for w in _words(rng, 2)),),
        ("",),
        ("a",),
        ("hELLO wORLD",),
    ]
    ins += [(rng.choice(_VOCAB),)]
    names = ["capitalize_words", "title_case", "capitalize_each", "headline", "upper_first_letters"]
    summary = (
        "returns $0 with the first letter of every word in uppercase and the other letters in lowercase; "
        "words are separated by single spaces"
    )
    body = "    return ' '.join(w[:1].upper() + w[1:].lower() for w in $0.split(' '))"
    return _make(rng, names, _SENT, summary, body, ins, anchors=((("hELLO wORLD",), "Hello World"),))


# ---------------------------------------------------------------------------------- difficulty 4
@_family("fibonacci", 4)
def _fib(rng: random.Random) -> Variant:
    ins = [(rng.randint(5, 10),), (rng.randint(11, 20),), (0,), (1,), (2,), (30,), (50,)]
    names = ["fibonacci", "fib", "nth_fibonacci", "fibonacci_number", "fibo"]
    summary = "returns the $0-th Fibonacci number, where the 0-th is 0, the 1st is 1 and each next one is the sum of the previous two"
    body = "    a, b = 0, 1\n    for _ in range($0):\n        a, b = b, a + b\n    return a"
    return _make(rng, names, _ONE[:3], summary, body, ins, anchors=(((10,), 55), ((0,), 0)))


@_family("dedupe", 4)
def _dedupe(rng: random.Random) -> Variant:
    ins = [
        (_ints(rng, 8, 0, 5),),
        (_words(rng, 5),),
        ([],),
        ([1, 1, 1],),
        ([3, 2, 1],),
        (_ints(rng, 12, -3, 3),),
    ]
    names = ["dedupe", "remove_duplicates", "unique_in_order", "distinct", "drop_repeats"]
    summary = "returns a list of the elements of $0 with duplicates removed, keeping the first occurrence of each in the original order"
    body = "    seen = set()\n    out = []\n    for v in $0:\n        if v not in seen:\n            seen.add(v)\n            out.append(v)\n    return out"
    return _make(rng, names, _LIST, summary, body, ins, anchors=((([3, 1, 3, 2, 1],), [3, 1, 2]),))


@_family("word_frequency", 4)
def _word_freq(rng: random.Random) -> Variant:
    ins = [
        (" ".join(_words(rng, 6)),),
        (" ".join(_words(rng, 4)),),
        ("",),
        ("a a a",),
        ("A a",),
        ("x  y\nx",),
    ]
    names = ["word_frequency", "word_counts", "count_each_word", "frequencies", "tally_words"]
    summary = (
        "returns a dictionary mapping each word of $0 to the number of times it occurs; words are separated "
        "by whitespace and compared exactly (case-sensitive)"
    )
    body = "    counts = {}\n    for w in $0.split():\n        counts[w] = counts.get(w, 0) + 1\n    return counts"
    return _make(rng, names, _SENT, summary, body, ins, anchors=((("b a b",), {"b": 2, "a": 1}),))


@_family("run_length_encode", 4)
def _rle(rng: random.Random) -> Variant:
    count_first = rng.random() < 0.5
    ins = [
        ("aaabcc",),
        ("".join(rng.choice("ab") * rng.randint(1, 4) for _ in range(4)),),
        ("",),
        ("z",),
        ("abc",),
    ]
    ins += [("x" * 12,)]
    names = ["run_length_encode", "rle", "compress", "encode_runs", "squeeze"]
    form = "the count followed by the character" if count_first else "the character followed by the count"
    ex = "'3a1b2c'" if count_first else "'a3b1c2'"
    summary = f"run-length encodes the string $0: each run of equal characters becomes {form} (for example 'aaabcc' becomes {ex}; '' becomes '')"
    piece = "str(n) + prev" if count_first else "prev + str(n)"
    body = (
        "    out = []\n    i = 0\n    while i < len($0):\n        prev = $0[i]\n        n = 0\n"
        "        while i < len($0) and $0[i] == prev:\n            i += 1\n            n += 1\n"
        f"        out.append({piece})\n    return ''.join(out)"
    )
    return _make(rng, names, _STR, summary, body, ins, anchors=((("aaabcc",), ex.strip("'")),))


@_family("second_largest", 4)
def _second(rng: random.Random) -> Variant:
    ins = [
        (_ints(rng, 6, 0, 50),),
        (_ints(rng, 5),),
        ([],),
        ([4, 4],),
        ([1, 2],),
        ([9, 9, 8, 8],),
        ([-1, -5, -3],),
    ]
    names = ["second_largest", "runner_up", "second_max", "second_biggest", "next_largest"]
    summary = "returns the second largest distinct value in the list $0, or None if it has fewer than two distinct values"
    body = "    distinct = sorted(set($0))\n    if len(distinct) < 2:\n        return None\n    return distinct[-2]"
    return _make(rng, names, _LIST, summary, body, ins, anchors=((([5, 9, 9, 1],), 5), (([2, 2],), None)))


@_family("is_prime", 4)
def _is_prime(rng: random.Random) -> Variant:
    ins = [
        (rng.choice([7, 11, 13, 29]),),
        (rng.choice([9, 15, 21, 25]),),
        (0,),
        (1,),
        (2,),
        (97,),
        (91,),
        (-7,),
    ]
    names = ["is_prime", "prime", "check_prime", "is_prime_number", "primality"]
    summary = (
        "returns True if the integer $0 is a prime number and False otherwise (numbers below 2 are not prime)"
    )
    body = "    if $0 < 2:\n        return False\n    i = 2\n    while i * i <= $0:\n        if $0 % i == 0:\n            return False\n        i += 1\n    return True"
    return _make(rng, names, _ONE, summary, body, ins, anchors=(((13,), True), ((1,), False), ((49,), False)))


@_family("flatten", 4)
def _flatten(rng: random.Random) -> Variant:
    ins = [
        ([_ints(rng, 2), _ints(rng, 3)],),
        ([[1], [], [2, 3]],),
        ([],),
        ([[]],),
        ([["a", "b"], ["c"]],),
        ([[[1]], [2]],),
    ]
    names = ["flatten", "flatten_once", "concat_lists", "join_lists", "merge_lists"]
    params = [("nested",), ("groups",), ("list_of_lists",)]
    summary = "takes a list of lists $0 and returns one list with all of their elements in order (flattening one level only)"
    body = "    out = []\n    for part in $0:\n        out.extend(part)\n    return out"
    return _make(rng, names, params, summary, body, ins, anchors=((([[1, 2], [3]],), [1, 2, 3]),))


@_family("anagram", 4)
def _anagram(rng: random.Random) -> Variant:
    w = rng.choice(_VOCAB)
    shuffled = "".join(rng.sample(w, len(w)))
    ins = [
        ("listen", "silent"),
        (w, shuffled),
        ("", ""),
        ("a", "b"),
        ("aab", "abb"),
        ("Abc", "cba"),
        ("abc", "abcd"),
    ]
    names = ["is_anagram", "anagrams", "same_letters", "check_anagram", "are_anagrams"]
    summary = "returns True if $0 and $1 consist of exactly the same characters with the same counts (case-sensitive), otherwise False"
    return _make(
        rng, names, _TWO, summary, "    return sorted($0) == sorted($1)", ins, anchors=((("ab", "ba"), True),)
    )


@_family("chunk", 4)
def _chunk(rng: random.Random) -> Variant:
    k = rng.randint(2, 4)
    ins = [
        (list(range(1, 2 * k + 2)),),
        (_ints(rng, k + 1),),
        ([],),
        (list(range(k)),),
        ([9],),
        (_words(rng, 2 * k),),
    ]
    names = ["chunk", f"chunks_of_{k}", "split_into_chunks", "batch", "group_by_size"]
    summary = f"splits the list $0 into consecutive chunks of {k} elements and returns a list of these chunks (lists); the last chunk may be shorter, and an empty list gives []"
    body = f"    return [$0[i:i + {k}] for i in range(0, len($0), {k})]"
    return _make(
        rng, names, _LIST, summary, body, ins, anchors=(((list(range(k + 1)),), [list(range(k)), [k]]),)
    )


@_family("caesar", 4)
def _caesar(rng: random.Random) -> Variant:
    k = rng.randint(1, 25)
    ins = [("hello",), (" ".join(_words(rng, 2)),), ("",), ("xyz",), ("Hello, World!",), ("abc123",)]
    names = ["caesar", "caesar_shift", f"shift_by_{k}", "encrypt", "rotate_letters"]
    summary = f"shifts every lowercase letter of $0 forward by {k} positions in the alphabet, wrapping around from 'z' to 'a', and leaves every other character unchanged"
    body = (
        "    out = []\n    for ch in $0:\n        if 'a' <= ch <= 'z':\n"
        f"            out.append(chr((ord(ch) - ord('a') + {k}) % 26 + ord('a')))\n"
        "        else:\n            out.append(ch)\n    return ''.join(out)"
    )
    anchor = ((("z!",), chr((25 + k) % 26 + ord("a")) + "!"),)
    return _make(rng, names, _SENT, summary, body, ins, anchors=anchor)


@_family("to_binary", 4)
def _binary(rng: random.Random) -> Variant:
    ins = [(rng.randint(2, 15),), (rng.randint(16, 255),), (0,), (1,), (1024,), (rng.randint(10**5, 10**6),)]
    names = ["to_binary", "binary_string", "int_to_binary", "as_binary", "bits_of"]
    summary = "returns the binary representation of the non-negative integer $0 as a string without the '0b' prefix (for 0 return '0')"
    body = "    if $0 == 0:\n        return '0'\n    bits = ''\n    while $0:\n        bits = str($0 % 2) + bits\n        $0 //= 2\n    return bits"
    return _make(rng, names, _ONE, summary, body, ins, anchors=(((5,), "101"), ((0,), "0")))


@_family("primes_up_to", 4)
def _primes(rng: random.Random) -> Variant:
    ins = [(10,), (rng.randint(11, 40),), (0,), (1,), (2,), (rng.randint(50, 120),)]
    names = ["primes_up_to", "list_primes", "primes_below_or_equal", "sieve", "find_primes"]
    summary = "returns a list of all prime numbers less than or equal to $0, in increasing order"
    body = "    return [p for p in range(2, $0 + 1) if all(p % d for d in range(2, int(p ** 0.5) + 1))]"
    return _make(
        rng, names, [("n",), ("limit",), ("upper",)], summary, body, ins, anchors=(((10,), [2, 3, 5, 7]),)
    )


# ---------------------------------------------------------------------------------- difficulty 5
@_family("balanced_brackets", 5)
def _balanced(rng: random.Random) -> Variant:
    ins = [("([]{})",), ("([)]",), ("",), ("(",), ("a(b)c[d]{e}",), ("{[()()]}",), ("())(",), ("}",)]
    names = ["is_balanced", "balanced", "brackets_ok", "check_brackets", "valid_brackets"]
    summary = "returns True if every bracket in $0 (round (), square [] and curly {}) is correctly matched and nested, otherwise False; other characters are ignored"
    body = (
        "    pairs = {')': '(', ']': '[', '}': '{'}\n    stack = []\n    for ch in $0:\n"
        "        if ch in '([{':\n            stack.append(ch)\n        elif ch in pairs:\n"
        "            if not stack or stack.pop() != pairs[ch]:\n                return False\n    return not stack"
    )
    return _make(rng, names, _EXPR, summary, body, ins, anchors=((("([])",), True), (("(]",), False)))


_ROMAN = "    values = [(1000, 'M'), (900, 'CM'), (500, 'D'), (400, 'CD'), (100, 'C'), (90, 'XC'), (50, 'L'), (40, 'XL'), (10, 'X'), (9, 'IX'), (5, 'V'), (4, 'IV'), (1, 'I')]\n"


@_family("int_to_roman", 5)
def _to_roman(rng: random.Random) -> Variant:
    ins = [(rng.randint(1, 39),), (rng.randint(40, 3999),), (1,), (4,), (9,), (1994,), (3999,), (444,)]
    names = ["to_roman", "int_to_roman", "roman_numeral", "as_roman", "roman"]
    summary = "converts the integer $0 (between 1 and 3999) to a Roman numeral string using the standard subtractive notation (for example 4 is 'IV' and 1994 is 'MCMXCIV')"
    body = (
        _ROMAN
        + "    out = ''\n    for v, sym in values:\n        while $0 >= v:\n            out += sym\n            $0 -= v\n    return out"
    )
    return _make(rng, names, _ONE, summary, body, ins, anchors=(((1994,), "MCMXCIV"), ((58,), "LVIII")))


@_family("roman_to_int", 5)
def _from_roman(rng: random.Random) -> Variant:
    ins = [
        ("XIV",),
        (rng.choice(["LVIII", "CDXLIV", "MMXXIV", "XC"]),),
        ("I",),
        ("IV",),
        ("MCMXCIV",),
        ("MMMCMXCIX",),
    ]
    names = ["from_roman", "roman_to_int", "parse_roman", "roman_value", "decode_roman"]
    summary = "converts the Roman numeral string $0 (standard subtractive notation, value 1 to 3999) to an integer (for example 'IX' is 9)"
    body = (
        "    values = {'I': 1, 'V': 5, 'X': 10, 'L': 50, 'C': 100, 'D': 500, 'M': 1000}\n    total = 0\n"
        "    for i, ch in enumerate($0):\n        v = values[ch]\n"
        "        if i + 1 < len($0) and values[$0[i + 1]] > v:\n            total -= v\n        else:\n            total += v\n"
        "    return total"
    )
    return _make(
        rng,
        names,
        [("s",), ("numeral",), ("roman",)],
        summary,
        body,
        ins,
        anchors=((("MCMXCIV",), 1994), (("IX",), 9)),
    )


@_family("transpose", 5)
def _transpose(rng: random.Random) -> Variant:
    r, c = rng.randint(2, 3), rng.randint(2, 4)
    ins = [
        ([_ints(rng, c, 0, 9) for _ in range(r)],),
        ([[1, 2, 3]],),
        ([],),
        ([[1], [2], [3]],),
        ([[5]],),
        ([[1, 2], [3, 4]],),
    ]
    names = ["transpose", "transpose_matrix", "flip_matrix", "swap_rows_columns", "matrix_transpose"]
    params = [("matrix",), ("m",), ("grid",), ("rows",)]
    summary = "returns the transpose of $0, a matrix given as a list of rows of equal length; the result is a list of lists (and [] for [])"
    body = "    if not $0:\n        return []\n    return [[row[j] for row in $0] for j in range(len($0[0]))]"
    return _make(rng, names, params, summary, body, ins, anchors=((([[1, 2], [3, 4]],), [[1, 3], [2, 4]]),))


@_family("merge_intervals", 5)
def _merge(rng: random.Random) -> Variant:
    rand = sorted([sorted(_ints(rng, 2, 0, 30)) for _ in range(5)], key=lambda p: -p[1])
    ins = [
        ([[1, 3], [2, 6], [8, 10]],),
        (rand,),
        ([],),
        ([[1, 4], [4, 5]],),
        ([[5, 6], [1, 2]],),
        ([[1, 10], [2, 3]],),
    ]
    names = ["merge_intervals", "merge_ranges", "combine_intervals", "union_intervals", "merge_spans"]
    params = [("intervals",), ("ranges",), ("spans",)]
    summary = "takes a list of [start, end] intervals $0 and returns the list of merged intervals sorted by start, merging intervals that overlap or touch (for example [1, 3] and [3, 5] become [1, 5])"
    body = (
        "    out = []\n    for start, end in sorted($0):\n        if out and start <= out[-1][1]:\n"
        "            out[-1][1] = max(out[-1][1], end)\n        else:\n            out.append([start, end])\n    return out"
    )
    return _make(rng, names, params, summary, body, ins, anchors=((([[1, 3], [3, 5]],), [[1, 5]]),))


@_family("common_prefix", 5)
def _prefix(rng: random.Random) -> Variant:
    stem = rng.choice(["inter", "pre", "fl", "cat"])
    ins = [
        ([stem + "view", stem + "nal", stem + "est"],),
        (["dog", "racecar", "car"],),
        ([],),
        (["alone"],),
        (["", "a"],),
    ]
    ins += [(["same", "same"],), (["ab", "a"],)]
    names = ["common_prefix", "longest_common_prefix", "shared_prefix", "prefix_of_all", "lcp"]
    params = [("words",), ("strings",), ("names",)]
    summary = "returns the longest common prefix of all strings in the list $0 ('' if the list is empty or they share no prefix)"
    body = "    if not $0:\n        return ''\n    prefix = $0[0]\n    for w in $0[1:]:\n        while not w.startswith(prefix):\n            prefix = prefix[:-1]\n    return prefix"
    return _make(rng, names, params, summary, body, ins, anchors=(((["flower", "flow", "flight"],), "fl"),))


@_family("two_sum", 5)
def _two_sum(rng: random.Random) -> Variant:
    xs = _ints(rng, 6, 0, 20)
    ins = [
        ([2, 7, 11, 15], 9),
        (xs, xs[1] + xs[4]),
        ([], 3),
        ([3, 3], 6),
        ([1, 2], 10),
        ([1, 5, 1, 5], 6),
        ([0, -1, 1], 0),
    ]
    names = ["two_sum", "pair_with_sum", "find_pair", "indices_summing_to", "sum_pair"]
    params = [("nums", "target"), ("numbers", "total"), ("values", "goal")]
    summary = (
        "returns [i, j] with i < j, the first pair of positions in the list $0 whose values add up to $1 "
        "(smallest i first, then smallest j), or [] if there is no such pair"
    )
    body = "    for i in range(len($0)):\n        for j in range(i + 1, len($0)):\n            if $0[i] + $0[j] == $1:\n                return [i, j]\n    return []"
    return _make(rng, names, params, summary, body, ins, anchors=((([2, 7, 11, 15], 9), [0, 1]),))


@_family("binary_search", 5)
def _bsearch(rng: random.Random) -> Variant:
    xs = sorted(rng.sample(range(-50, 50), 9))
    ins = [(xs, xs[6]), (xs, 51), ([], 1), ([4], 4), ([1, 3, 5, 7], 1), ([1, 3, 5, 7], 7), ([1, 3, 5, 7], 4)]
    names = ["binary_search", "search_sorted", "find_in_sorted", "bsearch", "locate_sorted"]
    params = [("nums", "target"), ("sorted_list", "value"), ("values", "x")]
    summary = "returns the index of $1 in the list $0, which is sorted in increasing order and has no duplicates, or -1 if $1 is not in it"
    body = (
        "    lo, hi = 0, len($0) - 1\n    while lo <= hi:\n        mid = (lo + hi) // 2\n        if $0[mid] == $1:\n"
        "            return mid\n        if $0[mid] < $1:\n            lo = mid + 1\n        else:\n            hi = mid - 1\n    return -1"
    )
    return _make(rng, names, params, summary, body, ins, anchors=((([1, 3, 5], 5), 2), (([1, 3], 2), -1)))


@_family("rotate_matrix", 5)
def _rotate(rng: random.Random) -> Variant:
    k = rng.randint(2, 4)
    ins = [
        ([[1, 2], [3, 4]],),
        ([_ints(rng, k, 0, 9) for _ in range(k)],),
        ([],),
        ([[7]],),
        ([[1, 2, 3], [4, 5, 6], [7, 8, 9]],),
        ([["a", "b"], ["c", "d"]],),
    ]
    names = ["rotate_clockwise", "rotate_matrix", "rotate_90", "turn_right", "rotate_grid"]
    params = [("matrix",), ("m",), ("grid",)]
    summary = "returns a new square matrix (list of rows) equal to the square matrix $0 rotated 90 degrees clockwise ([] for [])"
    body = "    n = len($0)\n    return [[$0[n - 1 - i][j] for i in range(n)] for j in range(n)]"
    return _make(rng, names, params, summary, body, ins, anchors=((([[1, 2], [3, 4]],), [[3, 1], [4, 2]]),))


@_family("longest_unique_substring", 5)
def _longest_unique(rng: random.Random) -> Variant:
    ins = [
        ("abcabcbb",),
        ("".join(rng.choice("abcd") for _ in range(10)),),
        ("",),
        ("bbbbb",),
        ("pwwkew",),
        ("abcdef",),
        ("abba",),
    ]
    names = [
        "longest_unique_substring",
        "longest_distinct_run",
        "max_unique_length",
        "longest_no_repeat",
        "unique_window",
    ]
    summary = "returns the length of the longest substring (contiguous run of characters) of $0 that has no repeated character"
    body = (
        "    best = 0\n    start = 0\n    last = {}\n    for i, ch in enumerate($0):\n        if ch in last and last[ch] >= start:\n"
        "            start = last[ch] + 1\n        last[ch] = i\n        best = max(best, i - start + 1)\n    return best"
    )
    return _make(rng, names, _STR, summary, body, ins, anchors=((("abcabcbb",), 3), (("abba",), 2)))


@_family("nesting_depth", 5)
def _depth(rng: random.Random) -> Variant:
    ins = [("(a(b))",), ("(()(()))",), ("",), ("abc",), ("()()",), ("((((x))))",), ("(1)+((2))",)]
    names = ["max_depth", "nesting_depth", "paren_depth", "deepest_nesting", "bracket_depth"]
    summary = "returns the maximum nesting depth of round parentheses in $0 (for example '(a(b))' has depth 2 and a string without parentheses has depth 0); the parentheses are balanced"
    body = "    depth = best = 0\n    for ch in $0:\n        if ch == '(':\n            depth += 1\n            best = max(best, depth)\n        elif ch == ')':\n            depth -= 1\n    return best"
    return _make(rng, names, _EXPR, summary, body, ins, anchors=((("(a(b))",), 2), (("x",), 0)))


@_family("eval_rpn", 5)
def _rpn(rng: random.Random) -> Variant:
    a, b, c = _ints(rng, 3, 1, 9)
    ins = [
        (["2", "3", "+", "4", "*"],),
        ([str(a), str(b), "-", str(c), "*"],),
        (["5"],),
        (["1", "2", "-"],),
        (["-3", "4", "*"],),
    ]
    ins += [(["2", "3", "4", "*", "+", "5", "-"],)]
    names = ["eval_rpn", "evaluate_postfix", "rpn", "calc_rpn", "postfix_value"]
    params = [("tokens",), ("expr",), ("parts",)]
    summary = (
        "evaluates the Reverse Polish Notation expression given as the list of strings $0 (integers such as '12' "
        "or '-3', and the operators '+', '-' and '*', each applied to the two values before it) and returns the integer result"
    )
    body = (
        "    stack = []\n    for tok in $0:\n        if tok in ('+', '-', '*'):\n            b = stack.pop()\n            a = stack.pop()\n"
        "            stack.append(a + b if tok == '+' else a - b if tok == '-' else a * b)\n        else:\n            stack.append(int(tok))\n"
        "    return stack[-1]"
    )
    return _make(rng, names, params, summary, body, ins, anchors=(((["2", "3", "+", "4", "*"],), 20),))


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
