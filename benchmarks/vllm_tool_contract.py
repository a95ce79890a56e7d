"""Tool-call contract probe against vLLM's CPU server (issue 38): vLLM started with Shipyard's Hermes
rendering (`--chat-template`, the filled-in `HERMES_CHATML`) and `--tool-call-parser hermes`; for
each prompt with tools, vLLM's prompt ids are compared with Shipyard's rendering, and Shipyard's
parser is run on vLLM's sampled ids and compared with vLLM's message (content, tool calls, finish).
Needs `.venv-vllm` (`make vllm`); ~3 min. Writes benchmarks/results/vllm_tool_contract.json.

    python benchmarks/vllm_tool_contract.py
"""

import json
import pathlib
import tempfile
import time

import httpx

from shipyard.config.schema import ModelConfig
from shipyard.inference.openai_api import ChatPlan, reply
from shipyard.inference.tools import tool_template
from shipyard.inference.types import GenerateResult
from shipyard.inference.vllm_server import VllmProcess
from shipyard.models.loading import load_tokenizer, smollm2_dir

ROOT = pathlib.Path(__file__).resolve().parents[1]
WORK = pathlib.Path(tempfile.mkdtemp(prefix="shipyard-vllm-tools-"))
tok = load_tokenizer(ModelConfig())
tpl = WORK / "hermes.jinja"
tpl.write_text(tool_template(tok).template)
proc = VllmProcess(
    ROOT / ".venv-vllm/bin/python",
    smollm2_dir("~/.cache/shipyard/models"),
    WORK / "server.log",
    served_name="smollm2",
    dtype="float32",
    max_model_len=2048,
    env={"VLLM_CPU_KVCACHE_SPACE": "2"},
    extra_args=["--chat-template", str(tpl), "--enable-auto-tool-choice", "--tool-call-parser", "hermes"],
).start()
t = time.time()
proc.wait_ready(900)
print("ready", time.time() - t, flush=True)
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "Read a file",
            "parameters": {
                "type": "object",
                "properties": {"path": {"type": "string"}},
                "required": ["path"],
            },
        },
    }
]
prompts = [
    "Read the file a.py",
    "Use read_file to open main.py",
    "What is in config.json? Call the tool.",
    "Say hi",
    "Read notes.txt please",
]
out = []
try:
    for p in prompts:
        for seed in range(3):
            body = {
                "model": "smollm2",
                "messages": [{"role": "user", "content": p}],
                "tools": TOOLS,
                "max_tokens": 60,
                "temperature": 1.0,
                "seed": seed,
                "return_token_ids": True,
            }
            r = httpx.post(f"{proc.url}/v1/chat/completions", json=body, timeout=300).json()
            ch = r["choices"][0]
            ids = ch.get("token_ids")
            ours_prompt = list(
                tok.apply_chat_template(
                    [{"role": "user", "content": p}],
                    tools=TOOLS,
                    chat_template=tool_template(tok).template,
                    add_generation_prompt=True,
                    tokenize=True,
                    return_dict=True,
                )["input_ids"]
            )
            fin = ch["finish_reason"]
            res = GenerateResult(
                ids,
                [0.0] * len(ids),
                [0] * len(ids),
                "eos"
                if fin in ("stop", "tool_calls") and ids and ids[-1] == tok.eos_token_id
                else ("length" if fin == "length" else "stop"),
            )
            msg, f, parsed = reply(tok, res, ChatPlan([], "hermes"))
            vm = ch["message"]
            same_calls = [
                (c["function"]["name"], json.loads(c["function"]["arguments"]))
                for c in (vm.get("tool_calls") or [])
            ] == [
                (c["function"]["name"], json.loads(c["function"]["arguments"]))
                for c in msg.get("tool_calls", [])
            ]
            rec = dict(
                prompt_same=r.get("prompt_token_ids") == ours_prompt,
                calls=len(vm.get("tool_calls") or []),
                same_calls=same_calls,
                content_same=(vm.get("content") or None) == (msg.get("content") or None),
                vfin=fin,
                ofin=f,
            )
            print(p, seed, rec, repr(vm.get("content"))[:80], flush=True)
            out.append(rec)
finally:
    proc.stop()
summary = {
    "requests": len(out),
    "prompt_ids_equal": sum(r["prompt_same"] for r in out),
    "content_equal": sum(r["content_same"] for r in out),
    "tool_calls_equal": sum(r["same_calls"] for r in out),
    "replies_with_calls": sum(r["calls"] > 0 for r in out),
    "finish_equal": sum(r["vfin"] == r["ofin"] for r in out),
    "records": out,
}
(ROOT / "benchmarks/results/vllm_tool_contract.json").write_text(json.dumps(summary, indent=1))
print({k: v for k, v in summary.items() if k != "records"})
