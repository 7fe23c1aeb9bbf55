"""The trainer's own batches for data-order tests: rank 0's micro-batches as ``trainer.setup.setup`` builds its
``TrainBatches`` (``data_build.TrainPipelines`` over a source), and a comparison that names every field that differs."""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

import torch

from vlm_sft.data import build as data_build
from vlm_sft.trainer.batches import DataLayout, TrainBatches


def rank0_batches(cfg: Any, processor: Any, renderer: Any, source: Any, *, num_workers: int, count: int) -> list[dict]:
    """The first ``count`` micro-batches of rank 0 of one process, each as a dict of its fields."""
    layout = DataLayout(0, 1, cfg.train.micro_batches, cfg.data.streams_per_micro_batch)
    train_batches = TrainBatches(
        data_build.TrainPipelines(cfg, source, renderer),
        layout,
        pad_id=int(processor.tokenizer.pad_token_id),
        num_workers=num_workers,
        prefetch=cfg.data.prefetch_packs,
    )
    return [dataclasses.asdict(b) for b in itertools.islice(train_batches, count)]


def batch_differences(a: list[dict], b: list[dict]) -> list[str]:
    """Where two batch sequences differ (empty: the same batches in the same order, every field equal)."""
    if len(a) != len(b):
        return [f"{len(a)} vs {len(b)} batches"]
    out = []
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        for name in x:
            u, v = x[name], y[name]
            same = torch.equal(u, v) if isinstance(u, torch.Tensor) and isinstance(v, torch.Tensor) else u == v
            if not same:
                out.append(f"batch {i}: {name}")
    return out
