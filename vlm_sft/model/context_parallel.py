"""Context parallelism (Ulysses): one packed row split over the ranks of a CP group, exact.

Every rank of a CP group holds the same packed row. The vision tower encodes each rank's share of the images
(``split_images``) and the features are gathered, so the image merge sees the whole row; then each rank keeps the
contiguous ``T / cp`` tokens of its shard (``shard``) for embeddings, MRoPE positions and loss targets. ``seq_lens``
stays **global**: documents straddle the shard cut.

The token mixers switch layouts around their sequence op with one all-to-all each way (autograd-aware functional
collectives, which gloo serves on the CPU):

- ``seq_to_heads``: ``[T / cp, H, d]`` (this rank's tokens, every head) -> ``[T, H / cp, d]`` (every token, this
  rank's heads), and ``heads_to_seq`` back. A head's op then runs on the whole sequence with the global segments,
  so the exact kernels (and fla's varlen kernel) are reused unchanged.
- Full attention: query heads are sharded; key / value heads too when ``cp`` divides them, else each is repeated
  on ``cp / kv`` ranks (the 0.8B's 2 kv heads at cp 4 or 8), so a rank's query heads always meet their kv head.
- GatedDeltaNet: key head i serves a contiguous block of value heads, so a rank takes a contiguous block of each;
  ``in_proj_qkv``'s q, k and v channels are three separate blocks, so the head shard (and the depthwise conv's
  weight) takes three slices (``qkv_channels``).

Everything else (norms, MLP, MoE, projections) is per token and runs on the rank's shard. Each rank's loss is the
sum over its own tokens; the CP group's sum is the row's loss, and gradients must be summed over the group, not
averaged (the trainer's business).

Legend: T = tokens of the row(s), t = T / cp tokens of a shard, H = heads, d = head dim, C = channels.
"""

from __future__ import annotations

import bisect
import functools
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as fc


@dataclass(frozen=True)
class ContextParallel:
    """This rank's place in its CP group; ``size == 1`` (or ``group`` None) is no context parallelism."""

    group: dist.ProcessGroup | None
    rank: int
    size: int

    @property
    def active(self) -> bool:
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
        """``[t, H, ...]`` -> ``[T, H / cp, ...]``: every token of the row, this rank's block of heads."""
        t, heads = x_tHd.shape[:2]
        rest = x_tHd.shape[2:]
        chunks = x_tHd.reshape(t, self.size, heads // self.size, *rest).transpose(0, 1).contiguous()
        return self._all_to_all(chunks.reshape(self.size * t, heads // self.size, *rest))  # rank j's tokens j-th

    def heads_to_seq(self, x_THd: torch.Tensor) -> torch.Tensor:
        """``[T, H / cp, ...]`` -> ``[t, H, ...]``: this rank's tokens, every head (the inverse of ``seq_to_heads``)."""
        T, local = x_THd.shape[:2]
        rest = x_THd.shape[2:]
        out = self._all_to_all(x_THd.contiguous()).reshape(self.size, T // self.size, local, *rest)
        return out.transpose(0, 1).reshape(T // self.size, self.size * local, *rest)

    def gather_rows(self, x_nD: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Every rank's ``x_nD`` (rank r holds ``counts[r]`` rows), concatenated in rank order, with gradients flowing
        back to each row's owner. Shares are padded to the largest: gloo's all-gather takes equal sizes only."""
        most = max(counts)
        padded = torch.cat([x_nD, x_nD.new_zeros(most - x_nD.shape[0], *x_nD.shape[1:])])
        gathered = fc.wait_tensor(fc.all_gather_single_autograd(padded, 0, self.group))
        return torch.cat([gathered[r * most : r * most + n] for r, n in enumerate(counts)])

    def _all_to_all(self, x: torch.Tensor) -> torch.Tensor:
        return fc.wait_tensor(fc.all_to_all_single_autograd(x, None, None, self.group))


NO_CP = ContextParallel(group=None, rank=0, size=1)
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
