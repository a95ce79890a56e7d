"""Given a Ray address, the same config joins that cluster: a token-authenticated head node this
test starts on loopback, and in the second test a worker node beside it, so a two-rank trainer is
placed one rank per node (:mod:`shipyard.orchestrate.loopback_cluster`: real `ray start` nodes).
The runs are `shipyard train` in processes of their own: Ray keeps a process's auth token for its
lifetime, so joining the token cluster in-process would break every later local `ray.init`."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from shipyard.orchestrate.loopback_cluster import LoopbackCluster, loopback_cluster
from shipyard.store import LocalStore
from shipyard.weights.snapshot import latest_version

ROOT = Path(__file__).resolve().parents[2]


def _shipyard_train(tmp_path: Path, cluster: LoopbackCluster, *overrides: str) -> subprocess.CompletedProcess:
    shipyard = str(Path(sys.executable).with_name("shipyard"))
    args = [
        "run.placement=ray",
        f'run.ray_address="{cluster.address}"',
        f'run.output_dir="{tmp_path}"',
        f'store.root="{tmp_path / "store"}"',
        *overrides,
    ]
    return subprocess.run(
        [shipyard, "train", str(ROOT / "configs/tiny.toml"), *args],
        env={**os.environ, **cluster.env},
        capture_output=True,
        text=True,
        timeout=900,
    )


@pytest.mark.slow
def test_run_joins_an_existing_ray_cluster(tmp_path: Path) -> None:
    with loopback_cluster(workers=0, log_dir=tmp_path / "ray", cpus=4) as cluster:
        run = _shipyard_train(tmp_path, cluster, "trainer.steps=2")
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
        assert latest_version(LocalStore(tmp_path / "store" / "tiny")) == 2
        # The actors ran in the head's session, not in a Ray instance this process started.
        sessions = list(cluster.temp_dir.glob("session_*/logs/worker-*.out"))
        assert sessions, "no actor logs under the head's temp dir: the run did not use the given cluster"


@pytest.mark.slow
def test_two_rank_trainer_spans_two_nodes(tmp_path: Path) -> None:
    with loopback_cluster(workers=1, log_dir=tmp_path / "ray") as cluster:
        run = _shipyard_train(
            tmp_path,
            cluster,
            "trainer.steps=3",
            "trainer.world_size=2",
            'trainer.placement_strategy="STRICT_SPREAD"',
        )
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
        summary = json.loads((tmp_path / "tiny/summary.json").read_text())
        assert summary["trainer"]["world_size"] == 2 and summary["trainer"]["final_version"] == 3
        assert len(set(summary["trainer"]["nodes"])) == 2  # one rank on each node
        assert latest_version(LocalStore(tmp_path / "store" / "tiny")) == 3
        too_big = _shipyard_train(tmp_path / "big", cluster, "trainer.world_size=8")
        assert too_big.returncode != 0
        assert "trainer.world_size=8 needs 8 CPU" in too_big.stdout + too_big.stderr
