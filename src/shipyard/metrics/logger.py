"""Run metrics: one JSONL line per record plus TensorBoard scalars.

Contract: ``MetricsLogger(run_dir).log(step, {"reward/mean": 0.4, ...})`` appends
``{"step": step, "time": t, ...}`` to ``run_dir/metrics.jsonl``; ``log(step, a, b)`` appends
both records in one write (flushed per call, so a crash loses at most the call being written,
never one record of a pair) and writes every numeric value as a TensorBoard scalar
under ``run_dir/tb``. ``read_metrics(path)`` returns the records, skipping a torn last line.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any


class MetricsLogger:
    def __init__(
        self, run_dir: str | Path, filename: str = "metrics.jsonl", tensorboard: bool = True
    ) -> None:
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / filename
        self._file = open(self.path, "a")  # noqa: SIM115 - held open for the run, closed in close()
        self._tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(self.run_dir / "tb"))

    def log(self, step: int, *records: dict[str, Any]) -> None:
        """Append ``records`` of ``step`` in one write: a crash keeps all of them or none."""
        now = time.time()
        lines = "".join(json.dumps({"step": step, "time": now, **r}, default=float) + "\n" for r in records)
        self._file.write(lines)
        self._file.flush()
        if self._tb is not None:
            for values in records:
                for k, v in values.items():
                    if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v):
                        self._tb.add_scalar(k, v, step)
            self._tb.flush()

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    p = Path(path)
    if not p.is_file():
        return []
    out = []
    for line in p.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def drop_after(path: str | Path, step: int) -> int:
    """Rewrite the JSONL at ``path`` without its records of steps after ``step`` (atomically); how
    many were dropped. A job resumed from the checkpoint of ``step`` calls it before logging again,
    so the steps it repeats are not in the file twice."""
    p = Path(path)
    records = read_metrics(p)
    keep = [r for r in records if r.get("step", 0) <= step]
    if len(keep) == len(records):
        return 0
    tmp = p.with_name(p.name + ".tmp")
    tmp.write_text("".join(json.dumps(r, default=float) + "\n" for r in keep))
    os.replace(tmp, p)
    return len(records) - len(keep)
