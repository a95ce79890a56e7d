"""What a run writes for people: metrics as JSONL (``logger``, the record of truth, re-read on
resume) and TensorBoard events, the live progress table and per-step lines (``progress``), and the
reward/staleness/mismatch plot (``plot``). Promises: a record is appended whole or not at all.
The viewer in a browser is `shipyard.view`. Does not cover computing the metrics (each subsystem does)."""
