"""The action format parser: unnamed and named writes, per-kind defaults, write-path rules."""

from shipyard.agent.actions import ALWAYS_PROTECTED, check_write_path, parse_action
from shipyard.envs.tasks.functions import REMINDER, SYSTEM_PROMPT
from shipyard.envs.tasks.kinds import clip_output, task_kind


def test_python_block_writes_solution() -> None:
    a = parse_action("Here:\n```python\ndef f(x):\n    return x\n```\nDone.")
    assert a.kind == "write" and a.content == "def f(x):\n    return x\n"


def test_bare_fence_with_def_counts_as_python_and_unclosed_fence_is_read() -> None:
    assert parse_action("```\ndef g():\n    pass\n```").kind == "write"
    assert parse_action("```python\ndef g():\n    return 1").content == "def g():\n    return 1\n"
    assert parse_action("```\nls -la\n```").kind == "none"


def test_bash_and_submit_and_none() -> None:
    a = parse_action("```bash\n$ python -m pytest -q\n```")
    assert a.kind == "run" and a.content == "python -m pytest -q"
    assert parse_action("All good.\nSUBMIT\n").kind == "submit"
    assert parse_action("I will SUBMIT later").kind == "none"
    assert parse_action("just words").kind == "none"


def test_python_wins_over_bash() -> None:
    text = "```bash\nls\n```\n```python\nx = 1\n```"
    assert parse_action(text).kind == "write"


def test_clip_output_keeps_head_and_tail() -> None:
    s = "A" * 500 + "B" * 500
    out = clip_output(s, 300)
    assert out.startswith("A" * 100) and out.endswith("B" * 200) and "700 characters cut" in out


# --- named writes, per-kind defaults and write-path rules -----------------------------------------


def test_function_task_format_is_unchanged() -> None:
    # the exact strings the trained runs saw: changing them would change every function-task record
    assert SYSTEM_PROMPT == (
        "You are a coding agent in a Linux sandbox. Act by replying with exactly one of:\n"
        "- a ```python block with the complete contents of solution.py (the visible tests then run),\n"
        "- a ```bash block with one shell command to run,\n"
        "- SUBMIT on its own line when you are done."
    )
    assert REMINDER == (
        "No action found. Reply with a ```python block holding the complete solution.py, "
        "a ```bash block with one command, or SUBMIT."
    )
    function = task_kind("function")
    assert function.system_prompt() == SYSTEM_PROMPT and function.reminder() == REMINDER
    assert task_kind("db").system_prompt() != SYSTEM_PROMPT
    assert "```python src/app.py" in task_kind("repo").system_prompt()
    # unnamed blocks parse for function tasks exactly as before named writes existed
    assert parse_action("```python\nx = 1\n```").path == "solution.py"
    assert parse_action("```\ndef g():\n    pass\n```").path == "solution.py"
    assert parse_action("```sql\nSELECT 1;\n```").kind == "none"
    assert parse_action("```text\ndef f(): pass\n```").kind == "none"


def test_named_blocks_write_their_path() -> None:
    a = parse_action("Now:\n```sql migration.sql\nALTER TABLE t ADD c int;\n```", "db")
    assert (a.kind, a.path, a.content) == ("write", "migration.sql", "ALTER TABLE t ADD c int;\n")
    a = parse_action("```python books/money.py\ndef f():\n    return 1\n```", "repo")
    assert (a.kind, a.path, a.content) == ("write", "books/money.py", "def f():\n    return 1\n")
    assert parse_action("```books/util.py\nX = 2\n```", "repo").path == "books/util.py"
    assert parse_action("```python:src/app.py\nX = 2\n```", "repo").path == "src/app.py"
    # a named write on a function task writes that file, not solution.py
    assert parse_action("```python helper.py\nK = 3\n```").path == "helper.py"
    # a named block wins over a later bash block; bash blocks never write, whatever their info string
    assert parse_action("```python a.py\nA = 1\n```\n```bash\nls\n```", "repo").path == "a.py"
    b = parse_action("```bash run.sh\necho hi\n```", "repo")
    assert (b.kind, b.content) == ("run", "echo hi")


def test_unnamed_defaults_by_kind() -> None:
    sql = "```sql\nUPDATE t SET c = 0;\n```"
    assert parse_action(sql, "db").path == "migration.sql"
    assert parse_action(sql, "repo").kind == "none" and parse_action(sql, "function").kind == "none"
    # db tasks have no python default: an unnamed python block is no action there
    assert parse_action("```python\nx = 1\n```", "db").kind == "none"
    # repo tasks: an unnamed python block is a write without a file (the harness asks for one)
    a = parse_action("```python\nx = 1\n```", "repo")
    assert (a.kind, a.path) == ("write", "")
    assert "```python src/app.py" in check_write_path(a.path)


def test_write_path_rules() -> None:
    protected = ["tests/*", "pyproject.toml"]
    assert check_write_path("books/money.py", protected) == ""
    assert check_write_path("./books/new.py", protected) == ""
    assert check_write_path("migration.sql") == ""
    assert check_write_path("/etc/passwd") == (
        "Cannot write /etc/passwd: paths are relative to the workspace (e.g. src/app.py), not absolute."
    )
    assert "not absolute" in check_write_path("~/.bashrc")
    assert (
        check_write_path("../outside.py")
        == "Cannot write ../outside.py: paths may not leave the workspace ('..')."
    )
    assert "may not leave" in check_write_path("books/../../x.py")
    assert "may not leave" in check_write_path("books\\..\\..\\x.py")
    assert check_write_path("tests/test_money.py", protected) == (
        "Cannot write tests/test_money.py: it is a protected file (tests, conftest, configuration and service "
        "files are restored before grading); change the code instead."
    )
    assert "protected" in check_write_path("./pyproject.toml", protected)
    for path in ("test_visible.py", "conftest.py", "pkg/conftest.py", "sitecustomize.py", "x.pth"):
        assert "protected" in check_write_path(path), path
    assert ".git directory" in check_write_path(".git/hooks/pre-commit")
    assert "directory" in check_write_path("books/")
    assert "not a usable file name" in check_write_path("a\0b")


def test_service_file_is_protected() -> None:
    from shipyard.envs.services.postgres import SERVICE_FILE

    assert SERVICE_FILE in ALWAYS_PROTECTED and "protected" in check_write_path(SERVICE_FILE)
