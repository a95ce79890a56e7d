"""Function-task families of difficulty 4 and 5 (classic small algorithms and puzzles)."""

from __future__ import annotations

import random

from shipyard.envs.tasks.function_families.common import (
    _EXPR,
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


# ---------------------------------------------------------------------------------- difficulty 4
def _fib(rng: random.Random) -> Variant:
    ins = [(rng.randint(5, 10),), (rng.randint(11, 20),), (0,), (1,), (2,), (30,), (50,)]
    names = ["fibonacci", "fib", "nth_fibonacci", "fibonacci_number", "fibo"]
    summary = "returns the $0-th Fibonacci number, where the 0-th is 0, the 1st is 1 and each next one is the sum of the previous two"
    body = "    a, b = 0, 1\n    for _ in range($0):\n        a, b = b, a + b\n    return a"
    return _make(rng, names, _ONE[:3], summary, body, ins, anchors=(((10,), 55), ((0,), 0)))


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


def _binary(rng: random.Random) -> Variant:
    ins = [(rng.randint(2, 15),), (rng.randint(16, 255),), (0,), (1,), (1024,), (rng.randint(10**5, 10**6),)]
    names = ["to_binary", "binary_string", "int_to_binary", "as_binary", "bits_of"]
    summary = "returns the binary representation of the non-negative integer $0 as a string without the '0b' prefix (for 0 return '0')"
    body = "    if $0 == 0:\n        return '0'\n    bits = ''\n    while $0:\n        bits = str($0 % 2) + bits\n        $0 //= 2\n    return bits"
    return _make(rng, names, _ONE, summary, body, ins, anchors=(((5,), "101"), ((0,), "0")))


def _primes(rng: random.Random) -> Variant:
    ins = [(10,), (rng.randint(11, 40),), (0,), (1,), (2,), (rng.randint(50, 120),)]
    names = ["primes_up_to", "list_primes", "primes_below_or_equal", "sieve", "find_primes"]
    summary = "returns a list of all prime numbers less than or equal to $0, in increasing order"
    body = "    return [p for p in range(2, $0 + 1) if all(p % d for d in range(2, int(p ** 0.5) + 1))]"
    return _make(
        rng, names, [("n",), ("limit",), ("upper",)], summary, body, ins, anchors=(((10,), [2, 3, 5, 7]),)
    )


# ---------------------------------------------------------------------------------- difficulty 5
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


def _to_roman(rng: random.Random) -> Variant:
    ins = [(rng.randint(1, 39),), (rng.randint(40, 3999),), (1,), (4,), (9,), (1994,), (3999,), (444,)]
    names = ["to_roman", "int_to_roman", "roman_numeral", "as_roman", "roman"]
    summary = "converts the integer $0 (between 1 and 3999) to a Roman numeral string using the standard subtractive notation (for example 4 is 'IV' and 1994 is 'MCMXCIV')"
    body = (
        _ROMAN
        + "    out = ''\n    for v, sym in values:\n        while $0 >= v:\n            out += sym\n            $0 -= v\n    return out"
    )
    return _make(rng, names, _ONE, summary, body, ins, anchors=(((1994,), "MCMXCIV"), ((58,), "LVIII")))


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


def _depth(rng: random.Random) -> Variant:
    ins = [("(a(b))",), ("(()(()))",), ("",), ("abc",), ("()()",), ("((((x))))",), ("(1)+((2))",)]
    names = ["max_depth", "nesting_depth", "paren_depth", "deepest_nesting", "bracket_depth"]
    summary = "returns the maximum nesting depth of round parentheses in $0 (for example '(a(b))' has depth 2 and a string without parentheses has depth 0); the parentheses are balanced"
    body = "    depth = best = 0\n    for ch in $0:\n        if ch == '(':\n            depth += 1\n            best = max(best, depth)\n        elif ch == ')':\n            depth -= 1\n    return best"
    return _make(rng, names, _EXPR, summary, body, ins, anchors=((("(a(b))",), 2), (("x",), 0)))


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
