"""Training batches from the packing pipeline, in the main process or prefetched by a dataloader worker.

Rendering images and packing cost CPU time that a worker process can overlap with the model's step. The worker runs
the whole pipeline and sends each collated ``PackedBatch`` together with the pipeline state *after* it, so the state
saved in a checkpoint is always that of the last batch the trainer consumed, never of batches still in flight: a
resumed run continues exactly where the killed one stopped, with or without a worker.

One worker at most: a single pipeline yields the packs in their one deterministic order (several workers would each
need a shard of the stream and a state of their own).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from vlm_sft.data.batch import PackedBatch
from vlm_sft.data.collate import collate
from vlm_sft.data.pipeline import PackingPipeline


class _PipelineBatches(IterableDataset):
    """Iterates ``(batch, pipeline state after it)`` of a pipeline restored to ``state``."""

    def __init__(self, make_pipeline: Callable[[], PackingPipeline], state: dict | None, pad_id: int, merge: int):
        self.make_pipeline = make_pipeline
        self.state = state
        self.pad_id = pad_id
        self.merge = merge

    def __iter__(self) -> Iterator[tuple[PackedBatch, dict]]:
        if get_worker_info() is not None:
            torch.set_num_threads(1)  # the worker renders and packs; leave the cores' threads to the model
        pipeline = self.make_pipeline()
        if self.state is not None:
            pipeline.load_state_dict(self.state)
        for pack in pipeline:
            batch = collate([pack], pad_id=self.pad_id, spatial_merge_size=self.merge)
            yield batch, pipeline.state_dict()


class TrainBatches:
    """``next(batches)`` -> the next ``PackedBatch``; ``state_dict()`` -> the pipeline state after it."""

    def __init__(
        self,
        make_pipeline: Callable[[], PackingPipeline],
        *,
        pad_id: int,
        spatial_merge_size: int = 2,
        num_workers: int = 0,
        state: dict | None = None,
        pin_memory: bool = False,
    ) -> None:
        if num_workers not in (0, 1):
            raise ValueError(f"num_workers={num_workers}: use 0 (main process) or 1 (one prefetching worker)")
        dataset = _PipelineBatches(make_pipeline, state, pad_id, spatial_merge_size)
        if num_workers == 0:
            self._iter: Iterator[tuple[PackedBatch, dict]] = iter(dataset)
        else:
            loader = DataLoader(
                dataset,
                batch_size=None,
                num_workers=1,
                prefetch_factor=4,
                pin_memory=pin_memory,
                persistent_workers=False,
            )
            self._iter = iter(loader)
        self._state = state

    def __iter__(self) -> TrainBatches:
        return self

    def __next__(self) -> PackedBatch:
        batch, self._state = next(self._iter)
        return batch

    def state_dict(self) -> dict | None:
        """Pipeline state after the last batch handed out (None before the first one of a fresh run)."""
        return self._state
