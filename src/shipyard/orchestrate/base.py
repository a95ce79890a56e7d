"""Placement interface: where the trainer, inference servers and rollout workers run.

Contract: ``start_inference`` starts ``inference.num_servers`` servers (each serving version 0
and subscribed to the store) and returns their URLs; ``start_training`` starts the trainer and
``rollout.num_workers`` workers (worker i uses server i mod num_servers); ``trainer_done`` polls;
``trainer_result`` returns the trainer's summary or re-raises its error; ``stop_workers`` ends
rollout generation (so evaluation gets the machine); ``stop`` tears everything down. Chosen by :func:`make_placement` switching on ``run.placement``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

from shipyard.config.schema import ShipyardConfig


class Placement(Protocol):
    def start_inference(self) -> list[str]: ...

    def start_training(self) -> None: ...

    def trainer_done(self) -> bool: ...

    def trainer_result(self) -> dict[str, Any]: ...

    def stop_workers(self) -> None: ...

    def stop(self) -> None: ...


def make_placement(cfg: ShipyardConfig, run_dir: Path) -> Placement:
    if cfg.run.placement == "local":
        from shipyard.orchestrate.local import LocalPlacement

        return LocalPlacement(cfg, run_dir)
    if cfg.run.placement == "ray":
        from shipyard.orchestrate.ray_placement import RayPlacement

        return RayPlacement(cfg, run_dir)
    raise ValueError(f"run.placement={cfg.run.placement!r} is not known (use 'ray' or 'local')")
