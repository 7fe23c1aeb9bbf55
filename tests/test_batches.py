"""Training batches from global data streams: the same packs for a given global batch whatever the number of ranks
and data workers, a resume point that matches what the trainer consumed (not what the workers had built), that
resumes on another split of the same global batch, and refusals with the fix for anything else."""

from __future__ import annotations

import collections
import itertools
import json

import pytest

from vlm_sft.checkpoint.state import merge_positions
from vlm_sft.config import ConfigError
from vlm_sft.data.collate import collate
from vlm_sft.data.pipeline import PackingPipeline
from vlm_sft.data.synthetic import SyntheticSource
from vlm_sft.trainer.batches import DataLayout, TrainBatches, auto_num_workers, dealt_workers

SOURCE = SyntheticSource(120, distribution="short", seed=1)


class Streams:
    """``(stream, streams) -> pipeline``: pipeline shard ``stream`` of ``streams`` of the data (picklable)."""

    def __init__(self, epochs: int | None = None, buffer_size: int = 16) -> None:
        self.epochs, self.buffer_size = epochs, buffer_size

    def __call__(self, stream: int, streams: int) -> PackingPipeline:
        return PackingPipeline(
            len(SOURCE), SOURCE, seq_len=256, pack_len=256, packing="bfd", epochs=self.epochs, seed=3,
            buffer_size=self.buffer_size, rank=stream, world_size=streams,
        )  # fmt: skip


def _take(batches: TrainBatches, n: int) -> list[tuple]:
    """The sample indices of the next ``n`` batches (a pack is identified by its samples)."""
    return [b.sample_indices for b in itertools.islice(batches, n)]


def _steps(per_rank: list[list[tuple]], micro_batches: int) -> list[list[tuple]]:
    """Per optimizer step, the micro-batches of rank 0, then rank 1, ...: the global batch in its global order."""
    steps = len(per_rank[0]) // micro_batches
    return [[b for rank in per_rank for b in rank[s * micro_batches : (s + 1) * micro_batches]] for s in range(steps)]


def _json(state: dict) -> dict:
    return json.loads(json.dumps(state))  # what a checkpoint writes and reads back


def test_a_rank_reads_its_streams_in_a_fixed_cycle():
    layout = DataLayout(dp_rank=1, dp_size=2, micro_batches=2, streams_per_micro_batch=2)  # B = 4, G = 8
    assert (layout.global_batch, layout.num_streams) == (4, 8)
    assert layout.cycle() == [2, 3, 6, 7]  # step 0: global micro-batches 2, 3; step 1: 6, 7; step 2: 10, 11 = 2, 3
    assert layout.steps_before_end(stream=2, packs=1) == 2  # its second visit is global micro-batch 10, in step 2
    assert layout.steps_before_end(stream=7, packs=0) == 1
    assert [dealt_workers(n, 8) for n in (0, 1, 2, 3, 5, 8, 12)] == [0, 1, 2, 2, 4, 8, 8]


def test_same_stream_for_any_number_of_workers():
    layout = DataLayout(streams_per_micro_batch=4)
    reference = _take(TrainBatches(Streams(), layout, pad_id=0), 10)
    assert len(set(reference)) == 10
    for workers in (1, 2, 3):  # 3 does not divide the rank's 4 streams: 2 are used
        assert _take(TrainBatches(Streams(), layout, pad_id=0, num_workers=workers), 10) == reference, workers


def test_same_global_batch_same_packs_whatever_the_ranks_and_workers():
    one = _take(TrainBatches(Streams(), DataLayout(0, 1, 2, 4), pad_id=0, num_workers=2), 8)  # 1 rank x 2
    two = [_take(TrainBatches(Streams(), DataLayout(r, 2, 1, 4), pad_id=0, num_workers=r), 4) for r in (0, 1)]
    assert _steps([one], 2) == _steps(two, 1)
    other_c = _take(TrainBatches(Streams(), DataLayout(0, 1, 2, 2), pad_id=0), 8)
    assert other_c != one  # the control: the streams per micro-batch are part of the data order


@pytest.mark.parametrize("num_workers", [0, 2])
def test_resume_from_consumed_state_continues_the_stream(num_workers):
    layout = DataLayout(streams_per_micro_batch=4)
    reference = _take(TrainBatches(Streams(), layout, pad_id=0, num_workers=num_workers), 12)
    first = TrainBatches(Streams(), layout, pad_id=0, num_workers=num_workers)
    head = _take(first, 5)  # workers have built batches past the 5th by now
    state = _json(first.state_dict())
    resumed = TrainBatches(Streams(), layout, pad_id=0, num_workers=num_workers, state=state)
    assert head + _take(resumed, 7) == reference
    state["micro_batches"] = 0  # the control: the streams' states without the position in the cycle
    wrong = TrainBatches(Streams(), layout, pad_id=0, num_workers=num_workers, state=state)
    assert head + _take(wrong, 7) != reference


