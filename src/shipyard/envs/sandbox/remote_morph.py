"""Remote sandboxes on Morph Cloud (VM instances started from a snapshot), behind the sandbox interface.

Contract: :class:`MorphSandbox` implements :class:`~.base.Sandbox` with Morph Cloud's REST API
as documented by its docs and its official Python SDK (``morphcloud.api``):

- ``POST {url}/instance?snapshot_id=ID`` with ``{"metadata", "ttl_seconds", "ttl_action"}`` starts
  an instance (answer: the instance object, ``id`` and ``status``);
- ``GET {url}/instance/{id}`` until ``status`` is ``"ready"`` (``"error"`` fails);
- ``POST {url}/instance/{id}/exec`` with ``{"command": [argv...]}`` runs a command to completion
  (answer: ``exit_code``, ``stdout``, ``stderr``);
- ``POST {url}/instance/{id}/branch?count=1`` snapshots the instance and starts a copy
  (answer: ``snapshot`` and ``instances``) -- our :meth:`~MorphSandbox.fork`;
- ``DELETE {url}/instance/{id}`` stops it -- our :meth:`~MorphSandbox.close`.

Every request carries ``Authorization: Bearer KEY`` with the key read from the environment
variable ``cfg.remote.api_key_env`` (never from a config file). References:
https://cloud.morph.so/docs/documentation/instances/basic-lifecycle,
https://cloud.morph.so/docs/documentation/instances/command-execution and the SDK's
``Instance.exec`` / ``Instance.branch`` / ``InstanceAPI.start`` / ``InstanceAPI.stop``.

Everything else is built on ``exec``: the workspace is ``/workspace`` in the VM; a command runs
as ``cd /workspace && timeout -k 1 T /bin/sh -c CMD`` (stdin piped in through base64, ``env``
exported first; exit status 124 from ``timeout`` is reported as ``timed_out``; ``timeout``
signals the command's whole process group); files go in and out base64-encoded, written in
chunks that fit one argument and read in chunks that fit one command's (possibly capped)
output; ``files()`` tars the workspace in the VM and fetches the archive, and
:meth:`~MorphSandbox.diff` compares it with the starting files.

Limits: verified only against the loopback server of ``tests/envs/test_remote_sandbox.py``, which
implements these endpoints as documented (backed by local bubblewrap sandboxes), not against the
live service; isolation (network included: ``network=False`` cannot be enforced through this
API) and resource limits are those of the provider's VM and the snapshot; a command that itself
exits 124 is reported as timed out.
"""

from __future__ import annotations

import base64
import io
import os
import shlex
import tarfile
import time
import uuid
from collections.abc import Mapping
from types import TracebackType
from typing import Any

import httpx

from shipyard.config.schema import SandboxConfig
from shipyard.envs.sandbox.base import SandboxUnavailable, check_relative, diff_files, env_prefix
from shipyard.envs.types import ExecResult, WorkspaceDiff

WORKDIR = "/workspace"
CHUNK = 64 * 1024
"""Bytes of a file per write command (base64 grows it to ~87 KiB, under one argument's 128 KiB)."""
READ_CHUNK = 32 * 1024
"""Bytes of a file per read command (an exec's output may be capped; ours is at 64 KiB)."""
MAX_TEXT_FILE_BYTES = 1024 * 1024
SKIPPED_DIRS = ("__pycache__", ".pytest_cache", ".mypy_cache", ".ruff_cache", ".git")
_POLL_S = 0.25


