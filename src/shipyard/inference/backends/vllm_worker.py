"""Shipyard's weight adoption inside a vLLM worker: the extension vLLM mixes into its worker class.

vLLM is started with ``--worker-extension-cls shipyard.inference.backends.vllm_worker.ShipyardWorkerExtension``
and Shipyard's sources on its ``PYTHONPATH`` (:mod:`shipyard.inference.backends.vllm`). Its methods are called
through vLLM's collective RPC (``POST /collective_rpc``, ``VLLM_SERVER_DEV_MODE=1``), which vLLM's
engine runs between two model steps, so none of them overlaps a forward. This module runs in vLLM's
environment: it imports torch, safetensors and Shipyard's store and weights packages, never vLLM.

Contract:
- ``shipyard_follow(spec)`` (once; ``spec`` is JSON: ``store`` (a StoreConfig), ``run``, ``model_dir``,
  ``name``, ``poll_s``, ``cache_dir``, ``lease_ttl_s``, ``connections``, ``chunk_bytes``, ``workers``)
  opens the run's store and starts the embedded server's own
  :class:`~shipyard.weights.subscriber.WeightSubscriber` in a thread of this process, with a
  :class:`MirrorSink`. The sink's live weights are a mirror of what vLLM serves, by checkpoint name
  (vLLM fuses q/k/v and gate/up and, on CPU, packs linear weights into oneDNN layouts it cannot give
  back), loaded from ``model_dir``'s safetensors: version 0, what vLLM loaded. So the subscriber plans,
  fetches, decodes and verifies each version (delta chain or snapshot, digests, fallback) while vLLM
  keeps generating, then stages it and waits.
- ``shipyard_pending()``: the staged version, or None.
- ``shipyard_apply()``: when a version is staged, writes it into the mirror (only the positions that
  changed) and into vLLM's model through vLLM's in-place reload (``model_runner.reload_weights``: maps
  checkpoint names onto fused layers and redoes the CPU weight packing) of the decoder layers that
  changed (whole layers, :func:`reload_set`) and any changed tensor outside them, then rebuilds the
  kernel copy of a tied LM head when the embedding changed; releases the subscriber, and
  returns ``{"version", "apply_s"}``. The controller pauses generation around it and then labels the
  engine's outputs with the new version (``/update_weight_version``), so vLLM reports for every
  request which tokens each version sampled.
- ``shipyard_state()``: the version served, the state digest of the mirror (the published manifest's
  ``state_digest`` when adoption was exact), how many of vLLM's own parameters could be read back and
  equal the mirror (all on GPU; on CPU only unpacked ones: embeddings and norms), the subscriber's
  errors and adoption events.

Limits: tensor parallel size 1 (one worker holds every parameter); the reload rewrites whole layers
(every layer of a 135M model on 2 CPU cores: about 0.6-0.9 s), where the embedded engine copies only
changed elements; a model whose starting weights are not ``model_dir``'s (``model.init_from``) is refused by
the backend.

Shape legend: no shapes here beyond each parameter's own.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
"""vLLM's fused parameters and the checkpoint parameters stacked (along dim 0) in each."""


def load_mirror(model_dir: str | Path) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors by name (what vLLM loaded as version 0)."""
    from safetensors.torch import load_file

    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise ValueError(f"model_dir {model_dir}: no *.safetensors files (vLLM's backend needs them)")
    mirror: dict[str, torch.Tensor] = {}
    for f in files:
        mirror.update(load_file(f))
    return mirror


class MirrorSink:
    """A :class:`~shipyard.weights.subscriber.WeightSink` over vLLM's weights: stages a version and
    blocks until :meth:`apply` (called by the engine between steps) has put it live."""

    def __init__(self, mirror: dict[str, torch.Tensor], reload: Any) -> None:
        self.mirror = mirror
        self.reload = reload
        """``reload(items)``: vLLM's in-place reload of (checkpoint name, tensor) pairs."""
        self._version = 0
        self._staged: tuple[int, dict[str, torch.Tensor], Mapping[str, Any] | None] | None = None
        self._applied = threading.Condition()
        self.last_apply_s: float | None = None

    def live(self) -> Mapping[str, torch.Tensor]:
        return self.mirror

    def version(self) -> int:
        return self._version

    def pending(self) -> int | None:
        staged = self._staged
        return None if staged is None else staged[0]

    def stage(
        self, version: int, tensors: dict[str, torch.Tensor], positions: Mapping[str, Any] | None = None
    ) -> float | None:
        with self._applied:
            self._staged = (version, tensors, positions)
            while self._version != version:
                if not self._applied.wait(timeout=600):
                    raise TimeoutError(f"vLLM did not apply weights version {version} within 600 s")
        return self.last_apply_s

    def apply(self) -> dict[str, Any] | None:
        """Put the staged version live (mirror, then vLLM's model); None when nothing is staged."""
        with self._applied:
            if self._staged is None:
                return None
            version, tensors, positions = self._staged
            t0 = time.perf_counter()
            for name, new in tensors.items():
                _copy_into(self.mirror[name], new, (positions or {}).get(name))
            self.reload([(k, self.mirror[k]) for k in reload_set(tensors, self.mirror)])
            self.last_apply_s = time.perf_counter() - t0
            self._version, self._staged = version, None
            self._applied.notify_all()
        return {"version": version, "apply_s": self.last_apply_s}


