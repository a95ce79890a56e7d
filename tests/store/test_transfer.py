"""Resumable parallel transfers on the local store: a download killed by SIGKILL resumes without
starting over; a corrupted object is detected and its partial file discarded."""

import hashlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from shipyard.store import LocalStore
from shipyard.store.transfer import download, fetch_bytes

KILLER = """
import os, signal, sys
from pathlib import Path
from shipyard.store import LocalStore
from shipyard.store.transfer import download

def die(i):
    if i == 3:
        os.kill(os.getpid(), signal.SIGKILL)

download(LocalStore(sys.argv[1]), "obj.bin", Path(sys.argv[2]), connections=1, chunk_bytes=65536, on_chunk=die)
"""


def test_killed_download_resumes_byte_exact_without_restarting(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "store")
    data = os.urandom(10 * 65536 + 123)
    store.put("obj.bin", data)
    dest = tmp_path / "dl" / "obj.bin"
    proc = subprocess.run([sys.executable, "-c", KILLER, str(store.root), str(dest)], check=False)
    assert proc.returncode == -signal.SIGKILL
    assert not dest.exists() and dest.with_name("obj.bin.part").exists()
    rep = download(store, "obj.bin", dest, hashlib.sha256(data).hexdigest(), connections=3, chunk_bytes=65536)
    assert rep.chunks_resumed == 4, "chunks 0-3 were journaled before the kill"
    assert rep.chunks_fetched == 7 and rep.bytes_fetched == len(data) - 4 * 65536
    assert dest.read_bytes() == data
    assert not dest.with_name("obj.bin.part.journal").exists()
    again = download(store, "obj.bin", dest, hashlib.sha256(data).hexdigest())
    assert again.bytes_fetched == 0, "a complete verified file is not fetched again"


def test_corrupted_object_is_detected_and_refetched_clean(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "store")
    data = os.urandom(300_000)
    sha = hashlib.sha256(data).hexdigest()
    bad = bytearray(data)
    bad[150_000] ^= 0x40
    store.put("obj.bin", bytes(bad))
    dest = tmp_path / "obj.bin"
    with pytest.raises(ValueError, match="obj.bin.*sha256.*corrupted"):
        download(store, "obj.bin", dest, sha, chunk_bytes=65536)
    assert not dest.exists() and not dest.with_name("obj.bin.part").exists()
    store.put("obj.bin", data)  # repaired at the source
    rep = download(store, "obj.bin", dest, sha, chunk_bytes=65536)
    assert rep.chunks_resumed == 0 and dest.read_bytes() == data


def test_fetch_bytes_parallel_ranges(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    data = os.urandom(1_000_003)
    store.put("x", data)
    before = store.stats.reads
    assert fetch_bytes(store, "x", len(data), connections=4, chunk_bytes=100_000) == data
    assert store.stats.reads - before == 11
