"""Weighted mixtures of data sources: one interleaved, resumable stream of samples drawn by weight.

A mixture (``[[data.sources]]``) feeds each data stream from every source. ``Mixture`` is both the ``SampleOrder``
and the ``render_fn`` of one stream's ``PackingPipeline``, so the packer sees one interleaved stream and its packs
mix sources; sampling, sharding, packing and resume are the pipeline's, unchanged.

**The draw.** Draw ``q`` of stream ``g`` takes the source ``SourceDraw(weights, seed, g).source_at(q)``. The draws
are dealt in blocks of ``BLOCK``: each block gives every source its share of the block, rounded so that at every
block boundary the count of every source is within one sample of ``q x weight / sum(weights)`` (largest remainder
on the running deficit), and a seeded permutation orders the block, so inside a block the shares wander as a
random draw's would (a 10% source took 17 of one window of 256 draws). The draw depends on the seed and the stream
only: never on processes or workers.

**Each source's order.** Source ``s`` is read through its own order for this stream (for a prepared dataset an
``IndexOrder`` over stream ``g``'s share of its rows, seeded per source; for a streamed one its ``StreamingRows``
shard): every row once per pass of that source, without replacement. A source that runs out starts its next pass
(reshuffled) and stream 0 logs it; a small, heavily weighted source is simply read more often.

**Epochs.** One epoch of a mixture is ``sum(rows of every source)`` draws over all streams: with weights proportional
to the sources' sizes it reads every source about once (to within the rounding of each stream's last, partial
block), as an epoch of the concatenated data would; otherwise source ``s`` is read
``weight_s / sum(weights) x total_rows / rows_s`` times per epoch (the run logs it). The pipeline flushes its
packer at the end of each epoch. A mixture with a streamed source has no known size: its epoch never ends, and
``train.epochs`` is refused (set ``train.max_steps``).

**Indices.** The mixture's sample index of row ``r`` of source ``s`` is ``r x S + s`` (``S`` sources): unique, and
it needs no source sizes, so streamed sources mix too. ``source_of(index)`` gives back ``(name, row)``.

**Resume.** ``state_dict(live)`` holds the draw counter, every source's pass and position, and every source order's
own state (its share of the ``live`` indices); the draw itself is recomputed from the counter.
"""

from __future__ import annotations

import bisect
import dataclasses
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from renderers.errors import SampleError
from renderers.types import RenderedSample
from vlm_sft.data.pipeline import SampleOrder

logger = logging.getLogger(__name__)

BLOCK = 256
"""Draws per block: within each block every source gets its share, to one sample."""


class EmptySourceError(RuntimeError):
    """A source of a mixture has no rows in one data stream's share (fewer rows than streams, or all read away)."""


def _block_seed(seed: int, stream: int, block: int) -> int:
    """A generator seed per (seed, stream, block); distinct for any realistic values, within 63 bits."""
    return (seed * 1_000_003 + stream * 9_176_867 + block * 131 + 17) % (2**63 - 1)


