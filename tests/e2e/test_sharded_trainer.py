"""The tiny run with a sharded trainer: two FSDP2 ranks as Ray actors in one placement group train
it, each rank publishes its share of every version; mid-training with two ranks ends where one
process does."""

import gzip
import json
from pathlib import Path

import pytest

from shipyard.config import load_config
from shipyard.metrics.logger import read_metrics
from shipyard.orchestrate.train import train
from shipyard.store import LocalStore
from shipyard.weights.snapshot import latest_version, load_version, read_manifest

ROOT = Path(__file__).resolve().parents[2]


def _cfg(tmp: Path, *extra: str):
    return load_config(
        ROOT / "configs/tiny.toml",
        [
            "run.placement=ray",
            f'run.output_dir="{tmp}"',
            f'store.root="{tmp / "store"}"',
            *extra,
        ],
    )


def test_two_rank_trainer_runs_the_loop(tmp_path: Path) -> None:
    summary = train(_cfg(tmp_path, "trainer.steps=2", "trainer.world_size=2"))
    assert summary["trainer"]["final_version"] == 2 and summary["trainer"]["world_size"] == 2
    assert len(summary["trainer"]["nodes"]) == 2
    store = LocalStore(tmp_path / "store" / "tiny")
    assert latest_version(store) == 2
    records = read_metrics(tmp_path / "tiny/metrics.jsonl")
    steps = [r for r in records if r.get("kind") == "train"]
    assert [r["step"] for r in steps] == [1, 2]
    assert all(r["mismatch/k3"] < 1e-3 for r in steps)  # both ranks' tokens scored, fp32 agrees
    assert all(r["train/num_seqs"] == 2 * 4 for r in steps)
    ranks_shards = {s.name.split("-")[0] for s in read_manifest(store, 2).encodings["delta"].shards}
    assert ranks_shards == {"r0", "r1"}  # each rank uploaded the delta of the tensors it owns
    weights = load_version(store, 2)  # the gathered full weights verify against the manifest digest
    assert read_manifest(store, 2).state_digest and "model.embed_tokens.weight" in weights
    ckpt = tmp_path / "tiny/checkpoints/step-000002"
    assert (ckpt / "meta.json").is_file() and len(list((ckpt / "dcp").glob("*.distcp"))) == 2
    with gzip.open(tmp_path / "tiny/logprobs/step-000002.json.gz") as f:  # both ranks' tokens, for the viewer
        assert len(json.load(f)) == steps[-1]["train/num_seqs"]


def test_a_run_resumes_at_another_world_size(tmp_path: Path) -> None:
    """Two steps with one trainer process, then the same run given a third step and two ranks: it
    resumes from the one-process checkpoint and goes on publishing deltas (each rank's parent is
    loaded from the store)."""
    train(_cfg(tmp_path, "trainer.steps=2"))
    summary = train(_cfg(tmp_path, "trainer.steps=3", "trainer.world_size=2"))
    assert summary["trainer"]["world_size"] == 2
    store = LocalStore(tmp_path / "store" / "tiny")
    assert latest_version(store) == 3 and read_manifest(store, 3).kind == "delta"
    steps = [r["step"] for r in read_metrics(tmp_path / "tiny/metrics.jsonl") if r.get("kind") == "train"]
    assert steps == [1, 2, 3]
    load_version(store, 3)  # the sharded delta applies to the one-process version 2 and verifies


def test_midtrain_at_world_2_matches_world_1(tmp_path: Path) -> None:
    """Mid-training with two Ray-placed ranks ends where one process does (same data, same update)."""
    import sysconfig

    from shipyard.orchestrate.midtrain import run_midtrain

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    corpus = [str(stdlib / "json"), str(stdlib / "email")]

    def cfg(world: int, out: Path):
        return load_config(
            ROOT / "configs/tiny.toml",
            [
                "run.placement=ray",
                f"trainer.world_size={world}",
                f"midtrain.corpus_dirs={corpus!r}".replace("'", '"'),
                "midtrain.seq_len=64",
                "midtrain.batch_seqs=4",
                "midtrain.micro_batch=2",
                "midtrain.steps=4",
                "midtrain.lr=1e-2",
                "midtrain.heldout_frac=0.2",
                "midtrain.heldout_seqs=6",
                f'midtrain.output_dir="{out / "mt"}"',
                f'run.results_dir="{out / "results"}"',
            ],
        )

    one = run_midtrain(cfg(1, tmp_path / "one"))
    two = run_midtrain(cfg(2, tmp_path / "two"))
    assert two["world_size"] == 2 and two["node"]
    assert two["heldout_code_loss_before"] == pytest.approx(one["heldout_code_loss_before"], abs=1e-5)
    assert two["heldout_code_loss_after"] == pytest.approx(one["heldout_code_loss_after"], abs=1e-4)
    assert two["heldout_code_loss_after"] < two["heldout_code_loss_before"]
