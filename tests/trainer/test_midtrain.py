"""Mid-training: the corpus (de-duplicated, split by file, held-out never trained on), the loop
(held-out loss falls, a resumed run ends where a straight one does, any world size), and its
result as the RL policy's starting point (`model.init_from`)."""

from __future__ import annotations

import sysconfig
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from shipyard.config import load_config
from shipyard.config.schema import MidtrainConfig
from shipyard.metrics.logger import read_metrics
from shipyard.models.loading import load_model, load_tokenizer
from shipyard.orchestrate.midtrain import run_midtrain
from shipyard.trainer import midtrain
from shipyard.trainer.corpus import build_corpus, is_heldout
from shipyard.trainer.midtrain import flops_per_token, lm_step, lr_at, step_indices

ROOT = Path(__file__).resolve().parents[2]
STDLIB = Path(sysconfig.get_paths()["stdlib"])


def _files(tmp: Path) -> Path:
    src = tmp / "src"
    (src / "pkg").mkdir(parents=True)
    for i in range(30):
        (src / "pkg" / f"m{i}.py").write_text(
            f"MARKER_{i} = {i}\n\ndef f{i}(x):\n    return x * {i} + MARKER_{i}\n" * 3
        )
    (src / "copy.py").write_text((src / "pkg" / "m0.py").read_text())  # a duplicate of m0
    (src / "latin1.py").write_bytes(b"x = '\xe9'\n")  # not UTF-8: skipped
    (src / "big.py").write_text("y = 1\n" * 50_000)  # over max_file_bytes: skipped
    (src / "notes.txt").write_text("not python")
    return src


def test_corpus_dedups_splits_by_file_and_never_mixes(tmp_path: Path) -> None:
    tok = load_tokenizer(load_config(ROOT / "configs/tiny.toml").model)
    cfg = MidtrainConfig(
        corpus_dirs=[str(_files(tmp_path))], heldout_frac=0.3, seq_len=16, max_file_bytes=10_000
    )
    corpus = build_corpus(cfg, tok, tmp_path / "corpus")
    info = corpus.info
    assert (
        info["files_found"] == 32 and info["files_distinct"] == 30
    )  # latin1 kept by size, dropped as non-UTF-8; copy
    train_text = tok.decode(corpus.train_N.tolist())
    heldout_text = tok.decode(corpus.heldout_N.tolist())
    held = {i for i in range(30) if f"MARKER_{i} =" in heldout_text}
    trained = {i for i in range(30) if f"MARKER_{i} =" in train_text}
    assert held and trained and held.isdisjoint(trained) and held | trained == set(range(30))
    assert len(held) == info["files_heldout"] == len(info["heldout_hashes"])
    assert all(is_heldout(h, 0.3) for h in info["heldout_hashes"])
    assert int(corpus.train_N[-1]) == tok.eos_token_id
    again = build_corpus(cfg, tok, tmp_path / "corpus")  # reused: same record, same arrays
    assert again.info == info and (again.train_N == corpus.train_N).all()


def test_corpus_bad_input_names_the_setting(tmp_path: Path) -> None:
    tok = load_tokenizer(load_config(ROOT / "configs/tiny.toml").model)
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "readme.txt").write_text("no code")
    with pytest.raises(ValueError, match=r"midtrain.corpus_dirs: no Python"):
        build_corpus(MidtrainConfig(corpus_dirs=[str(tmp_path / "empty")]), tok, tmp_path / "c")
    with pytest.raises(ValueError, match=r"midtrain.corpus_dirs: .*missing is not a directory"):
        build_corpus(MidtrainConfig(corpus_dirs=[str(tmp_path / "missing")]), tok, tmp_path / "c")


def test_schedule_and_data_order() -> None:
    m = MidtrainConfig(lr=1e-3, warmup_steps=4, steps=20, min_lr_frac=0.1)
    assert lr_at(2, m) == pytest.approx(5e-4) and lr_at(4, m) == pytest.approx(1e-3)
    assert lr_at(20, m) == pytest.approx(1e-4)
    seen = [i for s in range(1, 6) for i in step_indices(s, 4, 10, seed=0)]
    assert sorted(seen[:10]) == list(range(10)) and sorted(seen[10:20]) == list(range(10))  # epochs
    assert seen[:10] != seen[10:20]  # each epoch reshuffled
    assert step_indices(3, 4, 10, 0) == step_indices(3, 4, 10, 0)