class SourceDraw:
    """Which source draw ``q`` of one stream takes (module docstring: stratified blocks, seeded order per block)."""

    def __init__(self, weights: Sequence[float], *, seed: int, stream: int, block: int = BLOCK) -> None:
        if not weights or any(not w > 0 for w in weights):
            raise ValueError(f"weights {list(weights)}: need at least one source, every weight > 0")
        total = float(sum(weights))
        self.shares = torch.tensor([w / total for w in weights], dtype=torch.float64)
        """Each source's share of the draws."""
        self.seed, self.stream, self.block = seed, stream, block
        self._counts_at: list[torch.Tensor] = [torch.zeros(len(weights), dtype=torch.int64)]
        """Draws of each source before block ``b``, for every block computed so far."""
        self._cached: tuple[int, list[int]] | None = None

    def source_at(self, draw: int) -> int:
        """The source of draw ``draw`` (0-based)."""
        block, offset = divmod(draw, self.block)
        if self._cached is None or self._cached[0] != block:
            self._cached = (block, self._block_sources(block))
        return self._cached[1][offset]

    def counts_before(self, draw: int) -> list[int]:
        """How many of draws ``0 .. draw - 1`` each source took."""
        block, offset = divmod(draw, self.block)
        counts = self._counts(block).clone()
        for s in self._block_sources(block)[:offset] if offset else ():
            counts[s] += 1
        return counts.tolist()

    def _counts(self, block: int) -> torch.Tensor:
        while len(self._counts_at) <= block:
            b = len(self._counts_at) - 1
            self._counts_at.append(self._counts_at[b] + self._block_counts(b))
        return self._counts_at[block]

    def _block_counts(self, block: int) -> torch.Tensor:
        """Draws of each source in ``block``: the running deficit, rounded by largest remainder (seeded ties)."""
        before = self._counts(block)
        target = (block + 1) * self.block * self.shares - before.double()
        counts = target.floor().clamp(min=0).long()
        left = self.block - int(counts.sum())
        if left > 0:
            ties = torch.rand(len(counts), generator=self._generator(block, 0), dtype=torch.float64)
            remainder = (target - counts.double()).clamp(min=0)
            order = sorted(range(len(counts)), key=lambda s: (-round(float(remainder[s]), 9), float(ties[s])))
            for s in order[:left]:
                counts[s] += 1
        elif left < 0:  # float rounding only: take the surplus from the largest counts
            for s in torch.argsort(counts, descending=True)[:-left].tolist():
                counts[s] -= 1
        return counts

    def _block_sources(self, block: int) -> list[int]:
        counts = self._counts(block + 1) - self._counts(block)
        sources = torch.repeat_interleave(torch.arange(len(counts)), counts)
        return sources[torch.randperm(len(sources), generator=self._generator(block, 1))].tolist()

    def _generator(self, block: int, purpose: int) -> torch.Generator:
        """Block ``block``'s generator for the tie-breaks (0) or the order (1)."""
        return torch.Generator().manual_seed(_block_seed(self.seed, self.stream, 2 * block + purpose))


@dataclass(frozen=True)
class MixturePart:
    """One source as one stream of a mixture reads it."""

    name: str
    """The source's name (``[[data.sources]]``'s ``name``)."""
    weight: float
    """Relative share of the draws."""
    order: SampleOrder
    """This stream's order over the source's rows (``IndexOrder`` share, or a ``StreamingRows`` shard)."""
    render: Callable[[int], RenderedSample]
    """Row index of the source -> rendered sample (raises ``SampleError`` for a bad row)."""
    rows: int | None
    """Rows of the whole source (all streams); None for a streamed source (unknown)."""


