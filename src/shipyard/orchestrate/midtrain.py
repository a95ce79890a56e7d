"""`shipyard midtrain`: start the mid-training ranks (:mod:`shipyard.trainer.midtrain`).

Contract: :func:`run_midtrain` runs :func:`~shipyard.trainer.midtrain.midtrain_rank` in this
process at ``trainer.world_size = 1``, else as ``world_size`` Ray actors in one placement group
(:func:`~shipyard.orchestrate.ray_placement.start_rank_group`; a local Ray unless
``run.ray_address``), with the config's paths made absolute; returns rank 0's report.
Limits: the ranks must see ``midtrain.output_dir`` (one machine, or a shared file system).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from shipyard.config.schema import ShipyardConfig


def run_midtrain(cfg: ShipyardConfig) -> dict[str, Any]:
    """Mid-train with ``trainer.world_size`` ranks; rank 0's report."""
    from shipyard.trainer.distributed import ONE_PROCESS
    from shipyard.trainer.midtrain import midtrain_rank

    if cfg.trainer.world_size == 1:
        return midtrain_rank(ONE_PROCESS, cfg)
    import ray

    from shipyard.orchestrate.ray_placement import init_ray, start_rank_group

    cfg = cfg.model_copy(deep=True)  # ranks run elsewhere: absolute paths
    cfg.midtrain.output_dir = str(Path(cfg.midtrain.output_dir).resolve())
    cfg.run.results_dir = str(Path(cfg.run.results_dir).resolve())
    cfg.model.cache_dir = str(Path(cfg.model.cache_dir).expanduser().resolve())
    init_ray(cfg)
    try:
        return ray.get(start_rank_group(cfg, midtrain_rank, cfg))[0]
    finally:
        ray.shutdown()
