"""A vLLM server process, and a token-in / token-out client for it: the first half of the vLLM backend.

vLLM pins another ``transformers`` than Shipyard, so it lives in its own environment (``make vllm``
builds ``.venv-vllm``) and is reached over HTTP on loopback; nothing here imports it.

Contract:
- :class:`VllmProcess` owns one ``python -m vllm.entrypoints.openai.api_server`` process: the argv
  it builds (model directory, served name, dtype, context length, loopback host and port, any
  extra arguments), its log file, :meth:`~VllmProcess.start` then :meth:`~VllmProcess.wait_ready`
  (polls ``/health``; a process that exits or a deadline that passes raises with the log's tail),
  and :meth:`~VllmProcess.stop` (SIGTERM to its process session, SIGKILL after ``grace_s``). It
  runs with ``VLLM_SERVER_DEV_MODE=1`` (the pause, resume and collective-RPC routes weight updates
  will use).
- :class:`VllmClient` implements :class:`~shipyard.inference.types.InferenceClient` against any
  vLLM server (owned or given by URL). ``generate`` sends each request to ``/v1/completions`` with
  the prompt as token ids, concurrently (vLLM batches them), and returns the sampled token ids
  (``return_tokens_as_token_ids``), the sampler's logprob of each, and the finish reason: ``eos``
  (vLLM stopped on an end token), ``stop`` (a stop string; the tokens that made it are kept, so the
  record is token-exact), ``length``. Seeds, temperature, top-p, stop strings and ``max_tokens``
  are passed through; ``top_logprobs`` as vLLM's ``logprobs``.
Limits (what the rest of the backend adds): the weight version of every token is the version this
client was told the server holds (``version``, 0 until weight adoption through vLLM's worker
extension lands); no MoE routes; penalties and logit bias are refused rather than ignored.

Shape legend: no tensors here (token ids travel as lists).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

from shipyard.inference.types import GenerateRequest, GenerateResult


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class VllmProcess:
    """One vLLM OpenAI-compatible server process on loopback (module doc)."""

    def __init__(
        self,
        python: str | Path,
        model_dir: str | Path,
        log_path: str | Path,
        *,
        served_name: str = "policy",
        dtype: str = "float32",
        max_model_len: int = 4096,
        port: int = 0,
        extra_args: list[str] | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        if not Path(python).is_file():
            raise ValueError(f"vLLM python {python} does not exist: build it with `make vllm`")
        self.host = "127.0.0.1"
        self.port = port or _free_port(self.host)
        self.served_name = served_name
        self.log_path = Path(log_path)
        self.argv = [
            str(python),
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(model_dir),
            "--served-model-name",
            served_name,
            "--dtype",
            dtype,
            "--max-model-len",
            str(max_model_len),
            "--host",
            self.host,
            "--port",
            str(self.port),
            *(extra_args or []),
        ]
        self.env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", **(env or {})}
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> VllmProcess:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(
            self.argv,
            env=self.env,
            stdout=self.log_path.open("wb"),
            stderr=subprocess.STDOUT,
            start_new_session=True,  # the server and its engine processes stop together
        )
        return self

    def wait_ready(self, timeout_s: float = 600.0) -> None:
        """Until ``/health`` answers 200; RuntimeError with the log's tail if the process exits first,
        TimeoutError after ``timeout_s``."""
        assert self.proc is not None, "start() first"
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM exited with {self.proc.returncode}:\n{self._tail()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1.0)
        raise TimeoutError(
            f"vLLM did not become healthy at {self.url} within {timeout_s:.0f} s:\n{self._tail()}"
        )

    def stop(self, grace_s: float = 20.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=grace_s)

    def _tail(self, chars: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:] if self.log_path.is_file() else ""

    def __enter__(self) -> VllmProcess:
        self.start().wait_ready()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class VllmClient:
    """InferenceClient over a vLLM server's completions route, token ids in and out; thread-safe."""

    def __init__(self, url: str, served_name: str, concurrency: int = 32, timeout_s: float = 600.0) -> None:
        self.url = url.rstrip("/")
        self.served_name = served_name
        self.served_version = 0
        """The weight version the server holds (set by whoever updates its weights)."""
        self._http = httpx.Client(base_url=self.url, timeout=httpx.Timeout(timeout_s, connect=10.0))
        self._pool = ThreadPoolExecutor(concurrency, thread_name_prefix="vllm-client")

    def generate(self, requests: list[GenerateRequest]) -> list[GenerateResult]:
        """Sample every request (sent concurrently; vLLM batches them); results in request order."""
        return list(self._pool.map(self._one, requests))

    def version(self) -> int:
        return self.served_version

    def wait_ready(self, timeout_s: float = 60.0) -> int:
        end = time.monotonic() + timeout_s
        while True:
            try:
                if self._http.get("/health").status_code == 200:
                    return self.served_version
            except httpx.HTTPError:
                if time.monotonic() > end:
                    raise
            if time.monotonic() > end:
                raise TimeoutError(f"vLLM at {self.url} not healthy within {timeout_s} s")
            time.sleep(0.5)

    def close(self) -> None:
        self._pool.shutdown()
        self._http.close()

    def _one(self, request: GenerateRequest) -> GenerateResult:
        resp = self._http.post("/v1/completions", json=completion_body(request, self.served_name))
        if resp.status_code >= 400:
            raise ValueError(f"vLLM refused the request ({resp.status_code}): {resp.text[:500]}")
        return parse_choice(resp.json()["choices"][0], request, self.served_version)


def completion_body(request: GenerateRequest, served_name: str) -> dict[str, Any]:
    """The ``/v1/completions`` body of ``request``: token ids in, token ids and logprobs out."""
    p = request.params
    if p.presence_penalty or p.frequency_penalty or p.logit_bias:
        raise ValueError("the vLLM client does not forward presence/frequency penalties or logit_bias yet")
    body: dict[str, Any] = {
        "model": served_name,
        "prompt": list(request.prompt_ids),
        "max_tokens": p.max_tokens,
        "temperature": p.temperature,
        "top_p": p.top_p,
        "logprobs": p.top_logprobs,  # vLLM: the sampled token's logprob plus this many alternatives
        "return_tokens_as_token_ids": True,
        "include_stop_str_in_output": True,  # keep every sampled token: the record is token-exact
        "skip_special_tokens": False,
    }
    if p.stop:
        body["stop"] = list(p.stop)
    if p.seed is not None:
        body["seed"] = p.seed
    return body


def _token_id(token: str) -> int:
    """vLLM writes token ``i`` as ``"token_id:i"`` under ``return_tokens_as_token_ids``."""
    return int(token.rsplit(":", 1)[1])


def parse_choice(choice: dict[str, Any], request: GenerateRequest, version: int) -> GenerateResult:
    """A completion choice as a :class:`GenerateResult` (finish: eos, stop or length)."""
    lp = choice["logprobs"]
    ids = [_token_id(t) for t in lp["tokens"]]
    logprobs = [float(x) for x in lp["token_logprobs"]]
    if choice["finish_reason"] == "length":
        finish = "length"
    else:
        finish = "stop" if isinstance(choice.get("stop_reason"), str) else "eos"
    top = None
    if request.params.top_logprobs:
        top = [
            sorted(((_token_id(t), float(v)) for t, v in alts.items()), key=lambda tv: -tv[1])[
                : request.params.top_logprobs
            ]
            for alts in lp["top_logprobs"]
        ]
    return GenerateResult(ids, logprobs, [version] * len(ids), finish, top_logprobs=top)
