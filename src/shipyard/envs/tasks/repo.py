"""Repository-level tasks: a repository squashed to one commit, an issue, hidden tests; graded from the diff.

Contract: :func:`repo_tasks` is a pure function of ``(n, seed)``. Each task (``kind = "repo"``)
comes from a template repository built here in code (:data:`TEMPLATES`: several modules, a
README, ``pyproject.toml`` and visible tests under ``tests/``), renamed (the package name varies)
and broken by one :class:`Defect` (a bug, or a missing feature) that a later commit introduced.
Generation builds that two-commit history, then :func:`squash_repository` turns it into a fresh
repository holding only the snapshot: one commit, one branch, no tags, stash, reflog, packs or
objects from the history, so the fixed code (an object of the first commit) is not in it and
``git log``/``git show`` reveal nothing. ``Task.files`` is that snapshot's text files (the
repository is rebuilt from them, byte-identical commit included, by :func:`materialize`);
``prompt`` is the issue text; ``hidden_tests`` holds ``test_issue_*`` tests (fail before the
fix) and ``test_keep_*`` tests (behaviour that must not break); ``reference`` is the fixing diff;
``protected`` lists files restored before grading (tests, conftest, configuration).

Grading (:func:`grade_repo`): the session's changes are turned into a unified diff
(:func:`make_patch`, protected paths left out), applied with ``git apply`` in a fresh sandbox
over a fresh copy of the squashed repository, and the resulting files go to the two-sandbox
hidden-test grader (:func:`shipyard.envs.grading.grader.grade`). Reward = passed ``test_issue_*`` /
their number when every ``test_keep_*`` passes, else 0 (a fix that breaks something else is no
fix); a patch that does not apply earns 0 with the reason.

Limits: hidden tests call plain-data functions (the grader's limit); text files only (binary
files in a diff are not carried); the template pool is small (2 templates x 4 defects x 3
names), meant as a seeded set for training and tests, not a benchmark.

Example::

    task = repo_tasks(8, seed=0)[0]
    res = grade_repo(task, apply_patch_locally(task.files, task.reference), SandboxConfig(), cache)
"""

from __future__ import annotations

import difflib
import fnmatch
import hashlib
import os
import random
import re
import shutil
import subprocess
import tempfile
import threading
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import TracebackType

from shipyard.config.schema import SandboxConfig
from shipyard.envs.sandbox.base import diff_files
from shipyard.envs.tasks.kinds import (
    FILES_REMINDER,
    FILES_SYSTEM_PROMPT,
    GradingContext,
    check_hidden_tests,
    clip_output,
)
from shipyard.envs.types import RewardResult, Sandbox, Task

PROTECTED = ["tests/*", "conftest.py", "*/conftest.py", "pyproject.toml", "setup.cfg", "setup.py", "*.ini"]
"""Default ``Task.protected`` of repo tasks: restored from the task before grading."""
_GIT_ENV = {
    "GIT_AUTHOR_NAME": "shipyard",
    "GIT_AUTHOR_EMAIL": "shipyard@localhost",
    "GIT_COMMITTER_NAME": "shipyard",
    "GIT_COMMITTER_EMAIL": "shipyard@localhost",
    "GIT_AUTHOR_DATE": "2026-01-01T00:00:00+00:00",
    "GIT_COMMITTER_DATE": "2026-01-01T00:00:00+00:00",
    "GIT_CONFIG_NOSYSTEM": "1",
    "GIT_CONFIG_GLOBAL": "/dev/null",
    "HOME": "/nonexistent",
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "LANG": "C.UTF-8",
}


# ------------------------------------------------------------------------------------ git plumbing
def _git(repo: str, *args: str, stdin: str | None = None) -> str:
    res = subprocess.run(
        ["git", "-C", repo, *args], input=stdin, capture_output=True, text=True, env=_GIT_ENV, timeout=120
    )
    if res.returncode != 0:
        raise RuntimeError(f"git {' '.join(args[:3])} in {repo} failed: {res.stderr.strip()[-500:]}")
    return res.stdout


