"""The vLLM inference backend: one vLLM server that follows the run's published weights.

Contract: :class:`VllmNode` has the embedded node's interface (``url``, ``stop``). It starts and owns
a vLLM server (:class:`~shipyard.inference.backends.vllm_server.VllmProcess`, from ``inference.vllm.python``,
serving the policy's safetensors directory) or, with ``inference.vllm.url``, attaches to one a user
started the same way (the worker extension and ``--enable-scale-out`` are required). Then:

1. ``shipyard_follow`` (collective RPC) starts the embedded server's weight subscriber inside vLLM's
   worker (:mod:`shipyard.inference.backends.vllm_worker`): it fetches, verifies and decodes each new version
   there while vLLM generates, and stages it.
2. An adopter thread here asks every ``inference.vllm.apply_poll_s`` whether a version is staged;
   when one is, it pauses generation keeping the running requests (``/pause?mode=keep``), has the
   worker apply it, labels the engine's next tokens with the version (``/update_weight_version``)
   and resumes: generation stops only for the apply, and every response says which tokens each
   version sampled. Each apply is recorded in ``applies`` (version, apply seconds in the worker,
   pause seconds seen from here).
3. :meth:`VllmNode.final_state` reads the worker's state (mirror digest, vLLM's readable parameters
   against it, subscriber errors and adoptions) and the logprobs vLLM gives a fixed probe sequence,
   for checking that vLLM serves exactly the trainer's weights; ``stop`` writes it to the store
   (``inference/<name>.json``) before stopping the subscriber and, when it owns it, the server.

vLLM loads the policy's checkpoint directory (:func:`vllm_model_dir`: a policy Shipyard builds, e.g.
a mid-trained or upcycled one, is exported first). For an MoE policy vLLM returns the experts every
token was routed to (``--enable-return-routed-experts``) and the client turns them into the route
records router replay uses.

Limits: tensor parallel size 1.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from shipyard.config.schema import ModelConfig, ShipyardConfig
from shipyard.inference.backends.vllm_server import VllmProcess, label_version
from shipyard.store.types import Store

PROBE_IDS = [1, 9690, 42, 1113, 314, 253, 5248, 30, 476, 2, 1, 4093, 198, 20, 1073, 5134, 28, 614, 29]
"""A fixed token sequence whose logprobs under vLLM and under the trainer's weights are compared."""


def vllm_model_dir(cfg: ModelConfig) -> Path:
    """The safetensors directory vLLM loads: the shipped or given checkpoint as it is, or, for a policy
    Shipyard builds from it (``init_from``, ``random_init``, ``upcycle_experts``, a tiny model), that
    policy exported once (:func:`export_policy`)."""
    from shipyard.models.loading import smollm2_dir

    if not (cfg.init_from or cfg.random_init or cfg.upcycle_experts):
        if cfg.source == "smollm2":
            return smollm2_dir(cfg.cache_dir)
        if cfg.source == "hf" and cfg.path:
            return Path(cfg.path).expanduser()
    return export_policy(cfg)


def export_policy(cfg: ModelConfig) -> Path:
    """``load_model(cfg)`` saved as an HF directory (safetensors, config, tokenizer) under
    ``<model.cache_dir>/vllm/<key>``, the key a digest of the model settings and of the
    ``init_from`` files' names, sizes and times; written to a temporary directory, then renamed."""
    import hashlib
    import shutil
    import tempfile

    from shipyard.models.loading import load_model

    stamp = cfg.model_dump_json()
    if cfg.init_from:
        files = sorted(Path(cfg.init_from).expanduser().glob("*.safetensors"))
        stamp += "".join(f"{f.name}:{f.stat().st_size}:{f.stat().st_mtime_ns}" for f in files)
    dest = Path(cfg.cache_dir).expanduser() / "vllm" / hashlib.sha256(stamp.encode()).hexdigest()[:16]
    if (dest / "model.safetensors").is_file():
        return dest
    model, tok = load_model(cfg)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".export-", dir=dest.parent))
    model.save_pretrained(tmp, safe_serialization=True)
    tok.save_pretrained(tmp)
    try:
        tmp.rename(dest)
    except OSError:  # another process exported it first
        shutil.rmtree(tmp)
    return dest


def moe_layout(model_dir: Path) -> tuple[list[int], int] | None:
    """(decoder-layer indices of the MoE layers, experts per layer) from an HF ``config.json``; None
    for a dense model. Mixtral: every layer; Qwen3-MoE: every ``decoder_sparse_step``-th layer not in
    ``mlp_only_layers``; DeepSeek-V3: from ``first_k_dense_replace`` on, every ``moe_layer_freq``-th."""
    c = json.loads((model_dir / "config.json").read_text())
    n = int(c["num_hidden_layers"])
    if "num_local_experts" in c:
        return list(range(n)), int(c["num_local_experts"])
    if "n_routed_experts" in c:
        first, freq = int(c.get("first_k_dense_replace", 0)), int(c.get("moe_layer_freq", 1))
        return [i for i in range(first, n) if i % freq == 0], int(c["n_routed_experts"])
    if c.get("num_experts"):
        step, dense = int(c.get("decoder_sparse_step", 1)), set(c.get("mlp_only_layers") or [])
        return [i for i in range(n) if i not in dense and (i + 1) % step == 0], int(c["num_experts"])
    return None


def routes_wanted(cfg: ShipyardConfig) -> tuple[list[int], int] | None:
    """The MoE layout whose routes vLLM is asked to return (``inference.vllm.return_routes``; None:
    a dense model, or routes turned off)."""
    if cfg.inference.vllm.return_routes is False:
        return None
    layout = moe_layout(vllm_model_dir(cfg.model))
    if layout is None and cfg.inference.vllm.return_routes:
        raise ValueError("inference.vllm.return_routes = true, but the policy has no MoE layers")
    return layout


