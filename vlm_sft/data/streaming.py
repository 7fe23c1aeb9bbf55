"""Streaming rows: a ``SampleOrder`` and ``render_fn`` over a ``datasets`` IterableDataset, for data too large to
prepare on local disk.

``StreamingRows(source, row_to_sample=..., shard=k, num_shards=n)`` reads shard ``k`` of ``n`` of ``source`` (a local
parquet / jsonl file, a folder of such shards, or a hub dataset id) row by row and is both the ``order`` and the
``render_fn`` of one ``PackingPipeline``::

    rows = StreamingRows("data/train/", row_to_sample=convert, shard=stream, num_shards=num_streams)
    pipeline = PackingPipeline(0, rows, order=rows, seq_len=..., pack_len=...)

Order: rows are visited in shard order, never globally shuffled (a shuffle buffer cannot be resumed exactly). The
sample index of a row is its position in this shard's pass (0, 1, ...), so indices are unique within an epoch of one
shard only. Every epoch re-reads the shard from its start; ``shuffle_files=True`` changes the order of the files (the
same on every shard, so each row is still read once per epoch over all shards).

Sharding is ``datasets.distributed.split_dataset_by_node``: when the number of files (file shards) is a multiple of
``num_shards`` each shard reads its own files (file ``i`` goes to shard ``i % num_shards``); otherwise every shard
reads every file and keeps every ``num_shards``-th row, which multiplies the I/O by ``num_shards`` (a warning says
so once). Either way every row is read by exactly one shard per epoch.

Resume: the reader's position is the IterableDataset's own ``state_dict()`` (file index and row offset in it). The
pipeline's state keeps the rows still in its packer's buffer, which must be rendered again on resume, so the state
recorded here is the reader's position *just before the oldest of those rows* and that row's index. On resume the
reader is restored there and reads forward to where the pipeline stopped, rendering only the rows still buffered:
the rows in between were packed already, so they are read, never rendered. A resume therefore re-reads at most the
rows since the oldest sample still in the packer's buffer (about ``data.bfd_buffer`` rows, plus the rows of packs
decided and not yet yielded), never what was consumed before. Restoring the reader itself (``datasets``) skips the
files before the recorded one without opening them and re-reads, at Arrow speed, the recorded file from its start
up to the row group that holds the position.
"""

from __future__ import annotations

import functools
import logging
import os
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from renderers.types import RenderedSample
from vlm_sft.data.snapshots import DataKind, snapshot_files
from vlm_sft.data.sources import local_path

logger = logging.getLogger(__name__)


RowToSample = Callable[[dict, int], RenderedSample]
"""``(raw row, sample index) -> RenderedSample``; raises a ``SampleError`` subclass for a row that cannot be used."""

DEFAULT_MAX_HISTORY = 16_384
"""Reader positions (about 1 KB each) kept for rows that may still be in the packer's buffer. Each pipeline
``state_dict()`` drops those older than its oldest buffered row, so a trainer holds a few hundred (about
``bfd_buffer``); the limit only bounds a pass that never saves its state (the data report)."""


def local_files(
    source: str | os.PathLike, *, subset: str | None = None, split: str = "train"
) -> tuple[DataKind, list[str]] | None:
    """``(builder, sorted file paths)`` of a local file, folder or hub snapshot (``snapshots.snapshot_files``: its
    subset and split), or None when ``source`` names a hub dataset. The sorted order decides which shard reads which
    file, so it is the same on every process."""
    path = local_path(source)  # a missing local-looking path is FileNotFoundError, never a hub lookup
    if path is None:
        return None
    found = snapshot_files(path, subset=subset, split=split)
    return found.kind, list(found.files)


def open_stream(
    source: str, *, split: str, files: tuple[DataKind, list[str]] | None, load_kwargs: Mapping[str, Any] | None = None
) -> Any:
    """The whole ``source`` as a ``datasets.IterableDataset`` (imported here: only streaming runs need it)."""
    import datasets

    kwargs = dict(load_kwargs or {})
    if files is None:
        return datasets.load_dataset(source, split=split, streaming=True, **kwargs)
    kind, paths = files
    return datasets.load_dataset(kind, data_files={split: paths}, split=split, streaming=True, **kwargs)


@functools.lru_cache(maxsize=16)
def _warn_uneven(source: str, file_shards: int, num_shards: int) -> None:
    """Once per process and setting: every shard reads the whole source when the files do not divide evenly."""
    logger.warning(
        "streaming %s: %d file shard(s) is not a multiple of %d data streams (data.streams_per_micro_batch x global batch), so every stream reads "
        "every file and keeps 1 row in %d; write a multiple of %d files to read each file once",
        source, file_shards, num_shards, num_shards, num_shards,
    )  # fmt: skip


