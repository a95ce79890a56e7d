"""Building models and their numerics: SmolLM2 from its PyPI package, HF directories and tiny
random dense/MoE models (``loading``), precision chosen from the hardware (``hardware``), sampler
precision with an fp32 head or routers (``precision``), and MoE route capture and replay
(``router_replay``, ``routes``). Does not cover: serving or training loops."""
