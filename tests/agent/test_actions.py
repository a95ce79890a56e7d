"""The action format parser."""

from shipyard.agent.actions import clip_output, parse_action


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
