"""Local store: atomic puts, listing that never shows temporaries, key validation."""

import threading
from pathlib import Path

import pytest

from shipyard.store import LocalStore


def test_put_get_list_delete(tmp_path: Path) -> None:
    s = LocalStore(tmp_path)
    s.put("a/b/c.bin", b"123")
    s.put("a/d.bin", b"4")
    assert s.get("a/b/c.bin") == b"123"
    assert s.list("a/") == ["a/b/c.bin", "a/d.bin"]
    assert s.list("zzz/") == []
    s.delete("a/d.bin")
    assert not s.exists("a/d.bin")
    with pytest.raises(FileNotFoundError, match="a/d.bin"):
        s.get("a/d.bin")
    with pytest.raises(ValueError, match="relative path"):
        s.put("../escape", b"x")


def test_readers_never_see_partial_objects(tmp_path: Path) -> None:
    s = LocalStore(tmp_path)
    payloads = [bytes([i]) * 2_000_000 for i in range(1, 6)]
    stop = threading.Event()
    seen: list[int] = []

    def reader() -> None:
        while not stop.is_set():
            if s.exists("k"):
                data = s.get("k")
                assert len(data) == 2_000_000 and data == bytes([data[0]]) * len(data)
                seen.append(data[0])
            assert all(".tmp-" not in k for k in s.list(""))

    t = threading.Thread(target=reader)
    t.start()
    for p in payloads * 4:
        s.put("k", p)
    stop.set()
    t.join()
    assert seen, "reader never observed the object"
