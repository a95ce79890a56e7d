"""Shared fixtures of the inference tests."""

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from shipyard.config.schema import ModelConfig
from shipyard.models.loading import load_model


@pytest.fixture(scope="module", autouse=True)
def _one_thread() -> Iterator[None]:
    """One intra-op thread: the test machine is small and shared, where more threads only contend."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def model_tok() -> tuple[Any, Any]:
    """The tiny dense model and its tokenizer (the SmolLM2 one)."""
    return load_model(ModelConfig(source="tiny", tiny="dense"))
