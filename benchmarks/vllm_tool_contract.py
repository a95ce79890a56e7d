"""Tool-call contract probe against vLLM's CPU server (issue 38): vLLM started with Shipyard's Hermes
rendering (`--chat-template`, the filled-in `HERMES_CHATML`) and `--tool-call-parser hermes`; for
each prompt with tools, vLLM's prompt ids are compared with the embedded server's (the same
`chat_requests`), and Shipyard's parser is run on vLLM's sampled ids and compared with vLLM's
message (content, tool calls, finish). Needs `.venv-vllm` (`make vllm`); ~3 min. Writes
benchmarks/results/vllm_tool_contract.json.

    python benchmarks/vllm_tool_contract.py [--policy runs/warm/mini_swe]

``--policy DIR`` serves that HF directory instead (the warm-started policy, which calls tools),
asks it the way mini-swe-agent does (its system prompt, 5 held-out function tasks, its ``bash``
tool, 160 tokens) and merges its figures under ``policy`` in the same results file, so the
tool-call branches of both parsers are compared on replies that do call.
"""

import argparse
import json
import pathlib
import tempfile
import time
from typing import Any

import httpx

from shipyard.agent.session import first_message
from shipyard.config import load_config
from shipyard.config.schema import ModelConfig
from shipyard.envs.tasks.splits import heldout_tasks
from shipyard.inference.backends.vllm_server import VllmProcess
from shipyard.inference.serving.openai_api import ChatCompletionBody, chat_requests, reply
from shipyard.inference.serving.tools import tool_template
from shipyard.inference.types import GenerateResult
from shipyard.models.loading import load_tokenizer, smollm2_dir

ROOT = pathlib.Path(__file__).resolve().parents[1]
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
PROMPTS = [
    "Read the file a.py",
    "Use read_file to open main.py",
    "What is in config.json? Call the tool.",
    "Say hi",
    "Read notes.txt please",
]
SEEDS = 3


BASH = {
    "type": "function",
    "function": {
        "name": "bash",
        "description": "Execute a bash command",
        "parameters": {
            "type": "object",
            "properties": {"command": {"type": "string", "description": "The bash command to execute"}},
            "required": ["command"],
        },
    },
}
"""mini-swe-agent's one tool (minisweagent.models.utils.actions_toolcall.BASH_TOOL)."""
MINI_SYSTEM = "You are a helpful assistant that can interact with a computer."


def start_vllm(tok: Any, work: pathlib.Path, model_dir: pathlib.Path) -> VllmProcess:
    """vLLM's server with Shipyard's tool template and the hermes parser, ready."""
    template = work / "hermes.jinja"
    template.write_text(tool_template(tok).template)
    proc = VllmProcess(
        ROOT / ".venv-vllm/bin/python",
        model_dir,
        work / "server.log",
        served_name="smollm2",
        dtype="float32",
        max_model_len=2048,
        env={"VLLM_CPU_KVCACHE_SPACE": "2"},
        extra_args=[
            "--chat-template",
            str(template),
            "--enable-auto-tool-choice",
            "--tool-call-parser",
            "hermes",
        ],
    ).start()
    t0 = time.time()
    proc.wait_ready(900)
    print(f"vLLM ready in {time.time() - t0:.0f} s", flush=True)
    return proc


def _calls(message: dict[str, Any]) -> list[tuple[str, Any]]:
    return [
        (c["function"]["name"], json.loads(c["function"]["arguments"]))
        for c in message.get("tool_calls") or []
    ]


def compare(
    url: str, tok: Any, messages: list[dict[str, str]], seed: int, tools: list[Any], max_tokens: int
) -> dict[str, Any]:
    """One request with tools to vLLM, checked against the embedded server's prompt and parser."""
    body = {"model": "smollm2", "messages": messages, "tools": tools, "max_tokens": max_tokens}
    [ours], plan = chat_requests(ChatCompletionBody(**body), tok, "smollm2", 2048, 1)
    answer = httpx.post(
        f"{url}/v1/chat/completions",
        json={**body, "temperature": 1.0, "seed": seed, "return_token_ids": True},
        timeout=300,
    ).json()
    choice = answer["choices"][0]
    ids, finish = choice["token_ids"], choice["finish_reason"]
    ended = "eos" if ids and ids[-1] == tok.eos_token_id else ("length" if finish == "length" else "stop")
    message, our_finish, _ = reply(tok, GenerateResult(ids, [0.0] * len(ids), [0] * len(ids), ended), plan)
    theirs = choice["message"]
    return {
        "prompt_same": answer.get("prompt_token_ids") == ours.prompt_ids,
        "calls": len(theirs.get("tool_calls") or []),
        "same_calls": _calls(theirs) == _calls(message),
        "content_same": (theirs.get("content") or None) == (message.get("content") or None),
        "vfin": finish,
        "ofin": our_finish,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--policy", default="", help="an HF directory to serve instead of SmolLM2 (module doc)")
    args = ap.parse_args()
    tok = load_tokenizer(ModelConfig())
    if args.policy:
        cfg = load_config(str(ROOT / "configs/mini_swe.toml"))
        asks = [
            [{"role": "system", "content": MINI_SYSTEM}, {"role": "user", "content": first_message(t)}]
            for t in heldout_tasks(cfg, "function", 5)
        ]
        model_dir, tools, max_tokens = ROOT / args.policy, [BASH], 160
    else:
        asks = [[{"role": "user", "content": p}] for p in PROMPTS]
        model_dir, tools, max_tokens = smollm2_dir("~/.cache/shipyard/models"), TOOLS, 60
    proc = start_vllm(tok, pathlib.Path(tempfile.mkdtemp(prefix="shipyard-vllm-tools-")), model_dir)
    records = []
    try:
        for messages in asks:
            for seed in range(SEEDS):
                records.append(compare(proc.url, tok, messages, seed, tools, max_tokens))
                print(messages[-1]["content"][:60], seed, records[-1], flush=True)
    finally:
        proc.stop()
    summary = {
        "requests": len(records),
        "prompt_ids_equal": sum(r["prompt_same"] for r in records),
        "content_equal": sum(r["content_same"] for r in records),
        "tool_calls_equal": sum(r["same_calls"] for r in records),
        "replies_with_calls": sum(r["calls"] > 0 for r in records),
        "finish_equal": sum(r["vfin"] == r["ofin"] for r in records),
        "records": records,
    }
    path = ROOT / "benchmarks/results/vllm_tool_contract.json"
    if args.policy:
        current = json.loads(path.read_text()) if path.exists() else {}
        summary = {**current, "policy": {"dir": args.policy, **summary}}
    path.write_text(json.dumps(summary, indent=1))
    shown = summary["policy"] if args.policy else summary
    print({k: v for k, v in shown.items() if k != "records"})


if __name__ == "__main__":
    main()
