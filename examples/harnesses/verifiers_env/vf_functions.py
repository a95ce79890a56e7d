"""One rollout of one function-writing task, as a `verifiers` v1 environment (verifiers==0.4.0).

Purpose: an environment written with verifiers' own API (``import verifiers.v1 as vf``), run by
Shipyard as the agent program of a session: ``python vf_functions.py`` with a venv holding
verifiers. A ``vf.Taskset`` reads the rows of a JSONL file; a one-shot chat ``vf.Harness`` asks
the model once (no tools) for the function in a ```python block; the task's ``@vf.reward``
(the rubric) runs the row's hidden tests on the last python block of the answer. A
``vf.SingleAgentEnv`` runs one episode with the ``subprocess`` runtime.

Contract: environment variables OPENAI_BASE_URL, OPENAI_API_KEY, SHIPYARD_MODEL (sent as the
model), SHIPYARD_TASK_ID (the row's ``id``), SHIPYARD_REWARD_FILE; optional VF_TASKS (rows
``{"id", "prompt", "entry_point", "hidden_tests"}``, default ``tasks.jsonl`` beside this file,
made by ``export_tasks.py``) and MAX_TOKENS (256; the only sampling parameter sent). Writes
``{"reward": passed/total, "metrics": {"passed", "total"}}`` atomically and exits 0, also for a
garbage answer (reward 0) and for an HTTP 400 from the endpoint (Shipyard's session limit:
reward 0, metric ``endpoint_400``). Exit 2: unknown task id; exit 1: any other failure (no file).

Limits: the tests run as a plain subprocess (10 s for all, a temp dir, ``python -I``): not a
security boundary, and a child the solution spawns holding the output pipe can outlive the timeout.
The one model call goes through verifiers' interception server (aiohttp on a 127.0.0.1 port, so
loopback is needed); nothing else connects: no Prime sandbox/tunnel/CLI, no run upload
(``PRIME_RUNS_MODE=disabled``); runtime scratch in ``~/.cache/verifiers`` (``$HOME`` -> temp dir
if unwritable). Measured: ~4.4 s and ~240 MB RSS per run (2.6 s of it importing verifiers).
"""

import asyncio
import functools
import json
import logging
import os
import re
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

os.environ.setdefault("PRIME_RUNS_MODE", "disabled")  # prime_runs: never track/upload a run
if not os.access(os.path.expanduser("~"), os.W_OK):  # verifiers.v1 fixes CACHE_DIR from $HOME at import
    os.environ["HOME"] = tempfile.gettempdir()

import verifiers.v1 as vf  # noqa: E402
from openai import AsyncOpenAI  # noqa: E402

PLUGIN = Path(__file__).stem  # verifiers resolves taskset/harness ids by importing a module
sys.modules.setdefault(PLUGIN, sys.modules[__name__])
__all__ = ["FnTaskset", "OneShotChat"]
SYSTEM = (
    "You are an expert Python programmer. Reply with the complete function in a single ```python code block."
)
BLOCK = re.compile(r"```(?:python3?|py)?[^\n`]*\n(.*?)```", re.DOTALL)
RUNNER = r"""
import os, sys
nonce = sys.stdin.readline().strip(); sys.stdin.close(); sys.path.insert(0, os.getcwd())
import test_hidden as t
for name in sys.argv[1:]:
    try:
        getattr(t, name)(); ok = True
    except BaseException:
        ok = False
    sys.__stdout__.write(f"{nonce} {name} {ok}\n"); sys.__stdout__.flush()
"""


@functools.lru_cache(maxsize=8)
def run_tests(answer: str, hidden_tests: str, timeout: float = 10.0) -> tuple[int, int]:
    """(passed, total) of the ``test_*`` functions of ``hidden_tests`` on the answer's last code block."""
    names = re.findall(r"^def (test_\w+)\s*\(", hidden_tests, re.MULTILINE)
    blocks = BLOCK.findall(answer)
    if not blocks or not names:
        return 0, len(names)
    nonce = uuid.uuid4().hex
    with tempfile.TemporaryDirectory() as d:
        Path(d, "solution.py").write_text(blocks[-1])
        Path(d, "test_hidden.py").write_text(hidden_tests)
        cmd = [sys.executable, "-I", "-c", RUNNER, *names]
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONDONTWRITEBYTECODE": "1"}
        try:
            out = subprocess.run(
                cmd, cwd=d, env=env, input=nonce + "\n", capture_output=True, text=True, timeout=timeout
            ).stdout
        except subprocess.TimeoutExpired as e:  # keep the tests that finished in time
            out = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else e.stdout or ""
    return sum(line == f"{nonce} {n} True" for line in out.splitlines() for n in names), len(names)


