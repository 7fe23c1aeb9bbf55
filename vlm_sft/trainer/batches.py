"""Training batches from the packing pipelines of one rank: in the main process or in N data worker processes.

Rendering images and packing cost CPU time that worker processes overlap with the model's step. With N workers the
rank's samples are split into N disjoint shares (``make_pipeline(share, N)``: each share is a pipeline shard of its
own), worker ``k`` renders and packs one share, and the batches are taken from the workers in turn (share 0, 1, ...,
N-1, 0, ...: torch's DataLoader keeps that order; a share whose finite stream ended drops out of the turn), so the
stream is deterministic for a given N.

Each batch travels with its share's pipeline state *after* it. ``state_dict()`` holds the latest state of every
share plus which share comes next, i.e. exactly what the trainer consumed, never what workers built ahead of it. A
resumed run restarts every share from its state and rotates the workers so the share that was next comes first: the
packs after the resume are those of the uninterrupted run, for any N.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator

import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from vlm_sft.data.accounting import DataAccounting
from vlm_sft.data.batch import PackedBatch
from vlm_sft.data.collate import collate
from vlm_sft.data.pipeline import PackingPipeline

logger = logging.getLogger(__name__)

MAX_AUTO_WORKERS = 8
"""``data.num_workers = None`` never starts more workers than this per rank (``bench/bench_data.py``: one H200 on
the 0.8B model needs about 8 for 1-4 real-size images per sample)."""

MakePipeline = Callable[[int, int], PackingPipeline]
"""``(share, shares) -> pipeline`` of this rank's ``share``-th of ``shares`` disjoint parts of its samples."""


def auto_num_workers(local_world_size: int, cores: int | None = None) -> int:
    """Workers per rank when the config leaves it open: the cores left beside each rank's own, between 0 and 8."""
    if cores is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(0, min(MAX_AUTO_WORKERS, cores // max(local_world_size, 1) - 1))


def resolve_num_workers(setting: int | None, *, log: bool = False) -> int:
    """``data.num_workers``, or when unset one per core left beside this machine's ranks (``LOCAL_WORLD_SIZE``)."""
    if setting is not None:
        return setting
    n = auto_num_workers(int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    if log:
        logger.info("data: %d worker process(es) per rank (data.num_workers unset: one per spare core)", n)
    return n


class _ShareBatches(IterableDataset):
    """Iterates ``(batch, share, pipeline state after it)``; in worker ``w`` the share is ``(w + offset) % shares``."""

    def __init__(self, make_pipeline: MakePipeline, states: list[dict | None], offset: int, pad_id: int, merge: int):
        self.make_pipeline = make_pipeline
        self.states = states
        self.offset = offset
        self.pad_id = pad_id
        self.merge = merge

    def __iter__(self) -> Iterator[tuple[PackedBatch, int, dict]]:
        info = get_worker_info()
        if info is not None:
            torch.set_num_threads(1)  # a worker renders and packs; leave the cores' threads to the model
        shares = len(self.states)
        share = ((info.id if info is not None else 0) + self.offset) % shares
        pipeline = self.make_pipeline(share, shares)
        if self.states[share] is not None:
            pipeline.load_state_dict(self.states[share])
        for pack in pipeline:
            batch = collate([pack], pad_id=self.pad_id, spatial_merge_size=self.merge)
            yield batch, share, pipeline.state_dict()


class TrainBatches:
    """``next(batches)`` -> the next ``PackedBatch``; ``state_dict()`` -> every share's pipeline state after it."""

    def __init__(
        self,
        make_pipeline: MakePipeline,
        *,
        pad_id: int,
        spatial_merge_size: int = 2,
        num_workers: int = 0,
        prefetch: int = 4,
        state: dict | None = None,
        pin_memory: bool = False,
    ) -> None:
        if num_workers < 0:
            raise ValueError(f"num_workers={num_workers}: use 0 (main process) or more worker processes")
        shares = max(num_workers, 1)
        if state is not None and len(state["shares"]) != shares:
            raise ValueError(
                f"the checkpoint's data position was saved with {len(state['shares'])} data share(s) per rank and "
                f"this run has {shares}: the packs depend on it; set data.num_workers = {len(state['shares'])}"
            )
        self._states: list[dict | None] = list(state["shares"]) if state is not None else [None] * shares
        self._next = int(state["next"]) if state is not None else 0
        dataset = _ShareBatches(make_pipeline, list(self._states), self._next, pad_id, spatial_merge_size)
        if num_workers == 0:
            self._iter: Iterator[tuple[PackedBatch, int, dict]] = iter(dataset)
        else:
            loader = DataLoader(
                dataset,
                batch_size=None,
                num_workers=num_workers,
                prefetch_factor=prefetch,
                pin_memory=pin_memory,
                persistent_workers=False,
            )
            self._iter = iter(loader)

    def __iter__(self) -> TrainBatches:
        return self

    def __next__(self) -> PackedBatch:
        batch, share, state = next(self._iter)
        self._states[share] = state
        self._next = (share + 1) % len(self._states)
        return batch

    def state_dict(self) -> dict:
        """The pipeline state of every share after its last batch handed out (None before its first), and the next
        share."""
        return {"shares": list(self._states), "next": self._next}

    def accounting(self) -> DataAccounting:
        """This rank's samples seen / packed / skipped up to the last batch handed out."""
        return DataAccounting.from_pipeline_states(s for s in self._states if s is not None)
