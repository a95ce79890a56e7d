"""RL through a command harness: configs/tiny_harness.toml (examples/harnesses/tools_agent.py, the
openai client with tools, in each session's sandbox) trains three steps; the trainer sees the
endpoint's segments as it sees built-in sessions, token-exact."""

from pathlib import Path

from shipyard.config import load_config
from shipyard.metrics.logger import read_metrics
from shipyard.orchestrate.train import train
from shipyard.rollout.types import RolloutBatch
from shipyard.store import LocalStore

ROOT = Path(__file__).resolve().parents[2]


def test_a_command_harness_trains(tmp_path: Path) -> None:
    overrides = [
        f'run.output_dir="{tmp_path}"',
        f'store.root="{tmp_path / "store"}"',
        f'run.results_dir="{tmp_path / "results"}"',
        f'harness.files="{ROOT / "examples/harnesses"}"',
    ]
    cfg = load_config(ROOT / "configs/tiny_harness.toml", overrides)
    train(cfg)
    steps = [r for r in read_metrics(tmp_path / "tiny_harness/metrics.jsonl") if r.get("kind") == "train"]
    assert [r["step"] for r in steps] == [1, 2, 3]
    # the sampler's logprobs of the harness's tokens are the trainer's (fp32: equal to rounding)
    assert all(abs(r["mismatch/k1"]) < 1e-5 for r in steps)
    store = LocalStore(tmp_path / "store" / "tiny_harness")
    trajs = [t for k in store.list("rollouts/") for t in RolloutBatch.from_bytes(store.get(k)).trajectories]
    assert trajs and all(t.finish == "done" and t.error is None for t in trajs)
    assert all(t.metrics["calls"] >= 1 and t.metrics["retokenized_calls"] == 0 for t in trajs)
    assert all("total" in t.reward_info for t in trajs), "every session was graded"
    assert sum(sum(t.loss_mask) for t in trajs) > 0
