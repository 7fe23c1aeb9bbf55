"""The streaming, resumable packing pipeline over a sample order, with full sample accounting.

``PackingPipeline(num_samples, render_fn, seq_len=..., pack_len=...)`` visits sample indices in a seeded order per
epoch, renders each (``render_fn(index) -> RenderedSample``, which may raise ``SampleError``), truncates it
image-safely to ``seq_len`` inputs, shifts it, and feeds the packer; iterating the pipeline yields ``Pack`` values
(collate them into a ``PackedBatch`` with ``vlm_sft.data.collate.collate``). Every sample drawn ends in exactly one
pack or in the ``SkipReport`` with its reason and detail (``accounting``: seen == packed + skipped + buffered).

Where the indices come from is a ``SampleOrder``: ``IndexOrder`` (the default, built from ``num_samples``) for
random-access datasets, or a streaming reader (``vlm_sft.data.streaming``) that numbers rows as it reads them.

Epochs: epoch ``e`` of an ``IndexOrder`` visits ``randperm(num_samples)`` drawn from ``seed + e`` (or ``0..n-1``
without shuffle); at the end of an epoch the packer is flushed, so the epoch's tail pack is emitted and no pack mixes
two epochs. ``epochs=None`` repeats forever; a pass that yields no pack at all then raises ``EmptyPassError`` rather
than looping forever.

Sharding: shard ``rank`` of ``world_size`` takes positions ``rank, rank + w, ...`` of every epoch's order and packs
its own share. The trainer's data streams are such shards (``vlm_sft.trainer.batches``: stream ``g`` of ``G`` is
shard ``g``, whichever rank and worker reads it).

Resume: ``state_dict()`` is small (ints and lists of sample indices: epoch, position in the epoch's order, the packer's
decided-but-unyielded packs and undecided buffer, its round counter, the accounting); ``load_state_dict()``
re-renders the buffered samples by index, so a restored pipeline yields exactly the packs an uninterrupted one would
have yielded next. This needs ``render_fn`` to be deterministic per index (seed any augmentation by index and epoch).
"""

from __future__ import annotations

import dataclasses
import logging
import statistics
from collections.abc import Callable, Iterator, Sequence
from typing import Protocol

import torch

from renderers.errors import SampleError
from renderers.types import RenderedSample
from vlm_sft.data.accounting import DataAccounting, SkipReport
from vlm_sft.data.pack import Pack, PackingMode, make_packer
from vlm_sft.data.shift import ShiftedSample, shift_sample
from vlm_sft.data.truncate import TruncationPolicy, truncate_sample

logger = logging.getLogger(__name__)

STATE_VERSION = 2


class EmptyPassError(RuntimeError):
    """A whole pass over a shard produced no pack: every sample was skipped, or the shard holds no samples."""


class SkipFractionError(RuntimeError):
    """More of the samples seen than ``max_skip_fraction`` were skipped: the data (or its image folder) is broken."""


class SampleOrder(Protocol):
    """Which sample index a shard visits at each position of each epoch (and how to restore a reader on resume)."""

    def index_at(self, epoch: int, position: int) -> int | None:
        """The index at ``position`` of ``epoch``, or None when the epoch has no more samples (positions are asked
        for in increasing order within an epoch)."""

    def fingerprint(self) -> dict:
        """Settings that must match for a saved state to be valid."""

    def state_dict(self, live: Sequence[int]) -> dict:
        """Reader state; ``live`` are the indices still held by the packer (rendered again on resume)."""

    def load_state_dict(self, state: dict, *, epoch: int, position: int, live: Sequence[int]) -> None:
        """Prepare to continue at ``position`` of ``epoch`` and to render the ``live`` indices once more."""


