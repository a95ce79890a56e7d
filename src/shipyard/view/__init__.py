"""``shipyard view``: a run's dashboard and rollout viewer in the browser (``server``), reading the run's
directory and store as they are (``run``: one run; ``index``: its rollouts, paged; ``types``: rows and
filters). Static page and vendored libraries in ``static/``; see docs/viewer.md."""
