"""Sampling for rollouts and users: the embedded engine (continuous batching, KV and prefix cache,
per-token logprobs and versions, MoE routes, deterministic mode), its HTTP server (token-in/out and
OpenAI-compatible chat), clients, and the inference node (engine + server + weight subscriber).
Promises: every token names the weight version that produced it; new weights go live between
decode steps. Does not cover: vLLM or SGLang backends (planned), training."""
