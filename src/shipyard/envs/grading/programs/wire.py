"""Plain-data wire format between the grader's two sandboxes (stdlib only; runs inside them).

Contract: :func:`_encode` turns plain data (None, bool, int, float, complex, str, bytes, bytearray,
list, tuple, dict, set, frozenset, nested up to ``MAX_DEPTH``) into a JSON-ready tagged form and
raises ``TypeError`` for anything else; :func:`_decode` is its strict inverse (``ValueError`` on any
malformed value). Shipped into the sandboxes as source, before ``oracle.py`` or ``runner.py``
(:func:`shipyard.envs.grading.grader.program_source`); its limits below are the grader's.
"""

from __future__ import annotations

import base64
from collections.abc import Callable

MAX_DEPTH = 200
"""Deepest nesting of a value sent between the two sandboxes."""
MAX_MESSAGE_BYTES = 8 * 1024 * 1024
"""Largest single message between the two sandboxes (an answer, a request)."""


def _encode(value: object, depth: int = 0) -> object:
    """Plain data -> JSON-ready tagged form; TypeError for anything that is not plain data."""
    if depth > MAX_DEPTH:
        raise ValueError(f"value nested deeper than {MAX_DEPTH} levels")
    if value is None or type(value) in (bool, int, float, str):
        return value
    if type(value).__module__ == "numpy" and hasattr(value, "item") and not hasattr(value, "__len__"):
        return _encode(value.item(), depth + 1)  # numpy scalar
    for container, tag in ((list, "l"), (tuple, "t"), (set, "s"), (frozenset, "z")):
        if isinstance(value, container):
            return {tag: [_encode(v, depth + 1) for v in container.__iter__(value)]}
    if isinstance(value, dict):
        return {"d": [[_encode(k, depth + 1), _encode(v, depth + 1)] for k, v in dict.items(value)]}
    if isinstance(value, bytes | bytearray):
        tag = "a" if isinstance(value, bytearray) else "b"
        return {tag: base64.b64encode(bytes(value)).decode()}
    if isinstance(value, complex):
        return {"c": [complex(value).real, complex(value).imag]}
    for scalar in (int, float, str):  # subclasses (IntEnum, namedtuple fields, ...) become the base type
        if isinstance(value, scalar):
            plain = scalar(value)
            if type(plain) is scalar:
                return plain
    raise TypeError(f"a {type(value).__name__} is not plain data (None, numbers, str, bytes, containers)")


def _decode(obj: object, depth: int = 0) -> object:
    """Inverse of :func:`_encode`, strict: anything malformed raises ValueError or TypeError."""
    if depth > MAX_DEPTH:
        raise ValueError(f"value nested deeper than {MAX_DEPTH} levels")
    if obj is None or type(obj) in (bool, int, float, str):
        return obj
    if type(obj) is not dict or len(obj) != 1:
        raise ValueError("malformed value")
    ((tag, body),) = obj.items()
    kinds: dict[str, Callable[[list[object]], object]] = {"l": list, "t": tuple, "s": set, "z": frozenset}
    if tag in kinds and type(body) is list:
        return kinds[tag]([_decode(v, depth + 1) for v in body])
    if tag == "d" and type(body) is list:
        if not all(type(p) is list and len(p) == 2 for p in body):
            raise ValueError("malformed dict")
        return {_decode(k, depth + 1): _decode(v, depth + 1) for k, v in body}
    if tag in ("b", "a") and type(body) is str:
        data = base64.b64decode(body.encode(), validate=True)
        return bytearray(data) if tag == "a" else data
    if tag == "c" and type(body) is list and len(body) == 2 and all(type(x) in (int, float) for x in body):
        return complex(body[0], body[1])
    raise ValueError(f"malformed value (tag {tag!r})")
