"""A vLLM server process, and a token-in / token-out client for it.

vLLM pins another ``transformers`` than Shipyard, so it lives in its own environment (``make vllm``
builds ``.venv-vllm``) and is reached over HTTP on loopback; nothing here imports it.

Contract:
- :class:`VllmProcess` owns one ``python -m vllm.entrypoints.openai.api_server`` process: the argv
  it builds (model directory, served name, dtype, context length, loopback host and port, vLLM's
  token-in / token-out route (``--enable-scale-out``), logprobs of the distribution sampled from
  (``--logprobs-mode processed_logprobs``), Shipyard's worker extension
  (:mod:`shipyard.inference.backends.vllm_worker`, Shipyard's sources put on ``PYTHONPATH``), any extra
  arguments), its log file, :meth:`~VllmProcess.start` then :meth:`~VllmProcess.wait_ready` (polls
  ``/health``; a process that exits or a deadline that passes raises with the log's tail), and
  :meth:`~VllmProcess.stop` (SIGTERM to its process session, SIGKILL after ``grace_s``). It runs with
  ``VLLM_SERVER_DEV_MODE=1`` (the pause, resume, weight-version and collective-RPC routes).
- :class:`VllmClient` implements :class:`~shipyard.inference.types.InferenceClient` against any vLLM
  server started that way (owned or given by URL). ``generate`` posts prompt token ids to
  ``/inference/v1/generate`` and returns the sampled token ids, the sampler's logprob of each, the
  weight version of each token (vLLM's ``weight_versions`` spans, labelled by the backend's
  adopter), and the finish reason: ``eos``, ``stop`` (a stop string; the tokens that made it are
  kept, so the record is token-exact), ``length``. Seeds, temperature, top-p, stop strings,
  ``max_tokens`` and ``top_logprobs`` are passed through; identical unseeded requests of one call
  become one request with ``n``; the rest go concurrently (vLLM batches them).
  For an MoE model (``moe``) each result carries the route record of the experts vLLM used at every
  forwarded position (``--enable-return-routed-experts``), for router replay in the trainer.
Limits: penalties and logit bias are refused rather than ignored; vLLM cannot replay given routes
(``GenerateRequest.prompt_routes`` is ignored: it routes the prompt itself and reports what it used).

Shape legend: no tensors here (token ids travel as lists).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path
from typing import Any

import httpx

from shipyard.inference.types import UNAVAILABLE, VERSION_TIMEOUT_S, GenerateRequest, GenerateResult

WORKER_EXTENSION = "shipyard.inference.backends.vllm_worker.ShipyardWorkerExtension"
"""Shipyard's weight adoption inside vLLM's worker (:mod:`shipyard.inference.backends.vllm_worker`)."""


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
            "--max-num-batched-tokens",
            str(max_model_len),
            # whole prompts per step: vLLM 0.32 rewinds the generator of a seeded request whose prompt
            # was cut across steps, which CPU generators cannot do (the worker dies: "CPU Generator
            # does not use offset"; tests/inference/test_vllm_contract.py holds the case)
            "--no-enable-chunked-prefill",
            "--enable-scale-out",  # the token-in / token-out route
            "--logprobs-mode",
            "processed_logprobs",  # the logprob of the distribution sampled from (after temperature)
            "--worker-extension-cls",
            WORKER_EXTENSION,
            *(extra_args or []),
        ]
        src = str(Path(__file__).resolve().parents[3])  # Shipyard's sources, for the worker extension
        path = os.pathsep.join(p for p in (src, os.environ.get("PYTHONPATH", "")) if p)
        # vLLM 0.32's AOT-compiled artifact does not load back with this torch ("'function' object has no
        # attribute 'finalize_loading'"), so every start compiled again (~65 s here); without it inductor's
        # cache serves a restart (~18 s). The caller's environment or `env` can set it back to 1.
        aot = {"VLLM_USE_AOT_COMPILE": "0"}
        self.env = {**aot, **os.environ, "VLLM_SERVER_DEV_MODE": "1", "PYTHONPATH": path, **(env or {})}
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
    """InferenceClient over vLLM's token-in / token-out route; thread-safe (module doc)."""

    def __init__(
        self,
        url: str,
        served_name: str,
        concurrency: int = 32,
        timeout_s: float = 600.0,
        moe: tuple[list[int], int] | None = None,
    ) -> None:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"vLLM url={url!r} must start with http:// or https://")
        self.url = url.rstrip("/")
        self.served_name = served_name
        self.moe = moe
        """(MoE decoder-layer indices, experts per layer) of the served model: results then carry the
        routes vLLM returns (None: a dense model)."""
        self._http = httpx.Client(
            base_url=self.url,
            timeout=httpx.Timeout(timeout_s, connect=10.0),
            limits=httpx.Limits(max_connections=concurrency + 4),
        )
        self._pool = ThreadPoolExecutor(concurrency, thread_name_prefix="vllm-client")

    def generate(self, requests: list[GenerateRequest]) -> list[GenerateResult]:
        """Sample every request; identical unseeded requests go as one request with ``n`` (vLLM
        shares their prompt); the rest concurrently (vLLM batches them). Results in request order."""
        groups: dict[str, list[int]] = {}
        for i, r in enumerate(requests):
            key = json.dumps([r.prompt_ids, asdict(r.params)]) if r.params.seed is None else f"#{i}"
            groups.setdefault(key, []).append(i)
        out: list[GenerateResult | None] = [None] * len(requests)
        batches = list(groups.values())
        jobs = [(requests[b[0]], len(b)) for b in batches]
        for idx, results in zip(batches, self._pool.map(self._send, jobs), strict=True):
            for i, res in zip(idx, results, strict=True):
                out[i] = res
        assert all(r is not None for r in out)
        return out  # type: ignore[return-value]

    async def agenerate(
        self, requests: list[GenerateRequest], http: httpx.AsyncClient
    ) -> list[GenerateResult]:
        """:meth:`generate` on the caller's async client (its base URL this server's), one vLLM
        request each: cancelling the awaiting task drops the connections, and vLLM aborts them."""
        out = []
        for request in requests:
            resp = await http.post(GENERATE_ROUTE, json=generate_body(request, self.served_name, 1))
            out += self._choices(resp, request, 1)
        return out

    def version(self) -> int:
        """The weight version the server labels new tokens with (``/weight_info``; 0 before any)."""
        try:
            resp = self._http.get("/weight_info", timeout=VERSION_TIMEOUT_S)
        except httpx.TransportError as e:
            raise ConnectionError(f"vLLM at {self.url} did not answer /weight_info: {e!r}") from e
        if resp.status_code in UNAVAILABLE:
            raise ConnectionError(f"vLLM at {self.url} answered /weight_info with {resp.status_code}")
        resp.raise_for_status()
        return label_version(resp.json()["weight_version"])

    def stats(self) -> dict[str, Any]:
        return {"version": self.version(), "precision": {"engine": "vllm", "url": self.url}}

    def wait_ready(self, timeout_s: float = 60.0) -> int:
        end = time.monotonic() + timeout_s
        while True:
            try:
                if self._http.get("/health").status_code == 200:
                    return self.version()
            except (httpx.HTTPError, ConnectionError):
                pass
            if time.monotonic() > end:
                raise TimeoutError(f"vLLM at {self.url} not healthy within {timeout_s} s")
            time.sleep(0.5)

    def close(self) -> None:
        self._pool.shutdown()
        self._http.close()

    def __enter__(self) -> VllmClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _send(self, job: tuple[GenerateRequest, int]) -> list[GenerateResult]:
        request, n = job
        resp = self._http.post(GENERATE_ROUTE, json=generate_body(request, self.served_name, n))
        return self._choices(resp, request, n)

    def _choices(self, resp: httpx.Response, request: GenerateRequest, n: int) -> list[GenerateResult]:
        """The ``n`` results of ``request`` in vLLM's answer ``resp``; ValueError if it refused it."""
        if resp.status_code >= 400:
            raise ValueError(f"vLLM refused the request ({resp.status_code}): {resp.text[:500]}")
        choices = sorted(resp.json()["choices"], key=lambda c: c["index"])
        assert len(choices) == n, f"vLLM answered {len(choices)} choices for n={n}"
        return [parse_choice(c, request, self.moe) for c in choices]