def _write_tree(root: str, files: Mapping[str, str]) -> None:
    for path, text in files.items():
        host = os.path.join(root, *path.split("/"))
        os.makedirs(os.path.dirname(host), exist_ok=True)
        with open(host, "w", encoding="utf-8") as f:
            f.write(text)


def init_snapshot(root: str, message: str = "Import snapshot") -> str:
    """Make the files under ``root`` a fresh repository with exactly one commit; returns its hash.

    Fixed identity and dates make the commit reproducible; the reflog is off and removed, so the
    repository holds one ref (``main``), one commit and the objects of that snapshot only.
    """
    _git(root, "init", "-q", "-b", "main")
    _git(root, "config", "core.logAllRefUpdates", "false")
    _git(root, "add", "-A")
    _git(root, "commit", "-q", "--no-verify", "-m", message)
    shutil.rmtree(os.path.join(root, ".git", "logs"), ignore_errors=True)
    shutil.rmtree(os.path.join(root, ".git", "hooks"), ignore_errors=True)
    return _git(root, "rev-parse", "HEAD").strip()


def squash_repository(src: str, dest: str) -> str:
    """Copy ``src``'s HEAD tree (tracked files only) into a new one-commit repository at ``dest``."""
    os.makedirs(dest, exist_ok=False)
    archive = subprocess.run(
        ["git", "-C", src, "archive", "--format=tar", "HEAD"], capture_output=True, env=_GIT_ENV, timeout=120
    )
    if archive.returncode != 0:
        raise RuntimeError(f"git archive of {src} failed: {archive.stderr.decode(errors='replace')[-500:]}")
    subprocess.run(["tar", "-x", "-C", dest], input=archive.stdout, check=True, timeout=120)
    return init_snapshot(dest)


def repo_text_files(root: str) -> dict[str, str]:
    """Text files of a working tree (``.git`` left out), relative path -> content."""
    out: dict[str, str] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d != ".git")
        for name in sorted(filenames):
            path = os.path.join(dirpath, name)
            try:
                with open(path, encoding="utf-8") as f:
                    out[os.path.relpath(path, root).replace(os.sep, "/")] = f.read()
            except UnicodeDecodeError:
                continue
    return out


def materialize(files: Mapping[str, str], dest: str) -> str:
    """Build the task's one-commit repository from its files at ``dest``; returns the commit hash."""
    os.makedirs(dest, exist_ok=False)
    _write_tree(dest, files)
    return init_snapshot(dest)


class RepoCache:
    """One materialized repository per task (the copy-on-write base of its sandboxes), removed on close."""

    def __init__(self) -> None:
        self.root = ""
        """Host directory holding the repositories (made on first use)."""
        self._lock = threading.Lock()
        self._dirs: dict[str, str] = {}

    def __enter__(self) -> RepoCache:
        return self

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def path(self, task: Task) -> str:
        """Host directory of ``task``'s repository (built on the first call; never modified after)."""
        digest = hashlib.sha256(repr(sorted(task.files.items())).encode()).hexdigest()[:16]
        with self._lock:
            if not self.root:
                self.root = tempfile.mkdtemp(prefix=f"shipyard-repos-{os.getpid()}-")
                self._finalizer = weakref.finalize(self, shutil.rmtree, self.root, True)
            if digest not in self._dirs:
                dest = os.path.join(self.root, digest)
                materialize(task.files, dest)
                self._dirs[digest] = dest
            return self._dirs[digest]

    def close(self) -> None:
        """Remove every repository; a later :meth:`path` builds them again."""
        with self._lock:
            if self.root:
                self._finalizer()
            self.root, self._dirs = "", {}


# ------------------------------------------------------------------------------------ diffs
def is_protected(path: str, patterns: Sequence[str]) -> bool:
    """Whether ``path`` matches one of the glob ``patterns`` (``*`` crosses ``/``)."""
    return any(fnmatch.fnmatch(path, p) for p in patterns)


