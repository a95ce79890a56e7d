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


def test_step_bar_advance_counts_every_call_from_threads() -> None:
    from concurrent.futures import ThreadPoolExecutor

    out = io.StringIO()
    console = Console(file=out, force_terminal=False)
    with StepBar("eval", total=400, every_s=3600.0, console=console) as bar, ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda _: bar.advance(), range(400)))  # the pool drains before the bar closes
    assert bar.completed == 400
    assert out.getvalue().splitlines()[0].startswith("eval: 400/400 (100%)")


def test_run_progress_prints_one_line_per_new_step_on_a_pipe(tmp_path) -> None:
    import json

    from shipyard.metrics.progress import RunProgress

    path = tmp_path / "metrics.jsonl"
    out = io.StringIO()

    def record(step: int) -> str:
        return json.dumps(
            {
                "kind": "train",
                "step": step,
                "reward/mean": 0.25 * step,
                "reward/solved_frac": 0.5,
                "staleness/mean": 1.0,
                "staleness/max": 2,
                "rollout/dropped_stale": 1,
                "rollout/samples": 8,
                "rollout/sampled_tokens": 800,
                "time/elapsed_s": 10.0 * step,
                "time/wait_s": 1.0,
                "mismatch/k3": 1e-4,
            }
        )

    with RunProgress(
        path, 3, start_step=0, console=Console(file=out, force_terminal=False, width=60)
    ) as prog:
        prog.refresh()  # no file yet: nothing
        path.write_text(record(1) + "\n")
        prog.refresh()
        prog.refresh()  # same step: no second line
        path.write_text(record(1) + "\n" + record(2) + "\n")
    lines = out.getvalue().splitlines()  # step 2 comes from the closing refresh; 60 columns: no wrapping
    assert [line.split(",")[0] for line in lines] == ["training: step 1/3", "training: step 2/3"]
    assert "reward 0.500" in lines[1] and "dropped 2" in lines[1] and "tok/s 80" in lines[1]
