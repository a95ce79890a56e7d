"""HTTP serving: the embedded engine's server (token-in/out ``/generate``, OpenAI-compatible chat and
completions), OpenAI tool calling (rendering ``tools`` into the prompt, parsing the model's calls;
the session endpoint and the vLLM contract use it too) and ``shipyard serve``.

Modules: :mod:`.server` (FastAPI routes over the scheduler), :mod:`.openai_api` (the chat surface),
:mod:`.tools` (tool calling), :mod:`.serve` (the command).
"""
