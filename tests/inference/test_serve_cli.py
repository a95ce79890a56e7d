"""`shipyard serve`: a real server process that answers over HTTP and adopts new store versions."""

import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from shipyard.config.schema import ModelConfig
from shipyard.models.loading import load_model
from shipyard.store import LocalStore
from shipyard.store.run import stamp_new_run
from shipyard.weights.snapshot import WeightPublisher, named_params

ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(url: str, check, timeout_s: float = 120.0) -> dict:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        try:
            body = httpx.get(url, timeout=2).json()
            if check(body):
                return body
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"{url} never satisfied the check")


def _ignore_sigint() -> None:
    """Start the server with SIGINT ignored, as some supervisors and test runners do: Ctrl-C must still stop it."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


@pytest.mark.parametrize("run_first", [True, False], ids=["run-exists", "run-created-later"])
def test_serve_answers_and_follows_the_store(tmp_path: Path, run_first: bool) -> None:
    """Serve follows the run ``run.name``; started before the run exists (a fresh clone, issue 41), it
    serves the base model, writes nothing to the store, and follows the run once it is created."""
    port = _free_port()
    # what `shipyard train` claims; serve follows it
    run = stamp_new_run(LocalStore(tmp_path), "tiny") if run_first else None
    cmd = [
        sys.executable,
        "-m",
        "shipyard.cli",
        "serve",
        str(ROOT / "configs/tiny.toml"),
        f"inference.port={port}",
        f'store.root="{tmp_path}"',
        f'run.output_dir="{tmp_path.parent / (tmp_path.name + "-runs")}"',
        "inference.poll_s=0.2",
    ]
    log = tmp_path.parent / f"{tmp_path.name}-serve.log"
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, preexec_fn=_ignore_sigint)
    base = f"http://127.0.0.1:{port}"
    try:
        assert _wait(f"{base}/health", lambda b: b["status"] == "ok")["version"] == 0
        out = httpx.post(
            f"{base}/generate",
            json={"requests": [{"prompt_ids": [1, 2, 3], "params": {"max_tokens": 4, "temperature": 0.0}}]},
            timeout=60,
        ).json()
        assert len(out["results"][0]["token_ids"]) == 4 and out["results"][0]["versions"] == [0] * 4
        if run is None:
            assert not any(tmp_path.iterdir()), "serve wrote to the store before the run existed"
            assert "holds no run named 'tiny' yet" in log.read_text()
            run = stamp_new_run(LocalStore(tmp_path), "tiny")
        model, _ = load_model(ModelConfig(source="tiny", tiny="dense", seed=7))
        WeightPublisher(run).publish(1, named_params(model))
        _wait(f"{base}/version", lambda b: b["version"] == 1)
        out = httpx.post(
            f"{base}/generate",
            json={"requests": [{"prompt_ids": [1, 2, 3], "params": {"max_tokens": 2, "temperature": 0.0}}]},
            timeout=60,
        ).json()
        assert out["results"][0]["versions"] == [1, 1]
        # watched (issue 40): `/health` answers its progress record, for a monitor outside
        health = httpx.get(f"{base}/health", timeout=10).json()["health"]
        assert (health["component"], health["version"], health["pid"]) == (f"server {port}", 1, proc.pid)
        assert health["phase"] in ("idle", "decode") and health["seq"] >= 1
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0
