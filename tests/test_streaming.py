"""Streaming rows (``vlm_sft.data.streaming``) over local parquet / jsonl shards: every row once per epoch over the
shards (the trainer's data streams), and a resume that yields the packs of the uninterrupted run without rendering the consumed
rows again, in the main process and through DataLoader workers."""

from __future__ import annotations

import collections
import itertools
import json
import pickle
import random

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from renderers.errors import RenderError
from renderers.types import RenderedSample
from vlm_sft.data.pipeline import PackingPipeline
from vlm_sft.data.streaming import StreamingRows, local_files
from vlm_sft.data.synthetic import TextSpan, compose_sample, random_spans
from vlm_sft.trainer.batches import DataLayout, TrainBatches

NUM_FILES, ROWS_PER_FILE = 4, 25
NUM_ROWS = NUM_FILES * ROWS_PER_FILE
PACK_LEN = 64


def _length(row_id: int) -> int:
    return 4 + (row_id * 7) % 27


def _write_parquet(folder, bad: set[int] = frozenset()) -> str:
    """``NUM_FILES`` shards of ``{"id", "n"}`` rows, row groups of 10 (a resume lands inside a file's later groups)."""
    folder.mkdir()
    for f in range(NUM_FILES):
        ids = list(range(f * ROWS_PER_FILE, (f + 1) * ROWS_PER_FILE))
        table = pa.table({"id": ids, "n": [-1 if i in bad else _length(i) for i in ids]})
        pq.write_table(table, folder / f"part-{f:05d}.parquet", row_group_size=10)
    return str(folder)


@pytest.fixture(scope="module")
def parquet_dir(tmp_path_factory) -> str:
    return _write_parquet(tmp_path_factory.mktemp("stream") / "train")


BAD_ROWS = {3, 30, 31, 77}


@pytest.fixture(scope="module")
def bad_parquet_dir(tmp_path_factory) -> str:
    return _write_parquet(tmp_path_factory.mktemp("stream_bad") / "train", bad=BAD_ROWS)


