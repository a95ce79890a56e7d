"""What every function-task family shares: the drawn :class:`Variant`, :class:`Family`, and the
helpers builders draw names, arguments and inputs with (:func:`_make`, :func:`_ints`, :func:`_words`)."""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

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
