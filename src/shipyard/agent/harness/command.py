"""A command harness: any program, started once per session inside the session's sandbox.

Contract: :class:`CommandHarness` plays a session by running ``harness.command`` with
``/bin/sh -c`` in a fresh bubblewrap sandbox over the task's workspace (``/workspace``, the working
directory), with ``harness.timeout_s`` of wall time; the program and everything it starts are
killed when the command ends or the time is up. The sandbox has no network but its own loopback;
the only socket it can reach is its session endpoint's (:class:`~shipyard.agent.endpoint.SessionEndpoint`
on a unix socket in a host directory bound at ``/shipyard``), which :mod:`.relay` serves on
``127.0.0.1:8000`` inside. The program gets ``OPENAI_BASE_URL`` (``http://127.0.0.1:8000/v1``),
``OPENAI_API_KEY`` (the endpoint's key), ``SHIPYARD_MODEL``, ``SHIPYARD_TASK`` (the task's first
message, as the built-in harness words it, also in the file ``SHIPYARD_TASK_FILE``),
``SHIPYARD_TASK_ID``, ``SHIPYARD_WORKSPACE``, ``SHIPYARD_REWARD_FILE`` and ``harness.env``;
``harness.files`` (the harness's own code and configuration) is copied to ``/shipyard/harness``
for each session, and ``harness.venv`` (its installed packages) is bound read-only with its
``bin`` first on PATH. When it ends, the workspace's files are graded by the session's grader in
a fresh sandbox (``spec.bench.grade``: the task's hidden tests, reward components, anti-cheat),
or with ``harness.reward = "harness"`` the reward is the one the harness wrote
(:func:`harness_reward`); the endpoint's calls become the session's segments.

Outcomes (``finish``; reward 0 and ``reward_info["reason"]`` for every one but ``done``):
``done`` (exit 0, graded), ``timeout`` (killed at ``harness.timeout_s``), ``harness_error``
(non-zero exit: also ``error``, so its tokens are not trained), ``no_calls`` (it never called the
model: one environment-only trajectory of the task's prompt). ``grade["harness"]`` keeps the
exit code, the wall time, the tails of stdout and stderr and the refused calls.

Limits: function tasks only (repo and db tasks need their own sandboxes, services and binds:
a session of another kind comes back as an error naming it); bubblewrap sandboxes only.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import sys
import tempfile
import time
import traceback
from contextlib import closing
from typing import Any

from shipyard.agent.endpoint import SessionEndpoint
from shipyard.agent.session import (
    SessionSpec,
    files_diff,
    first_message,
    grade_record,
    workspace_files,
)
from shipyard.agent.types import Trajectory
from shipyard.config.schema import HarnessConfig, SandboxConfig
from shipyard.envs.sandbox import make_sandbox
from shipyard.envs.types import ExecResult, RewardResult, Task

INSIDE = "/shipyard"
"""Where the session's host directory (endpoint socket, relay, task file) is bound in the sandbox."""
PORT = 8000
"""The relay's port on the sandbox's own loopback."""
REWARD_FILE = "reward.json"
"""Where a ``harness.reward = "harness"`` harness writes its reward, in ``/shipyard``."""
_SANDBOX_PATH = "/usr/local/bin:/usr/bin:/bin"
"""The rest of the harness's PATH after ``harness.venv``'s ``bin``."""
TAIL = 2000
"""Characters of the harness's stdout and stderr kept in ``grade["harness"]``."""


