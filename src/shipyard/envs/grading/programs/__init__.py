"""The programs the grader runs inside its sandboxes, shipped as source files: ``wire.py`` (the value
format), ``oracle.py`` (solution sandbox), ``runner.py`` (test sandbox). Stdlib only; never imported by
Shipyard itself except to test the wire format."""
