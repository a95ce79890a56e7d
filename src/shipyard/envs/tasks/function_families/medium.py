"""Function-task families of difficulty 3 (loops over strings and lists)."""

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


# ---------------------------------------------------------------------------------- difficulty 3
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


def _factorial(rng: random.Random) -> Variant:
    ins = [(rng.randint(3, 6),), (rng.randint(7, 10),), (0,), (1,), (2,), (15,)]
    names = ["factorial", "fact", "product_up_to", "compute_factorial", "factorial_of"]
    summary = "returns the factorial of the non-negative integer $0 (the factorial of 0 is 1)"
    body = "    result = 1\n    for i in range(2, $0 + 1):\n        result *= i\n    return result"
    return _make(rng, names, _ONE, summary, body, ins, anchors=(((5,), 120), ((0,), 1)))


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


def _index_of(rng: random.Random) -> Variant:
    xs = _ints(rng, 6, 0, 9)
    ins = [(xs, xs[3]), (xs, 42), ([], 1), ([5, 5, 5], 5), ([1, 2, 3], 3), (_ints(rng, 9, 0, 5), 2)]
    names = ["index_of", "find_index", "position_of", "first_index", "locate"]
    params = [("items", "target"), ("nums", "value"), ("values", "x"), ("lst", "item")]
    summary = "returns the index of the first occurrence of $1 in the list $0, or -1 if it does not occur"
    body = "    for i, v in enumerate($0):\n        if v == $1:\n            return i\n    return -1"
    return _make(rng, names, params, summary, body, ins, anchors=((([4, 7, 7], 7), 1), (([1], 2), -1)))


def _sum_multiples(rng: random.Random) -> Variant:
    d1, d2 = rng.choice([(3, 5), (2, 7), (3, 4), (5, 7), (2, 3)])
    ins = [(10,), (rng.randint(11, 40),), (0,), (1,), (d1 + 1,), (rng.randint(100, 500),)]
    names = ["sum_multiples", "sum_of_multiples", "multiples_total", f"sum_{d1}_{d2}", "euler_one"]
    summary = f"returns the sum of all positive integers below $0 that are divisible by {d1} or {d2}"
    body = f"    return sum(i for i in range(1, $0) if i % {d1} == 0 or i % {d2} == 0)"
    anchor = (((10,), sum(i for i in range(1, 10) if i % d1 == 0 or i % d2 == 0)),)
    return _make(rng, names, [("n",), ("limit",), ("below",)], summary, body, ins, anchors=anchor)


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