def refresh_kernel_copies(model: torch.nn.Module) -> None:
    """Rebuild the CPU kernel copies of layers that keep their weight parameter (embeddings, LM heads).

    vLLM's reload re-processes the layers it loaded; a tied LM head shares the embedding's parameter,
    is not loaded itself, and keeps the oneDNN copy it packed at start-up, so the logits would stay
    version 0's (measured: 0.67 nats off after a perturbed embedding). Layers whose weight moved into
    a kernel layout (empty parameter) were rebuilt by the reload. No-op where there are no CPU kernels.
    """
    for module in model.modules():
        weight, method = getattr(module, "weight", None), getattr(module, "quant_method", None)
        if hasattr(module, "cpu_linear") and weight is not None and weight.numel() and method is not None:
            method.process_weights_after_loading(module)


def reload_set(changed: Mapping[str, Any], mirror: Mapping[str, torch.Tensor]) -> list[str]:
    """What to reload for ``changed``: every tensor of each decoder layer that holds a changed one, and
    the changed tensors outside layers. vLLM's reload processes a layer once all of its fused weights
    have arrived: a lone ``q_proj`` leaves ``qkv_proj`` half-written (measured: 18 nats off)."""
    layers = {m.group(1) for name in changed if (m := _LAYER.match(name))}
    return [
        k for k in mirror if k in changed or ((m := _LAYER.match(k)) is not None and m.group(1) in layers)
    ]


_LAYER = re.compile(r"^(.*\.layers\.\d+\.)")


def _copy_into(live: torch.Tensor, new: torch.Tensor, positions: Any) -> None:
    """``live`` becomes ``new``: only at ``positions`` (flat indices) when given, else whole."""
    if positions is None or live.dtype != new.dtype:
        live.copy_(new)
        return
    flat = live.view(-1)
    flat[positions] = new.reshape(-1)[positions]


def readable_match(model: torch.nn.Module, mirror: Mapping[str, torch.Tensor]) -> dict[str, int]:
    """Compare vLLM's parameters with the mirror where vLLM still holds them in checkpoint layout:
    ``compared``, ``equal`` (bit-exact after casting the mirror to vLLM's dtype), ``packed`` (empty
    parameters whose weights live in a kernel layout, e.g. oneDNN on CPU)."""
    out = {"compared": 0, "equal": 0, "packed": 0}
    for name, param in model.named_parameters():
        if param.numel() == 0:
            out["packed"] += 1
            continue
        parts = _checkpoint_parts(name, mirror)
        if parts is None:
            continue
        expected = torch.cat([mirror[p] for p in parts]) if len(parts) > 1 else mirror[parts[0]]
        out["compared"] += 1
        out["equal"] += int(
            expected.shape == param.shape and torch.equal(expected.to(param.dtype), param.detach().cpu())
        )
    return out


def _checkpoint_parts(name: str, mirror: Mapping[str, torch.Tensor]) -> list[str] | None:
    """The checkpoint names a vLLM parameter stacks (one for an unfused parameter), or None."""
    for fused, parts in FUSED.items():
        if f".{fused}." in name:
            names = [name.replace(f".{fused}.", f".{p}.") for p in parts]
            return names if all(n in mirror for n in names) else None
    return [name] if name in mirror else None


class ShipyardWorkerExtension:
    """Mixed into vLLM's worker class; every method is a collective-RPC target (module doc)."""

    _shipyard: tuple[Any, MirrorSink] | None = None

    def shipyard_follow(self, spec_json: str) -> dict[str, Any]:
        from shipyard.config.schema import StoreConfig
        from shipyard.store.run import open_run
        from shipyard.weights.subscriber import WeightSubscriber

        assert self._shipyard is None, "shipyard_follow was called twice"
        spec = json.loads(spec_json)
        runner = self.model_runner  # type: ignore[attr-defined]

        def reload(items: list[tuple[str, torch.Tensor]]) -> None:
            runner.reload_weights(weights_iterator=iter(items), is_checkpoint_format=True)
            if any(_LAYER.match(name) is None for name, _ in items):  # embeddings, final norm, head
                refresh_kernel_copies(runner.get_model())

        sink = MirrorSink(load_mirror(spec["model_dir"]), reload)
        subscriber = WeightSubscriber(
            open_run(StoreConfig(**spec["store"]), spec["run"]),
            sink,
            name=spec["name"],
            poll_s=spec["poll_s"],
            cache_dir=spec.get("cache_dir"),
            lease_ttl_s=spec["lease_ttl_s"],
            connections=spec["connections"],
            chunk_bytes=spec["chunk_bytes"],
            workers=spec["workers"],
        )
        subscriber.start(feed_url=spec.get("feed_url"))
        self._shipyard = (subscriber, sink)
        return {"version": sink.version(), "tensors": len(sink.mirror)}

    def shipyard_pending(self) -> int | None:
        return None if self._shipyard is None else self._shipyard[1].pending()

    def shipyard_apply(self) -> dict[str, Any] | None:
        return None if self._shipyard is None else self._shipyard[1].apply()

    def shipyard_state(self) -> dict[str, Any]:
        from shipyard.weights.states import tensor_digest
        from shipyard.weights.types import state_digest

        assert self._shipyard is not None, "shipyard_follow first"
        subscriber, sink = self._shipyard
        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        return {
            "version": sink.version(),
            "digest": state_digest({k: tensor_digest(t) for k, t in sink.mirror.items()}),
            "readable": readable_match(model, sink.mirror),
            "errors": list(subscriber.errors),
            "adopted": list(subscriber.adopted),
        }

    def shipyard_stop(self) -> None:
        if self._shipyard is not None:
            self._shipyard[0].stop()
            self._shipyard = None
