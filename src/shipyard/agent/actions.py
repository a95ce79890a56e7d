"""The action format of Shipyard's coding harness, its parser and the write-path rules.

The policy acts by writing one of (first match wins, in this order):

1. a fenced block that writes a file:

   - a block whose info string names a workspace path after the language (```` ```sql migration.sql ````,
     ```` ```python pkg/util.py ````) or is the path alone (```` ```migration.sql ````): its content
     replaces that file (``lang:path`` is read the same way);
   - a block without a path whose language has a default file for the task kind
     (the kind's ``default_files()``, :mod:`shipyard.envs.tasks.kinds`): ```` ```python ```` writes
     ``solution.py`` on function tasks (a bare
     ```` ``` ```` block whose body contains ``def `` counts too, so a small model that forgets the
     language tag is not punished for formatting alone), ```` ```sql ```` writes ``migration.sql``
     on db tasks. A ```` ```python ```` block without a path on a repo task is a write with no file
     (``path = ""``): the harness asks the policy to name the file;

2. a fenced ```bash (or ```sh) block: its first command runs in the sandbox; output is fed back.
3. the word ``SUBMIT`` on a line of its own: the session ends and is graded.

Anything else gets a short reminder of these actions. What follows a write (visible tests, a
trial run of a migration) is the session's business (:mod:`shipyard.agent.session`).

Write paths (:func:`check_write_path`): relative to the workspace, no ``..``, no absolute path,
no ``.git`` and none of the protected globs (the task's ``protected``, the visible tests, conftest,
``sitecustomize.py``, ``*.pth``, the service files of db tasks): a refused write changes nothing
and the policy is told why in one line.

The format is plain text, so any chat model can produce it, and it is small enough for a 135M
model to learn by RL. For function tasks it is exactly the format the harness had before
named writes existed (same system prompt, same parse of every unnamed block).
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from shipyard.envs.tasks.kinds import task_kind

ActionKind = Literal["write", "run", "submit", "none"]

_FENCE = re.compile(r"```([^\n`]*)\n(.*?)(?:```|\Z)", re.DOTALL)
_SUBMIT = re.compile(r"^\s*SUBMIT\s*$", re.MULTILINE)
_LANGS = {
    "python": "python",
    "py": "python",
    "sql": "sql",
    "postgresql": "sql",
    "psql": "sql",
    "pgsql": "sql",
}
_SHELLS = ("bash", "sh", "shell", "console")
_LANG_TOKEN = re.compile(r"[A-Za-z0-9_+-]*")

ALWAYS_PROTECTED = (
    "test_visible.py",
    "conftest.py",
    "*/conftest.py",
    "sitecustomize.py",
    "*.pth",
    ".pg_service.conf",  # the db service file (shipyard.envs.services.postgres.SERVICE_FILE)
)
"""Globs no write may touch on any task (``*`` crosses ``/``); the task's ``protected`` adds to them."""
MAX_PATH_CHARS = 200


@dataclass
class Action:
    kind: ActionKind
    content: str = ""
    path: str = ""
    """``write``: the workspace path written ("" when the block named none and its language has no
    default file for the task kind)."""


def _info(info: str) -> tuple[str, str]:
    """(language, path) of a fence's info string (``"sql migration.sql"``, ``"migration.sql"``, ``"py"``)."""
    tokens = info.split()
    if not tokens:
        return "", ""
    first = tokens[0].lower()
    if len(tokens) >= 2:
        return first, tokens[1]
    lang, sep, path = tokens[0].partition(":")
    if sep and path and _LANG_TOKEN.fullmatch(lang):
        return lang.lower(), path  # ```python:src/app.py
    if _LANG_TOKEN.fullmatch(tokens[0]) and (first in _LANGS or first in _SHELLS or "." not in first):
        return first, ""
    return "", tokens[0]  # a lone path: ```migration.sql, ```src/app.py


def parse_action(text: str, kind: str = "function") -> Action:
    """The action in one assistant message of a task of ``kind`` (see the module docstring)."""
    blocks = [(*_info(info), body) for info, body in _FENCE.findall(text)]
    task = task_kind(kind)
    defaults = task.default_files()
    for lang, path, body in blocks:
        if lang in _SHELLS:
            continue
        language = _LANGS.get(lang, "python" if lang == "" and "def " in body else "")
        if path:
            return Action("write", body.strip("\n") + "\n", path)
        if language in defaults:
            return Action("write", body.strip("\n") + "\n", defaults[language])
        if task.asks_for_path() and language == "python":
            return Action("write", body.strip("\n") + "\n", "")
    for lang, _, body in blocks:
        if lang in _SHELLS:
            cmd = next((ln.removeprefix("$ ").strip() for ln in body.splitlines() if ln.strip()), "")
            if cmd:
                return Action("run", cmd)
    if _SUBMIT.search(text):
        return Action("submit")
    return Action("none")


def check_write_path(path: str, protected: Sequence[str] = ()) -> str:
    """Why ``path`` may not be written ("" when it may): see the module docstring's rules."""
    norm = path.replace("\\", "/")
    parts = [p for p in norm.split("/") if p not in ("", ".")]
    if not path:
        return "Name the file to write after the language, e.g. ```python src/app.py."
    if len(path) > MAX_PATH_CHARS or any(c in path for c in "\0\n\r"):
        return f"Cannot write {path[:60]!r}: not a usable file name."
    if norm.startswith("/") or norm.startswith("~") or re.match(r"[A-Za-z]:/", norm):
        return f"Cannot write {path}: paths are relative to the workspace (e.g. src/app.py), not absolute."
    if ".." in parts:
        return f"Cannot write {path}: paths may not leave the workspace ('..')."
    if not parts or norm.endswith("/"):
        return f"Cannot write {path}: it names a directory, not a file."
    rel = "/".join(parts)
    if parts[0] == ".git":
        return f"Cannot write {rel}: the repository's .git directory is not writable; edit the files instead."
    patterns = [*ALWAYS_PROTECTED, *protected]
    if any(fnmatch.fnmatch(rel, p) for p in patterns):
        return (
            f"Cannot write {rel}: it is a protected file (tests, conftest, configuration and service "
            "files are restored before grading); change the code instead."
        )
    return ""