def test_resume_two_ranks_on_one_with_the_same_global_batch():
    """3 steps on 2 ranks x 1 micro-batch, then the joined position on 1 rank x 2: the steps of the 2-rank run."""
    two = [TrainBatches(Streams(), DataLayout(r, 2, 1, 4), pad_id=0) for r in (0, 1)]
    head = _steps([_take(b, 3) for b in two], 1)
    position = merge_positions(_json(b.state_dict()) for b in two)
    assert position["micro_batches"] == 6 and len(position["streams"]) == 6
    resumed = TrainBatches(Streams(), DataLayout(0, 1, 2, 4), pad_id=0, num_workers=2, state=position)
    tail = _steps([_take(resumed, 6)], 2)
    more = [_take(TrainBatches(Streams(), DataLayout(r, 2, 1, 4), pad_id=0), 6) for r in (0, 1)]
    assert head + tail == _steps(more, 1)


def test_a_resume_with_another_global_batch_or_streams_is_refused_with_the_fix():
    two = [TrainBatches(Streams(), DataLayout(r, 2, 1, 4), pad_id=0) for r in (0, 1)]
    for b in two:
        _take(b, 2)
    position = merge_positions(_json(b.state_dict()) for b in two)
    message = (
        r"written with 2 processes x 1 micro-batch = global batch 2; this run has 1 process x 1 micro-batch = "
        r"global batch 1: .*set train\.micro_batches = 2"
    )
    with pytest.raises(ConfigError, match=message):
        TrainBatches(Streams(), DataLayout(0, 1, 1, 4), pad_id=0, state=position)
    with pytest.raises(ConfigError, match=r"launch 2 processes"):
        TrainBatches(Streams(), DataLayout(0, 3, 1, 4), pad_id=0, state=position)
    with pytest.raises(ConfigError, match=r"set data\.streams_per_micro_batch = 4"):
        TrainBatches(Streams(), DataLayout(0, 1, 2, 8), pad_id=0, state=position)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_finite_data_ends_at_the_first_stream_that_runs_out(num_workers):
    layout = DataLayout(streams_per_micro_batch=4)
    streams = [[collate([p], pad_id=0).sample_indices for p in Streams(epochs=1)(g, 4)] for g in range(4)]
    first_end = min(range(4), key=lambda g: (len(streams[g]), g))  # the stream whose pass is shortest, first
    expected = [streams[i % 4][i // 4] for i in range(4 * len(streams[first_end]) + first_end)]
    got = _take(TrainBatches(Streams(epochs=1), layout, pad_id=0, num_workers=num_workers), 10_000)
    assert got == expected
    assert max(collections.Counter(i for indices in got for row in indices for i in row).values()) == 1


def test_accounting_sums_the_streams_as_consumed():
    batches = TrainBatches(Streams(), DataLayout(streams_per_micro_batch=4), pad_id=0, num_workers=2)
    taken = _take(batches, 6)
    acc = batches.accounting()
    assert acc.packed == sum(len(row) for indices in taken for row in indices)
    assert acc.seen == acc.packed + acc.skipped + acc.buffered and acc.buffered >= 0
    assert acc.passes == 0  # no stream has finished a pass (and two were never read)


def test_auto_workers_leave_a_core_per_rank():
    assert auto_num_workers(1, cores=2) == 1
    assert auto_num_workers(2, cores=2) == 0
    assert auto_num_workers(1, cores=64) == 8
    assert auto_num_workers(8, cores=64) == 7
    assert auto_num_workers(8, cores=16) == 1


def test_streams_whose_epoch_fits_the_bfd_buffer_are_warned_about(caplog):
    """The default run's 4000 samples over 8 streams (500 each, buffer 512) packed every epoch longest-first and
    ended at 37% colour accuracy; one stream (4000 samples) mixes them."""
    from vlm_sft.trainer.batches import warn_small_streams

    with caplog.at_level("WARNING"):
        assert warn_small_streams(4000, DataLayout(streams_per_micro_batch=8), 512, "bfd")
    assert "data.streams_per_micro_batch" in caplog.text
    assert not warn_small_streams(4000, DataLayout(streams_per_micro_batch=1), 512, "bfd")
    assert not warn_small_streams(4000, DataLayout(streams_per_micro_batch=8), 512, "cat")
