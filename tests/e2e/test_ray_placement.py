"""The same tiny run placed as Ray actors (trainer, inference server, rollout worker) on a local Ray."""

from pathlib import Path

from shipyard.config import load_config
from shipyard.metrics.logger import read_metrics
from shipyard.orchestrate.train import train
from shipyard.store import LocalStore
from shipyard.weights.snapshot import latest_version

ROOT = Path(__file__).resolve().parents[2]


def test_ray_placement_runs_the_loop(tmp_path: Path) -> None:
    cfg = load_config(
        ROOT / "configs/tiny.toml",
        [
            "run.placement=ray",
            "trainer.steps=2",
            f'run.output_dir="{tmp_path}"',
            f'store.root="{tmp_path / "store"}"',
        ],
    )
    summary = train(cfg)
    assert summary["trainer"]["final_version"] == 2
    assert latest_version(LocalStore(tmp_path / "store" / "tiny")) == 2
    steps = [r["step"] for r in read_metrics(tmp_path / "tiny/metrics.jsonl") if r.get("kind") == "train"]
    assert steps == [1, 2]


def test_actors_get_absolute_local_paths_and_s3_roots_unchanged() -> None:
    """A local store's root becomes absolute for actors in other directories; an S3 root is
    `bucket/prefix` and stays as given (it was once resolved into a local path, so a Ray run on S3
    could not open its run)."""
    from shipyard.orchestrate.ray_placement import for_actors

    local = for_actors(load_config(ROOT / "configs/tiny.toml", ['store.root="runs/store"']))
    assert local.store.root == str(Path("runs/store").resolve())
    s3 = for_actors(
        load_config(
            ROOT / "configs/tiny.toml",
            ["store.type=s3", 'store.root="bucket/runs"', 'store.endpoint_url="http://127.0.0.1:9"'],
        )
    )
    assert s3.store.root == "bucket/runs" and Path(s3.model.cache_dir).is_absolute()
