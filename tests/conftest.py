"""Test-wide settings: offline hub, deterministic torch, the ``gpu`` marker's skip and the ``interpret`` lane's set-up.

The ``interpret`` lane (``tests/test_kernels_interpret.py``) runs flash-linear-attention's triton kernels on CPU
tensors under Triton's interpreter. ``TRITON_INTERPRET=1`` is set here, on a machine without CUDA where triton is
installed, before anything imports triton: with fla installed, transformers' Qwen3.5 module imports it (and triton)
while other test modules are collected, so a lane module that set the variable itself would be too late. The lane's
tests are skipped, with the reason, where the ``interpret`` extra is not installed; where it is installed at other
versions than ``triton_interpret.PINNED``, selecting them is an error, not a skip (the interpreter workarounds are
written for the pinned versions, and one that silently stopped applying would make the lane lie).
"""

from __future__ import annotations

import importlib.util
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("MPLBACKEND", "Agg")

import pytest
import torch

if not torch.cuda.is_available() and importlib.util.find_spec("triton") is not None:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported (module docstring)


def _interpret_extra_installed() -> bool:
    return all(importlib.util.find_spec(m) is not None for m in ("triton", "fla"))


@pytest.hookimpl(trylast=True)  # after ``-m`` has deselected: only a run that selects the lane is refused
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    _set_up_interpret_lane(items)
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs CUDA (gpu marker); run on a GPU machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


def _set_up_interpret_lane(items: list[pytest.Item]) -> None:
    lane = [item for item in items if "interpret" in item.keywords]
    if not lane:
        return
    if not _interpret_extra_installed():
        skip = pytest.mark.skip(reason='needs the interpret extra: pip install -e ".[interpret]" in its own venv')
        for item in lane:
            item.add_marker(skip)
        return
    from triton_interpret import version_mismatches

    if mismatches := version_mismatches():
        raise pytest.UsageError(
            "the interpret lane's workarounds (tests/triton_interpret.py) are pinned to other versions than the "
            f'installed ones: {"; ".join(mismatches)}. Fix: pip install -e ".[interpret]", or re-check the '
            "workarounds against the new versions and update triton_interpret.PINNED and the extra."
        )
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise pytest.UsageError(
            "the interpret lane needs TRITON_INTERPRET=1 (set by tests/conftest.py only without CUDA); on a CUDA "
            'machine run the kernels with -m gpu instead, or run the lane with -m "interpret" and TRITON_INTERPRET=1'
        )


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


@pytest.fixture(scope="module")
def image_files(tmp_path_factory) -> list[str]:
    """Five png files of shapes in different sizes (``chat_fixtures.conversations`` takes their paths)."""
    from chat_fixtures import shape_image

    root = tmp_path_factory.mktemp("images")
    sizes = [(64, 64), (96, 96), (64, 128), (96, 64), (32, 32)]
    paths = []
    for i, size in enumerate(sizes):
        path = root / f"shape{i}.png"
        shape_image(i, size).save(path)
        paths.append(str(path))
    return paths


@pytest.fixture(autouse=True)
def _seed_torch() -> None:
    torch.manual_seed(0)
