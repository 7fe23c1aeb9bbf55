"""Training batches from a rank's data shares, in the main process or in N worker processes: a deterministic
stream, every sample once per epoch for any N, and a resume point that matches what the trainer consumed (not what
the workers had already built)."""

from __future__ import annotations

import collections
import itertools
import json

import pytest
import torch

from vlm_sft.data.pipeline import PackingPipeline
from vlm_sft.data.synthetic import SyntheticSource
from vlm_sft.trainer.batches import TrainBatches, auto_num_workers

SOURCE = SyntheticSource(120, distribution="short", seed=1)


class Shares:
    """``(share, shares) -> pipeline``: shard ``share`` of ``shares`` of one rank's data (picklable)."""

    def __init__(self, epochs: int | None = None, buffer_size: int = 512) -> None:
        self.epochs, self.buffer_size = epochs, buffer_size

    def __call__(self, share: int, shares: int) -> PackingPipeline:
        return PackingPipeline(
            len(SOURCE), SOURCE, seq_len=256, pack_len=256, packing="bfd", epochs=self.epochs, seed=3,
            buffer_size=self.buffer_size, rank=share, world_size=shares,
        )  # fmt: skip


def _take(batches: TrainBatches, n: int) -> list[tuple[tuple, torch.Tensor]]:
    return [(b.sample_indices, b.input_ids) for b in itertools.islice(batches, n)]


def _same(a, b) -> bool:
    return len(a) == len(b) and all(ia == ib and torch.equal(xa, xb) for (ia, xa), (ib, xb) in zip(a, b, strict=True))


@pytest.mark.parametrize("num_workers", [0, 1, 2, 4])
def test_resume_from_consumed_state_continues_the_stream(num_workers):
    shares = Shares(buffer_size=24)
    reference = _take(TrainBatches(shares, pad_id=0, num_workers=num_workers), 14)
    first = TrainBatches(shares, pad_id=0, num_workers=num_workers)
    head = _take(first, 5)  # 5 is not a multiple of the worker count: the resume must start at the right share
    state = json.loads(json.dumps(first.state_dict()))  # workers have built batches past the 5th by now
    resumed = TrainBatches(shares, pad_id=0, num_workers=num_workers, state=state)
    assert _same(head + _take(resumed, 9), reference)
    if num_workers > 1:  # the control: without the rotation to the next share, the resumed stream differs
        state["next"] = 0
        wrong = TrainBatches(shares, pad_id=0, num_workers=num_workers, state=state)
        assert not _same(head + _take(wrong, 9), reference)


def test_one_worker_stream_equals_main_process_stream():
    assert _same(_take(TrainBatches(Shares(), pad_id=0, num_workers=1), 6), _take(TrainBatches(Shares(), pad_id=0), 6))


@pytest.mark.parametrize("num_workers", [2, 4])
def test_workers_see_every_sample_once_per_epoch(num_workers):
    def samples(n: int) -> collections.Counter:
        batches = TrainBatches(Shares(epochs=1, buffer_size=16), pad_id=0, num_workers=n)
        return collections.Counter(i for b in batches for row in b.sample_indices for i in row)

    one, many = samples(0), samples(num_workers)
    assert sum(one.values()) > 100 and max(one.values()) == 1
    assert many == one


def test_accounting_sums_the_shares_as_consumed():
    batches = TrainBatches(Shares(buffer_size=16), pad_id=0, num_workers=2)
    taken = _take(batches, 6)
    acc = batches.accounting()
    assert acc.packed == sum(len(row) for indices, _ in taken for row in indices)
    assert acc.seen == acc.packed + acc.skipped + acc.buffered and acc.buffered >= 0


def test_a_checkpoint_from_another_worker_count_is_refused_with_the_fix():
    first = TrainBatches(Shares(), pad_id=0, num_workers=2)
    _take(first, 3)
    with pytest.raises(ValueError, match=r"data\.num_workers = 2"):
        TrainBatches(Shares(), pad_id=0, num_workers=1, state=first.state_dict())


def test_auto_workers_leave_a_core_per_rank():
    assert auto_num_workers(1, cores=2) == 1
    assert auto_num_workers(2, cores=2) == 0
    assert auto_num_workers(1, cores=64) == 8
    assert auto_num_workers(8, cores=64) == 7
    assert auto_num_workers(8, cores=16) == 1
