"""Segment bookkeeping for packed (variable-length) batches: ``Segments`` and the index maps the pure-torch kernels use.

A packed row holds several samples (segments) back to back; the flattened batch is ``T`` tokens long. Every kernel of
the text model takes the segment boundaries as one ``Segments`` object, built once per forward from host integers:
the lengths as Python ints and ``cu_seqlens``, the int32 prefix sums ``[0, l0, l0 + l1, ..., T]`` on the device (the
convention of flash-attn, flash-linear-attention and torch's varlen attention). Every kernel must keep each token's
output independent of every other segment.

The pure-torch kernels (GatedDeltaNet, conv, SDPA attention) batch all segments into one computation instead of
looping over them in Python: they move tokens into a padded layout (each segment padded to whole chunks or to a
bucket length), compute, and move them back. The index maps for that are built here, once per distinct list of
lengths (cached), from plain integer lengths.

Legend: T = total tokens of the flattened batch, S = segments, N = chunks, C = chunk size, H = heads.
"""

from __future__ import annotations

import functools
import itertools
import operator
from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Segments:
    """The segment layout of one forward's flattened tokens, built once per micro-batch from host integers.

    Every varlen op needs the same two views of the boundaries: the lengths as Python ints (the pure-torch kernels
    build their padded layouts from them, and ``max_len`` sizes the flash kernels) and ``cu_seqlens`` on the compute
    device (what flash-attn, fla and torch's varlen attention read). Both are made here, once, from lengths that live
    on the host, so no layer ever reads a device tensor back (a device-to-host copy is a sync on CUDA). The object
    holds no tensor that FSDP's input hook would move, apart from ``cu_seqlens``, which is already where it belongs.
    """

    lengths: tuple[int, ...]
    """Segment lengths in token order (host ints; zero-length segments are allowed and empty)."""
    cu_seqlens: torch.Tensor
    """int32 ``[S + 1]``: ``[0, l0, l0 + l1, ..., T]`` on the compute device (flash-attn, torch varlen attention)."""
    cu_seqlens_long: torch.Tensor
    """The same as int64, for flash-linear-attention. Its kernels cache the chunk indices they derive (with a host
    sync) by the identity of this tensor, so every layer must get this very object, never a fresh conversion."""
    max_len: int
    """Longest segment (0 when there is none)."""

    @property
    def total(self) -> int:
        """``T``: tokens covered by the segments."""
        return sum(self.lengths)

    @functools.cached_property
    def cu_seqlens_cpu(self) -> torch.Tensor:
        """int64 ``[S + 1]`` on the host, built from ``lengths`` (no device read): flash-linear-attention derives its
        chunk indices and longest segment from it instead of copying ``cu_seqlens_long`` back (a host sync). A cached
        property, not a field, so nothing that moves a dataclass's tensors to the device (FSDP's input hook) moves it.
        """
        return torch.tensor([0, *itertools.accumulate(self.lengths)], dtype=torch.int64)

    @classmethod
    def from_lengths(cls, lengths: torch.Tensor | Sequence[int], device: torch.device | str | None = None) -> Segments:
        """Segments of the given lengths (a 1-D integer CPU tensor or a sequence of ints) with ``cu_seqlens`` on
        ``device`` (default CPU). A tensor on another device is refused: reading it would cost a host sync."""
        if isinstance(lengths, torch.Tensor):
            if lengths.device.type != "cpu":
                raise ValueError(
                    f"segment lengths are on {lengths.device}: pass them as host ints (a CPU tensor or a list); "
                    "reading a device tensor back costs a host sync in every forward"
                )
            if lengths.dim() != 1:
                raise ValueError(f"seq_lens must be 1-D (one length per segment), got shape {tuple(lengths.shape)}")
            if lengths.is_floating_point() or lengths.dtype == torch.bool:
                raise ValueError(f"seq_lens must hold integers, got dtype {lengths.dtype}")
            lengths = lengths.tolist()
        try:
            values = tuple(operator.index(n) for n in lengths)
        except TypeError:
            raise ValueError(f"seq_lens must be a 1-D sequence of integers, got {lengths!r}") from None
        if any(n < 0 for n in values):
            raise ValueError(f"seq_lens must be non-negative, got {list(values)}")
        cu = torch.tensor([0, *itertools.accumulate(values)], dtype=torch.int64).to(device or "cpu")
        return cls(lengths=values, cu_seqlens=cu.int(), cu_seqlens_long=cu, max_len=max(values, default=0))

    def check_tokens(self, total_tokens: int, what: str) -> None:
        """Raises when the segments do not cover exactly ``total_tokens`` (host ints only: no sync)."""
        if self.total != total_tokens:
            raise ValueError(f"{what}: the segments cover {self.total} tokens but the input has {total_tokens}")