class FnData(vf.TaskData):
    entry_point: str
    hidden_tests: str


class FnTask(vf.Task[FnData]):
    @vf.metric
    async def tests(self, trace: vf.Trace) -> dict[str, float]:
        passed, total = await asyncio.to_thread(run_tests, trace.last_reply, self.data.hidden_tests)
        return {"passed": passed, "total": total}

    @vf.reward(weight=1.0)
    async def pass_rate(self, trace: vf.Trace) -> float:
        passed, total = await asyncio.to_thread(run_tests, trace.last_reply, self.data.hidden_tests)
        return passed / total if total else 0.0


class FnTasksetConfig(vf.TasksetConfig):
    path: str = str(Path(__file__).with_name("tasks.jsonl"))


class FnTaskset(vf.Taskset[FnTask, FnTasksetConfig]):
    def load(self):
        with open(self.config.path) as f:
            for row in map(json.loads, filter(str.strip, f)):
                fields = {k: row[k] for k in ("id", "prompt", "entry_point", "hidden_tests")}
                yield FnTask(FnData(system_prompt=SYSTEM, **fields), self.config.task)


class OneShotChat(vf.Harness[vf.HarnessConfig]):
    """One chat completion, in-process, through the rollout's interception endpoint (the trace)."""

    APPENDS_SYSTEM_PROMPT, EXECUTES_CODE, NEEDS_CONTAINER = True, False, False

    async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data, **_) -> vf.ProgramResult:
        system, prompt = self.resolve_prompt(data)
        messages = [{"role": "system", "content": system}] if system else []
        async with AsyncOpenAI(base_url=endpoint, api_key=secret, max_retries=0) as client:
            reply = await client.chat.completions.create(
                model=ctx.model, messages=[*messages, {"role": "user", "content": prompt}]
            )
        return vf.ProgramResult(exit_code=0, stdout=reply.choices[0].message.content or "", stderr="")


def write_result(path: str, reward: float, metrics: dict) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    Path(tmp).write_text(json.dumps({"reward": reward, "metrics": metrics}))
    os.replace(tmp, path)


async def main() -> int:
    task_id, out = os.environ["SHIPYARD_TASK_ID"], os.environ["SHIPYARD_REWARD_FILE"]
    config = vf.SingleAgentEnvConfig(
        taskset={"id": PLUGIN, "path": os.environ.get("VF_TASKS") or FnTasksetConfig().path},
        agent=vf.AgentConfig(runtime=vf.SubprocessConfig()),  # default is a remote Prime sandbox
    )
    env = vf.load_environment(config)  # SingleAgentEnv; its agent's harness is this module's OneShotChat
    task = next(iter(env.taskset.include(ids=[task_id])), None)
    if task is None:
        print(f"vf_functions: no task with id {task_id!r} in {config.taskset.path}", file=sys.stderr)
        return 2
    ctx = vf.ModelContext(
        model=os.environ.get("SHIPYARD_MODEL", "policy"),
        client=vf.EvalClientConfig(base_url=os.environ["OPENAI_BASE_URL"], api_key_var="OPENAI_API_KEY"),
        sampling=vf.SamplingConfig(max_tokens=int(os.environ.get("MAX_TOKENS", "256"))),
    )
    async with env.serving():
        episode = await env.run_episode(task, ctx)
    trace = episode.traces[-1] if episode.traces else None
    errors = [*episode.errors, *(trace.errors if trace else [])]
    if trace is not None and trace.ok:
        write_result(out, trace.reward, {k: v for k, v in trace.metrics.items() if v is not None})
        return 0
    if any(e.status_code == 400 for e in errors):  # the endpoint refused the call (session limit)
        total = len(re.findall(r"^def test_", task.data.hidden_tests, re.MULTILINE))
        write_result(out, 0.0, {"passed": 0, "total": total, "endpoint_400": 1})
        return 0
    print(f"vf_functions: rollout failed: {[f'{e.type}: {e.message}' for e in errors]}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    sys.exit(asyncio.run(main()))