def make_patch(before: Mapping[str, str], after: Mapping[str, str], protected: Sequence[str] = ()) -> str:
    """Unified diff (``git apply`` format) from ``before`` to ``after``, protected paths left out."""
    diff = diff_files(before, after)
    chunks = []
    for path in diff.paths():
        if is_protected(path, protected):
            continue
        old, new = before.get(path), after.get(path)
        a = "/dev/null" if old is None else f"a/{path}"
        b = "/dev/null" if new is None else f"b/{path}"
        header = f"diff --git a/{path} b/{path}\n"
        if old is None:
            header += "new file mode 100644\n"
        elif new is None:
            header += "deleted file mode 100644\n"
        body = difflib.unified_diff(
            (old or "").splitlines(keepends=True), (new or "").splitlines(keepends=True), a, b, n=3
        )
        lines = [ln if ln.endswith("\n") else ln + "\n\\ No newline at end of file\n" for ln in body]
        if lines:
            chunks.append(header + "".join(lines))
    return "".join(chunks)


def grade_repo(task: Task, files: dict[str, str], cfg: SandboxConfig, repos: RepoCache) -> RewardResult:
    """Apply the session's diff to a fresh copy of the repository; run the hidden tests; see the module."""
    from shipyard.envs.grading.grader import grade
    from shipyard.envs.sandbox import BwrapSandbox

    patch = make_patch(task.files, files, task.protected)
    with BwrapSandbox(None, cfg, base=repos.path(task)) as sb:
        applied = sb.exec("git apply --whitespace=nowarn -", stdin=patch) if patch else None
        patched = sb.files()
    if applied is not None and applied.returncode != 0:
        details = {
            "reason": f"the session's diff does not apply: {applied.stderr.strip()[-300:]}",
            "patch": patch,
        }
        return RewardResult(0.0, 0, len(_issue_tests(task)), details)
    res = grade(task, patched, cfg)  # which restores the protected files exactly as the task has them
    return _gate(task, res, patch)


def _issue_tests(task: Task) -> list[str]:
    from shipyard.envs.grading.grader import expected_tests

    return [t for t in expected_tests(task.hidden_tests) if not t.startswith("test_keep")]


def _gate(task: Task, res: RewardResult, patch: str) -> RewardResult:
    """Reward = issue tests passed / issue tests, and 0 when any ``test_keep_*`` test does not pass."""
    tests = res.details.get("tests", {})
    issue = _issue_tests(task)
    passed = sum(tests.get(t, {}).get("outcome") == "passed" for t in issue)
    broken = sorted(t for t, o in tests.items() if t.startswith("test_keep") and o["outcome"] != "passed")
    details = {**res.details, "patch_lines": patch.count("\n")}
    if broken:
        details["reason"] = f"the change breaks {broken}"
        return RewardResult(0.0, passed, len(issue), details)
    return RewardResult(passed / len(issue) if issue else 0.0, passed, len(issue), details)


# ------------------------------------------------------------------------------------ templates
@dataclass(frozen=True)
class Defect:
    """One task of a template: how the fixed code is broken, the issue that reports it, its tests."""

    key: str
    path: str
    fixed: str
    broken: str
    """``fixed`` (a snippet of ``path``) is replaced by ``broken`` in the task's repository."""
    issue: str
    tests: str
    """``test_issue_*`` functions (fail on the broken code, pass on the fixed one)."""


@dataclass(frozen=True)
class Template:
    package: str
    names: tuple[str, ...]
    """Package names tasks use instead of ``package`` (the first is ``package`` itself)."""
    files: dict[str, str]
    keep_tests: str
    """``test_keep_*`` functions over behaviour no defect touches."""
    defects: tuple[Defect, ...]


