"""Inference backends without a vLLM server (these run in CI): the switch on `inference.type`, the
config errors, the vLLM client's request and response mapping (on a response recorded from vLLM
0.32's `/inference/v1/generate`), and the worker extension's mirror sink driven by the real weight
subscriber over a real store, reloading into a real model (`tests/inference/test_vllm_backend.py`
runs the same inside vLLM)."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from shipyard.config.schema import ModelConfig, ShipyardConfig
from shipyard.inference.backends.base import open_client
from shipyard.inference.backends.vllm import moe_layout, routes_wanted, vllm_model_dir
from shipyard.inference.backends.vllm_server import VllmClient, generate_body, parse_choice, versions_of
from shipyard.inference.backends.vllm_worker import MirrorSink, _checkpoint_parts, readable_match, reload_set
from shipyard.inference.client import HttpInferenceClient
from shipyard.inference.types import GenerateRequest, SamplingParams
from shipyard.models.loading import build_tiny
from shipyard.store.run import claim_run
from shipyard.weights.publisher import WeightPublisher, named_params
from shipyard.weights.states import tensor_digest
from shipyard.weights.subscriber import WeightSubscriber
from shipyard.weights.types import state_digest

# one choice of a real vLLM 0.32 response (max_tokens 3, stop " the", logprobs 1), versions 0 then 1
CHOICE = {
    "index": 0,
    "finish_reason": "stop",
    "stop_reason": " the",
    "token_ids": [13168, 44894, 260],
    "weight_versions": [{"version": "0", "start": 0, "end": 1}, {"version": "1", "start": 1, "end": 3}],
    "logprobs": {
        "content": [
            {
                "token_id": 13168,
                "logprob": -8.59,
                "top_logprobs": [{"token_id": 13168, "logprob": -8.59}, {"token_id": 11, "logprob": -0.2}],
            },
            {
                "token_id": 44894,
                "logprob": -0.006,
                "top_logprobs": [
                    {"token_id": 44894, "logprob": -0.006},
                    {"token_id": 44894, "logprob": -0.006},
                ],
            },
            {
                "token_id": 260,
                "logprob": -1.5,
                "top_logprobs": [{"token_id": 260, "logprob": -1.5}, {"token_id": 7, "logprob": -0.9}],
            },
        ]
    },
}


def test_the_backend_switch_and_its_config_errors() -> None:
    assert isinstance(open_client(ShipyardConfig(), "http://127.0.0.1:1"), HttpInferenceClient)
    cfg = ShipyardConfig.model_validate({"inference": {"type": "vllm"}})
    client = open_client(cfg, "http://127.0.0.1:1")
    assert isinstance(client, VllmClient) and client.served_name == "policy"
    client.close()
    with pytest.raises(ValueError, match="inference.vllm.url attaches to one server"):
        ShipyardConfig.model_validate(
            {"inference": {"type": "vllm", "num_servers": 2, "vllm": {"url": "http://127.0.0.1:8000"}}}
        )


def test_request_and_response_mapping() -> None:
    req = GenerateRequest(
        [1, 2, 3], SamplingParams(temperature=0.7, max_tokens=3, stop=[" the"], top_logprobs=1)
    )
    body = generate_body(req, "policy", n=4)
    assert body["token_ids"] == [1, 2, 3] and body["model"] == "policy"
    sp = body["sampling_params"]
    assert (sp["n"], sp["max_tokens"], sp["temperature"], sp["stop"], sp["logprobs"]) == (
        4,
        3,
        0.7,
        [" the"],
        1,
    )
    assert sp["include_stop_str_in_output"] is True and "seed" not in sp and "ignore_eos" not in sp
    fixed = GenerateRequest([1], SamplingParams(max_tokens=8, ignore_eos=True))
    assert generate_body(fixed, "policy")["sampling_params"]["ignore_eos"] is True
    res = parse_choice(CHOICE, req)
    assert res.token_ids == [13168, 44894, 260] and res.logprobs == [-8.59, -0.006, -1.5]
    assert res.versions == [0, 1, 1] and res.finish_reason == "stop"
    assert res.top_logprobs == [[(11, -0.2)], [(44894, -0.006)], [(7, -0.9)]]
    assert versions_of([{"version": "default", "start": 0, "end": 2}], 2) == [0, 0]
    with pytest.raises(ValueError, match="penalties or logit_bias"):
        generate_body(GenerateRequest([1], SamplingParams(frequency_penalty=0.1)), "policy")


def test_mirror_sink_adopts_deltas_into_a_model(tmp_path: Path) -> None:
    store = claim_run(
        ShipyardConfig().store.model_copy(update={"root": str(tmp_path / "s")}), "m", tmp_path / "r"
    )
    trainer, served = build_tiny("dense", 512, 0), build_tiny("dense", 512, 0)
    pub = WeightPublisher(store, snapshot_every=10)
    pub.publish(0, named_params(trainer))
    mirror = {k: t.clone() for k, t in named_params(served).items()}
    reloads: list[int] = []

    def reload(items) -> None:  # the reload target is a real model, as vLLM's is
        missing, unexpected = served.load_state_dict(dict(items), strict=False)
        assert missing == ["lm_head.weight"] and unexpected == []  # tied to the embedding
        reloads.append(1)

    sink = MirrorSink(mirror, reload)
    sub = WeightSubscriber(store, sink, name="mirror", cache_dir=tmp_path / "cache")
    opt = torch.optim.AdamW(trainer.parameters(), lr=1e-3)
    for v in (1, 2):
        ids = torch.randint(0, 512, (2, 8), generator=torch.Generator().manual_seed(v))
        trainer(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
        manifest = pub.publish(v, named_params(trainer))
        t = threading.Thread(target=sub.poll_once)
        t.start()  # the subscriber stages and waits, as inside vLLM, until the engine applies
        while sink.pending() != v:
            assert t.is_alive() or sink.version() == v
        done = sink.apply()
        t.join()
        assert done is not None and done["version"] == v == sink.version() and sink.apply() is None
    assert state_digest({k: tensor_digest(t) for k, t in mirror.items()}) == manifest.state_digest
    assert all(torch.equal(p, trainer.state_dict()[k]) for k, p in served.state_dict().items())
    assert len(reloads) == 2 and [e["path"] for e in sub.adopted] == [["1:delta"], ["2:delta"]]
    assert readable_match(served, mirror) == {"compared": len(mirror), "equal": len(mirror), "packed": 0}


def test_fused_parameter_names() -> None:
    mirror = {f"model.layers.0.self_attn.{p}.weight": torch.zeros(1) for p in ("q_proj", "k_proj", "v_proj")}
    assert _checkpoint_parts("model.layers.0.self_attn.qkv_proj.weight", mirror) == list(mirror)
    assert _checkpoint_parts("model.layers.0.mlp.gate_up_proj.weight", mirror) is None


def test_reload_set_takes_whole_layers() -> None:
    names = [f"model.layers.{i}.{p}.weight" for i in (0, 1) for p in ("self_attn.q_proj", "mlp.up_proj")]
    mirror = {n: torch.zeros(1) for n in ["model.embed_tokens.weight", *names, "model.norm.weight"]}
    assert reload_set({"model.layers.1.mlp.up_proj.weight": 0}, mirror) == names[2:]
    assert reload_set({"model.norm.weight": 0}, mirror) == ["model.norm.weight"]


def test_policies_shipyard_builds_are_exported_once_for_vllm(tmp_path: Path) -> None:
    """vLLM loads a directory: a tiny MoE (or an upcycled or mid-trained policy) is saved once, with the
    layout of its MoE layers read back from its config."""
    cfg = ModelConfig(source="tiny", tiny="moe", cache_dir=str(tmp_path))
    first = vllm_model_dir(cfg)
    assert (first / "model.safetensors").is_file() and (first / "tokenizer.json").is_file()
    assert vllm_model_dir(cfg) == first and vllm_model_dir(cfg.model_copy(update={"seed": 1})) != first
    assert moe_layout(first) == ([0, 1], 8)
    mixtral = vllm_model_dir(cfg.model_copy(update={"tiny": "mixtral"}))
    deepseek = vllm_model_dir(cfg.model_copy(update={"tiny": "deepseek_v3"}))
    assert moe_layout(mixtral) == ([0, 1], 8) and moe_layout(deepseek) == ([1, 2], 8)
    assert moe_layout(vllm_model_dir(cfg.model_copy(update={"tiny": "dense"}))) is None


def test_routes_of_an_moe_choice() -> None:
    """vLLM's documented routed_experts: base64 `.npy` of [prompt + generated - 1, MoE layers, k]."""
    import base64
    import io

    import numpy as np

    from shipyard.models.routes import decode_routes

    ids_NLK = np.array([[[0, 3], [1, 2]], [[3, 1], [0, 2]], [[2, 0], [1, 3]]], dtype=np.int32)
    buf = io.BytesIO()
    np.save(buf, ids_NLK)
    choice = {**CHOICE, "routed_experts": base64.b64encode(buf.getvalue()).decode()}
    req = GenerateRequest([5], SamplingParams(max_tokens=3))
    res = parse_choice(choice, req, moe=([1, 3], 4))
    assert res.routes is not None and res.routes["layers"] == [1, 3] and res.routes["experts"] == 4
    assert (decode_routes(res.routes) == ids_NLK).all() and parse_choice(CHOICE, req).routes is None
    with pytest.raises(ValueError, match="--enable-return-routed-experts"):
        parse_choice(CHOICE, req, moe=([1, 3], 4))
    cfg = ShipyardConfig.model_validate({"inference": {"type": "vllm", "vllm": {"return_routes": True}}})
    with pytest.raises(ValueError, match="return_routes = true, but the policy has no MoE layers"):
        routes_wanted(cfg)
