"""One packed row split over ranks, the model's side: which tokens and heads a rank holds, no communication.

Under context parallelism (Ulysses; the ranks, the collectives and the wrappers around the token mixers are
``vlm_sft.parallel.context_parallel``'s) every rank of a group holds the same packed row and ``Qwen3_5VLM`` keeps a
``SequenceSplit`` on ``context_parallel``. The model reads from it only:

- ``shard``: this rank's contiguous ``T / size`` tokens of the row, for embeddings, MRoPE positions, loss targets and
  the router mask. ``seq_lens`` stays **global**: documents straddle the shard cut;
- ``split_images``: which images this rank's vision tower encodes; ``gather_rows`` then gathers every image's
  features so the image merge sees the whole row.

The token mixers themselves know nothing of the split: their ``core`` runs on every token of the row for one block
of heads (``HeadBlock``), which the parallel package hands them between its all-to-alls. What that needs of the heads
is math, and lives here:

- GatedDeltaNet: key head i serves a contiguous block of value heads, so a rank takes a contiguous block of each;
  ``in_proj_qkv``'s q, k and v channels are three separate blocks, so the head block (and the depthwise conv's
  weight) takes three slices (``qkv_channels``, ``qkv_rank_order``).
- Full attention: query heads are split; key / value heads too when ``size`` divides them, else each is repeated on
  ``size / kv`` ranks (``kv_heads_layout``: the 0.8B's 2 kv heads at cp 4 or 8), so a rank's query heads always meet
  their kv head. ``check_heads`` refuses head counts that cannot split, with the fix.

``WHOLE_ROW`` (size 1) is the default: the whole row on one rank, nothing to move.

Legend: T = tokens of the row, t = T / size tokens of a shard, H = heads, d = head dim, n = rows, D = features.
"""

from __future__ import annotations

import bisect
import functools
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class HeadBlock:
    """Which heads a token mixer's ``core`` holds: block ``index`` of ``count`` equal, contiguous blocks of each kind
    of head (GatedDeltaNet key and value heads; attention query and kv heads). The default is every head."""

    index: int = 0
    """This block's place, from 0 (a CP rank's ``rank``)."""
    count: int = 1
    """Equal blocks the heads are cut into (the CP size); 1: all heads."""

    def of(self, num_heads: int) -> slice:
        """This block's slice of ``num_heads`` heads (or of a per-head parameter)."""
        n = num_heads // self.count
        return slice(self.index * n, (self.index + 1) * n)


ALL_HEADS = HeadBlock()
"""Every head: the plain forward, one rank holding the whole row."""