_LEDGER_MONEY = '''"""Money amounts as integer cents."""


def to_cents(amount: str) -> int:
    """Parse a decimal string such as "12.34", "-0.5" or "7" into integer cents."""
    text = amount.strip()
    sign = -1 if text.startswith("-") else 1
    whole, _, frac = text.lstrip("+-").partition(".")
    if len(frac) > 2 or not (whole or frac):
        raise ValueError(f"not a money amount: {amount!r}")
    return sign * (int(whole or "0") * 100 + int(frac.ljust(2, "0") or "0"))


def format_cents(cents: int) -> str:
    """Format integer cents as a decimal string: 1234 -> "12.34", -5 -> "-0.05"."""
    sign = "-" if cents < 0 else ""
    whole, frac = divmod(abs(cents), 100)
    return f"{sign}{whole}.{frac:02d}"
'''
_LEDGER_ACCOUNTS = '''"""Account balances from ledger entries ({"account": name, "cents": amount})."""


def balance(entries: list[dict]) -> dict[str, int]:
    """Sum of the cents of every entry, per account."""
    out: dict[str, int] = {}
    for entry in entries:
        out[entry["account"]] = out.get(entry["account"], 0) + entry["cents"]
    return out


def overdrawn(balances: dict[str, int], limit: int = 0) -> list[str]:
    """Accounts (sorted) whose balance is below -limit cents."""
    return sorted(name for name, cents in balances.items() if cents < -limit)
'''
_LEDGER_REPORT = '''"""Plain-text reports."""

from ledger.accounts import balance
from ledger.money import format_cents


def summary_lines(entries: list[dict]) -> list[str]:
    """One "name: amount" line per account, sorted by name, then a "TOTAL: amount" line."""
    balances = balance(entries)
    lines = [f"{name}: {format_cents(cents)}" for name, cents in sorted(balances.items())]
    lines.append(f"TOTAL: {format_cents(sum(balances.values()))}")
    return lines
'''
_LEDGER = Template(
    package="ledger",
    names=("ledger", "books", "tally"),
    files={
        "README.md": "# ledger\n\nSmall bookkeeping helpers: money parsing and formatting, balances, reports.\n\n"
        "Run the tests with `python -m pytest -q tests`.\n",
        "pyproject.toml": '[project]\nname = "ledger"\nversion = "0.3.1"\nrequires-python = ">=3.10"\n',
        "ledger/__init__.py": '"""Small bookkeeping helpers."""\n\n__version__ = "0.3.1"\n',
        "ledger/money.py": _LEDGER_MONEY,
        "ledger/accounts.py": _LEDGER_ACCOUNTS,
        "ledger/report.py": _LEDGER_REPORT,
        "tests/test_money.py": "from ledger.money import format_cents, to_cents\n\n\n"
        "def test_round_trip():\n    assert format_cents(to_cents('12.34')) == '12.34'\n\n\n"
        "def test_whole():\n    assert to_cents('7') == 700\n",
    },
    keep_tests="from ledger.accounts import balance\nfrom ledger.money import to_cents\n\n\n"
    "def test_keep_balance():\n    entries = [{'account': 'a', 'cents': 5}, {'account': 'b', 'cents': -3}, "
    "{'account': 'a', 'cents': 7}]\n    assert balance(entries) == {'a': 12, 'b': -3}\n\n\n"
    "def test_keep_to_cents():\n    assert to_cents('12.34') == 1234 and to_cents('-3') == -300\n",
    defects=(
        Defect(
            "negative_format",
            "ledger/money.py",
            '    sign = "-" if cents < 0 else ""\n    whole, frac = divmod(abs(cents), 100)\n    return f"{sign}{whole}.{frac:02d}"',
            '    whole, frac = divmod(cents, 100)\n    return f"{whole}.{frac:02d}"',
            "`format_cents` prints wrong amounts for negative values: `format_cents(-5)` gives `-1.95` and "
            "`format_cents(-1234)` gives `-13.66`; they should be `-0.05` and `-12.34`.",
            "from ledger.money import format_cents\n\n\ndef test_issue_small_negative():\n    assert format_cents(-5) == '-0.05'\n\n\n"
            "def test_issue_negative():\n    assert format_cents(-1234) == '-12.34'\n\n\n"
            "def test_keep_positive():\n    assert format_cents(1234) == '12.34' and format_cents(0) == '0.00'\n",
        ),
        Defect(
            "one_decimal",
            "ledger/money.py",
            'int(frac.ljust(2, "0") or "0")',
            'int(frac or "0")',
            "Amounts with a single decimal digit are parsed wrong: `to_cents('12.5')` returns 1205 "
            "instead of 1250, and `to_cents('-0.5')` returns -5 instead of -50.",
            "from ledger.money import to_cents\n\n\ndef test_issue_one_digit():\n    assert to_cents('12.5') == 1250\n\n\n"
            "def test_issue_negative_one_digit():\n    assert to_cents('-0.5') == -50\n\n\n"
            "def test_keep_two_digits():\n    assert to_cents('0.05') == 5\n",
        ),
        Defect(
            "overdrawn_boundary",
            "ledger/accounts.py",
            "if cents < -limit)",
            "if cents <= -limit)",
            "`overdrawn` reports accounts that sit exactly at the limit: with `limit=100` an account at "
            "-100 cents is listed, but only balances below -100 are overdrawn (and with the default limit "
            "a zero balance is reported as overdrawn).",
            "from ledger.accounts import overdrawn\n\n\ndef test_issue_at_limit():\n    assert overdrawn({'a': -100, 'b': -101}, 100) == ['b']\n\n\n"
            "def test_issue_zero_balance():\n    assert overdrawn({'a': 0, 'b': -1}) == ['b']\n",
        ),
        Defect(
            "summary_total",
            "ledger/report.py",
            '    lines.append(f"TOTAL: {format_cents(sum(balances.values()))}")\n',
            "",
            "Feature request: `summary_lines` should end with a total line, `TOTAL: <amount>`, the sum of "
            "all balances formatted like the other lines (e.g. `TOTAL: 4.50`).",
            "from ledger.report import summary_lines\n\n\ndef test_issue_total_line():\n    entries = [{'account': 'b', 'cents': 250}, "
            "{'account': 'a', 'cents': 200}]\n    assert summary_lines(entries) == ['a: 2.00', 'b: 2.50', 'TOTAL: 4.50']\n\n\n"
            "def test_issue_empty():\n    assert summary_lines([]) == ['TOTAL: 0.00']\n",
        ),
    ),
)

