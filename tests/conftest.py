"""Test set-up: one intra-op thread before any compute, so forked ranks start fast and safe; the
CPU as every test's device, GPU or not (INTERLACE_DEVICE=cpu, inherited by the ranks tests
launch); tests marked `cuda` skipped without CUDA and run last, so no rank is forked from a
process that has initialised CUDA."""

import os

import pytest
import torch

from interlace.mesh import DEVICE_ENV

torch.set_num_threads(1)
os.environ[DEVICE_ENV] = "cpu"

# DDP imports torch._dynamo lazily; importing it once here spares every forked rank the cost.
import torch._dynamo  # noqa: E402


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip `cuda` tests where CUDA is unavailable; move them after all others."""
    items.sort(key=lambda item: item.get_closest_marker("cuda") is not None)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if item.get_closest_marker("cuda"):
            item.add_marker(skip)