GENERATE_ROUTE = "/inference/v1/generate"
"""vLLM's token-in / token-out route (``--enable-scale-out``)."""


def generate_body(request: GenerateRequest, served_name: str, n: int = 1) -> dict[str, Any]:
    """The body of ``GENERATE_ROUTE`` for ``request``: token ids in; token ids, the sampler's logprobs
    and weight-version spans out."""
    p = request.params
    if p.presence_penalty or p.frequency_penalty or p.logit_bias:
        raise ValueError("the vLLM client does not forward presence/frequency penalties or logit_bias yet")
    sampling: dict[str, Any] = {
        "n": n,
        "max_tokens": p.max_tokens,
        "temperature": p.temperature,
        "top_p": p.top_p,
        "logprobs": p.top_logprobs,  # vLLM: the sampled token's logprob plus this many alternatives
        "include_stop_str_in_output": True,  # keep every sampled token: the record is token-exact
        "skip_special_tokens": False,
    }
    if p.stop:
        sampling["stop"] = list(p.stop)
    if p.seed is not None:
        sampling["seed"] = p.seed
    if p.ignore_eos:
        sampling["ignore_eos"] = True
    return {"model": served_name, "token_ids": list(request.prompt_ids), "sampling_params": sampling}


def label_version(label: object) -> int:
    """Shipyard's weight version from a vLLM weight-version label (vLLM's unlabelled ``"default"``: 0)."""
    return int(label) if str(label).isdigit() else 0