class RowSample:
    """``row_to_sample`` for the test rows: a sample whose first token is the row id, the rest drawn from the id;
    ``n < 0`` is a malformed row. Counts its calls (what a resume renders again)."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, row: dict, index: int) -> RenderedSample:
        self.calls += 1
        if row["n"] < 0:
            raise RenderError("bad_length", f"n={row['n']}")
        spans = [
            TextSpan(1, ids=(row["id"],)),
            *random_spans(random.Random(row["id"]), max_tokens=row["n"], max_images=1, max_grid=4),
            TextSpan(1, trainable=True),
        ]
        return compose_sample(spans, sample_index=row["id"])


def _pipeline(rows: StreamingRows, epochs: int | None = 2) -> PackingPipeline:
    return PackingPipeline(
        0, rows, order=rows, packing="bfd", buffer_size=8, seq_len=PACK_LEN, pack_len=PACK_LEN, epochs=epochs, seed=5
    )


def _rows(source: str, shard: int = 0, num_shards: int = 1, **kwargs) -> StreamingRows:
    return StreamingRows(source, row_to_sample=RowSample(), shard=shard, num_shards=num_shards, **kwargs)


def _summary(pack) -> list[tuple[int, int, list[int]]]:
    """(sample index, row id, input token ids) of every sample of a pack."""
    return [(s.sample_index, int(s.input_ids[0]), s.input_ids.tolist()) for s in pack.samples]


def _epochs_of(pipeline: PackingPipeline) -> list[tuple[int, list]]:
    """(epoch, summary) of every pack (a pack popped belongs to the epoch the pipeline is in)."""
    return [(pipeline.epoch, _summary(pack)) for pack in pipeline]


# -- sharding -------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("num_shards", [4, 3])
def test_every_row_once_per_epoch_over_the_shards(parquet_dir, num_shards):
    """2 ranks x 2 workers (4 shards: one file each) and 3 shards (4 files do not divide: every 3rd row each)."""
    seen = collections.Counter()
    for shard in range(num_shards):
        ids = set()
        for epoch, samples in _epochs_of(_pipeline(_rows(parquet_dir, shard, num_shards))):
            seen.update((epoch, row_id) for _, row_id, _ in samples)
            ids.update(row_id for _, row_id, _ in samples)
        if num_shards == NUM_FILES:  # split by files: shard k reads file k
            assert ids == set(range(shard * ROWS_PER_FILE, (shard + 1) * ROWS_PER_FILE))
        else:  # split by rows: every num_shards-th row
            assert ids == {i for i in range(NUM_ROWS) if i % num_shards == shard}
    assert seen == {(e, i): 1 for e in range(2) for i in range(NUM_ROWS)}


def test_shuffled_files_still_cover_every_row_once_per_epoch(parquet_dir):
    epochs = 3
    seen = collections.Counter()
    first_rows = collections.defaultdict(list)
    for shard in range(2):
        for epoch, samples in _epochs_of(_pipeline(_rows(parquet_dir, shard, 2, shuffle_files=True), epochs=epochs)):
            seen.update((epoch, row_id) for _, row_id, _ in samples)
            first_rows[epoch].extend(row_id for index, row_id, _ in samples if index == 0)
    assert seen == {(e, i): 1 for e in range(epochs) for i in range(NUM_ROWS)}
    assert len({tuple(sorted(v)) for v in first_rows.values()}) > 1, "the file order never changed between epochs"


def test_jsonl_folder(tmp_path):
    folder = tmp_path / "rows"
    folder.mkdir()
    for f in range(2):
        lines = [json.dumps({"id": i, "n": _length(i)}) for i in range(f * 10, f * 10 + 10)]
        (folder / f"part-{f}.jsonl").write_text("\n".join(lines) + "\n")
    assert local_files(folder) == ("json", [str(folder / "part-0.jsonl"), str(folder / "part-1.jsonl")])
    packs = [pack for s in range(2) for _, pack in _epochs_of(_pipeline(_rows(str(folder), s, 2), epochs=1))]
    ids = [row_id for pack in packs for _, row_id, _ in pack]
    assert sorted(ids) == list(range(20))


def test_source_resolution_errors(tmp_path):
    assert local_files("some-org/some-dataset") is None  # a hub id: opened with load_dataset(id, streaming=True)
    with pytest.raises(FileNotFoundError, match="no such file"):
        local_files(tmp_path / "missing.parquet")
    (tmp_path / "a.parquet").write_bytes(b"")
    (tmp_path / "b.jsonl").write_text("")
    with pytest.raises(ValueError, match=r"must all be \.jsonl / \.json or all \.parquet"):
        local_files(tmp_path)
    with pytest.raises(ValueError, match="0 <= shard < num_shards"):
        _rows(str(tmp_path / "a.parquet"), 2, 2)


# -- resume ---------------------------------------------------------------------------------------------------------
def _checkpoints(source: str, shard: int, num_shards: int, epochs: int = 2):
    """The uninterrupted run: pack summaries, and after every k packs (k = 0 .. all, then after the end) the JSON
    round-tripped pipeline state and how many rows had been rendered."""
    rows = _rows(source, shard, num_shards)
    pipeline = _pipeline(rows, epochs)
    packs, states, calls = [], [], []
    pack = True
    while pack is not None:
        states.append(json.loads(json.dumps(pipeline.state_dict())))
        calls.append(rows.row_to_sample.calls)
        pack = next(pipeline, None)
        if pack is not None:
            packs.append(_summary(pack))
    states.append(json.loads(json.dumps(pipeline.state_dict())))  # after the end: the pipeline is in epoch `epochs`
    calls.append(rows.row_to_sample.calls)
    return packs, states, calls, pipeline.accounting.to_dict()


def _live(state: dict) -> list[int]:
    packer = state["packer"]
    return [i for pack in packer["pending"] for row in pack for i in row] + packer["buffer"]


def _check_resumes(source: str, shard: int, num_shards: int, epochs: int = 2) -> collections.Counter:
    """Resume from every checkpoint of a shard: the rest equals the uninterrupted run, the resume renders only the
    rows still in the packer (never the packed ones), and the accounting ends the same. Returns the kinds of
    checkpoints met."""
    packs, states, calls, accounting = _checkpoints(source, shard, num_shards, epochs)
    rows_per_epoch = calls[-1] // epochs
    kinds = collections.Counter()
    for k, state in enumerate(states):
        rows = _rows(source, shard, num_shards)
        pipeline = _pipeline(rows, epochs)
        pipeline.load_state_dict(state)
        live = _live(state)
        assert rows.row_to_sample.calls == len(live), f"after {k} packs: the resume rendered packed rows again"
        tail = [_summary(p) for p in pipeline]
        assert tail == packs[k:], f"shard {shard}/{num_shards}: resume after {k} packs differs"
        assert rows.row_to_sample.calls == len(live) + calls[-1] - calls[k], f"after {k} packs: rows rendered twice"
        assert pipeline.accounting.to_dict() == accounting
        if state["packer"]["buffer"] and 0 < state["position"] < rows_per_epoch:
            kinds["mid_epoch_buffered"] += 1
        if not live and state["position"] == rows_per_epoch and state["epoch"] < epochs - 1:
            kinds["epoch_boundary"] += 1
        if state["epoch"] == epochs:
            kinds["after_the_end"] += 1
    return kinds


@pytest.mark.parametrize("num_shards", [4, 3])
def test_resume_equals_uninterrupted_run(parquet_dir, num_shards):
    kinds = collections.Counter()
    for shard in range(num_shards):
        kinds += _check_resumes(parquet_dir, shard, num_shards)
    assert kinds["mid_epoch_buffered"] > 0 and kinds["epoch_boundary"] > 0 and kinds["after_the_end"] == num_shards


def test_resume_state_is_small_and_starts_at_the_oldest_buffered_row(parquet_dir):
    rows = _rows(parquet_dir, 1, 4)
    pipeline = _pipeline(rows)
    next(pipeline)
    state = pipeline.state_dict()
    live = _live(state)
    assert live, "the checkpoint should hold buffered rows"
    order = state["order"]
    assert order["first"] == min(live) and order["epoch"] == 0
    assert len(json.dumps(order)) < 2000


def test_skipped_rows_are_counted_and_resume(bad_parquet_dir):
    for shard in range(2):
        packs, _, _, accounting = _checkpoints(bad_parquet_dir, shard, 2)
        bad = {i for i in BAD_ROWS if (i // ROWS_PER_FILE) % 2 == shard}  # 4 files over 2 shards: file f -> f % 2
        assert accounting["skipped"]["bad_length"]["count"] == 2 * len(bad)
        assert accounting["samples_seen"] == accounting["samples_packed"] + 2 * len(bad)
        assert not {row_id for pack in packs for _, row_id, _ in pack} & BAD_ROWS
        _check_resumes(bad_parquet_dir, shard, 2)


def test_history_limit_fails_with_the_fix(parquet_dir):
    pipeline = _pipeline(_rows(parquet_dir, 0, 4, max_history=3))
    next(pipeline)
    with pytest.raises(RuntimeError, match="raise max_history"):
        pipeline.state_dict()


def test_pickled_copy_carries_settings_not_the_reader(parquet_dir):
    rows = _rows(parquet_dir, 2, 4)
    first = next(_pipeline(rows))  # the reader is open and mid-file: an open generator cannot be pickled
    copy = pickle.loads(pickle.dumps(rows))
    assert copy._source_ds is None and copy._rows is None
    assert _summary(next(_pipeline(copy))) == _summary(first)


# -- through DataLoader workers -------------------------------------------------------------------------------------
class Streams:
    """``(stream, streams) -> pipeline``: stream ``stream`` of ``streams`` is shard ``stream`` (what the trainer's
    ``TrainPipelines`` gives each global data stream)."""

    def __init__(self, source: str) -> None:
        self.source = source

    def __call__(self, stream: int, streams: int) -> PackingPipeline:
        return _pipeline(_rows(self.source, stream, streams), epochs=None)


def _take(batches: TrainBatches, n: int) -> list[tuple[tuple, torch.Tensor]]:
    return [(b.sample_indices, b.input_ids) for b in itertools.islice(batches, n)]


def test_train_batches_with_workers_resume(parquet_dir):
    streams = Streams(parquet_dir)
    layout = DataLayout(dp_rank=1, dp_size=2, streams_per_micro_batch=2)  # 4 streams; rank 1 reads streams 1 and 3
    n, cut = 24, 7  # 2 streams of 25 rows, about 8 packs an epoch each: the run crosses an epoch boundary
    full = _take(TrainBatches(streams, layout, pad_id=0, num_workers=2, prefetch=2), n)
    first = TrainBatches(streams, layout, pad_id=0, num_workers=2, prefetch=2)
    head = _take(first, cut)
    state = json.loads(json.dumps(first.state_dict()))
    del first
    tail = _take(TrainBatches(streams, layout, pad_id=0, num_workers=2, prefetch=2, state=state), n - cut)
    assert len(head + tail) == len(full) == n
    for k, ((ia, xa), (ib, xb)) in enumerate(zip(head + tail, full, strict=True)):
        assert ia == ib and torch.equal(xa, xb), f"batch {k} differs after the resume"
    files = {int(x[0, 0]) // ROWS_PER_FILE for _, x in full}
    assert files == {1, 3}, "4 files for 4 streams: stream k reads file k"
