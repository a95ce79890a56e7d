"""Function-task families of difficulty 1 (one expression) and 2 (a branch or a loop)."""

from __future__ import annotations

import random

from shipyard.envs.tasks.function_families.common import (
    _LIST,
    _ONE,
    _SENT,
    _STR,
    _TWO,
    _VOCAB,
    Variant,
    _ints,
    _make,
    _words,
)


# ---------------------------------------------------------------------------------- difficulty 1
def _add(rng: random.Random) -> Variant:
    ins = [(rng.randint(1, 9), rng.randint(1, 9)) for _ in range(2)] + [(0, 0), (-3, 3), (-7, -8)]
    ins += [tuple(_ints(rng, 2, -100, 100)) for _ in range(3)]
    names = ["add_numbers", "add", "sum_two", "plus", "add_values", "add_two"]
    return _make(
        rng, names, _TWO, "returns the sum of $0 and $1", "    return $0 + $1", ins, anchors=(((2, 3), 5),)
    )


def _constant(rng: random.Random) -> Variant:
    k = rng.randint(0, 999)
    names = ["get_answer", "magic_number", "constant_value", "favorite_number", "lucky_number", "the_number"]
    extra = ("isinstance($f(), int)", "$f() == $f()", f"$f() + 1 == {k + 1}")
    summary = f"takes no arguments and returns the integer {k}"
    return _make(rng, names, [()], summary, f"    return {k}", [(), (), ()], extra=extra, anchors=(((), k),))


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


def _add_k(rng: random.Random) -> Variant:
    k = rng.randint(1, 100)
    ins = [(rng.randint(1, 10),), (rng.randint(11, 50),), (0,), (-k,), (-1000,), (rng.randint(100, 999),)]
    names = [f"add_{k}", f"plus_{k}", "increase", "bump", "add_constant"]
    return _make(rng, names, _ONE, f"returns $0 plus {k}", f"    return $0 + {k}", ins, anchors=(((0,), k),))


def _square(rng: random.Random) -> Variant:
    ins = [(rng.randint(2, 9),), (rng.randint(10, 30),), (0,), (1,), (-5,), (rng.randint(100, 999),)]
    names = ["square", "squared", "square_number", "sq", "power_two"]
    return _make(
        rng, names, _ONE, "returns $0 multiplied by itself", "    return $0 * $0", ins, anchors=(((3,), 9),)
    )


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


def _length(rng: random.Random) -> Variant:
    ins = [(w,) for w in _words(rng, 2)] + [("",), ("a b c",), ("  ",), ("".join(_words(rng, 4)),), ("x",)]
    names = ["string_length", "length_of", "text_length", "count_chars", "size_of_text"]
    summary = "returns the number of characters in the string $0"
    return _make(rng, names, _STR, summary, "    return len($0)", ins, anchors=((("abc",), 3),))


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
def _reverse(rng: random.Random) -> Variant:
    ins = [(w,) for w in _words(rng, 2)] + [("",), ("a",), ("ab cd",), (" ".join(_words(rng, 3)),), ("Hi!",)]
    names = ["reverse_string", "reverse_text", "reversed_word", "flip_text", "backwards"]
    summary = "returns the string $0 reversed"
    return _make(rng, names, _STR, summary, "    return $0[::-1]", ins, anchors=((("abc",), "cba"),))


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


def _list_max(rng: random.Random) -> Variant:
    ins = [(_ints(rng, 5),), (_ints(rng, 4, 0, 99),), ([7],), ([-5, -2, -9],), ([3, 3, 3],), (_ints(rng, 8),)]
    names = ["largest", "find_max", "max_value", "biggest", "maximum"]
    summary = "returns the largest number in the non-empty list $0"
    return _make(rng, names, _LIST, summary, "    return max($0)", ins, anchors=((([1, 9, 4],), 9),))


def _list_min(rng: random.Random) -> Variant:
    ins = [(_ints(rng, 5),), (_ints(rng, 4, 0, 99),), ([7],), ([-5, -2, -9],), ([3, 3, 3],), (_ints(rng, 8),)]
    names = ["smallest", "find_min", "min_value", "tiniest", "minimum"]
    summary = "returns the smallest number in the non-empty list $0"
    return _make(rng, names, _LIST, summary, "    return min($0)", ins, anchors=((([4, 1, 9],), 1),))


def _list_sum(rng: random.Random) -> Variant:
    ins = [(_ints(rng, 4, 0, 20),), (_ints(rng, 5),), ([],), ([5],), ([-1, 1],), (_ints(rng, 9, -100, 100),)]
    names = ["sum_list", "total", "list_total", "add_all", "sum_of_numbers"]
    summary = "returns the sum of the numbers in the list $0 (0 for an empty list)"
    body = "    total = 0\n    for v in $0:\n        total += v\n    return total"
    return _make(rng, names, _LIST, summary, body, ins, anchors=((([1, 2, 3],), 6), (([],), 0)))


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


def _last(rng: random.Random) -> Variant:
    ins = [(_ints(rng, 4),), (_words(rng, 3),), ([42],), ([1, 2, 3, 4, 5, 6, 7],), (["only"],), ([0, 0, -1],)]
    names = ["last_element", "get_last", "final_item", "last", "tail_item"]
    summary = "returns the last element of the non-empty list $0"
    return _make(rng, names, _LIST, summary, "    return $0[-1]", ins, anchors=((([1, 2, 3],), 3),))


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


def _average(rng: random.Random) -> Variant:
    ins = [(_ints(rng, 4, 0, 20),), (_ints(rng, 3, 0, 20),), ([5],), ([1, 2],), ([-3, 3],), (_ints(rng, 7),)]
    names = ["average", "mean", "list_average", "mean_value", "avg"]
    summary = "returns the average (arithmetic mean) of the numbers in the non-empty list $0"
    body = "    return sum($0) / len($0)"
    return _make(rng, names, _LIST, summary, body, ins, anchors=((([1, 2],), 1.5),), approx=True)