def _python(setting: str) -> Path:
    """``inference.vllm.python``: as given, or (relative and not found here) under the repository, as
    a Ray actor's working directory may not be the driver's."""
    path = Path(setting).expanduser()
    repo = Path(__file__).resolve().parents[4] / path
    return repo if not path.is_absolute() and not path.is_file() and repo.is_file() else path


class VllmNode:
    """One vLLM server following the run's weights (module doc)."""

    def __init__(self, cfg: ShipyardConfig, store: Store, port: int = 0) -> None:
        self.cfg, self.store = cfg, store
        v = cfg.inference.vllm
        model_dir = vllm_model_dir(cfg.model)
        moe = ["--enable-return-routed-experts"] if routes_wanted(cfg) is not None else []
        self.name = f"vllm-{os.getpid()}-{id(self):x}"
        self.proc: VllmProcess | None = None
        if v.url:
            self._url = v.url.rstrip("/")
        else:
            log = Path(cfg.run.output_dir) / cfg.run.name / "logs" / f"{self.name}.log"
            self.proc = VllmProcess(
                _python(v.python),
                model_dir,
                log,
                served_name=cfg.inference.served_model_name or "policy",
                dtype=v.dtype,
                max_model_len=v.max_model_len,
                port=port,
                extra_args=[*moe, *v.extra_args],
                env={"VLLM_CPU_KVCACHE_SPACE": str(v.kv_cache_gb), **v.env},
            ).start()
            self.proc.wait_ready(v.start_timeout_s)
            self._url = self.proc.url
        self._http = httpx.Client(base_url=self._url, timeout=httpx.Timeout(600.0, connect=10.0))
        self.applies: list[dict[str, Any]] = []
        self._set_label(0)
        self._rpc("shipyard_follow", json.dumps(self._follow_spec(model_dir)))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._adopt, name="vllm-adopter", daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return self._url

    def _follow_spec(self, model_dir: Path) -> dict[str, Any]:
        cfg = self.cfg
        store_cfg = cfg.store.model_dump()
        if cfg.store.type == "local":  # the worker's working directory is vLLM's, not ours
            store_cfg["root"] = str(Path(cfg.store.root).expanduser().resolve())
        return {
            "store": store_cfg,
            "run": cfg.run.name,
            "model_dir": str(model_dir),
            "name": self.name,
            "poll_s": cfg.inference.poll_s,
            "cache_dir": cfg.weights.cache_dir,
            "lease_ttl_s": cfg.weights.lease_ttl_s,
            "connections": cfg.store.connections,
            "chunk_bytes": int(cfg.store.part_mb * (1 << 20)),
            "workers": cfg.weights.workers,
            "feed_url": cfg.weights.follow_url,
        }

    def _rpc(self, method: str, *args: str) -> Any:
        resp = self._http.post("/collective_rpc", json={"method": method, "args": list(args)})
        if resp.status_code != 200:
            raise RuntimeError(f"vLLM collective_rpc {method} failed ({resp.status_code}): {resp.text[:500]}")
        return resp.json()["results"][0] if resp.content else None

    def _set_label(self, version: int) -> None:
        self._http.post("/update_weight_version", json={"new_version": str(version)}).raise_for_status()

    def _adopt(self) -> None:
        while not self._stop.wait(self.cfg.inference.vllm.apply_poll_s):
            try:
                if self._rpc("shipyard_pending") is not None:
                    self.adopt_staged()
            except (httpx.HTTPError, RuntimeError) as e:  # vLLM busy or restarting: try again
                self.applies.append({"error": str(e), "at": time.time()})

    def adopt_staged(self) -> dict[str, Any] | None:
        """Pause (keeping running requests), apply the staged version, label, resume."""
        t0 = time.perf_counter()
        self._http.post("/pause", params={"mode": "keep"}).raise_for_status()
        try:
            done = self._rpc("shipyard_apply")
            if done is not None:
                self._set_label(int(done["version"]))
        finally:
            self._http.post("/resume").raise_for_status()
        if done is not None:
            done["pause_s"] = time.perf_counter() - t0
            self.applies.append(done)
        return done

    def version(self) -> int:
        return label_version(self._http.get("/weight_info").json()["weight_version"])

    def final_state(self) -> dict[str, Any]:
        """The worker's state and vLLM's logprobs of :data:`PROBE_IDS` (module doc, point 3)."""
        state = self._rpc("shipyard_state")
        body = {
            "model": self.cfg.inference.served_model_name or "policy",
            "prompt": PROBE_IDS,
            "max_tokens": 1,
            "temperature": 1.0,
            "prompt_logprobs": 0,
        }
        resp = self._http.post("/v1/completions", json=body)
        resp.raise_for_status()
        prompt_lp = resp.json()["choices"][0].get("prompt_logprobs") or resp.json().get("prompt_logprobs")
        state["probe_ids"] = PROBE_IDS
        state["probe_logprobs"] = [
            None if d is None else float(d[str(t)]["logprob"])
            for t, d in zip(PROBE_IDS, prompt_lp, strict=True)
        ]
        state["applies"] = [a for a in self.applies if "version" in a]
        state["apply_errors"] = [a["error"] for a in self.applies if "error" in a]
        return state

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=60)
        try:
            self.store.put(f"inference/{self.name}.json", json.dumps(self.final_state()).encode())
            self._rpc("shipyard_stop")
        except (httpx.HTTPError, RuntimeError, ValueError) as e:  # a dead server has no state to give
            print(f"vLLM node {self.name}: final state not recorded ({e})")
        self._http.close()
        if self.proc is not None:
            self.proc.stop()
