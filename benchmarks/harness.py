"""The small harness benchmarks share: arguments, the machine description, the table, the results JSON.

Contract: :func:`parser` gives an ``argparse`` parser with ``--quick`` (a reduced size that runs in
under a minute) and ``--out`` (the results directory); :func:`machine` describes the host (CPU model,
cores, torch and its CPU capability, date) for ``docs/benchmarks.md``; :func:`table` prints rows
side by side with rich; :func:`shipyard` runs one ``shipyard`` command as its own process;
:func:`write_results` writes ``<out>/<name>.json`` (``<name>_quick.json``
under ``--quick``) atomically, with the machine description under ``machine``.

Example::

    args = parser(__doc__).parse_args()
    rows = {"fp32": {"tok/s": 31.5}, "bf16": {"tok/s": 3.4}}
    table("trainer precision", rows)
    write_results(args, "precision", {"trainer_tok_s_fp32": 31.5, ...})
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

RESULTS = Path(__file__).resolve().parent / "results"
ROOT = RESULTS.parents[1]
console = Console()


def parser(doc: str | None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=(doc or "").split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--quick", action="store_true", help="reduced size (under a minute); writes <name>_quick.json"
    )
    p.add_argument("--out", type=Path, default=RESULTS, help="directory of the results JSON")
    return p


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine() -> dict[str, Any]:
    import torch

    return {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "python": platform.python_version(),
        "date": datetime.date.today().isoformat(),
    }


def table(title: str, rows: dict[str, dict[str, Any]]) -> None:
    """Print ``rows`` (row name -> column -> value) as one table (floats: see :func:`_fmt`)."""
    cols: list[str] = []
    for r in rows.values():
        cols += [c for c in r if c not in cols]
    t = Table(title=title)
    t.add_column("")
    for c in cols:
        t.add_column(c, justify="right")
    for name, r in rows.items():
        t.add_row(name, *(_fmt(r.get(c, "")) for c in cols))
    console.print(t)


def _fmt(v: Any) -> str:
    """Floats: whole numbers from 100 up, else 3 significant digits."""
    if isinstance(v, float):
        return f"{v:.0f}" if abs(v) >= 100 else f"{v:.3g}"
    return str(v)


def write_results(args: argparse.Namespace, name: str, figures: dict[str, Any]) -> Path:
    """Write ``figures`` (plus ``machine`` and ``quick``) to ``<out>/<name>[_quick].json``, atomically."""
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"{name}{'_quick' if args.quick else ''}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({**figures, "quick": args.quick, "machine": machine()}, indent=1) + "\n")
    tmp.replace(path)
    console.print(f"wrote {path}")
    return path


def merge_fleet(args: argparse.Namespace, section: str, figures: dict[str, Any], top: dict[str, Any]) -> None:
    """Merge one part of issue 19 into ``<out>/fleet[_quick].json``: ``figures`` under ``section`` and
    the ``top`` keys at the top level (the other parts keep theirs), atomically."""
    path = args.out / f"fleet{'_quick' if args.quick else ''}.json"
    fleet = json.loads(path.read_text()) if path.exists() else {}
    fleet[section] = figures
    fleet.update(top)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(fleet, indent=1) + "\n")
    tmp.replace(path)


def shipyard(args: list[str], log: Path, timeout_s: float | None = None) -> float:
    """Run ``shipyard ARGS`` as its own process (in the repository, output to ``log``); returns its
    minutes, or exits naming the log when it fails. With ``timeout_s`` the process is stopped
    (SIGTERM, then SIGKILL after 30 s) when the time is up, which is not a failure: what it wrote
    atomically before (checkpoints, published versions, metrics) stays."""
    console.print(f"[bold]shipyard {' '.join(args)}[/]  (log: {log})")
    t0 = time.time()
    with open(log, "w") as f:
        proc = subprocess.Popen(
            [sys.executable, "-m", "shipyard.cli", *args], cwd=ROOT, stdout=f, stderr=subprocess.STDOUT
        )
        try:
            code = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            console.print(f"stopped after {timeout_s:.0f} s (its time budget)")
            code = 0
    if code != 0:
        raise SystemExit(f"shipyard {args[0]} failed with exit code {code}; see {log}")
    minutes = (time.time() - t0) / 60
    console.print(f"done in {minutes:.1f} min")
    return minutes
