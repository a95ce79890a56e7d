"""The action format of Shipyard's coding harness, and its parser.

The policy acts by writing one of (first match wins, in this order):

1. a fenced ```python block: its content replaces ``solution.py``; the visible tests then run
   and their result is fed back. A bare ``` block whose body contains ``def `` counts too, so a
   small model that forgets the language tag is not punished for formatting alone.
2. a fenced ```bash (or ```sh) block: its first command runs in the sandbox; output is fed back.
3. the word ``SUBMIT`` on a line of its own: the session ends and is graded.

Anything else gets a short reminder of these three actions. The format is plain text, so any
chat model can produce it, and it is small enough for a 135M model to learn by RL.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

ActionKind = Literal["write", "run", "submit", "none"]

_FENCE = re.compile(r"```([A-Za-z0-9_+-]*)[ \t]*\n(.*?)(?:```|\Z)", re.DOTALL)
_SUBMIT = re.compile(r"^\s*SUBMIT\s*$", re.MULTILINE)

SYSTEM_PROMPT = (
    "You are a coding agent in a Linux sandbox. Act by replying with exactly one of:\n"
    "- a ```python block with the complete contents of solution.py (the visible tests then run),\n"
    "- a ```bash block with one shell command to run,\n"
    "- SUBMIT on its own line when you are done."
)

REMINDER = (
    "No action found. Reply with a ```python block holding the complete solution.py, "
    "a ```bash block with one command, or SUBMIT."
)


@dataclass
class Action:
    kind: ActionKind
    content: str = ""


def parse_action(text: str) -> Action:
    """The action in one assistant message (see the module docstring for the format)."""
    blocks = [(lang.lower(), body) for lang, body in _FENCE.findall(text)]
    for lang, body in blocks:
        if lang in ("python", "py") or (lang == "" and "def " in body):
            return Action("write", body.strip("\n") + "\n")
    for lang, body in blocks:
        if lang in ("bash", "sh", "shell", "console"):
            cmd = next((ln.removeprefix("$ ").strip() for ln in body.splitlines() if ln.strip()), "")
            if cmd:
                return Action("run", cmd)
    if _SUBMIT.search(text):
        return Action("submit")
    return Action("none")


def clip_output(text: str, limit: int) -> str:
    """Keep the head and tail of long tool output, marking what was cut."""
    if len(text) <= limit:
        return text
    head = limit // 3
    tail = limit - head
    return f"{text[:head]}\n... [{len(text) - limit} characters cut] ...\n{text[-tail:]}"
