"""Training batches with and without a prefetching worker: the same stream, and a resume point that matches what the
trainer consumed (not what the worker had already built)."""

from __future__ import annotations

import functools
import itertools

import pytest
import torch

from vlm_sft.data.pipeline import PackingPipeline
from vlm_sft.data.synthetic import SyntheticSource
from vlm_sft.trainer.batches import TrainBatches


def _pipeline() -> PackingPipeline:
    source = SyntheticSource(120, distribution="short", seed=1)
    return PackingPipeline(len(source), source, seq_len=256, pack_len=256, packing="bfd", epochs=None, seed=3)


def _take(batches: TrainBatches, n: int) -> list[tuple[tuple, torch.Tensor]]:
    return [(b.sample_indices, b.input_ids) for b in itertools.islice(batches, n)]


def _same(a, b) -> bool:
    return len(a) == len(b) and all(ia == ib and torch.equal(xa, xb) for (ia, xa), (ib, xb) in zip(a, b, strict=True))


@pytest.mark.parametrize("num_workers", [0, 1])
def test_resume_from_consumed_state_continues_the_stream(num_workers):
    reference = _take(TrainBatches(_pipeline, pad_id=0), 10)
    first = TrainBatches(_pipeline, pad_id=0, num_workers=num_workers)
    head = _take(first, 4)
    state = first.state_dict()  # the worker has built batches past the 4th by now; the state must not reflect them
    resumed = TrainBatches(_pipeline, pad_id=0, num_workers=num_workers, state=state)
    assert _same(head + _take(resumed, 6), reference)


def test_worker_stream_equals_main_process_stream():
    assert _same(
        _take(TrainBatches(_pipeline, pad_id=0, num_workers=1), 6), _take(TrainBatches(_pipeline, pad_id=0), 6)
    )


def test_more_than_one_worker_is_refused():
    with pytest.raises(ValueError, match="one prefetching worker"):
        TrainBatches(functools.partial(_pipeline), pad_id=0, num_workers=2)