def _midtrain_cfg(tmp: Path, *extra: str):
    corpus = [str(STDLIB / "json"), str(STDLIB / "email"), str(STDLIB / "logging")]
    return load_config(
        ROOT / "configs/tiny.toml",
        [
            f"midtrain.corpus_dirs={corpus!r}".replace("'", '"'),
            "midtrain.seq_len=64",
            "midtrain.batch_seqs=4",
            "midtrain.micro_batch=2",
            "midtrain.lr=1e-2",
            "midtrain.warmup_steps=2",
            "midtrain.heldout_frac=0.2",
            "midtrain.heldout_seqs=8",
            "midtrain.eval_every=6",
            "midtrain.checkpoint_every=6",
            f'midtrain.output_dir="{tmp / "mt"}"',
            f'run.results_dir="{tmp / "results"}"',
            *extra,
        ],
    )


def test_midtrain_lowers_heldout_loss_resumes_exactly_and_seeds_rl(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    straight = run_midtrain(_midtrain_cfg(tmp_path / "a", "midtrain.steps=12"))
    assert straight["heldout_code_loss_after"] < straight["heldout_code_loss_before"] - 1.0
    assert straight["heldout_tokens"] > 0 and straight["corpus_tokens"] > straight["heldout_tokens"]
    # a run that crashes in step 8 (after step 6's checkpoint), resumed by a second invocation:
    calls = {"n": 0}

    def crash_at_8(*args: Any) -> dict[str, float]:
        calls["n"] += 1
        if calls["n"] == 8:
            raise RuntimeError("killed")
        return lm_step(*args)

    monkeypatch.setattr(midtrain, "lm_step", crash_at_8)
    with pytest.raises(RuntimeError, match="killed"):
        run_midtrain(_midtrain_cfg(tmp_path / "c", "midtrain.steps=12"))
    monkeypatch.undo()
    resumed = run_midtrain(_midtrain_cfg(tmp_path / "c", "midtrain.steps=12"))
    steps = [r["step"] for r in read_metrics(tmp_path / "c/mt/metrics.jsonl")]
    assert steps == list(range(13))  # step 7, logged before the crash, is not in the file twice
    assert resumed["heldout_code_loss_after"] == pytest.approx(straight["heldout_code_loss_after"], abs=1e-6)
    a = load_file(str(tmp_path / "a/mt/final/model.safetensors"))
    c = load_file(str(tmp_path / "c/mt/final/model.safetensors"))
    assert max(float((a[k] - c[k]).abs().max()) for k in a) < 1e-6
    # RL starts from it: model.init_from gives exactly those weights
    cfg = load_config(ROOT / "configs/tiny.toml", [f'model.init_from="{tmp_path / "a/mt/final"}"'])
    model, _ = load_model(cfg.model)
    state = model.state_dict()
    assert all(torch.equal(state[k], v) for k, v in a.items())
    assert (tmp_path / "a/results/midtrain.json").is_file()


def test_init_from_another_model_is_a_clear_error(tmp_path: Path) -> None:
    moe = load_model(load_config(ROOT / "configs/tiny_moe.toml").model)[0]
    moe.save_pretrained(tmp_path / "moe")
    cfg = load_config(ROOT / "configs/tiny.toml", [f'model.init_from="{tmp_path / "moe"}"'])
    with pytest.raises(ValueError, match=r"model.init_from=.* is not a checkpoint of this model"):
        load_model(cfg.model)
    with pytest.raises(ValueError, match=r"model.init_from=.*no \*.safetensors"):
        load_model(load_config(ROOT / "configs/tiny.toml", [f'model.init_from="{tmp_path}"']).model)


def test_flops_per_token_formula() -> None:
    model = load_model(load_config(ROOT / "configs/tiny.toml").model)[0]
    c = model.config
    blocks = sum(p.numel() for p in model.model.layers.parameters()) + model.model.norm.weight.numel()
    head = model.lm_head.weight.numel()
    assert flops_per_token(model, 128) == 6 * (blocks + head) + 12 * c.num_hidden_layers * c.hidden_size * 128