class IndexOrder:
    """Random-access datasets: a seeded permutation of ``0..num_samples-1`` per epoch, this shard's positions of it."""

    def __init__(self, num_samples: int, *, shuffle: bool, seed: int, rank: int = 0, world_size: int = 1) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank={rank}, world_size={world_size}: need 0 <= rank < world_size")
        self.num_samples, self.shuffle, self.seed = num_samples, shuffle, seed
        self.rank, self.world_size = rank, world_size
        self._cache: tuple[int, list[int]] | None = None

    def epoch_order(self, epoch: int) -> list[int]:
        """This shard's indices for ``epoch``, in visiting order."""
        if self._cache is not None and self._cache[0] == epoch:
            return self._cache[1]
        if self.shuffle:
            order = torch.randperm(self.num_samples, generator=torch.Generator().manual_seed(self.seed + epoch))
        else:
            order = torch.arange(self.num_samples)
        result = order[self.rank :: self.world_size].tolist()
        self._cache = (epoch, result)
        return result

    def index_at(self, epoch: int, position: int) -> int | None:
        order = self.epoch_order(epoch)
        return order[position] if position < len(order) else None

    def fingerprint(self) -> dict:
        return {
            "num_samples": self.num_samples,
            "shuffle": self.shuffle,
            "seed": self.seed,
            "rank": self.rank,
            "world_size": self.world_size,
        }

    def state_dict(self, live: Sequence[int]) -> dict:
        return {}

    def load_state_dict(self, state: dict, *, epoch: int, position: int, live: Sequence[int]) -> None:
        pass