_TEXT_SLUG = '''"""URL slugs."""

import re


def slugify(text: str, sep: str = "-") -> str:
    """Lower-case ``text``; every run of characters other than letters and digits becomes one ``sep``."""
    words = re.split(r"[^a-z0-9]+", text.lower())
    return sep.join(w for w in words if w)
'''
_TEXT_WRAP = '''"""Greedy word wrapping."""


def wrap(text: str, width: int) -> list[str]:
    """Words of ``text`` packed greedily into lines of at most ``width`` characters (longer words alone)."""
    lines: list[str] = []
    current = ""
    for word in text.split():
        if current and len(current) + 1 + len(word) <= width:
            current += " " + word
        else:
            if current:
                lines.append(current)
            current = word
    if current:
        lines.append(current)
    return lines
'''
_TEXT_CASE = '''"""Identifier case conversions."""

import re


def snake_to_camel(name: str) -> str:
    """``http_server_error`` -> ``httpServerError``."""
    head, *rest = name.split("_")
    return head + "".join(part.title() for part in rest)


def camel_to_snake(name: str) -> str:
    """``httpServerError`` -> ``http_server_error``; runs of capitals stay one word (``HTTPServer`` -> ``http_server``)."""
    spaced = re.sub(r"([A-Z]+)([A-Z][a-z])", r"\\1_\\2", name)
    spaced = re.sub(r"([a-z0-9])([A-Z])", r"\\1_\\2", spaced)
    return spaced.lower()
'''
_TEXT_STATS = '''"""Word statistics."""

from collections import Counter


def word_count(text: str) -> int:
    return len(text.split())


def top_words(text: str, n: int) -> list[tuple[str, int]]:
    """The ``n`` most frequent lower-cased words with their counts; ties in alphabetical order."""
    counts = Counter(text.lower().split())
    return sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:n]
'''
_TEXTKIT = Template(
    package="textkit",
    names=("textkit", "wordsmith", "strtools"),
    files={
        "README.md": "# textkit\n\nText helpers: slugs, wrapping, identifier cases, word statistics.\n\n"
        "Run the tests with `python -m pytest -q tests`.\n",
        "pyproject.toml": '[project]\nname = "textkit"\nversion = "1.2.0"\nrequires-python = ">=3.10"\n',
        "textkit/__init__.py": '"""Text helpers."""\n',
        "textkit/slug.py": _TEXT_SLUG,
        "textkit/wrap.py": _TEXT_WRAP,
        "textkit/case.py": _TEXT_CASE,
        "textkit/stats.py": _TEXT_STATS,
        "tests/test_slug.py": "from textkit.slug import slugify\n\n\n"
        "def test_basic():\n    assert slugify('Hello World') == 'hello-world'\n",
    },
    keep_tests="from textkit.case import snake_to_camel\nfrom textkit.stats import word_count\n\n\n"
    "def test_keep_snake_to_camel():\n    assert snake_to_camel('http_server_error') == 'httpServerError'\n\n\n"
    "def test_keep_word_count():\n    assert word_count('a b  c') == 3\n",
    defects=(
        Defect(
            "slug_runs",
            "textkit/slug.py",
            '    words = re.split(r"[^a-z0-9]+", text.lower())\n    return sep.join(w for w in words if w)',
            '    return re.sub(r"[^a-z0-9]", sep, text.lower()).strip(sep)',
            "`slugify` keeps repeated separators: `slugify('Hello,  World!')` returns `hello---world` "
            "instead of `hello-world`. Every run of non-alphanumeric characters should become one separator.",
            "from textkit.slug import slugify\n\n\ndef test_issue_runs():\n    assert slugify('Hello,  World!') == 'hello-world'\n\n\n"
            "def test_issue_custom_sep():\n    assert slugify('  a -- b  ', sep='_') == 'a_b'\n",
        ),
        Defect(
            "wrap_width",
            "textkit/wrap.py",
            "len(current) + 1 + len(word) <= width",
            "len(current) + len(word) <= width",
            "`wrap` produces lines one character longer than `width`: `wrap('aa bb cc', 4)` gives "
            "`['aa bb', 'cc']` but 'aa bb' has 5 characters; expected `['aa', 'bb', 'cc']`.",
            "from textkit.wrap import wrap\n\n\ndef test_issue_width():\n    assert wrap('aa bb cc', 4) == ['aa', 'bb', 'cc']\n\n\n"
            "def test_keep_exact_fit():\n    assert wrap('aa bb cc', 5) == ['aa bb', 'cc']\n",
        ),
        Defect(
            "camel_acronym",
            "textkit/case.py",
            '    spaced = re.sub(r"([A-Z]+)([A-Z][a-z])", r"\\1_\\2", name)\n    spaced = re.sub(r"([a-z0-9])([A-Z])", r"\\1_\\2", spaced)',
            '    spaced = re.sub(r"(?<!^)([A-Z])", r"_\\1", name)',
            "`camel_to_snake` splits acronyms into letters: `camel_to_snake('HTTPServer')` returns "
            "`h_t_t_p_server`; it should return `http_server` (and `parseXMLFile` -> `parse_xml_file`).",
            "from textkit.case import camel_to_snake\n\n\ndef test_issue_acronym():\n    assert camel_to_snake('HTTPServer') == 'http_server'\n\n\n"
            "def test_issue_inner_acronym():\n    assert camel_to_snake('parseXMLFile') == 'parse_xml_file'\n\n\n"
            "def test_keep_plain():\n    assert camel_to_snake('httpServerError') == 'http_server_error'\n",
        ),
        Defect(
            "top_words_ties",
            "textkit/stats.py",
            "key=lambda kv: (-kv[1], kv[0])",
            "key=lambda kv: -kv[1]",
            "`top_words` returns tied words in first-seen order, so results change with word order: "
            "`top_words('b a', 2)` gives `[('b', 1), ('a', 1)]`. Ties should be alphabetical.",
            "from textkit.stats import top_words\n\n\ndef test_issue_ties():\n    assert top_words('b a', 2) == [('a', 1), ('b', 1)]\n\n\n"
            "def test_issue_counts_first():\n    assert top_words('c b b a', 2) == [('b', 2), ('a', 1)]\n",
        ),
    ),
)