@dataclass(frozen=True)
class ChunkLayout:
    """Where each token goes when every segment is padded to whole chunks, chunks ordered step-major.

    Segments are ranked by their chunk count (most chunks first). Chunk ``j`` of the ``r``-th ranked segment sits at
    slot ``step_offsets[j] + r``: all first chunks come first, then all second chunks, and so on. Step ``j`` of the
    inter-chunk scan then reads one contiguous block of ``step_sizes[j]`` chunks, and the segments still active at
    step ``j`` are a prefix of the previous step's, so the carried state is just sliced.
    """

    token_to_slot: torch.Tensor
    """int64 ``[T]``: flat padded position (``chunk_slot * C + offset``) of each token."""
    slot_to_token: torch.Tensor
    """int64 ``[N * C]``: source token of each padded position, ``T`` (a zero row appended by the caller) for padding."""
    step_sizes: tuple[int, ...]
    """Chunks per scan step (non-increasing); they sum to ``N``."""
    num_chunks: int
    """``N``: total chunks over all segments."""


@functools.lru_cache(maxsize=64)
def chunk_layout(lengths: tuple[int, ...], chunk_size: int, device: torch.device) -> ChunkLayout:
    """Build (and cache per length list) the step-major chunk layout of segments with these lengths."""
    assert chunk_size > 0
    total = sum(lengths)
    n_chunks = [-(-n // chunk_size) for n in lengths]  # ceil; a zero-length segment has none
    order = sorted(range(len(lengths)), key=lambda s: -n_chunks[s])  # stable: ties keep packing order
    rank = [0] * len(lengths)
    for r, s in enumerate(order):
        rank[s] = r
    max_chunks = max(n_chunks, default=0)
    step_sizes = tuple(sum(1 for n in n_chunks if n > j) for j in range(max_chunks))
    step_offsets = [0]
    for size in step_sizes:
        step_offsets.append(step_offsets[-1] + size)
    num_chunks = step_offsets[-1]

    lens_t = torch.tensor(lengths, dtype=torch.int64)
    seg_of_token = torch.repeat_interleave(torch.arange(len(lengths)), lens_t)
    starts = torch.cumsum(lens_t, 0) - lens_t
    pos = torch.arange(total) - starts[seg_of_token]
    chunk_in_seg = torch.div(pos, chunk_size, rounding_mode="floor")
    slot = torch.tensor(step_offsets[:-1] or [0], dtype=torch.int64)[chunk_in_seg] + torch.tensor(rank)[seg_of_token]
    token_to_slot = slot * chunk_size + pos % chunk_size
    slot_to_token = torch.full((num_chunks * chunk_size,), total, dtype=torch.int64)
    slot_to_token[token_to_slot] = torch.arange(total)
    return ChunkLayout(
        token_to_slot=token_to_slot.to(device),
        slot_to_token=slot_to_token.to(device),
        step_sizes=step_sizes,
        num_chunks=num_chunks,
    )


@dataclass(frozen=True)
class ChunkGroup:
    """Some segments of a packed row, padded to whole chunks of one size, chunks ordered step-major.

    A *single-chunk* group (``step_sizes == (num_chunks,)``) holds segments no longer than its chunk size: one chunk
    each, no state carried between chunks. A multi-chunk group is a ``ChunkLayout`` over its segments.
    """

    chunk_size: int
    """``C`` of this group."""
    num_chunks: int
    """Chunks in this group (one per segment for a single-chunk group)."""
    step_sizes: tuple[int, ...]
    """Chunks per scan step, as in ``ChunkLayout`` (one step for a single-chunk group)."""
    first_row: int
    """Where this group's ``num_chunks * H * C`` rows start in ``GroupedChunkLayout``'s head-major rows."""

    @property
    def single_chunk(self) -> bool:
        return len(self.step_sizes) == 1


@dataclass(frozen=True)
class GroupedChunkLayout:
    """A packed row split into chunk groups of different chunk sizes, so short segments are not padded to long ones.

    Segments longer than the chunk size form one multi-chunk group (chunk size ``chunk_size``); shorter ones form
    single-chunk groups whose chunk size is their longest member, chosen to minimise padded work plus a fixed cost per
    group (``grouped_chunk_layout``). Every (token, head) pair has one *row*: the groups one after the other, each
    group's rows head-major (``[num_chunks, H, C]``, the layout its batched matmuls read without a copy).
    """

    groups: tuple[ChunkGroup, ...]
    """The chunk groups, multi-chunk group (if any) first."""
    row_of_token_head: torch.Tensor
    """int64 ``[T * H]``: the row of token ``t``, head ``h`` at ``t * H + h`` (each row holds at most one pair)."""
    padding_rows: torch.Tensor
    """int64: the rows no (token, head) pair holds (chunk padding); with ``row_of_token_head`` they are all
    ``sum(num_chunks * H * C)`` rows."""


def _length_class(n: int) -> int:
    """Lengths are grouped into classes of at most 1/8 relative width (exact up to 16) before the bucketing search,
    which keeps it to ~8 candidates per octave however many segments a row has."""
    step = 1 << max(0, n.bit_length() - 4)
    return -(-n // step) * step


def length_buckets(lengths: Sequence[int], *, linear_cost: int, group_cost: int) -> list[list[int]]:
    """Partition the non-empty segments into buckets that are each padded to their longest member.

    Minimises ``sum over buckets (members * L * (L + linear_cost)) + group_cost * buckets`` (L = the bucket's
    longest length): quadratic work per padded segment (attention scores, ``[C, C]`` chunk algebra), linear work,
    and a fixed cost per bucket (its kernel calls). Exact dynamic programme over the length classes (longest first;
    a bucket is a run of consecutive classes). Returns segment indices per bucket, longest bucket first.
    """
    by_class: dict[int, list[int]] = {}
    for s, n in enumerate(lengths):
        if n > 0:
            by_class.setdefault(_length_class(n), []).append(s)
    classes = sorted(by_class, reverse=True)
    longest = [max(lengths[s] for s in by_class[c]) for c in classes]
    counts = [len(by_class[c]) for c in classes]
    m = len(classes)
    best = [0.0] + [float("inf")] * m
    cut = [0] * (m + 1)
    for j in range(1, m + 1):
        members = 0
        for i in range(j, 0, -1):  # run classes[i-1 .. j-1]; its longest member is in classes[i-1]
            members += counts[i - 1]
            top = longest[i - 1]
            cost = best[i - 1] + members * top * (top + linear_cost) + group_cost
            if cost < best[j]:
                best[j], cut[j] = cost, i - 1
    runs: list[list[int]] = []
    j = m
    while j > 0:
        runs.append([s for c in classes[cut[j] : j] for s in by_class[c]])
        j = cut[j]
    return runs[::-1]


def _padded_slots(
    starts: torch.Tensor, lens: torch.Tensor, width: int, total: int, base: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Segments ``(starts, lens)`` laid out as rows of ``width`` slots, padding after each segment's tokens.

    Returns ``slot_to_token`` (``[n * width]``, ``total`` for padding) and the (token, slot) pairs of the real
    tokens, slots offset by ``base``."""
    offsets = torch.arange(width)
    real = offsets[None, :] < lens[:, None]
    tokens = starts[:, None] + offsets[None, :]
    slot_to_token = torch.where(real, tokens, total).reshape(-1)
    slots = torch.arange(base, base + lens.numel() * width).view(-1, width)
    return slot_to_token, tokens[real], slots[real]


@functools.lru_cache(maxsize=64)
def grouped_chunk_layout(
    lengths: tuple[int, ...],
    chunk_size: int,
    device: torch.device,
    linear_cost: int = 0,
    group_cost: int = 0,
    num_heads: int = 1,
    single_max: int | None = None,
) -> GroupedChunkLayout:
    """Build (and cache per length list) the chunk groups of segments with these lengths (see ``GroupedChunkLayout``).

    Short segments are bucketed by ``length_buckets(linear_cost, group_cost)``: the work of a chunk of ``C`` slots is
    taken as ``C * (C + linear_cost)``, every extra group as ``group_cost`` (the fixed cost of its kernel calls). A
    short bucket cheaper as one-chunk members of the multi-chunk group (e.g. one stray 3-token segment) joins it.
    """
    assert chunk_size > 0 and num_heads > 0
    lens_t = torch.tensor(lengths, dtype=torch.int64)
    starts_t = torch.cumsum(lens_t, 0) - lens_t
    total = int(lens_t.sum())
    heads = torch.arange(num_heads)
    row_of_token_head = torch.empty(total, num_heads, dtype=torch.int64)
    groups: list[ChunkGroup] = []
    first_row = 0

    def place(tokens: torch.Tensor, slots: torch.Tensor, width: int, num_chunks: int, step_sizes: tuple[int, ...]):
        """Group-local slots (``chunk * width + offset``) of its real tokens -> their rows, head-major."""
        nonlocal first_row
        chunk, offset = slots // width, slots % width
        rows = first_row + (chunk * num_heads * width + offset)[:, None] + heads[None, :] * width
        row_of_token_head[tokens] = rows
        groups.append(ChunkGroup(width, num_chunks, step_sizes, first_row))
        first_row += num_chunks * num_heads * width

    single_max = chunk_size if single_max is None else single_max
    long_segs = [s for s, n in enumerate(lengths) if n > single_max]
    short = [n if n <= single_max else 0 for n in lengths]
    short_groups = length_buckets(short, linear_cost=linear_cost, group_cost=group_cost)
    if long_segs:
        # A short bucket that costs more on its own than as chunks of the scan (where it adds no step) joins it.
        chunk_cost = chunk_size * (chunk_size + linear_cost)
        joins = [
            segs
            for segs in short_groups
            if sum(-(-short[s] // chunk_size) for s in segs) * chunk_cost
            < len(segs) * max(short[s] for s in segs) * (max(short[s] for s in segs) + linear_cost) + group_cost
        ]
        short_groups = [segs for segs in short_groups if segs not in joins]
        long_segs = sorted(long_segs + [s for segs in joins for s in segs])
        sub = chunk_layout(tuple(lengths[s] for s in long_segs), chunk_size, torch.device("cpu"))
        tokens = torch.cat([torch.arange(int(starts_t[s]), int(starts_t[s]) + lengths[s]) for s in long_segs])
        place(tokens, sub.token_to_slot, chunk_size, sub.num_chunks, sub.step_sizes)
    for segs in short_groups:
        idx = torch.tensor(segs, dtype=torch.int64)
        width = max(short[s] for s in segs)
        _, tokens, slots = _padded_slots(starts_t[idx], lens_t[idx], width, total, 0)
        place(tokens, slots, width, len(segs), (len(segs),))
    taken = torch.zeros(first_row, dtype=torch.bool)
    taken[row_of_token_head.view(-1)] = True
    padding_rows = torch.nonzero(~taken).view(-1)
    return GroupedChunkLayout(
        groups=tuple(groups),
        row_of_token_head=row_of_token_head.view(-1).to(device),
        padding_rows=padding_rows.to(device),
    )


@functools.lru_cache(maxsize=64)
def chunk_successors(step_sizes: tuple[int, ...], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """For step-major chunks (``ChunkLayout``): the chunks that have a next chunk in their segment, and that next
    chunk (int64, both ``[N - step_sizes[0]]``). Rank ``r`` of step ``j`` continues at rank ``r`` of step ``j + 1``
    when ``r < step_sizes[j + 1]``."""
    offsets = [0, *itertools.accumulate(step_sizes)]
    pairs = [(offsets[j] + r, offsets[j + 1] + r) for j in range(len(step_sizes) - 1) for r in range(step_sizes[j + 1])]
    has_next = torch.tensor([a for a, _ in pairs], dtype=torch.int64)
    next_chunk = torch.tensor([b for _, b in pairs], dtype=torch.int64)
    return has_next.to(device), next_chunk.to(device)


@dataclass(frozen=True)
class BucketLayout:
    """Segments grouped into buckets of similar length, each bucket padded to its longest segment.

    A bucket is one batched call of a dense kernel (``[B, L_max, ...]``); padding sits at the end of each row, so a
    causal kernel never lets a real token see it. The grouping (``length_buckets``) trades padded work against the
    fixed cost of one more call.
    """

    buckets: tuple[tuple[int, int], ...]
    """``(batch, max_len)`` of each bucket, in the order their rows appear in ``slot_to_token``."""
    slot_to_token: torch.Tensor
    """int64 ``[sum(batch * max_len)]``: source token of each padded position, ``T`` for padding."""
    token_to_slot: torch.Tensor
    """int64 ``[T]``: padded position of each token."""


@functools.lru_cache(maxsize=64)
def bucket_layout(
    lengths: tuple[int, ...], device: torch.device, linear_cost: int = 0, group_cost: int = 0
) -> BucketLayout:
    """Group the non-empty segments into buckets (``length_buckets``) and lay each out padded to its longest."""
    lens_t = torch.tensor(lengths, dtype=torch.int64)
    starts_t = torch.cumsum(lens_t, 0) - lens_t
    total = int(lens_t.sum())
    token_to_slot = torch.empty(total, dtype=torch.int64)
    slot_parts, buckets = [], []
    base = 0
    for segs in length_buckets(lengths, linear_cost=linear_cost, group_cost=group_cost):
        idx = torch.tensor(segs, dtype=torch.int64)
        width = max(lengths[s] for s in segs)
        slot_to_token, tokens, slots = _padded_slots(starts_t[idx], lens_t[idx], width, total, base)
        token_to_slot[tokens] = slots
        slot_parts.append(slot_to_token)
        buckets.append((len(segs), width))
        base += len(segs) * width
    slot_to_token = torch.cat(slot_parts) if slot_parts else torch.zeros(0, dtype=torch.int64)
    return BucketLayout(
        buckets=tuple(buckets), slot_to_token=slot_to_token.to(device), token_to_slot=token_to_slot.to(device)
    )


def segment_index(lengths: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """int32 ``[T]``: the index of each token's segment (causal-conv1d's ``seq_idx``)."""
    return _segment_index(lengths, torch.device(device))


@functools.lru_cache(maxsize=64)
def _segment_index(lengths: tuple[int, ...], device: torch.device) -> torch.Tensor:
    seg = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths, dtype=torch.int64))
    return seg.to(device=device, dtype=torch.int32)


def position_in_segment(lengths: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """int64 ``[T]``: each token's offset from the start of its segment (0 at every segment start)."""
    return _position_in_segment(lengths, torch.device(device))


@functools.lru_cache(maxsize=64)
def _position_in_segment(lengths: tuple[int, ...], device: torch.device) -> torch.Tensor:
    lens_t = torch.tensor(lengths, dtype=torch.int64)
    starts = torch.cumsum(lens_t, 0) - lens_t
    seg = torch.repeat_interleave(torch.arange(len(lengths)), lens_t)
    return (torch.arange(int(lens_t.sum())) - starts[seg]).to(device)


def gather_rows(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``x`` with one zero row appended, indexed along dim 0 (index ``len(x)`` reads the zero row, i.e. padding)."""
    padded = torch.cat([x, x.new_zeros((1, *x.shape[1:]))], dim=0)
    return padded.index_select(0, index)


def to_rows(x_PF: torch.Tensor, layout: GroupedChunkLayout) -> torch.Tensor:
    """``[T * H, F]`` (token-major pairs) -> the layout's rows ``[R, F]``, padding rows zero (a GatedDeltaNet padding
    slot then neither decays nor writes the state). Differentiable."""
    return _ToRows.apply(x_PF, layout.row_of_token_head, layout.padding_rows)


def from_rows(rows_RF: torch.Tensor, layout: GroupedChunkLayout) -> torch.Tensor:
    """The layout's rows ``[R, F]`` -> ``[T * H, F]``, the inverse of ``to_rows``. Differentiable."""
    return _FromRows.apply(rows_RF, layout.row_of_token_head, layout.padding_rows)


class _ToRows(torch.autograd.Function):
    """``x_PF`` scattered to the layout's rows: ``rows[row_of_pair[p]] = x[p]``, and ``padding_rows`` (every other
    row) zero.

    Each row receives at most one ``p``, so the backward is a gather (``index_select``), and ``_FromRows``' backward
    a scatter (``index_copy``); autograd's own ``index_select`` backward accumulates (``index_add``) into zeros of the
    source's size, and the zero row ``gather_rows`` appends costs a copy of the whole input. Only the padding rows
    are zero-filled, not the whole buffer."""

    @staticmethod
    def forward(ctx, x_PF: torch.Tensor, row_of_pair: torch.Tensor, padding_rows: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(row_of_pair)
        return _scatter_rows(x_PF, row_of_pair, padding_rows)

    @staticmethod
    def backward(ctx, grad_RF: torch.Tensor):
        (row_of_pair,) = ctx.saved_tensors
        return grad_RF.index_select(0, row_of_pair), None, None


class _FromRows(torch.autograd.Function):
    """``rows_RF[row_of_pair]``: the inverse of ``_ToRows`` (its rows of padding get no gradient)."""

    @staticmethod
    def forward(ctx, rows_RF: torch.Tensor, row_of_pair: torch.Tensor, padding_rows: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(row_of_pair, padding_rows)
        return rows_RF.index_select(0, row_of_pair)

    @staticmethod
    def backward(ctx, grad_PF: torch.Tensor):
        row_of_pair, padding_rows = ctx.saved_tensors
        return _scatter_rows(grad_PF.contiguous(), row_of_pair, padding_rows), None, None


def _scatter_rows(x_PF: torch.Tensor, row_of_pair: torch.Tensor, padding_rows: torch.Tensor) -> torch.Tensor:
    """``rows[row_of_pair[p]] = x[p]`` and every padding row zero (``_ToRows``' forward, ``_FromRows``' backward)."""
    rows_RF = x_PF.new_empty(row_of_pair.numel() + padding_rows.numel(), x_PF.shape[1])
    return rows_RF.index_fill_(0, padding_rows, 0.0).index_copy_(0, row_of_pair, x_PF)


def clear_layout_caches() -> None:
    """Forget every cached layout (chunk groups, buckets, segment indices): the next forward of a length list pays
    its layout again, as the first step of a training run does (benchmarks and host-read counts start from here)."""
    for cached in (
        chunk_layout,
        grouped_chunk_layout,
        chunk_successors,
        bucket_layout,
        _segment_index,
        _position_in_segment,
    ):
        cached.cache_clear()
