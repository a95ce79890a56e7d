"""Tests of :mod:`shipyard.inference.engine.kv_cache`: a :class:`SlackLayer` holds exactly what transformers'
``DynamicLayer`` holds through every operation the engine and transformers apply (prefill, decode
steps across buffer refills, row selection, a cut of leading columns, crop), copies its cache only
when a buffer is full or replaced, and the engine's tokens and logprobs are bit-identical with and
without it (continuous batching with joins and compactions, the prefix cache, a sampled and a greedy
row; the tiny GQA model and SmolLM2).

Shape legend: B = rows, K = key/value heads, T = positions, D = head size.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers import MistralConfig
from transformers.cache_utils import DynamicLayer

from shipyard.config.schema import ModelConfig
from shipyard.inference.engine.engine import EmbeddedEngine
from shipyard.inference.engine.kv_cache import SlackLayer, full_attention, slack_cache
from shipyard.inference.types import GenerateRequest, SamplingParams
from shipyard.models.loading import load_model


def _kv(gen: torch.Generator, b: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(b, 2, n, 4, generator=gen), torch.randn(b, 2, n, 4, generator=gen)


def _same(a: DynamicLayer, b: DynamicLayer) -> bool:
    return torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


def test_a_slack_layer_holds_what_a_dynamic_layer_holds() -> None:
    gen = torch.Generator().manual_seed(0)
    ours, ref = SlackLayer(slack=8), DynamicLayer()
    buffers: list[int] = []

    def step(n: int = 1) -> None:
        k_BKTD, v_BKTD = _kv(gen, ours.keys.shape[0] if ours.is_initialized else 3, n)
        got, want = ours.update(k_BKTD, v_BKTD), ref.update(k_BKTD, v_BKTD)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        assert ours._keys_buf is not None
        buffers.append(ours._keys_buf.data_ptr())

    step(5)  # a prefill of 5 positions: a buffer of 5 + 8
    for _ in range(40):
        step()
    assert _same(ours, ref) and ours.get_seq_length() == ref.get_seq_length() == 45
    # the 40 decode steps wrote in place, but for a new buffer once its 8 spare positions were used:
    # the cache was copied 4 times (DynamicLayer: 40)
    assert sum(a != b for a, b in zip(buffers[:-1], buffers[1:], strict=True)) == 40 // 9 == 4
    for layer in (ours, ref):  # the engine's compaction: keep rows 2 and 0
        layer.batch_select_indices(torch.tensor([2, 0]))
    step()
    for layer in (ours, ref):  # the engine's cut of leading padding columns: a view at an offset
        layer.keys, layer.values = layer.keys[:, :, 3:], layer.values[:, :, 3:]
    step()
    step()
    for layer in (ours, ref):
        layer.crop(-2)
    step(3)
    assert _same(ours, ref) and ours.get_seq_length() == 45 + 1 - 3 + 2 - 2 + 3


def test_slack_cache_keeps_sliding_window_layers_as_they_are() -> None:
    dense, _ = load_model(ModelConfig(source="tiny", tiny="dense"))
    cache = slack_cache(dense.config)
    assert all(type(layer) is SlackLayer for layer in cache.layers) and full_attention(cache)
    assert all(type(layer) is DynamicLayer for layer in slack_cache(dense.config, 0).layers)
    sliding = MistralConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, sliding_window=8,
    )  # fmt: skip
    cache = slack_cache(sliding)
    assert not any(type(layer) is SlackLayer for layer in cache.layers) and not full_attention(cache)


def _workload(vocab: int) -> list[GenerateRequest]:
    """Rows of different prompt lengths and ends, more than the batch holds: joins and compactions;
    two rows share a prompt (the prefix cache serves the second)."""
    prompts = [[3 + (7 * i + j) % (vocab - 3) for i in range(n)] for j, n in enumerate((40, 30, 4, 17, 40))]
    prompts[4] = prompts[0]  # admitted while row 0 still runs: its prompt is served from the cache
    maxes = (40, 12, 25, 7, 33)
    return [
        GenerateRequest(p, SamplingParams(temperature=0.0 if j == 3 else 1.0, max_tokens=m, seed=j))
        for j, (p, m) in enumerate(zip(prompts, maxes, strict=True))
    ]


@pytest.mark.parametrize("kind", ["dense", "smollm2"])
@pytest.mark.parametrize("prefix_cache_mb", [0, 16])
def test_the_engine_is_bit_identical_without_a_copy_per_step(kind: str, prefix_cache_mb: int) -> None:
    cfg = ModelConfig(source="smollm2") if kind == "smollm2" else ModelConfig(source="tiny", tiny="dense")
    model, tok = load_model(cfg)
    if kind == "dense":  # larger random weights, so sampled rows do not just repeat a token
        gen = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() == 2:
                    p.normal_(0.0, 0.15, generator=gen)
    reqs = _workload(int(model.get_input_embeddings().num_embeddings))
    results: dict[int, Any] = {}
    stats: dict[int, dict[str, float]] = {}
    for slack in (0, 8):  # 8: buffers refill mid-run, after joins and compactions
        engine = EmbeddedEngine(model, tok, max_batch=3, prefix_cache_mb=prefix_cache_mb, kv_slack=slack)
        results[slack], stats[slack] = engine.generate(reqs), engine.stats
    assert stats[8]["joins"] >= 2 and stats[8]["decode_steps"] == stats[0]["decode_steps"]
    assert (stats[8]["prefix_hits"] > 0) == (prefix_cache_mb > 0)
    for a, b in zip(results[0], results[8], strict=True):
        assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason
        assert a.logprobs == b.logprobs  # bit for bit
    assert len({len(r.token_ids) for r in results[0]}) >= 3  # rows really ended at different steps