TEMPLATES: dict[str, Template] = {"ledger": _LEDGER, "textkit": _TEXTKIT}
"""Template repositories by key; :func:`repo_tasks` draws (template, defect, name) combinations."""


def _rename(text: str, old: str, new: str) -> str:
    return re.sub(rf"\b{re.escape(old)}\b", new, text)


def _renamed_files(tpl: Template, name: str) -> dict[str, str]:
    out = {}
    for path, text in tpl.files.items():
        parts = path.split("/")
        parts[0] = name if parts[0] == tpl.package else parts[0]
        out["/".join(parts)] = _rename(text, tpl.package, name)
    return out


def _break(files: dict[str, str], path: str, fixed: str, broken: str) -> dict[str, str]:
    if files[path].count(fixed) != 1:
        raise AssertionError(f"defect snippet must occur once in {path}")
    return {**files, path: files[path].replace(fixed, broken)}


def _history_then_squash(fixed: dict[str, str], broken: dict[str, str]) -> dict[str, str]:
    """Commit ``fixed``, then ``broken`` on top (the regression), squash; the snapshot's files."""
    work = tempfile.mkdtemp(prefix="shipyard-repo-gen-")
    try:
        src, dest = os.path.join(work, "src"), os.path.join(work, "squashed")
        os.mkdir(src)
        _write_tree(src, fixed)
        init_snapshot(src, "Initial version")
        _write_tree(src, broken)
        _git(src, "commit", "-q", "-a", "-m", "Refactor")
        _git(src, "tag", "v1")
        squash_repository(src, dest)
        return repo_text_files(dest)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _make_task(index: int, tpl: Template, defect: Defect, name: str) -> Task:
    fixed = _renamed_files(tpl, name)
    path = _rename(defect.path, tpl.package, name)
    broken = _break(
        fixed, path, _rename(defect.fixed, tpl.package, name), _rename(defect.broken, tpl.package, name)
    )
    files = _history_then_squash(fixed, broken)
    issue = _rename(defect.issue, tpl.package, name)
    hidden = _rename(defect.tests, tpl.package, name) + "\n\n" + _rename(tpl.keep_tests, tpl.package, name)
    prompt = (
        f"You are working in the `{name}` repository (the current directory, a git checkout). Resolve this "
        f"issue:\n\n{issue}\n\nEdit the code in place; run the tests with `python -m pytest -q tests`. "
        "Your changes are graded as a diff against the repository, with hidden tests."
    )
    return Task(
        id=f"repo-{tpl.package}-{defect.key}-{index:04d}",
        prompt=prompt,
        entry_point=path,
        files=files,
        hidden_tests=hidden,
        difficulty=3,
        source="repo",
        reference=make_patch(broken, fixed),
        kind="repo",
        protected=list(PROTECTED),
    )


