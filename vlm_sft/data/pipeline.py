"""The streaming, resumable packing pipeline over an indexable source, with full sample accounting.

``PackingPipeline(num_samples, render_fn, seq_len=..., pack_len=...)`` iterates the source indices in a seeded order
per epoch, renders each (``render_fn(index) -> RenderedSample``, which may raise ``SampleError``), truncates it
image-safely to ``seq_len`` inputs, shifts it, and feeds the packer; iterating the pipeline yields ``Pack`` values
(collate them into a ``PackedBatch`` with ``vlm_sft.data.collate.collate``). Every sample drawn from the source ends
in exactly one pack or in the ``SkipReport`` with its reason.

Epochs: epoch ``e`` visits ``randperm(num_samples)`` drawn from ``seed + e`` (or ``0..n-1`` without shuffle); at the
end of an epoch the packer is flushed, so the epoch's tail pack is emitted and no pack mixes two epochs.
``epochs=None`` repeats forever.

Resume: ``state_dict()`` is small (ints and lists of sample indices: epoch, position in the epoch's order, the packer's
decided-but-unyielded packs and undecided buffer, its round counter, the skip report); ``load_state_dict()`` re-renders
the buffered samples by index, so a restored pipeline yields exactly the packs an uninterrupted one would have yielded
next. This needs ``render_fn`` to be deterministic per index (seed any augmentation by index and epoch).

Sharding for distributed training (``rank`` of ``world_size``; DataLoader workers count as further ranks:
``rank * num_workers + worker_id`` of ``world_size * num_workers``):
- ``shard_by="indices"`` (default): every rank draws the same epoch order and takes positions ``rank, rank + w, ...``
  of it, then packs its own share. Render cost is split w ways; ranks may end an epoch with a pack more or less, so
  a trainer that needs equal step counts should run steps-based with ``epochs=None``.
- ``shard_by="packs"``: every rank runs the whole pipeline and keeps packs ``rank, rank + w, ...`` of the global pack
  sequence: the union over ranks is exactly the single-process stream, at w times the render cost.
"""

from __future__ import annotations

import dataclasses
import logging
import statistics
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Literal

import torch

from renderers.errors import SampleError
from renderers.types import RenderedSample
from vlm_sft.data.pack import Pack, PackingMode, make_packer
from vlm_sft.data.shift import ShiftedSample, shift_sample
from vlm_sft.data.truncate import TruncationPolicy, truncate_sample

logger = logging.getLogger(__name__)

STATE_VERSION = 1


@dataclass
class SkipReport:
    """Skipped samples by reason: a count and the first few dataset indices of each (mutable accumulator)."""

    counts: dict[str, int] = field(default_factory=dict)
    """reason -> number of skipped samples."""
    examples: dict[str, list[int]] = field(default_factory=dict)
    """reason -> up to ``max_examples`` dataset indices, in the order they were skipped."""
    max_examples: int = 5
    """How many example indices to keep per reason."""

    def add(self, err: SampleError) -> None:
        self.counts[err.reason] = self.counts.get(err.reason, 0) + 1
        ex = self.examples.setdefault(err.reason, [])
        if len(ex) < self.max_examples:
            ex.append(err.sample_index)

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def to_dict(self) -> dict[str, dict]:
        """``{reason: {"count": n, "examples": [indices]}}``, most frequent first."""
        order = sorted(self.counts, key=lambda r: (-self.counts[r], r))
        return {r: {"count": self.counts[r], "examples": list(self.examples.get(r, []))} for r in order}

    def load(self, state: dict[str, dict]) -> None:
        self.counts = {r: int(v["count"]) for r, v in state.items()}
        self.examples = {r: [int(i) for i in v["examples"]] for r, v in state.items()}