class Mixture:
    """``SampleOrder`` and ``render_fn`` of one data stream of a mixture (module docstring)."""

    def __init__(self, parts: Sequence[MixturePart], *, seed: int, stream: int, streams: int) -> None:
        if not parts:
            raise ValueError("a mixture needs at least one source")
        self.parts = tuple(parts)
        self.stream, self.streams = stream, streams
        self.draw = SourceDraw([p.weight for p in parts], seed=seed, stream=stream)
        sizes = [p.rows for p in parts]
        total = None if None in sizes else sum(sizes)
        self.epoch_draws = None if total is None else len(range(stream, total, streams))
        """This stream's draws per epoch of the mixture (None: a streamed source; the epoch never ends)."""
        self._next = 0
        self._last: tuple[int, int] | None = None
        self._source_pass = [0] * len(parts)
        self._source_pos = [0] * len(parts)

    # -- SampleOrder ---------------------------------------------------------------------------------------------
    def index_at(self, epoch: int, position: int) -> int | None:
        if self.epoch_draws is not None and position >= self.epoch_draws:
            return None
        draw = position + epoch * (self.epoch_draws or 0)
        if self._last is not None and self._last[0] == draw:
            return self._last[1]
        if draw != self._next:
            raise RuntimeError(f"mixture stream {self.stream}: draw {draw} asked for, {self._next} expected next")
        source = self.draw.source_at(draw)
        index = self._next_row(source) * len(self.parts) + source
        self._next, self._last = draw + 1, (draw, index)
        return index

    def _next_row(self, source: int) -> int:
        part = self.parts[source]
        for _ in range(2):
            row = part.order.index_at(self._source_pass[source], self._source_pos[source])
            if row is not None:
                self._source_pos[source] += 1
                return row
            self._source_pass[source] += 1
            self._source_pos[source] = 0
            if self.stream == 0:
                logger.info(
                    "data: source %r starts its pass %d (data stream 0)", part.name, self._source_pass[source] + 1
                )
        raise EmptySourceError(
            f"data source {part.name!r}: data stream {self.stream} of {self.streams} has no rows of it"
            + (f" (the source has {part.rows} rows)" if part.rows is not None else "")
            + "; every stream reads its own share of every source: give the source at least as many rows as "
            "there are data streams (data.streams_per_micro_batch x global batch), or remove it"
        )

    def fingerprint(self) -> dict:
        return {
            "mixture": [[p.name, p.weight, p.order.fingerprint()] for p in self.parts],
            "stream": self.stream,
            "streams": self.streams,
        }

    def state_dict(self, live: Sequence[int]) -> dict:
        return {
            "draws": self._next,
            "source_pass": list(self._source_pass),
            "source_position": list(self._source_pos),
            "sources": [p.order.state_dict(self._rows_of(s, live)) for s, p in enumerate(self.parts)],
        }

    def load_state_dict(self, state: dict, *, epoch: int, position: int, live: Sequence[int]) -> None:
        self._next, self._last = int(state["draws"]), None
        self._source_pass = [int(v) for v in state["source_pass"]]
        self._source_pos = [int(v) for v in state["source_position"]]
        for s, part in enumerate(self.parts):
            part.order.load_state_dict(
                state["sources"][s], epoch=self._source_pass[s], position=self._source_pos[s],
                live=self._rows_of(s, live),
            )  # fmt: skip

    def _rows_of(self, source: int, indices: Sequence[int]) -> list[int]:
        n = len(self.parts)
        return [i // n for i in indices if i % n == source]

    # -- render_fn and accounting --------------------------------------------------------------------------------
    def __call__(self, index: int) -> RenderedSample:
        return self.parts[index % len(self.parts)].render(index // len(self.parts))

    def source_of(self, index: int) -> tuple[str, int]:
        """``(source name, row of that source)`` of a mixture sample index."""
        n = len(self.parts)
        return self.parts[index % n].name, index // n

    @property
    def names(self) -> list[str]:
        return [p.name for p in self.parts]


class ConcatSource:
    """Several held-out sources (``[[data.eval_sources]]``) read as one: rows of the first, then of the second, ...

    It answers what the eval reads of a ``ConversationSource`` (``len``, ``source[i]``, ``column``), and
    ``source_of(i)`` names the source of row ``i`` so that the eval scores each source on its own too."""

    def __init__(self, parts: Sequence[tuple[str, Any]]) -> None:
        self.parts = tuple(parts)
        self.starts = [0]
        for _, source in self.parts:
            self.starts.append(self.starts[-1] + len(source))
        self.name = "+".join(name for name, _ in self.parts)

    def __len__(self) -> int:
        return self.starts[-1]

    def _locate(self, index: int) -> tuple[int, int]:
        if not 0 <= index < len(self):
            raise IndexError(f"{self.name}: row {index} out of range (len {len(self)})")
        part = bisect.bisect_right(self.starts, index) - 1
        return part, index - self.starts[part]

    def __getitem__(self, index: int) -> Any:
        part, row = self._locate(index)
        try:
            conversation = self.parts[part][1][row]
        except SampleError as err:
            raise err.with_index(index) from err
        return dataclasses.replace(conversation, index=index)

    def source_of(self, index: int) -> tuple[str, int]:
        part, row = self._locate(index)
        return self.parts[part][0], row

    def column(self, name: str) -> list | None:
        values = [source.column(name) for _, source in self.parts]
        if all(v is None for v in values):
            return None
        return [x for v, (_, source) in zip(values, self.parts, strict=True) for x in (v or [None] * len(source))]