class PackingPipeline:
    """Render -> truncate -> shift -> pack over a sample order; an iterator of ``Pack`` (module docstring)."""

    def __init__(
        self,
        num_samples: int,
        render_fn: Callable[[int], RenderedSample],
        *,
        seq_len: int | None,
        pack_len: int,
        packing: PackingMode = "bfd",
        batch_size: int = 1,
        buffer_size: int = 512,
        max_image_patches_per_pack: int | None = None,
        truncation: TruncationPolicy = "drop",
        pad_multiple: int = 8,
        shuffle: bool = True,
        seed: int = 0,
        epochs: int | None = 1,
        rank: int = 0,
        world_size: int = 1,
        order: SampleOrder | None = None,
        max_skip_fraction: float | None = None,
        skip_check_after: int = 200,
        source_of: Callable[[int], tuple[str, int]] | None = None,
    ) -> None:
        if seq_len is not None and seq_len > pack_len:
            raise ValueError(
                f"seq_len={seq_len} > pack_len={pack_len}: a truncated sample would still not fit a pack; "
                "set seq_len <= pack_len"
            )
        if epochs is not None and epochs < 1:
            raise ValueError(f"epochs={epochs}: use None (forever) or >= 1")
        self.order = order or IndexOrder(num_samples, shuffle=shuffle, seed=seed, rank=rank, world_size=world_size)
        """Where the sample indices come from."""
        self.render_fn = render_fn
        self.seq_len = seq_len
        self.pack_len = pack_len
        self.packing = packing
        self.truncation = truncation
        self.epochs = epochs
        self.max_skip_fraction = max_skip_fraction
        """Raise ``SkipFractionError`` when more than this fraction of the samples seen were skipped (None: never)."""
        self.skip_check_after = skip_check_after
        """Samples to see before the fraction is checked (a whole pass counts too, if it is shorter)."""
        self.source_of = source_of
        """Sample index -> ``(source name, row)`` for a mixture (``vlm_sft.data.mixture``): the accounting and the
        skip check are then kept per source too. None: one source."""
        self.packer = make_packer(
            packing,
            pack_len,
            batch_size=batch_size,
            buffer_size=buffer_size,
            seed=seed,
            pad_multiple=pad_multiple,
            max_image_patches_per_pack=max_image_patches_per_pack,
        )
        self.accounting = DataAccounting()
        """Samples seen / packed / skipped (with reasons and examples) by this pipeline, over all epochs."""
        self._epoch = 0
        self._pos = 0
        self._epoch_packs = 0

    @property
    def skips(self) -> SkipReport:
        return self.accounting.skips

    @property
    def samples_seen(self) -> int:
        return self.accounting.seen

    # -- per sample -----------------------------------------------------------------------------------------------
    def prepare(self, index: int) -> ShiftedSample:
        """Render, truncate and shift one sample (raises ``SampleError`` naming ``index`` when it cannot be used)."""
        try:
            sample = self.render_fn(index)
            if sample.sample_index != index:
                sample = _with_index(sample, index)
            if self.seq_len is not None:
                sample = truncate_sample(sample, self.seq_len, policy=self.truncation)
            return shift_sample(sample)
        except SampleError as err:
            if err.sample_index == index:
                raise
            raise err.with_index(index) from err

    # -- iteration ------------------------------------------------------------------------------------------------
    def __iter__(self) -> Iterator[Pack]:
        return self

    def __next__(self) -> Pack:
        while True:
            pack = self.packer.pop()
            if pack is not None:
                self._epoch_packs += 1
                for sample in pack.samples:
                    source = self._source(sample.sample_index)[0]
                    self.accounting.count_packed(source, len(sample), sample.num_trainable_tokens)
                return pack
            if self.epochs is not None and self._epoch >= self.epochs:
                raise StopIteration
            index = self.order.index_at(self._epoch, self._pos)
            if index is not None:
                self._pos += 1
                source, row = self._source(index)
                self.accounting.count_seen(source)
                try:
                    self.packer.push(self.prepare(index))
                except SampleError as err:
                    self.accounting.count_skip(err, source, row)
                    self._check_skips(False)
                continue
            self.packer.flush()
            if self.packer.num_pending == 0:
                self._check_skips(True)
                self._end_epoch()

    def _source(self, index: int) -> tuple[str | None, int]:
        return (None, index) if self.source_of is None else self.source_of(index)

    def _check_skips(self, pass_done: bool) -> None:
        """Raise ``SkipFractionError`` when more than ``max_skip_fraction`` of the samples seen were skipped, in all
        or in any one source of a mixture (each source once it saw ``skip_check_after`` samples of its own), so that
        a broken small source cannot hide in a healthy total. The message names the sources over the limit."""
        a, limit = self.accounting, self.max_skip_fraction
        if limit is None:
            return
        enough = pass_done or a.seen >= self.skip_check_after
        over = [n for n, c in a.sources.items() if c.skip_fraction > limit]
        named = [n for n in over if pass_done or a.sources[n].seen >= self.skip_check_after]
        if not named and not (enough and a.skip_fraction > limit):
            return
        if over:
            c = a.sources[over[0]]
            what = (
                f"data source {over[0]!r}: {c.skipped} of its {c.seen} samples seen so far "
                f"({100 * c.skip_fraction:.1f}%) were skipped"
            )
            where, fix = "this data stream", f"Fix the rows of {over[0]!r} above, remove the source"
        else:
            what = f"{a.skipped} of the {a.seen} samples seen so far ({100 * a.skip_fraction:.1f}%) were skipped"
            where, fix = "data shard " + str(self.order.fingerprint()), "Fix the rows above"
        raise SkipFractionError(
            f"{what}, more than data.max_skip_fraction = {limit}:\n{a.format(where)}\n{fix} (python -m vlm_sft.report "
            "lists every skip of the whole dataset), or raise data.max_skip_fraction (1 disables the check)"
        )

    def _end_epoch(self) -> None:
        if self._epoch_packs == 0 and self.epochs is None:
            raise EmptyPassError(
                f"shard {self.settings()['order']}: a whole pass produced no pack "
                f"({self._pos} samples in the pass).\n{self.accounting.format('this shard')}\n"
                "Fix the skipped rows, or use fewer data workers / ranks than usable samples"
            )
        self._epoch += 1
        self._pos = 0
        self._epoch_packs = 0
        self.accounting.end_pass()

    @property
    def epoch(self) -> int:
        return self._epoch

    # -- state ----------------------------------------------------------------------------------------------------
    def settings(self) -> dict:
        """What a saved state must have been written with to continue here (plain values; compared on resume)."""
        return {
            "order": self.order.fingerprint(),
            "seq_len": self.seq_len,
            "pack_len": self.pack_len,
            "packing": self.packing,
        }

    def state_dict(self) -> dict:
        """Where the stream stands, as plain ints, strings and lists of sample indices (never tensors)."""
        packer = self.packer.state_dict()
        return {
            "version": STATE_VERSION,
            "config": self.settings(),
            "epoch": self._epoch,
            "position": self._pos,
            "epoch_packs": self._epoch_packs,
            "packer": packer,
            "order": self.order.state_dict(_live_indices(packer)),
            "accounting": self.accounting.to_dict(),
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue from ``state``: the next packs are those the saved pipeline would have yielded next."""
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"pipeline state version {state.get('version')!r}; this code reads {STATE_VERSION}")
        change = settings_change(self.settings(), state["config"])
        if change:
            raise ValueError(change)
        self._epoch = int(state["epoch"])
        self._pos = int(state["position"])
        self._epoch_packs = int(state["epoch_packs"])
        self.accounting = DataAccounting.from_dict(state["accounting"])
        live = _live_indices(state["packer"])
        self.order.load_state_dict(state["order"], epoch=self._epoch, position=self._pos, live=live)
        self.packer.load_state_dict(state["packer"], self._rebuild)

    def _rebuild(self, index: int) -> ShiftedSample:
        try:
            return self.prepare(index)
        except SampleError as err:
            raise RuntimeError(
                f"sample {index} was accepted before the checkpoint but now fails ({err}); "
                "render_fn must be deterministic per index for an exact resume"
            ) from err


def settings_change(now: dict, saved: dict) -> str:
    """Why a pipeline state saved with ``saved`` settings cannot continue under ``now`` (empty when it can): for a
    mixture its sources and weights, else each differing setting with both values."""
    diff = {k: (v, saved.get(k)) for k, v in now.items() if saved.get(k) != v}
    if not diff:
        return ""
    mix_now, mix_saved = (x.get("mixture") if isinstance(x, dict) else None for x in diff.get("order", (None, None)))
    if mix_now is not None and mix_saved is not None and len(diff) == 1:

        def weights(m: list) -> str:
            return ", ".join(f"{name} = {weight:g}" for name, weight, _ in m)

        if weights(mix_now) != weights(mix_saved):
            return (
                f"the checkpoint's data was drawn from the mixture {weights(mix_saved)}; this config mixes "
                f"{weights(mix_now)}: the saved position continues only the same sources with the same weights. "
                "Restore [[data.sources]] as saved, or start a new run from the checkpoint's weights "
                "(model.name_or_path = <checkpoint>/hf, train.resume = none)"
            )
    parts = "; ".join(f"{k}: now {v[0]!r}, saved {v[1]!r}" for k, v in diff.items())
    return f"the checkpoint's data was packed with other settings ({parts}); restore them to resume exactly"


def _live_indices(packer_state: dict) -> list[int]:
    """Every sample index a packer state holds: decided packs not yet popped, then the undecided buffer."""
    live = [i for pack in packer_state["pending"] for row in pack for i in row]
    return live + list(packer_state.get("buffer", packer_state.get("open", [])))


def _with_index(sample: RenderedSample, index: int) -> RenderedSample:
    return dataclasses.replace(sample, sample_index=index)


def summarize_pass(pipeline: PackingPipeline) -> dict:
    """Run ``pipeline`` to its end (finite ``epochs``) without a model and summarize it for the data report.

    Returns ``samples_seen``, ``samples_packed``, ``skipped`` ``{reason: {count, examples}}``, ``packs``, ``rows``,
    ``real_tokens``, ``trainable_tokens``, ``padding_tokens``, ``capacity_tokens``, ``packing_efficiency`` (real /
    capacity), ``images``, ``videos``, ``video_frames``, ``video_tokens``,
    ``patches_per_pack`` ``{min, median, max}`` and ``pack_len``; for a mixture also
    ``sources`` ``{name: {seen, packed, skipped, samples_skipped, buffered, real_tokens, trainable_tokens}}``.
    """
    if pipeline.epochs is None:
        raise ValueError("summarize_pass needs a finite pipeline: set epochs to an integer")
    packs = rows = real = trainable = capacity = images = videos = video_frames = video_tokens = packed = 0
    patches: list[int] = []
    for pack in pipeline:
        packs += 1
        rows += len(pack.rows)
        real += pack.num_real_tokens
        trainable += pack.num_trainable_tokens
        capacity += pack.capacity
        images += pack.num_images
        videos += pack.num_videos
        video_frames += pack.num_video_frames
        video_tokens += pack.num_video_tokens
        packed += len(pack.samples)
        patches.append(pack.num_patches)
    accounting = pipeline.accounting
    if accounting.buffered != 0 or accounting.packed != packed:  # seen == packed + skipped after a whole pass
        raise AssertionError(f"sample accounting failed: {packed} samples in packs, {accounting.to_dict()}")
    return {
        "samples_seen": accounting.seen,
        "samples_packed": packed,
        "skipped": accounting.skips.to_dict(),
        "packs": packs,
        "rows": rows,
        "pack_len": pipeline.pack_len,
        "real_tokens": real,
        "trainable_tokens": trainable,
        "padding_tokens": capacity - real,
        "capacity_tokens": capacity,
        "packing_efficiency": real / capacity if capacity else 0.0,
        **({"sources": {n: c.to_dict() for n, c in accounting.sources.items()}} if accounting.sources else {}),
        "images": images,
        "videos": videos,
        "video_frames": video_frames,
        "video_tokens": video_tokens,
        "patches_per_pack": {
            "min": min(patches, default=0),
            "median": statistics.median(patches) if patches else 0,
            "max": max(patches, default=0),
        },
    }
