"""Segment bookkeeping for packed (variable-length) batches: ``cu_seqlens`` and the index maps the pure-torch kernels use.

A packed row holds several samples (segments) back to back; the flattened batch is ``T`` tokens long. Every kernel of
the text model takes the segment boundaries as ``cu_seqlens``, the int32 prefix sums ``[0, l0, l0 + l1, ..., T]``
(the convention of flash-attn, flash-linear-attention and torch's varlen attention), and must keep each token's output
independent of every other segment.

The pure-torch kernels (GatedDeltaNet, conv, SDPA attention) batch all segments into one computation instead of
looping over them in Python: they gather tokens into a padded layout (each segment padded to whole chunks or to a
bucket length), compute, and gather back. The index maps for that are built here, once per distinct list of lengths
(cached), from plain integer lengths.

Legend: T = total tokens of the flattened batch, S = segments, N = chunks, C = chunk size.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch


def seq_lens_to_cu_seqlens(
    seq_lens: torch.Tensor | Sequence[int], *, device: torch.device | str | None = None
) -> torch.Tensor:
    """Turn segment lengths ``[l0, l1, ...]`` into int32 ``cu_seqlens`` ``[0, l0, l0 + l1, ..., T]`` (``[S + 1]``).

    ``seq_lens`` is the packer's per-row contract (a 1-D integer tensor or list whose sum is the row length); the
    kernels want prefix sums because every fast varlen kernel (flash-attn, fla, torch varlen attention) does. Zero
    lengths are allowed (they make an empty segment); negative lengths raise.
    """
    lens = torch.as_tensor(seq_lens, device=device)
    if lens.dim() != 1:
        raise ValueError(f"seq_lens must be 1-D (one packed row), got shape {tuple(lens.shape)}")
    if lens.is_floating_point() or lens.dtype == torch.bool:
        raise ValueError(f"seq_lens must hold integers, got dtype {lens.dtype}")
    if lens.numel() and bool((lens < 0).any()):
        raise ValueError(f"seq_lens must be non-negative, got {lens.tolist()}")
    cu = torch.zeros(lens.numel() + 1, dtype=torch.int32, device=lens.device)
    cu[1:] = torch.cumsum(lens, 0).to(torch.int32)
    return cu


def cu_seqlens_to_lengths(cu_seqlens: torch.Tensor, total_tokens: int) -> tuple[int, ...]:
    """Segment lengths as Python ints, checked against the token count (one host sync; the layouts need ints)."""
    cu = cu_seqlens.tolist()
    if len(cu) < 2 or cu[0] != 0 or cu[-1] != total_tokens:
        raise ValueError(f"cu_seqlens must run from 0 to the token count {total_tokens}, got {cu}")
    lengths = tuple(b - a for a, b in itertools.pairwise(cu))
    if any(n < 0 for n in lengths):
        raise ValueError(f"cu_seqlens must be non-decreasing, got {cu}")
    return lengths


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
class BucketLayout:
    """Segments grouped into buckets of similar length, each bucket padded to its longest segment.

    A bucket is one batched call of a dense kernel (``[B, L_max, ...]``); padding sits at the end of each row, so a
    causal kernel never lets a real token see it. Grouping by length bounds the padding at 2x the real tokens.
    """

    buckets: tuple[tuple[int, int], ...]
    """``(batch, max_len)`` of each bucket, in the order their rows appear in ``slot_to_token``."""
    slot_to_token: torch.Tensor
    """int64 ``[sum(batch * max_len)]``: source token of each padded position, ``T`` for padding."""
    token_to_slot: torch.Tensor
    """int64 ``[T]``: padded position of each token."""


@functools.lru_cache(maxsize=64)
def bucket_layout(lengths: tuple[int, ...], device: torch.device) -> BucketLayout:
    """Group non-empty segments (longest first) into buckets whose members are at least half the bucket's longest."""
    starts = [0]
    for n in lengths:
        starts.append(starts[-1] + n)
    total = starts[-1]
    order = sorted((s for s in range(len(lengths)) if lengths[s] > 0), key=lambda s: -lengths[s])
    groups: list[list[int]] = []
    for s in order:
        if groups and 2 * lengths[s] >= lengths[groups[-1][0]]:
            groups[-1].append(s)
        else:
            groups.append([s])
    slot_to_token: list[int] = []
    token_to_slot = [0] * total
    buckets = []
    for group in groups:
        max_len = lengths[group[0]]
        buckets.append((len(group), max_len))
        for s in group:
            base = len(slot_to_token)
            n = lengths[s]
            slot_to_token.extend(range(starts[s], starts[s] + n))
            slot_to_token.extend([total] * (max_len - n))
            for i in range(n):
                token_to_slot[starts[s] + i] = base + i
    return BucketLayout(
        buckets=tuple(buckets),
        slot_to_token=torch.tensor(slot_to_token, dtype=torch.int64, device=device),
        token_to_slot=torch.tensor(token_to_slot, dtype=torch.int64, device=device),
    )


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
