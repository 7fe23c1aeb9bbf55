"""Test-wide settings: offline hub, deterministic torch, and the ``gpu`` marker's skip."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("MPLBACKEND", "Agg")

import pytest
import torch


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs CUDA (gpu marker); run on a GPU machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="module")
def processor():
    """The offline tiny Qwen3.5 processor (one per test module, so a module's changes never leak to another)."""
    from processors import load_tiny_processor

    return load_tiny_processor()


@pytest.fixture(scope="module")
def renderer(processor):
    """The default Qwen3.5 renderer over the tiny processor."""
    from renderers import get_renderer

    return get_renderer(processor)


@pytest.fixture(autouse=True)
def _seed_torch() -> None:
    torch.manual_seed(0)