class CommandHarness:
    """``harness.type = "command"`` (module doc)."""

    def __init__(self, cfg: HarnessConfig, sandbox: SandboxConfig, max_context: int) -> None:
        if cfg.files and not os.path.isdir(cfg.files):
            raise ValueError(f"harness.files: {cfg.files!r} is not a directory; give the harness's folder")
        if cfg.venv and not os.path.isfile(os.path.join(cfg.venv, "bin", "python")):
            raise ValueError(
                f"harness.venv: {cfg.venv!r} is not a virtualenv (no bin/python); build it with "
                "`make harnesses` or `python -m venv DIR && DIR/bin/pip install PACKAGE`"
            )
        self.cfg = cfg
        self.ro_binds = _venv_binds(cfg.venv) if cfg.venv else ()
        self.max_context = cfg.max_context or max_context
        self.sandbox_cfg = sandbox.model_copy(
            update={
                "memory_mb": cfg.memory_mb,
                "cgroup_memory_mb": max(sandbox.cgroup_memory_mb, cfg.memory_mb),
                "max_processes": max(sandbox.max_processes, 256),
            }
        )

    def run(self, spec: SessionSpec, task: Task, group_id: str, sample_idx: int) -> list[Trajectory]:
        t0 = time.monotonic()
        if task.kind != "function":
            why = f'harness.type = "command" plays function tasks; task {task.id} is a {task.kind!r} task'
            return [_empty(spec, task, group_id, sample_idx, "harness_error", why, error=why)]
        home = tempfile.mkdtemp(prefix="shipyard-harness-")
        endpoint = None
        try:
            shutil.copy(os.path.join(os.path.dirname(__file__), "relay.py"), os.path.join(home, "relay.py"))
            if self.cfg.files:
                shutil.copytree(self.cfg.files, os.path.join(home, "harness"), symlinks=False)
            message = first_message(task)
            with open(os.path.join(home, "task.md"), "w") as f:
                f.write(message)
            endpoint = SessionEndpoint(
                spec.client,
                spec.frame.tok,
                self.cfg,
                spec.sampling,
                max_context=self.max_context,
                session=(group_id, sample_idx),
                seed=spec.seed,
                uds=os.path.join(home, "endpoint.sock"),
            ).start()
            sb = make_sandbox(
                self.sandbox_cfg, workspace_files(task), binds={home: INSIDE}, ro_binds=self.ro_binds
            )
            with closing(sb):
                env = self._env(endpoint, task, message)
                res = sb.exec(self._launch(), timeout_s=self.cfg.timeout_s, env=env)
                endpoint.close()
                final = sb.files()
            result = None
            if res.returncode == 0 and not res.timed_out:
                result = (
                    spec.bench.grade(task, final)
                    if self.cfg.reward == "grader"
                    else harness_reward(os.path.join(home, REWARD_FILE))
                )
            return _outcome(
                spec, task, group_id, sample_idx, endpoint, res, result, final, time.monotonic() - t0
            )
        except Exception as e:  # a crashed session is recorded, never propagated
            why = f"{type(e).__name__}: {e}"
            return [
                _empty(spec, task, group_id, sample_idx, "error", why, error=traceback.format_exc(limit=4))
            ]
        finally:
            if endpoint is not None:
                endpoint.close()
            shutil.rmtree(home, ignore_errors=True)

    def _launch(self) -> str:
        """Start the relay, wait until it listens, then run the harness's command."""
        ready = "/tmp/.shipyard-relay-ready"
        relay = f"{shlex.quote(sys.executable)} {INSIDE}/relay.py {INSIDE}/endpoint.sock {PORT} {ready}"
        wait = f"i=0; while [ ! -e {ready} ] && [ $i -lt 500 ]; do sleep 0.01; i=$((i+1)); done"
        return f"{relay} & {wait}; exec /bin/sh -c {shlex.quote(self.cfg.command)}"

    def _env(self, endpoint: SessionEndpoint, task: Task, message: str) -> dict[str, str]:
        path = {"PATH": f"{self.cfg.venv}/bin:{_SANDBOX_PATH}"} if self.cfg.venv else {}
        return {
            **path,
            **self.cfg.env,
            "SHIPYARD_TASK_ID": task.id,
            "SHIPYARD_REWARD_FILE": f"{INSIDE}/{REWARD_FILE}",
            "OPENAI_BASE_URL": f"http://127.0.0.1:{PORT}/v1",
            "OPENAI_API_KEY": endpoint.key,
            "SHIPYARD_MODEL": endpoint.model_name,
            "SHIPYARD_TASK": message,
            "SHIPYARD_TASK_FILE": f"{INSIDE}/task.md",
            "SHIPYARD_WORKSPACE": "/workspace",
        }


