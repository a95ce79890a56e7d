"""Snapshot versions: manifest last, LATEST after it, digests verified, subscriber adopts."""

from pathlib import Path

import pytest
import torch

from shipyard.store import LocalStore
from shipyard.weights.snapshot import WeightPublisher, latest_version, load_version, published_versions
from shipyard.weights.subscriber import WeightSubscriber
from shipyard.weights.types import version_dir


def _tensors(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(64, 32, generator=g), "b": torch.randn(32, generator=g).to(torch.bfloat16)}


def test_publish_load_roundtrip_and_gc(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    pub = WeightPublisher(store, keep=2)
    for v in range(5):
        pub.publish(v, _tensors(v))
    assert latest_version(store) == 4
    assert published_versions(store) == [3, 4]
    got = load_version(store, 4)
    for k, t in _tensors(4).items():
        assert torch.equal(got[k], t) and got[k].dtype == t.dtype


def test_corruption_is_detected(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    WeightPublisher(store).publish(1, _tensors(1))
    key = f"{version_dir(1)}/model.safetensors"
    data = bytearray(store.get(key))
    data[-1] ^= 0xFF
    store.put(key, bytes(data))
    with pytest.raises(ValueError, match="version 1: digest"):
        load_version(store, 1)


def test_subscriber_stages_new_versions_and_survives_missing_objects(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    pub = WeightPublisher(store)
    staged: list[tuple[int, dict]] = []
    sub = WeightSubscriber(store, lambda v, t: staged.append((v, t)), current=0)
    assert not sub.poll_once()
    pub.publish(1, _tensors(1))
    assert sub.poll_once() and staged[-1][0] == 1
    assert torch.equal(staged[-1][1]["w"], _tensors(1)["w"])
    pub.publish(2, _tensors(2))
    store.delete(f"{version_dir(2)}/model.safetensors")
    assert not sub.poll_once() and sub.current == 1 and "version 2" in sub.errors[-1]
    pub.publish(3, _tensors(3))
    assert sub.poll_once() and sub.current == 3
