"""Write Shipyard's generated function tasks as the JSONL rows ``vf_functions.py`` reads.

Run with Shipyard's venv: ``.venv/bin/python examples/harnesses/verifiers_env/export_tasks.py``.
Writes every task of ``generated_tasks(n, seed)``, train and held-out alike (a session's task id
may be either), one JSON object a line: ``id``, ``prompt``, ``entry_point``, ``hidden_tests``.
Use the run's ``tasks.num_generated``/``tasks.seed`` as ``--n``/``--seed``: a task's content
depends only on its index and the seed (the first 600 of n=2000 are the 600 of n=600), but ids
past ``n - 1`` are missing from a smaller file. About 740 bytes a task (n=2000: 1.48 MB).
"""

import argparse
import json
import os
from pathlib import Path

from shipyard.envs.tasks.functions import generated_tasks, split_tasks

FIELDS = ("id", "prompt", "entry_point", "hidden_tests")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=600, help="number of generated tasks (tasks.num_generated)")
    p.add_argument("--seed", type=int, default=1234, help="generation seed (tasks.seed)")
    p.add_argument("--heldout-frac", type=float, default=0.25, help="only for the summary line")
    p.add_argument("--out", type=Path, default=Path(__file__).with_name("tasks.jsonl"))
    args = p.parse_args()
    tasks = generated_tasks(args.n, seed=args.seed)
    train, heldout = split_tasks(tasks, args.heldout_frac, seed=args.seed)
    tmp = args.out.with_name(args.out.name + ".tmp")
    with tmp.open("w") as f:
        for t in tasks:
            f.write(json.dumps({k: getattr(t, k) for k in FIELDS}) + "\n")
    os.replace(tmp, args.out)
    print(f"wrote {len(tasks)} tasks ({len(train)} train + {len(heldout)} held out) to {args.out}")


if __name__ == "__main__":
    main()