def versions_of(spans: list[dict[str, Any]] | None, n_tokens: int) -> list[int]:
    """Per-token weight versions from vLLM's ``weight_versions`` spans (labels Shipyard set with
    ``/update_weight_version``; vLLM's unlabelled ``"default"`` is version 0)."""
    versions = [0] * n_tokens
    for span in spans or []:
        v = label_version(span["version"])
        versions[span["start"] : span["end"]] = [v] * (span["end"] - span["start"])
    return versions


def routes_of(choice: dict[str, Any], moe: tuple[list[int], int] | None) -> dict[str, Any] | None:
    """The route record of a choice's ``routed_experts`` (base64 ``.npy``, ``[prompt + generated - 1,
    MoE layers, k]``: every forwarded position), or None for a dense model."""
    if moe is None:
        return None
    if choice.get("routed_experts") is None:
        raise ValueError(
            "the model is MoE but vLLM returned no routed_experts: start it with --enable-return-routed-experts"
        )
    import base64
    import io

    import numpy as np

    from shipyard.models.routes import encode_routes

    ids_NLK = np.load(io.BytesIO(base64.b64decode(choice["routed_experts"])))
    return encode_routes(ids_NLK.astype(np.int64), moe[0], moe[1])


def parse_choice(
    choice: dict[str, Any], request: GenerateRequest, moe: tuple[list[int], int] | None = None
) -> GenerateResult:
    """A generate-route choice as a :class:`GenerateResult` (finish: eos, stop or length; routes for
    an MoE model, ``moe``: its MoE layers and experts)."""
    ids = [int(t) for t in choice["token_ids"]]
    content = (choice.get("logprobs") or {}).get("content") or []
    if len(content) != len(ids):
        raise ValueError(f"vLLM returned {len(content)} logprobs for {len(ids)} tokens")
    logprobs = [float(c["logprob"]) for c in content]
    if choice["finish_reason"] == "length":
        finish = "length"
    else:
        finish = "stop" if isinstance(choice.get("stop_reason"), str) else "eos"
    top = None
    if request.params.top_logprobs:
        # vLLM lists the sampled token first, then the candidates by rank: dedupe, rank, keep k
        top = [
            sorted(
                {int(a["token_id"]): float(a["logprob"]) for a in c["top_logprobs"]}.items(),
                key=lambda t: -t[1],
            )[: request.params.top_logprobs]
            for c in content
        ]
    versions = versions_of(choice.get("weight_versions"), len(ids))
    return GenerateResult(ids, logprobs, versions, finish, routes=routes_of(choice, moe), top_logprobs=top)