class SequenceSplit:
    """One row split over ``size`` ranks, as the model sees it: this rank's ``rank``, its token shard, and the data
    movement (``seq_to_heads``, ``heads_to_seq``, ``gather_rows``) that only a split over real ranks implements
    (``vlm_sft.parallel.context_parallel.ContextParallel``)."""

    rank: int
    size: int

    @property
    def active(self) -> bool:
        """True when the row is split over more than one rank."""
        return self.size > 1

    def shard(self, x: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """This rank's contiguous ``1 / size`` of ``x`` along ``dim`` (the token axis)."""
        n = x.shape[dim]
        if n % self.size:
            raise ValueError(
                f"{n} tokens do not split evenly over a context-parallel group of {self.size}: the data pipeline must "
                f"pad every pack to a multiple of train.cp_size"
            )
        return x.narrow(dim, self.rank * (n // self.size), n // self.size)

    def seq_to_heads(self, x_tHd: torch.Tensor) -> torch.Tensor:
        """``[t, H, ...]`` -> ``[T, H / size, ...]``: every token of the row, this rank's block of heads."""
        raise NotImplementedError(f"{type(self).__name__} moves no data between ranks")

    def heads_to_seq(self, x_THd: torch.Tensor) -> torch.Tensor:
        """``[T, H / size, ...]`` -> ``[t, H, ...]``: the inverse of ``seq_to_heads``."""
        raise NotImplementedError(f"{type(self).__name__} moves no data between ranks")

    def gather_rows(self, x_nD: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Every rank's ``x_nD`` (rank r holds ``counts[r]`` rows) concatenated in rank order, gradients flowing back
        to each row's owner."""
        raise NotImplementedError(f"{type(self).__name__} moves no data between ranks")


@dataclass(frozen=True)
class WholeRow(SequenceSplit):
    """The whole row on one rank: every data movement is the identity."""

    rank: int = 0
    size: int = 1

    def seq_to_heads(self, x_tHd: torch.Tensor) -> torch.Tensor:
        return x_tHd

    def heads_to_seq(self, x_THd: torch.Tensor) -> torch.Tensor:
        return x_THd

    def gather_rows(self, x_nD: torch.Tensor, counts: list[int]) -> torch.Tensor:
        return x_nD


WHOLE_ROW = WholeRow()
"""The default: the whole row on one rank."""


def split_images(patches: list[int], size: int) -> list[tuple[int, int]]:
    """Contiguous blocks ``[start, end)`` of the images, one per CP rank: image i goes to the rank whose share of the
    patch count holds its middle patch, so a rank encodes at most ``1 / size`` of the patches plus one image (half
    an image past each end of its share)."""
    total, first, owners = max(sum(patches), 1), 0, []
    for n in patches:
        owners.append(min((2 * first + n) * size // (2 * total), size - 1))
        first += n
    return [(bisect.bisect_left(owners, r), bisect.bisect_right(owners, r)) for r in range(size)]


def kv_heads_layout(num_kv_heads: int, size: int) -> int:
    """How many times each kv head is repeated before ``seq_to_heads`` (1 when ``size`` divides the kv heads)."""
    if num_kv_heads % size == 0:
        return 1
    if size % num_kv_heads == 0:
        return size // num_kv_heads
    raise ValueError(
        f"{num_kv_heads} key/value heads cannot be split over train.cp_size = {size}: choose a cp_size that divides "
        f"them or that they divide"
    )


@functools.cache
def qkv_channels(key_dim: int, value_dim: int, rank: int, size: int, device: torch.device) -> torch.Tensor:
    """Indices of rank ``rank``'s channels of GatedDeltaNet's fused ``[q | k | v]`` (three blocks, one per part), on
    ``device``; cached, so a forward indexes with a tensor already there instead of copying one per layer."""
    kq, vq = key_dim // size, value_dim // size
    parts = [
        torch.arange(rank * kq, (rank + 1) * kq),
        key_dim + torch.arange(rank * kq, (rank + 1) * kq),
        2 * key_dim + torch.arange(rank * vq, (rank + 1) * vq),
    ]
    return torch.cat(parts).to(device)


@functools.cache
def qkv_rank_order(key_dim: int, value_dim: int, size: int, device: torch.device) -> torch.Tensor:
    """Every rank's ``qkv_channels`` in rank order: the permutation that makes each rank's channels contiguous."""
    return torch.cat([qkv_channels(key_dim, value_dim, r, size, device) for r in range(size)])


def check_heads(text_config, size: int) -> None:
    """Raise ``ValueError`` with the fix unless every head count of ``text_config`` splits over ``size`` CP ranks:
    GatedDeltaNet key and value heads divisible by it; full-attention query heads divisible by it; kv heads
    divisible by it or dividing it (``kv_heads_layout``)."""
    if size <= 1:
        return
    counts = {
        "linear_num_key_heads": text_config.linear_num_key_heads,
        "linear_num_value_heads": text_config.linear_num_value_heads,
        "num_attention_heads": text_config.num_attention_heads,
    }
    for name, heads in counts.items():
        if heads % size:
            raise ValueError(
                f"train.cp_size = {size} does not divide {name} = {heads}: each CP rank runs whole heads; choose a "
                f"cp_size that divides {heads}"
            )
    kv_heads_layout(text_config.num_key_value_heads, size)