class StreamingRows:
    """Shard ``shard`` of ``num_shards`` of a streamed dataset, as a pipeline's ``order`` and ``render_fn``.

    ``index_at(epoch, position)`` reads the next row of the shard and returns ``position`` (None at the end of the
    shard); ``rows(position)`` then converts that row with ``row_to_sample(row, position)``. Positions must be asked
    for in order, as ``PackingPipeline`` does. Picklable: a copy carries the settings only and opens its own reader
    when first used (data workers build theirs in the worker).
    """

    def __init__(
        self,
        source: str | os.PathLike,
        *,
        row_to_sample: RowToSample,
        shard: int = 0,
        num_shards: int = 1,
        split: str = "train",
        subset: str | None = None,
        shuffle_files: bool = False,
        seed: int = 0,
        decode: bool = False,
        load_kwargs: Mapping[str, Any] | None = None,
        max_history: int = DEFAULT_MAX_HISTORY,
    ) -> None:
        if not 0 <= shard < num_shards:
            raise ValueError(f"shard={shard}, num_shards={num_shards}: need 0 <= shard < num_shards")
        if max_history < 1:
            raise ValueError(f"max_history={max_history}: must be >= 1")
        self.source = str(source)
        """Local file, folder of shards, or hub dataset id."""
        self.files = local_files(source, subset=subset, split=split)
        """``(builder, sorted paths)`` for a local source (listed once, here), None for a hub id."""
        if self.files is None and subset is not None:
            load_kwargs = {"name": subset, **(load_kwargs or {})}
        self.row_to_sample = row_to_sample
        self.shard, self.num_shards = shard, num_shards
        self.split = split
        self.shuffle_files = shuffle_files
        """Shuffle the order of the files every epoch (datasets' ``set_epoch``); rows keep their order in a file."""
        self.seed = seed
        self.decode = decode
        """Decode media columns (Image, Audio) while reading; False passes ``{"bytes", "path"}`` to
        ``row_to_sample``, so decoding, and its failures, happen per row where they become counted skips."""
        self.load_kwargs = dict(load_kwargs or {})
        """Extra ``datasets.load_dataset`` arguments (a hub config ``name``, ``revision``, ...)."""
        self.max_history = max_history
        self._reset()

    def _reset(self) -> None:
        """Forget the reader: the state that is never pickled."""
        self._source_ds: Any = None  # the whole IterableDataset, opened on first use
        self._dataset: Any = None  # this shard's IterableDataset for the current epoch
        self._rows: Any = None  # its row iterator
        self._epoch = 0
        self._next = 0  # position of the next row the iterator yields
        self._cursor: dict | None = None  # reader state before that row (None: the epoch's start)
        self._history: deque[tuple[int, dict | None]] = deque(maxlen=self.max_history)
        self._read: dict[int, dict] = {}  # rows read and not yet rendered

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        for name in ("_source_ds", "_dataset", "_rows", "_epoch", "_next", "_cursor", "_history", "_read"):
            state.pop(name)
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._reset()

    # -- SampleOrder ----------------------------------------------------------------------------------------------
    def index_at(self, epoch: int, position: int) -> int | None:
        if self._rows is None or epoch != self._epoch:
            if position != 0:
                raise RuntimeError(f"{self._name()}: epoch {epoch} asked at position {position} before position 0")
            self._open(epoch, None, first=0)
        if position != self._next:
            raise RuntimeError(f"{self._name()}: position {position} asked, the reader is at {self._next}")
        row = self._read_row()
        if row is None:
            return None
        self._read[position] = row
        return position

    def fingerprint(self) -> dict:
        return {
            "source": self.source,
            "split": self.split,
            "shard": self.shard,
            "num_shards": self.num_shards,
            "num_files": None if self.files is None else len(self.files[1]),
            "shuffle_files": self.shuffle_files,
            "seed": self.seed if self.shuffle_files else None,
        }

    def state_dict(self, live: Sequence[int]) -> dict:
        """The reader's position before the oldest ``live`` row (or before the next row when none is live)."""
        first = min(live) if live else self._next
        while self._history and self._history[0][0] < first:
            self._history.popleft()  # rows older than every live row are never rendered again
        if not live:
            return {"epoch": self._epoch, "first": first, "reader": self._cursor}
        if not self._history or self._history[0][0] != first:
            raise RuntimeError(
                f"{self._name()}: row {first} is still in the packer's buffer but the reader kept its position only "
                f"for the last {self.max_history} rows read; raise max_history or save the pipeline state more often"
            )
        return {"epoch": self._epoch, "first": first, "reader": self._history[0][1]}

    def load_state_dict(self, state: dict, *, epoch: int, position: int, live: Sequence[int]) -> None:
        """Restore the reader before the oldest live row and read up to ``position``, keeping the live rows for the
        ``render_fn`` calls that follow (the rows in between are read, not rendered)."""
        if int(state["epoch"]) != epoch:
            # Saved after the pipeline closed an epoch and before it read the next one: start that epoch afresh.
            if position != 0 or live:
                raise ValueError(
                    f"{self._name()}: reader state of epoch {state['epoch']} for pipeline epoch {epoch} at position "
                    f"{position} with {len(live)} buffered rows; the checkpoint is inconsistent"
                )
            self._close()
            self._epoch, self._next, self._cursor = epoch, 0, None
            return
        first = int(state["first"])
        if live and min(live) < first:
            raise ValueError(f"{self._name()}: buffered row {min(live)} precedes the saved reader position {first}")
        self._open(epoch, state["reader"], first=first)
        wanted = set(live)
        while self._next < position:
            index = self._next
            row = self._read_row()
            if row is None:
                raise RuntimeError(
                    f"{self._name()}: the shard ends at row {index} but the checkpoint was taken at row {position}; "
                    "the data changed since the checkpoint (resume needs the same files in the same order)"
                )
            if index in wanted:
                self._read[index] = row

    # -- render_fn ------------------------------------------------------------------------------------------------
    def __call__(self, index: int) -> RenderedSample:
        row = self._read.pop(index, None)
        if row is None:
            raise RuntimeError(
                f"{self._name()}: row {index} was not read; render_fn renders only rows that index_at just returned "
                "or that load_state_dict restored"
            )
        return self.row_to_sample(row, index)

    # -- reader ---------------------------------------------------------------------------------------------------
    def _name(self) -> str:
        return f"streaming {self.source} shard {self.shard}/{self.num_shards}"

    def _open(self, epoch: int, reader: dict | None, *, first: int) -> None:
        """Start this shard's rows of ``epoch`` at the saved ``reader`` state (None: the start), at row ``first``."""
        from datasets.distributed import split_dataset_by_node

        self._close()
        if self._source_ds is None:
            self._source_ds = self._open_source()
        dataset = split_dataset_by_node(self._source_ds, rank=self.shard, world_size=self.num_shards)
        if self.shuffle_files:
            # datasets shuffles the file order from the epoch number; 0 means unshuffled, so count from 1.
            dataset.set_epoch(self.seed * 1_000_003 + epoch + 1)
        if reader is not None:
            if reader.get("epoch") != dataset.epoch:
                # datasets would silently start over on a mismatch; an exact resume must not.
                raise ValueError(
                    f"{self._name()}: reader state of datasets epoch {reader.get('epoch')} cannot restore datasets "
                    f"epoch {dataset.epoch}; resume with the shuffle_files and seed of the checkpoint"
                )
            dataset.load_state_dict(reader)
        self._dataset = dataset
        # ``iter(batch_size=1)`` rather than ``iter(dataset)``: inside a DataLoader worker the latter would split the
        # shard once more between the workers, and this object already is one data stream's shard.
        self._rows = dataset.iter(batch_size=1)
        self._epoch, self._next, self._cursor = epoch, first, reader

    def _close(self) -> None:
        if self._rows is not None:
            self._rows.close()  # closes the file the abandoned reader holds open
        self._dataset = self._rows = None
        self._history.clear()
        self._read.clear()

    def _open_source(self) -> Any:
        from torch.utils.data import get_worker_info

        if get_worker_info() is not None:
            import fsspec.asyn

            fsspec.asyn.reset_lock()  # a forked worker must not reuse the parent's event-loop lock (as datasets does)
        ds = open_stream(self.source, split=self.split, files=self.files, load_kwargs=self.load_kwargs)
        if not self.decode:
            ds = ds.decode(False)
        if ds.num_shards % self.num_shards and self.shard == 0:
            _warn_uneven(self.source, ds.num_shards, self.num_shards)
        return ds

    def _read_row(self) -> dict | None:
        """The next row (None at the end of the shard), remembering the reader state just before it."""
        before = self._cursor
        try:
            batch = next(self._rows)
        except StopIteration:
            return None
        self._history.append((self._next, before))
        self._cursor = self._dataset.state_dict()
        self._next += 1
        return {name: values[0] for name, values in batch.items()}
