"""Shared helpers of the weight-shipping tests: a chain of real Adam-like versions."""

import time
from collections.abc import Callable

import pytest
import torch

from shipyard.store import LocalStore
from shipyard.weights.publisher import WeightPublisher


def chain(n: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """``n`` consecutive states: bf16 and fp32 tensors, each step a small update (most bf16
    elements unchanged, as in RL), plus one tensor that never changes."""
    g = torch.Generator().manual_seed(seed)
    master = {
        "w": torch.randn(256, 96, generator=g),
        "b": torch.randn(96, generator=g),
        "frozen": torch.randn(64, 8, generator=g),
    }
    out = []
    for _ in range(n):
        out.append(
            {"w": master["w"].bfloat16(), "b": master["b"].clone(), "frozen": master["frozen"].bfloat16()}
        )
        master["w"] = master["w"] + 2e-3 * torch.randn(master["w"].shape, generator=g)
        master["b"] = master["b"] + 1e-6 * torch.randn(master["b"].shape, generator=g)
    return out


def publish_chain(store: LocalStore, states: list[dict[str, torch.Tensor]], **kw: int) -> WeightPublisher:
    pub = WeightPublisher(store, **kw)
    for v, s in enumerate(states):
        pub.publish(v, s)
    return pub


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    """Bit-exact equality of two states (raw bytes, so NaN payloads and -0.0 count)."""
    return set(a) == set(b) and all(
        a[k].dtype == b[k].dtype
        and a[k].shape == b[k].shape
        and torch.equal(a[k].contiguous().view(torch.uint8), b[k].contiguous().view(torch.uint8))
        for k in a
    )


@pytest.fixture
def make_chain() -> Callable[..., list[dict[str, torch.Tensor]]]:
    return chain


@pytest.fixture
def publish() -> Callable[..., WeightPublisher]:
    return publish_chain


@pytest.fixture
def same_state() -> Callable[[dict, dict], bool]:
    return same


def _until(cond: Callable[[], bool], timeout_s: float = 20.0) -> bool:
    """Whether ``cond()`` became true within ``timeout_s`` (checked every 10 ms: the conditions here
    are states of threads and stores that announce nothing)."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.01)
    return False


@pytest.fixture
def until() -> Callable[..., bool]:
    """``until(cond, timeout_s=20.0)``: wait for a condition instead of sleeping a fixed time."""
    return _until
