"""The embedded engine: continuous batching over a KV cache that grows in place, the prefix cache,
per-token logprobs and weight versions, MoE routes, the sampler and the CPU kernels it uses.

Modules: :mod:`.engine` (:class:`~.engine.EmbeddedEngine`, in-flight weight adoption),
:mod:`.scheduler` (many callers, one engine loop), :mod:`.kv_cache`, :mod:`.prefix_cache`,
:mod:`.sampling`, :mod:`.attention`, :mod:`.packed` and :mod:`.lean_decode` (decode kernels and the decode step on CPUs). It serves no HTTP
(:mod:`shipyard.inference.serving`) and follows no store (:mod:`shipyard.inference.backends`).
"""
