"""Wiring: building a run's components from the config and placing them (Ray actors or threads,
``base``/``ray_placement``/``local``), the ``shipyard train`` driver (``train``: claim the run's
store, evaluate, train, evaluate, report), one component as its own process (``standalone``:
``shipyard trainer``/``worker``) and the supervised warm start (``warmstart``). Top of the layers:
nothing imports it but the CLI."""
