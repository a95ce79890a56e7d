"""Live progress of a training run, read from the trainer's metrics JSONL.

Contract: :class:`RunProgress` renders a rich live view — a progress bar with ETA and a table of
the newest step's reward, staleness, drops, mismatch, throughput and trainer idle share —
refreshed from ``metrics.jsonl`` whenever :meth:`refresh` is called; on a pipe or a log file it
prints the same figures as one plain line per new step instead. It reads the file the trainer
writes, so it works the same whichever process or machine the trainer runs on.
:class:`StepBar` is a plain bar for any counted work that also reports on a pipe or a log file.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

from rich.console import Console, Group
from rich.live import Live
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table

from shipyard.metrics.logger import read_metrics


def summarize(records: list[dict[str, Any]]) -> dict[str, float]:
    """Run-level figures from trainer records: throughput and trainer idle share."""
    train = [r for r in records if r.get("kind") == "train"]
    if not train:
        return {}
    elapsed = max(train[-1]["time/elapsed_s"], 1e-9)
    samples = sum(r["rollout/samples"] for r in train)
    tokens = sum(r["rollout/sampled_tokens"] for r in train)
    idle = sum(r["time/wait_s"] for r in train)
    return {
        "steps": float(len(train)),
        "samples_per_s": samples / elapsed,
        "tokens_per_s": tokens / elapsed,
        "trainer_idle_frac": idle / elapsed,
        "dropped_stale": float(sum(r["rollout/dropped_stale"] for r in train)),
        "reward_first": train[0]["reward/mean"],
        "reward_last": train[-1]["reward/mean"],
    }


def step_figures(last: dict[str, Any], run: dict[str, float]) -> dict[str, str]:
    """The progress view's columns for the newest train record ``last`` and run figures ``run``."""
    return {
        "step": f"{last['step']}",
        "reward": f"{last['reward/mean']:.3f}",
        "solved": f"{last['reward/solved_frac']:.2f}",
        "staleness": f"{last['staleness/mean']:.2f} (max {last['staleness/max']:.0f})",
        "dropped": f"{run['dropped_stale']:.0f}",
        "k3": f"{last.get('mismatch/k3', float('nan')):.2e}",
        "samples/s": f"{run['samples_per_s']:.2f}",
        "tok/s": f"{run['tokens_per_s']:.0f}",
        "trainer idle": f"{100 * run['trainer_idle_frac']:.0f}%",
    }


class RunProgress:
    def __init__(
        self, metrics_path: Path, total_steps: int, start_step: int = 0, console: Console | None = None
    ) -> None:
        self.path, self.total = metrics_path, total_steps
        self.console = console or Console()
        self.printed = start_step  # on a pipe: the last step printed as a line
        self.bar = Progress(
            TextColumn("[bold]training"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("ETA"),
            TimeRemainingColumn(),
        )
        self.task = self.bar.add_task("train", total=total_steps, completed=start_step)
        self.live = (
            Live(Group(self.bar, Table()), refresh_per_second=2, console=self.console)
            if self.console.is_terminal
            else None
        )

    def __enter__(self) -> RunProgress:
        if self.live is not None:
            self.live.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.refresh()
        if self.live is not None:
            self.live.__exit__(None, None, None)

    def refresh(self) -> None:
        records = [r for r in read_metrics(self.path) if r.get("kind") == "train"]
        if not records:
            return
        last, run = records[-1], summarize(records)
        cols = step_figures(last, run)
        if self.live is None:
            if last["step"] > self.printed:
                self.printed = last["step"]
                line = ", ".join(f"{k} {v}" for k, v in cols.items() if k != "step")
                # one unwrapped line per step: a log stays greppable whatever its width
                self.console.print(
                    f"training: step {last['step']}/{self.total}, {line}", highlight=False, soft_wrap=True
                )
            return
        self.bar.update(self.task, completed=last["step"])
        table = Table(show_header=True, header_style="bold")
        for k in cols:
            table.add_column(k)
        table.add_row(*cols.values())
        self.live.update(Group(self.bar, table))


class StepBar:
    """Progress of ``total`` units of work: a rich bar on a terminal; on a pipe or a log file (where
    a live bar prints nothing until it ends) a plain line at most every ``every_s`` seconds and
    at the end, so a background run's log shows how far it got and its ETA.

    Example::

        with StepBar("sft", total=steps) as bar:
            for step in range(1, steps + 1):
                bar.update(step, f"loss {loss:.3f}")
    """

    def __init__(self, label: str, total: int, every_s: float = 30.0, console: Console | None = None) -> None:
        self.label, self.total, self.every_s = label, total, every_s
        self.console = console or Console()
        self.bar = Progress(console=self.console) if self.console.is_terminal else None
        self.task = self.bar.add_task(label, total=total) if self.bar is not None else None
        self.t0 = self.last = time.monotonic()
        self.completed, self.note = 0, ""
        self._lock = threading.Lock()  # advance() is called from worker threads

    def __enter__(self) -> StepBar:
        if self.bar is not None:
            self.bar.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.stop()
        elif self.completed:
            self._line()

    def advance(self, n: int = 1) -> None:
        """``n`` more units done (for callbacks that count one at a time, from any thread)."""
        with self._lock:
            self.update(self.completed + n, self.note)

    def update(self, completed: int, note: str = "") -> None:
        self.completed, self.note = completed, note
        if self.bar is not None:
            assert self.task is not None
            self.bar.update(self.task, completed=completed, description=f"{self.label} {note}".strip())
        elif time.monotonic() - self.last >= self.every_s or completed >= self.total:
            self._line()

    def _line(self) -> None:
        self.last = time.monotonic()
        elapsed = self.last - self.t0
        eta = elapsed * (self.total - self.completed) / self.completed if self.completed else float("nan")
        pct = 100 * self.completed / max(self.total, 1)
        self.console.print(
            f"{self.label}: {self.completed}/{self.total} ({pct:.0f}%), {elapsed:.0f} s, ETA {eta:.0f} s {self.note}".rstrip(),
            highlight=False,
            soft_wrap=True,
        )
