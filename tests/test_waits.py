"""No wait in Shipyard is unbounded without a stated reason (issue 40): an audit of every call in
``src/shipyard`` that can block forever, which fails when a new one appears.

What counts as an unbounded wait: ``subprocess.run/check_output/check_call/call`` without
``timeout``; ``ray.get``/``ray.wait`` (also as ``self.ray``) without ``timeout``; ``.join()``, ``.wait()`` and
``.result()`` with no argument (threads, processes, conditions, events, futures); any call given
``timeout=None``. HTTP clients are not listed: httpx bounds every request by default (5 s) and
Shipyard's clients pass their own deadlines; a ``timeout=None`` passed to one is caught above.

Each allowed wait is keyed ``path:function:call`` with the reason it ends; an entry that no longer
matches a wait fails too, so the list stays what the code does.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "shipyard"

BLOCKING_SUBPROCESS = {"run", "check_output", "check_call", "call"}
BLOCKING_METHODS = {"join", "wait", "result"}

_REAPED = "reaps a process the line before SIGKILLed (the kernel ends it)"
_LOCAL_FUTURE = "a job of a local thread pool whose own calls have deadlines (store, HTTP, sandbox)"
ALLOWED: dict[str, str] = {
    "agent/harness/relay.py:forward:back.join()": "the pump ends when either socket closes, and the "
    "sandbox's process (the relay's parent) is killed at the session's deadline",
    "envs/sandbox/bwrap.py:_exec_once:proc.wait()": _REAPED,
    "envs/sandbox/session.py:kill:self.proc.wait()": _REAPED,
    "fleet/region.py:stop:self.proc.wait()": _REAPED,
    "envs/sandbox/pool.py:_fill_loop:self._cond.wait()": "the filler's idle wait; close() notifies it",
    "online/buffer.py:_run:self._cond.wait()": "the writer's idle wait; close() notifies it",
    "envs/sandbox/pool.py:close:self._filler.join()": "the filler exits once closed (its creates have "
    "the sandbox's deadlines)",
    "envs/sandbox/pool.py:adopt:self._spawner.submit(self._checked_create, factory).result()": _LOCAL_FUTURE,
    "envs/sandbox/pool.py:acquire:self._spawner.submit(self._checked_create, self._factory).result()": (
        _LOCAL_FUTURE
    ),
    "inference/backends/embedded.py:__init__:pool.submit(build_engine, cfg).result()": "the engine's "
    "build (loading the weights), moved to a thread that exits so the batcher is the one OpenMP thread; "
    "as long as building it on the caller's thread, which has no deadline either",
    "inference/engine/scheduler.py:generate:self.submit(requests).result()": "the engine's loop answers "
    "every request (the watchdog watches its decode steps)",
    "inference/serving/server.py:_results:waiting.result()": "awaited with the client's disconnect as a "
    "cancel (an HTTP client's deadline ends it)",
    "inference/serving/server.py:finished:fut.result()": "called when the future is done",
    "orchestrate/local.py:trainer_result:self._trainer.join()": "the trainer thread, watched by the "
    "watchdog (a stall ends the run before this is reached)",
    "orchestrate/midtrain.py:run_midtrain:ray.get": "the midtraining run itself: as long as its steps",
    "orchestrate/ray_placement.py:trainer_result:self.ray.get": "the trainer group's results, asked once "
    "a rank has ended (the others end with it: a rank's failure breaks the group's collectives)",
    "rollout/worker.py:play_batch:j.result()": "a session: bounded by its harness's timeout and the "
    "watchdog's worker deadline",
    "rollout/worker.py:_run_streaming:f.result()": "called on finished sessions only",
    "store/transfer.py:_run_all:fut.result()": _LOCAL_FUTURE,
    "trainer/step.py:train_step:mismatch.result()": "a local computation on the step's own tensors",
    "weights/publisher.py:finish:fut.result()": _LOCAL_FUTURE,
    "weights/publisher.py:_ordered_map:window.pop(0).result()": _LOCAL_FUTURE,
    "weights/publisher.py:_ordered_map:fut.result()": _LOCAL_FUTURE,
    "weights/relay.py:_step:self._decoder.submit(self.reader.apply, *args).result()": "a local decode "
    "of shards already fetched",
    "weights/versions.py:_take_prefetched:fut.result()": _LOCAL_FUTURE,
}


def unbounded_waits(path: Path) -> list[str]:
    """``path:function:call`` of every unbounded wait in ``path`` (module docstring)."""
    rel = str(path.relative_to(SRC)) if path.is_relative_to(SRC) else path.name
    out: list[str] = []

    def visit(node: ast.AST, function: str) -> None:
        for child in ast.iter_child_nodes(node):
            inner = child.name if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef) else function
            if isinstance(child, ast.Call) and (what := _unbounded(child)):
                out.append(f"{rel}:{function}:{what}")
            visit(child, inner)

    visit(ast.parse(path.read_text()), "<module>")
    return out


def _unbounded(call: ast.Call) -> str:
    f = call.func
    name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
    base = ast.unparse(f.value) if isinstance(f, ast.Attribute) else ""
    keywords = {k.arg for k in call.keywords}
    if any(
        k.arg == "timeout" and isinstance(k.value, ast.Constant) and k.value.value is None
        for k in call.keywords
    ):
        return f"{ast.unparse(f)}(timeout=None)"
    if base == "subprocess" and name in BLOCKING_SUBPROCESS and "timeout" not in keywords:
        return f"subprocess.{name}"
    if (base == "ray" or base.endswith(".ray")) and name in ("get", "wait") and "timeout" not in keywords:
        return f"{base}.{name}"
    if name in BLOCKING_METHODS and not call.args and not call.keywords:
        return f"{base}.{name}()"
    return ""


def test_every_unbounded_wait_has_a_reason() -> None:
    found = [w for path in sorted(SRC.rglob("*.py")) for w in unbounded_waits(path)]
    new = [w for w in found if w not in ALLOWED]
    assert not new, (
        "unbounded waits (give them a deadline, or add them to ALLOWED with the reason they end):\n"
        + "\n".join(new)
    )
    gone = sorted(set(ALLOWED) - set(found))
    assert not gone, f"ALLOWED entries that match no wait any more (drop them): {gone}"


def test_the_audit_sees_each_kind_of_wait(tmp_path: Path) -> None:
    code = tmp_path / "waits.py"
    code.write_text(
        "import subprocess, ray\n"
        "def f(t, fut, proc, client):\n"
        "    subprocess.run(['true'])\n"
        "    subprocess.run(['true'], timeout=5)\n"
        "    ray.get(x)\n"
        "    self.ray.wait(refs)\n"
        "    t.join()\n"
        "    t.join(5)\n"
        "    fut.result()\n"
        "    proc.wait(timeout=1)\n"
        "    client.get('/x', timeout=None)\n"
    )
    assert unbounded_waits(code) == [
        "waits.py:f:subprocess.run",
        "waits.py:f:ray.get",
        "waits.py:f:self.ray.wait",
        "waits.py:f:t.join()",
        "waits.py:f:fut.result()",
        "waits.py:f:client.get(timeout=None)",
    ]
