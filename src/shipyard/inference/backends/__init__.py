"""Inference backends: one inference server of a run that follows its published weights, embedded or
vLLM, behind one interface; :func:`.base.start_node` picks it from ``inference.type``.

Modules: :mod:`.base` (the interface and the switch), :mod:`.embedded` (engine + server + weight
subscriber), :mod:`.vllm` (a vLLM server adopting deltas), :mod:`.vllm_server` (the vLLM process and
its token client), :mod:`.vllm_worker` (the extension loaded inside vLLM's workers).
"""