def repo_tasks(n: int, seed: int) -> list[Task]:
    """``n`` repository tasks (ids ``repo-<template>-<defect>-<k>``), a pure function of ``(n, seed)``."""
    combos = [(t, d, name) for t in TEMPLATES.values() for d in t.defects for name in t.names]
    if not 0 <= n <= len(combos):
        raise ValueError(f"n={n} must be in [0, {len(combos)}] (the distinct repository tasks available)")
    rng = random.Random(seed)
    pairs = [(t, d, rng.sample(t.names, len(t.names))) for t in TEMPLATES.values() for d in t.defects]
    rng.shuffle(pairs)
    rounds = max(len(t.names) for t in TEMPLATES.values())
    order = [(t, d, names[r]) for r in range(rounds) for t, d, names in pairs if r < len(names)]
    return [_make_task(k, *combo) for k, combo in enumerate(order[:n])]  # every defect once before repeats


def apply_patch_locally(files: Mapping[str, str], patch: str) -> dict[str, str]:
    """``files`` with ``patch`` applied by ``git apply`` in a scratch directory (trusted patches only)."""
    work = tempfile.mkdtemp(prefix="shipyard-apply-")
    try:
        _write_tree(work, files)
        _git(work, "init", "-q")
        if patch:
            _git(work, "apply", "--whitespace=nowarn", "-", stdin=patch)
        return repo_text_files(work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


REPO_TESTS = "python -m pytest -q tests"
"""How the first message tells the policy to run a repository's tests."""
MAX_LISTED_FILES = 40
"""Most workspace paths the first message lists."""


class RepoKind:
    """Fix a repository (files written by name, copy-on-write over the squashed repository); graded by
    applying the session's diff to a fresh copy. See :mod:`shipyard.envs.tasks.kinds`."""

    name = "repo"

    def system_prompt(self) -> str:
        return FILES_SYSTEM_PROMPT

    def reminder(self) -> str:
        return FILES_REMINDER

    def default_files(self) -> dict[str, str]:
        return {}

    def asks_for_path(self) -> bool:
        return True

    def first_message(self, task: Task) -> str:
        paths = sorted(task.files)
        listed = "\n".join(paths[:MAX_LISTED_FILES])
        more = f"\n... and {len(paths) - MAX_LISTED_FILES} more" if len(paths) > MAX_LISTED_FILES else ""
        return (
            f"{task.prompt}\n\nFiles:\n{listed}{more}\n\nRead a file with a ```bash block (e.g. `cat README.md`). "
            "Change a file by replying with a block that names it and holds its complete new contents, "
            f"e.g. ```python path/to/module.py. Run the tests with `{REPO_TESTS}`. Tests, conftest and "
            "configuration files are protected. Reply SUBMIT when the issue is resolved."
        )

    def after_write(
        self, task: Task, sb: Sandbox, path: str, limit: int, end_on_pass: bool
    ) -> tuple[str, str]:
        return f"{path} written.", ""

    def work_state(self, sb: Sandbox, chars: int) -> str:
        diff = sb.diff()
        if diff.is_empty():
            return "No file has been changed yet."
        changed = {**diff.added, **diff.modified}
        parts = [f"Changed {path}:\n```\n{clip_output(text, chars)}\n```" for path, text in changed.items()]
        parts += [f"Deleted {path}." for path in diff.deleted]
        return "\n\n".join(parts)

    def check(self, task: Task, where: str) -> None:
        check_hidden_tests(task, where)
        if not task.files:
            raise ValueError(f"{where}: a repo task needs `repo` (a git repository path) or `files`")

    def workspace_base(self, task: Task, repos: RepoCache) -> str | None:
        return repos.path(task)

    def ignored_flags(self) -> frozenset[str]:
        return frozenset({"git_history"})

    def reference_files(self, task: Task) -> dict[str, str]:
        return apply_patch_locally(task.files, task.reference)

    def grade(self, task: Task, files: dict[str, str], ctx: GradingContext) -> RewardResult:
        return grade_repo(task, files, ctx.sandbox, ctx.repos)