class PackingPipeline:
    """Render -> truncate -> shift -> pack over ``num_samples`` indices; an iterator of ``Pack`` (module docstring)."""

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
        shard_by: Literal["indices", "packs"] = "indices",
    ) -> None:
        if seq_len is not None and seq_len > pack_len:
            raise ValueError(
                f"seq_len={seq_len} > pack_len={pack_len}: a truncated sample would still not fit a pack; "
                "set seq_len <= pack_len"
            )
        if not 0 <= rank < world_size:
            raise ValueError(f"rank={rank}, world_size={world_size}: need 0 <= rank < world_size")
        if shard_by not in ("indices", "packs"):
            raise ValueError(f"shard_by={shard_by!r}: use 'indices' or 'packs'")
        if epochs is not None and epochs < 1:
            raise ValueError(f"epochs={epochs}: use None (forever) or >= 1")
        self.num_samples = num_samples
        self.render_fn = render_fn
        self.seq_len = seq_len
        self.pack_len = pack_len
        self.packing = packing
        self.truncation = truncation
        self.shuffle = shuffle
        self.seed = seed
        self.epochs = epochs
        self.rank = rank
        self.world_size = world_size
        self.shard_by = shard_by
        self.packer = make_packer(
            packing,
            pack_len,
            batch_size=batch_size,
            buffer_size=buffer_size,
            seed=seed,
            pad_multiple=pad_multiple,
            max_image_patches_per_pack=max_image_patches_per_pack,
        )
        self.skips = SkipReport()
        self.samples_seen = 0
        """Samples drawn from the source so far (this rank's share), over all epochs."""
        self._epoch = 0
        self._pos = 0
        self._packs_seen = 0
        self._order_cache: tuple[int, list[int]] | None = None

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

    def epoch_order(self, epoch: int) -> list[int]:
        """This rank's source indices for ``epoch``, in visiting order."""
        if self._order_cache is not None and self._order_cache[0] == epoch:
            return self._order_cache[1]
        if self.shuffle:
            order = torch.randperm(self.num_samples, generator=torch.Generator().manual_seed(self.seed + epoch))
        else:
            order = torch.arange(self.num_samples)
        if self.shard_by == "indices":
            order = order[self.rank :: self.world_size]
        result = order.tolist()
        self._order_cache = (epoch, result)
        return result

    # -- iteration ------------------------------------------------------------------------------------------------
    def __iter__(self) -> Iterator[Pack]:
        return self

    def __next__(self) -> Pack:
        while True:
            pack = self.packer.pop()
            if pack is not None:
                k = self._packs_seen
                self._packs_seen += 1
                if self.shard_by == "packs" and k % self.world_size != self.rank:
                    continue
                return pack
            if self.epochs is not None and self._epoch >= self.epochs:
                raise StopIteration
            order = self.epoch_order(self._epoch)
            if self._pos < len(order):
                index = order[self._pos]
                self._pos += 1
                self.samples_seen += 1
                try:
                    self.packer.push(self.prepare(index))
                except SampleError as err:
                    self.skips.add(err)
                continue
            self.packer.flush()
            if self.packer.num_pending == 0:
                self._epoch += 1
                self._pos = 0

    @property
    def epoch(self) -> int:
        return self._epoch

    # -- state ----------------------------------------------------------------------------------------------------
    def _fingerprint(self) -> dict:
        return {
            "num_samples": self.num_samples,
            "seq_len": self.seq_len,
            "pack_len": self.pack_len,
            "packing": self.packing,
            "shuffle": self.shuffle,
            "seed": self.seed,
            "rank": self.rank,
            "world_size": self.world_size,
            "shard_by": self.shard_by,
        }

    def state_dict(self) -> dict:
        """Where the stream stands, as plain ints and lists of sample indices (never tensors)."""
        return {
            "version": STATE_VERSION,
            "config": self._fingerprint(),
            "epoch": self._epoch,
            "position": self._pos,
            "samples_seen": self.samples_seen,
            "packs_seen": self._packs_seen,
            "packer": self.packer.state_dict(),
            "skips": self.skips.to_dict(),
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue from ``state``: the next packs are those the saved pipeline would have yielded next."""
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"pipeline state version {state.get('version')!r}; this code reads {STATE_VERSION}")
        mismatch = {
            k: (v, state["config"].get(k)) for k, v in self._fingerprint().items() if state["config"].get(k) != v
        }
        if mismatch:
            raise ValueError(f"pipeline state was saved with other settings (now, saved): {mismatch}")
        self._epoch = int(state["epoch"])
        self._pos = int(state["position"])
        self.samples_seen = int(state["samples_seen"])
        self._packs_seen = int(state["packs_seen"])
        self.skips = SkipReport()
        self.skips.load(state["skips"])
        self.packer.load_state_dict(state["packer"], self._rebuild)

    def _rebuild(self, index: int) -> ShiftedSample:
        try:
            return self.prepare(index)
        except SampleError as err:
            raise RuntimeError(
                f"sample {index} was accepted before the checkpoint but now fails ({err}); "
                "render_fn must be deterministic per index for an exact resume"
            ) from err


def _with_index(sample: RenderedSample, index: int) -> RenderedSample:
    return dataclasses.replace(sample, sample_index=index)


def summarize_pass(pipeline: PackingPipeline) -> dict:
    """Run ``pipeline`` to its end (finite ``epochs``) without a model and summarize it for the data report.

    Returns ``samples_seen``, ``samples_packed``, ``skipped`` ``{reason: {count, examples}}``, ``packs``, ``rows``,
    ``real_tokens``, ``trainable_tokens``, ``padding_tokens``, ``capacity_tokens``, ``packing_efficiency`` (real /
    capacity), ``images``, ``patches_per_pack`` ``{min, median, max}`` and ``pack_len``.
    """
    if pipeline.epochs is None:
        raise ValueError("summarize_pass needs a finite pipeline: set epochs to an integer")
    packs = rows = real = trainable = capacity = images = packed = 0
    patches: list[int] = []
    for pack in pipeline:
        packs += 1
        rows += len(pack.rows)
        real += pack.num_real_tokens
        trainable += pack.num_trainable_tokens
        capacity += pack.capacity
        images += pack.num_images
        packed += len(pack.samples)
        patches.append(pack.num_patches)
    if pipeline.shard_by == "indices":
        assert pipeline.samples_seen == packed + pipeline.skips.total, "a sample was lost or counted twice"
    return {
        "samples_seen": pipeline.samples_seen,
        "samples_packed": packed,
        "skipped": pipeline.skips.to_dict(),
        "packs": packs,
        "rows": rows,
        "pack_len": pipeline.pack_len,
        "real_tokens": real,
        "trainable_tokens": trainable,
        "padding_tokens": capacity - real,
        "capacity_tokens": capacity,
        "packing_efficiency": real / capacity if capacity else 0.0,
        "images": images,
        "patches_per_pack": {
            "min": min(patches, default=0),
            "median": statistics.median(patches) if patches else 0,
            "max": max(patches, default=0),
        },
    }