def harness_reward(path: str) -> RewardResult:
    """The reward a harness wrote (``harness.reward = "harness"``): ``{"reward": float in [0, 1],
    "metrics": {...}}``; a missing or malformed file is reward 0 with the reason in ``details``."""
    try:
        with open(path) as f:
            data = json.load(f)
        reward = data["reward"]
        if isinstance(reward, bool) or not isinstance(reward, int | float) or not 0.0 <= reward <= 1.0:
            raise ValueError(f"reward must be a number in [0, 1], got {reward!r}")
        metrics = data.get("metrics", {})
        if not isinstance(metrics, dict):
            raise ValueError(f"metrics must be an object, got {type(metrics).__name__}")
    except FileNotFoundError:
        return RewardResult(0.0, 0, 1, {"reason": f"the harness wrote no {REWARD_FILE}"})
    except (ValueError, KeyError, TypeError) as e:
        return RewardResult(0.0, 0, 1, {"reason": f"the harness's {REWARD_FILE} is malformed: {e}"})
    passed, total = _count(metrics.get("passed")), _count(metrics.get("total"))
    if passed is None or total is None or not 0 <= passed <= total:
        passed, total = int(reward == 1.0), 1
    return RewardResult(float(reward), passed, total, {"source": "harness", "metrics": metrics})


def _count(x: Any) -> int | None:
    """A whole number a harness reported (``6`` or ``6.0``), else None."""
    ok = isinstance(x, int | float) and not isinstance(x, bool) and float(x).is_integer()
    return int(x) if ok else None


def _venv_binds(venv: str) -> tuple[str, ...]:
    """The virtualenv and, when it lies outside ``/usr``, the Python installation it was made from
    (``home`` in its ``pyvenv.cfg``), both bound read-only."""
    binds = [venv]
    try:
        with open(os.path.join(venv, "pyvenv.cfg")) as f:
            cfg = {k.strip(): v.strip() for k, v in (line.split("=", 1) for line in f if "=" in line)}
    except OSError:
        return tuple(binds)
    home = os.path.realpath(cfg.get("home", "/"))
    prefix = os.path.dirname(home) if home.endswith("/bin") else home
    if prefix and prefix != "/" and not prefix.startswith("/usr") and os.path.isdir(prefix):
        binds.append(prefix)
    return tuple(binds)


def _empty(
    spec: SessionSpec, task: Task, group_id: str, idx: int, finish: str, reason: str, error: str | None = None
) -> Trajectory:
    """A session without calls: the task's prompt as environment tokens, reward 0, the reason."""
    ids = spec.frame.prompt_ids(first_message(task))
    n = len(ids)
    traj = Trajectory(task.id, group_id, idx, ids, [0] * n, [0.0] * n, [-1] * n, prompt_len=n)
    traj.session_id, traj.finish, traj.error = f"{group_id}/{idx}", finish, error
    traj.reward_info = {"reason": reason}
    return traj


def _outcome(
    spec: SessionSpec,
    task: Task,
    group_id: str,
    idx: int,
    endpoint: SessionEndpoint,
    res: ExecResult,
    result: RewardResult | None,
    final: dict[str, str],
    seconds: float,
) -> list[Trajectory]:
    """The session's segments with its outcome (module doc) on each."""
    log = {
        "returncode": res.returncode,
        "seconds": round(seconds, 3),
        "stdout": res.stdout[-TAIL:],
        "stderr": res.stderr[-TAIL:],
        "refused_calls": dict(endpoint.refused),
    }
    if res.timed_out:
        finish, reason, error = (
            "timeout",
            f"the harness ran past harness.timeout_s ({res.duration_s:.0f} s)",
            None,
        )
    elif res.returncode != 0:
        reason = f"the harness exited with {res.returncode}: {res.stderr.strip()[-300:]}"
        finish, error = "harness_error", reason
    else:
        finish, reason, error = "done", "", None
    segs = endpoint.segments(task.id)
    if not segs:
        why = reason or "the harness never called the model"
        segs = [_empty(spec, task, group_id, idx, finish if reason else "no_calls", why, error)]
        finish, reason = segs[0].finish, why
    metrics = {**endpoint.metrics(), "harness_s": round(seconds, 3)}
    for seg in segs:
        seg.finish, seg.error, seg.metrics = finish, error, dict(metrics)
        seg.reward, seg.reward_info = 0.0, {"reason": reason} if reason else {}
        if error is not None:
            seg.loss_mask = [0] * len(seg.token_ids)
    last = segs[-1]
    last.grade = {"harness": log}
    if result is not None and finish == "done":
        info, grade = grade_record(result)
        for seg in segs:
            seg.reward, seg.reward_info = result.reward, dict(info)
        last.grade = {**grade, "harness": log}
        last.changes = files_diff(workspace_files(task), final)
    return segs
