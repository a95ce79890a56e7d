"""Sampling for rollouts and users, in three subpackages by concern: :mod:`.engine` (the embedded
engine: continuous batching, KV and prefix cache, per-token logprobs and versions, MoE routes,
deterministic mode), :mod:`.serving` (HTTP: token-in/out, OpenAI-compatible chat with tool calling,
``shipyard serve``) and :mod:`.backends` (one inference server of a run, embedded or vLLM, following
its published weights); :mod:`.types` holds the records and the client interface, :mod:`.client`
its HTTP and in-process clients.
Promises: every token names the weight version that produced it; new weights go live between
decode steps. Does not cover: training."""
