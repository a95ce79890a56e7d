"""Prepare `.gpu/`: what the GPU benchmarks need on a machine that cannot download anything.

Contract: writes ``.gpu/smollm2/`` (SmolLM2-135M's config and tokenizer files, from the converted
cache) and ``.gpu/smollm2-1.7b/`` (the same tokenizer with SmolLM2-1.7B's architecture: 24 blocks,
hidden 2048, 32 heads, MLP 8192, rope theta 130000), and downloads into ``.gpu/whl/`` the wheels the
GPU image lacks (pydantic and its parts, torchao) for CPython 3.12 manylinux, at the versions this
environment uses. ``.gpu/`` is git-excluded (``.git/info/exclude``); it travels with the device
tool's ``carry``. On the GPU machine: ``pip install --no-index --no-deps --target /tmp/site
.gpu/whl/*.whl`` and ``PYTHONPATH=/tmp/site:src``. Weights do not travel (64 MiB limit): the
benchmarks build these architectures with random weights (``model.random_init``).

Usage::

    .venv/bin/python benchmarks/gpu_carry.py
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WHEELS = ["pydantic", "pydantic_core", "annotated-types", "typing-inspection"]
TORCHAO = "0.18.0"
TOKENIZER_FILES = [
    "config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
    "chat_template.jinja",
]
SMOLLM2_17B = {
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "num_hidden_layers": 24,
    "head_dim": 64,
}


def main() -> None:
    sys.path.insert(0, str(ROOT / "src"))
    from shipyard.models.loading import smollm2_dir

    out = ROOT / ".gpu"
    src = smollm2_dir("~/.cache/shipyard/models")
    for name, dims in (("smollm2", {}), ("smollm2-1.7b", SMOLLM2_17B)):
        (out / name).mkdir(parents=True, exist_ok=True)
        for f in TOKENIZER_FILES:
            if (src / f).is_file():
                shutil.copy(src / f, out / name / f)
        cfg = json.loads((out / name / "config.json").read_text())
        cfg.update(dims)
        if dims:
            cfg["rope_parameters"]["rope_theta"] = 130000.0
        (out / name / "config.json").write_text(json.dumps(cfg, indent=2))
    pins = [f"{w}=={version(w)}" for w in WHEELS] + [f"torchao=={TORCHAO}"]
    platforms = [
        f"--platform={p}"
        for p in (
            "manylinux_2_28_x86_64",
            "manylinux_2_24_x86_64",
            "manylinux_2_17_x86_64",
            "manylinux2014_x86_64",
        )
    ]
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--only-binary=:all:",
            "--python-version=3.12",
            "--implementation=cp",
            *platforms,
            "-d",
            str(out / "whl"),
            *pins,
        ],
        check=True,
    )
    exclude = ROOT / ".git" / "info" / "exclude"
    if (ROOT / ".git").is_dir() and "/.gpu/" not in (exclude.read_text() if exclude.exists() else ""):
        exclude.parent.mkdir(parents=True, exist_ok=True)
        with exclude.open("a") as f:
            f.write("/.gpu/\n")
    print(f"{out}: {sorted(p.name for p in out.rglob('*') if p.is_file())}")


if __name__ == "__main__":
    main()