class MorphSandbox:
    """One Morph Cloud instance as a sandbox; see the module docstring."""

    def __init__(
        self,
        files: Mapping[str, str] | None,
        cfg: SandboxConfig,
        network: bool = False,
        *,
        instance_id: str | None = None,
    ) -> None:
        self.cfg, self.network = cfg, network
        key = os.environ.get(cfg.remote.api_key_env, "")
        if not key:
            raise SandboxUnavailable(
                f"remote sandboxes need an API key in the environment variable {cfg.remote.api_key_env} "
                "(sandbox.remote.api_key_env); create one in the Morph Cloud console"
            )
        if instance_id is None and not cfg.remote.snapshot_id:
            raise ValueError("sandbox.remote.snapshot_id is empty: give the snapshot instances start from")
        self._http = httpx.Client(
            base_url=cfg.remote.url.rstrip("/"), headers={"Authorization": f"Bearer {key}"}, timeout=60.0
        )
        self._closed = False
        self._initial: dict[str, str] = {}
        self.id = ""
        try:
            self.id = instance_id or self._start()
            self._wait_ready()
            self.exec(f"mkdir -p {WORKDIR}")
            self.seed(files or {})
        except BaseException:
            self.close()
            raise

    # ----------------------------------------------------------------- REST calls
    def _call(self, method: str, path: str, timeout: float = 60.0, **kw: Any) -> Any:
        res = self._http.request(method, path, timeout=timeout, **kw)
        if res.is_error:
            raise RuntimeError(f"Morph API {method} {path} answered {res.status_code}: {res.text[:500]}")
        return res.json() if res.content else None

    def _start(self) -> str:
        body = {
            "metadata": {"shipyard": "sandbox"},
            "ttl_seconds": self.cfg.remote.ttl_s,
            "ttl_action": "stop",
        }
        inst = self._call("POST", "/instance", params={"snapshot_id": self.cfg.remote.snapshot_id}, json=body)
        return str(inst["id"])

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.cfg.remote.ready_timeout_s
        while True:
            status = self._call("GET", f"/instance/{self.id}")["status"]
            if status == "ready":
                return
            if status == "error":
                raise RuntimeError(f"Morph instance {self.id} reported status 'error'")
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"Morph instance {self.id} not ready after {self.cfg.remote.ready_timeout_s} s "
                    f"(status {status!r}; sandbox.remote.ready_timeout_s)"
                )
            time.sleep(_POLL_S)

    def _run(self, script: str, timeout: float) -> dict[str, Any]:
        return self._call(
            "POST", f"/instance/{self.id}/exec", timeout=timeout, json={"command": ["/bin/sh", "-c", script]}
        )

    # ----------------------------------------------------------------- interface
    def exec(
        self,
        cmd: str,
        timeout_s: float | None = None,
        stdin: str | None = None,
        *,
        env: Mapping[str, str] | None = None,
    ) -> ExecResult:
        """Run ``cmd`` in ``/workspace``; ``timeout`` kills its process group after ``timeout_s``."""
        if self._closed:
            raise RuntimeError("exec on a closed sandbox")
        timeout = self.cfg.timeout_s if timeout_s is None else timeout_s
        if not timeout > 0:
            raise ValueError(f"timeout_s={timeout_s} must be > 0 (seconds of wall-clock time)")
        run = f"timeout -k 1 {timeout:g} /bin/sh -c {shlex.quote(env_prefix(env) + cmd)}"
        if stdin is None:
            script = f"cd {WORKDIR} && {run} </dev/null"
        else:
            data = base64.b64encode(stdin.encode()).decode()
            script = f"cd {WORKDIR} && printf %s {data} | base64 -d | {run}"
        start = time.monotonic()
        out = self._run(script, timeout + 30.0)
        code = int(out["exit_code"])
        return ExecResult(
            code, out.get("stdout", ""), out.get("stderr", ""), code == 124, time.monotonic() - start
        )

    def _path(self, path: str) -> str:
        return shlex.quote(f"{WORKDIR}/{'/'.join(check_relative(path))}")

    def write(self, path: str, content: str) -> None:
        target = self._path(path)
        data = content.encode()
        chunks = [data[i : i + CHUNK] for i in range(0, len(data), CHUNK)] or [b""]
        for i, chunk in enumerate(chunks):
            op = ">" if i == 0 else ">>"
            mk = f'mkdir -p "$(dirname {target})" && ' if i == 0 else ""
            script = f"{mk}printf %s {base64.b64encode(chunk).decode()} | base64 -d {op} {target}"
            res = self._run(script, 60.0)
            if int(res["exit_code"]) != 0:
                raise OSError(f"writing {path!r} in Morph instance {self.id} failed: {res.get('stderr', '')}")

    def _read_bytes(self, remote: str) -> bytes:
        """A file of the VM (a quoted absolute path), fetched in :data:`READ_CHUNK` pieces."""
        res = self._run(f"test -f {remote} && wc -c < {remote}", 60.0)
        if int(res["exit_code"]) != 0:
            raise FileNotFoundError(f"{remote} is not a regular file in Morph instance {self.id}")
        size, data = int(res["stdout"].strip()), bytearray()
        for i in range(-(-size // READ_CHUNK)):
            piece = self._run(
                f"dd if={remote} bs={READ_CHUNK} skip={i} count=1 2>/dev/null | base64 -w0", 60.0
            )
            data += base64.b64decode(piece["stdout"])
        return bytes(data)

    def read(self, path: str) -> str:
        return self._read_bytes(self._path(path)).decode("utf-8", errors="replace")

    def files(self) -> dict[str, str]:
        excludes = " ".join(f"--exclude={shlex.quote(d)}" for d in SKIPPED_DIRS)
        snap = f"/tmp/shipyard-files-{uuid.uuid4().hex}.tgz"
        res = self._run(f"tar -C {WORKDIR} {excludes} -czf {snap} .", 120.0)
        if int(res["exit_code"]) != 0:
            raise OSError(
                f"listing the workspace of Morph instance {self.id} failed: {res.get('stderr', '')}"
            )
        try:
            blob = self._read_bytes(snap)
        finally:
            self._run(f"rm -f {snap}", 60.0)
        out: dict[str, str] = {}
        with tarfile.open(fileobj=io.BytesIO(blob), mode="r:gz") as tar:
            for member in tar:
                if not member.isfile() or member.size > MAX_TEXT_FILE_BYTES:
                    continue
                f = tar.extractfile(member)
                data = f.read() if f is not None else b""
                if b"\0" in data:
                    continue
                try:
                    out[os.path.normpath(member.name)] = data.decode("utf-8")
                except UnicodeDecodeError:
                    continue
        return dict(sorted(out.items()))

    def seed(self, files: Mapping[str, str]) -> None:
        for path, content in files.items():
            self.write(path, content)
        self._initial.update(files)

    def diff(self) -> WorkspaceDiff:
        return diff_files(self._initial, self.files())

    def fork(self) -> MorphSandbox:
        """Branch the instance (Morph snapshots it and starts a copy); the copy shares this base."""
        branched = self._call("POST", f"/instance/{self.id}/branch", params={"count": 1}, timeout=300.0)
        child = MorphSandbox(None, self.cfg, self.network, instance_id=str(branched["instances"][0]["id"]))
        child._initial = dict(self._initial)
        return child

    def close(self) -> None:
        """Stop the instance (idempotent; a failed stop is left to the instance's TTL)."""
        if getattr(self, "_closed", True):
            return
        self._closed = True
        try:
            if self.id:
                self._call("DELETE", f"/instance/{self.id}")
        except (httpx.HTTPError, RuntimeError):
            pass
        finally:
            self._http.close()

    def __enter__(self) -> MorphSandbox:
        return self

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
