"""The embedded engine on a GPU (``inference.device = "cuda"``) against the same engine on the CPU.

Contract checked: on CUDA, greedy generation over a batch whose rows finish at different steps
(compaction), admit late (joins) and extend cached prefixes (the prefix cache, one padded forward
for several hits) gives the CPU engine's tokens, with logprobs within 1e-3 (fp32 on both; the GPU's
kernels sum in another order); a weight delta staged as flat positions applies on the GPU and
changes the tokens exactly as on the CPU. Without CUDA (CI) these tests skip; what runs everywhere
is the clear error for a config that asks for a GPU this machine does not have.

Shape legend: V = vocabulary.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch

from shipyard.config import load_config
from shipyard.config.schema import ModelConfig
from shipyard.inference.engine.engine import EmbeddedEngine
from shipyard.inference.types import GenerateRequest, SamplingParams
from shipyard.models.loading import load_model

ROOT = Path(__file__).resolve().parents[2]
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [100, 200, 300], [42, 17, 99, 1000, 2000, 3000, 4, 8], [7, 7]]


def _pair() -> tuple[EmbeddedEngine, EmbeddedEngine]:
    """The same lively tiny model as a CPU engine and a CUDA engine, prefix caches on."""
    model, tok = load_model(ModelConfig(source="tiny", tiny="dense"))
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.15, generator=gen)
    on_gpu = copy.deepcopy(model).to("cuda")
    return (
        EmbeddedEngine(model, tok, max_batch=3, prefix_cache_mb=64),
        EmbeddedEngine(on_gpu, tok, max_batch=3, prefix_cache_mb=64),
    )


def _same(cpu: list[Any], gpu: list[Any]) -> None:
    for c, g in zip(cpu, gpu, strict=True):
        assert c.token_ids == g.token_ids
        assert max(abs(a - b) for a, b in zip(c.logprobs, g.logprobs, strict=True)) < 1e-3


@cuda
def test_the_engine_on_a_gpu_samples_what_it_samples_on_the_cpu() -> None:
    cpu, gpu = _pair()
    # 4 prompts, 3 slots, different lengths: rows finish apart (compaction) and one joins late
    turn1 = [
        GenerateRequest(p, SamplingParams(temperature=0.0, max_tokens=4 + 3 * i))
        for i, p in enumerate(PROMPTS)
    ]
    first_c, first_g = cpu.generate(turn1), gpu.generate(turn1)
    _same(first_c, first_g)
    assert gpu.stats["joins"] > 0 and gpu.stats["compactions"] > 0
    # next turns extend the cached sequences: prefix hits, prefilled together
    turn2 = [
        GenerateRequest(q.prompt_ids + r.token_ids + [17, 18], SamplingParams(temperature=0.0, max_tokens=5))
        for q, r in zip(turn1, first_c, strict=True)
    ]
    _same(cpu.generate(turn2), gpu.generate(turn2))
    assert gpu.stats["prefix_hits"] == cpu.stats["prefix_hits"] > 0


@cuda
def test_a_weight_delta_applies_on_the_gpu_as_on_the_cpu() -> None:
    cpu, gpu = _pair()
    name, param = [(n, p) for n, p in cpu.model.named_parameters() if n.endswith("down_proj.weight")][-1]
    positions = torch.arange(0, param.numel(), 7)
    values = torch.randn(len(positions), generator=torch.Generator().manual_seed(1))
    new = param.detach().clone().reshape(-1)
    new[positions] = values
    for engine in (cpu, gpu):
        engine.stage_weights(1, {name: new.reshape(param.shape)}, positions={name: positions})
        engine.apply_pending()
    assert torch.equal(gpu.model.get_parameter(name).cpu(), cpu.model.get_parameter(name))
    reqs = [GenerateRequest(p, SamplingParams(temperature=0.0, max_tokens=6)) for p in PROMPTS]
    after_c, after_g = cpu.generate(reqs), gpu.generate(reqs)
    _same(after_c, after_g)
    assert all(v == 1 for r in after_g for v in r.versions)


def test_a_gpu_engine_on_a_machine_without_one_is_refused_naming_the_setting(tmp_path: Path) -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    from shipyard.inference.backends.embedded import EmbeddedNode
    from shipyard.store import LocalStore

    cfg = load_config(ROOT / "configs" / "tiny.toml", ["inference.device=cuda"])
    with pytest.raises(ValueError, match=r"inference.device = 'cuda'.*use 'cpu'"):
        EmbeddedNode(cfg, LocalStore(tmp_path))
