"""Tool calling through the real `openai` client against both backends (issue 38): a small model
taught a Hermes tool call is served by the embedded server and by vLLM's CPU server (started with
Shipyard's Hermes template, ``--enable-auto-tool-choice --tool-call-parser hermes``); the same
requests with ``tools`` get the same tool calls, the same answer after the tool's result, and the
same prompt ids from both. Needs `.venv-vllm` (`make vllm`); skipped without it, and says so.

The model is SmolLM2's tokenizer on a 2-layer Llama with 64-wide heads (the tiny test model's
16-wide heads are not a size vLLM's CPU attention serves), taught the two replies of
``tests/conftest.py`` (:func:`tool_examples`).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import torch
from tests.conftest import DONE, TOOLS, teach, tool_examples

from shipyard.config.schema import ModelConfig
from shipyard.inference.backends.vllm_server import VllmProcess
from shipyard.inference.engine.engine import EmbeddedEngine
from shipyard.inference.serving.server import InferenceServer
from shipyard.inference.serving.tools import tool_template
from shipyard.models.loading import load_tokenizer

ROOT = Path(__file__).resolve().parents[2]
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
USER = [{"role": "user", "content": "Look at a.py"}]

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not VLLM_PYTHON.is_file(),
        reason="vLLM tool tests need .venv-vllm (`make vllm`; .ci/run builds it unless SHIPYARD_CI_VLLM=0)",
    ),
]


@pytest.fixture(scope="module")
def taught_dir(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any, Any]:
    """The taught model saved as an HF directory (with its tokenizer), and the model itself."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    tok = load_tokenizer(ModelConfig())
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
    )
    model = teach(AutoModelForCausalLM.from_config(config, dtype=torch.float32), tok, tool_examples(tok), 90)
    out = tmp_path_factory.mktemp("taught")
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out, model, tok


@pytest.fixture(scope="module")
def clients(taught_dir: tuple[Path, Any, Any]) -> Iterator[dict[str, openai.OpenAI]]:
    """The `openai` client of each backend serving the taught model."""
    model_dir, model, tok = taught_dir
    (model_dir / "hermes.jinja").write_text(tool_template(tok).template)
    proc = VllmProcess(
        VLLM_PYTHON,
        model_dir,
        model_dir / "vllm.log",
        served_name="taught",
        dtype="float32",
        max_model_len=1024,
        extra_args=[
            "--chat-template",
            str(model_dir / "hermes.jinja"),
            "--enable-auto-tool-choice",
            "--tool-call-parser",
            "hermes",
            "--enforce-eager",  # a 2-layer model: compiling it would be most of the start
        ],
        env={"VLLM_CPU_KVCACHE_SPACE": "1"},
    ).start()
    try:
        proc.wait_ready(900)
        with InferenceServer(EmbeddedEngine(model, tok, max_batch=4), model_name="taught") as ours:
            kw = {"api_key": "unused", "max_retries": 0, "timeout": 300}
            yield {
                "embedded": openai.OpenAI(base_url=f"{ours.url}/v1", **kw),
                "vllm": openai.OpenAI(base_url=f"{proc.url}/v1", **kw),
            }
    finally:
        proc.stop()


def _ask(name: str, client: openai.OpenAI, messages: list[dict[str, Any]]) -> Any:
    """A greedy request with the tool; vLLM is asked for its prompt ids (the embedded server always
    sends them, under ``shipyard``)."""
    extra = {"return_token_ids": True} if name == "vllm" else None
    return client.chat.completions.create(
        model="taught", messages=messages, tools=TOOLS, temperature=0, max_tokens=40, extra_body=extra
    ).model_dump()


def test_both_backends_call_the_tool_then_answer_alike(clients: dict[str, openai.OpenAI]) -> None:
    firsts = {name: _ask(name, c, USER) for name, c in clients.items()}
    calls = {}
    for name, answer in firsts.items():
        choice = answer["choices"][0]
        [call] = choice["message"]["tool_calls"]
        assert choice["finish_reason"] == "tool_calls", (name, choice)
        assert not choice["message"]["content"], (name, choice["message"])
        calls[name] = (call["function"]["name"], json.loads(call["function"]["arguments"]))
    assert calls["embedded"] == calls["vllm"] == ("read_file", {"path": "a.py"})
    # the prompt both rendered from the same messages and tools: the same ids
    vllm_prompt = firsts["vllm"]["prompt_token_ids"]
    assert vllm_prompt and vllm_prompt == firsts["embedded"]["shipyard"]["prompt_token_ids"]
    # the tool's result sent back as clients do (the assistant turn with tool_calls re-serialized)
    seconds = {}
    for name, c in clients.items():
        message = firsts[name]["choices"][0]["message"]
        call = message["tool_calls"][0]
        history = [
            *USER,
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": call["id"], "content": "print(1)"},
        ]
        seconds[name] = _ask(name, c, history)["choices"][0]
    assert seconds["embedded"]["message"]["content"] == seconds["vllm"]["message"]["content"] == DONE
    assert seconds["embedded"]["finish_reason"] == seconds["vllm"]["finish_reason"] == "stop"
    assert not seconds["vllm"]["message"]["tool_calls"] and not seconds["embedded"]["message"]["tool_calls"]


def test_streamed_tool_calls_agree_across_backends(clients: dict[str, openai.OpenAI]) -> None:
    got = {}
    for name, c in clients.items():
        calls: dict[int, dict[str, str]] = {}
        content, finish = "", None
        stream = c.chat.completions.create(
            model="taught", messages=USER, tools=TOOLS, temperature=0, max_tokens=40, stream=True
        )
        for chunk in stream:
            for ch in chunk.choices:
                content += ch.delta.content or ""
                finish = ch.finish_reason or finish
                for tc in ch.delta.tool_calls or []:  # vLLM streams arguments in pieces
                    slot = calls.setdefault(tc.index, {"name": "", "arguments": ""})
                    slot["name"] += (tc.function and tc.function.name) or ""
                    slot["arguments"] += (tc.function and tc.function.arguments) or ""
        got[name] = (
            content.strip(),
            finish,
            [(v["name"], json.loads(v["arguments"])) for v in calls.values()],
        )
    assert got["embedded"] == got["vllm"] == ("", "tool_calls", [("read_file", {"path": "a.py"})])
