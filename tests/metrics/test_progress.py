"""StepBar: on a pipe or a log file it writes plain progress lines (a live bar would print nothing)."""

from __future__ import annotations

import io

from rich.console import Console

from shipyard.metrics.progress import StepBar


def test_step_bar_writes_lines_when_not_a_terminal() -> None:
    out = io.StringIO()
    console = Console(file=out, force_terminal=False, width=200)
    with StepBar("sft", total=4, every_s=0.0, console=console) as bar:
        for step in range(1, 5):
            bar.update(step, f"loss {1.0 / step:.3f}")
    lines = out.getvalue().splitlines()
    assert [line.split(",")[0] for line in lines] == [
        "sft: 1/4 (25%)",
        "sft: 2/4 (50%)",
        "sft: 3/4 (75%)",
    ] + ["sft: 4/4 (100%)"] * 2  # the last step, then the closing line
    assert lines[-1].endswith("loss 0.250") and "ETA 0 s" in lines[-1]


def test_step_bar_throttles_lines_and_skips_work_never_started() -> None:
    out = io.StringIO()
    console = Console(file=out, force_terminal=False, width=200)
    with StepBar("demos", total=100, every_s=3600.0, console=console) as bar:
        for n in range(1, 51):
            bar.update(n)
    lines = out.getvalue().splitlines()
    assert len(lines) == 1 and lines[0].startswith("demos: 50/100 (50%)")  # only the closing line
    quiet = io.StringIO()
    with StepBar("idle", total=3, console=Console(file=quiet, force_terminal=False)):
        pass
    assert quiet.getvalue() == ""
