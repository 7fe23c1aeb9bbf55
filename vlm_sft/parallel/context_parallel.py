"""Context parallelism (Ulysses): one packed row split over the ranks of a CP group, exact.

Every rank of a CP group holds the same packed row. The vision tower encodes each rank's share of the images
(``split_images``) and the features are gathered (``ContextParallel.gather_rows``), so the image merge sees the whole
row; then each rank keeps the contiguous ``T / cp`` tokens of its shard (``shard``) for embeddings, MRoPE positions
and loss targets. ``seq_lens`` stays **global**: documents straddle the shard cut. The model does that part itself,
from the split it holds on ``Qwen3_5VLM.context_parallel`` (``vlm_sft.model.sequence_split``: the math of the split,
with no communication).

This module holds what moves data between the ranks. The token mixers switch layouts around their sequence op with
one all-to-all each way (autograd-aware functional collectives, which gloo serves on the CPU):

- ``seq_to_heads``: ``[T / cp, H, d]`` (this rank's tokens, every head) -> ``[T, H / cp, d]`` (every token, this
  rank's heads), and ``heads_to_seq`` back. A head's op then runs on the whole sequence with the global segments,
  so the exact kernels (and fla's varlen kernel) are reused unchanged.
- Full attention: query heads are sharded; key / value heads too when ``cp`` divides them, else each is repeated
  on ``cp / kv`` ranks (the 0.8B's 2 kv heads at cp 4 or 8), so a rank's query heads always meet their kv head.
- GatedDeltaNet: key head i serves a contiguous block of value heads, so a rank takes a contiguous block of each;
  ``in_proj_qkv``'s q, k and v channels are three separate blocks, so the head shard (and the depthwise conv's
  weight) takes three slices (``qkv_channels``).

The all-to-alls sit **around** each mixer's ``core``, outside the model: ``apply_context_parallel`` replaces each
mixer instance's ``forward`` with ``project`` on this rank's tokens -> all-to-all -> ``core`` for this rank's heads
(``HeadBlock(rank, size)``) -> all-to-all back -> ``output``, and restores the class's ``forward`` when CP is turned
off. Only the instance attribute changes (accelerate's hooks do the same), never the module tree or a parameter
name, so Hugging Face checkpoints, FSDP2 and DCP see the same model.

Everything else (norms, MLP, MoE, projections) is per token and runs on the rank's shard. Each rank's loss is the
sum over its own tokens; the CP group's sum is the row's loss, and gradients must be summed over the group, not
averaged (the trainer's business).

Legend: T = tokens of the row(s), t = T / cp tokens of a shard, H = heads, d = head dim, C = channels, D = hidden
size, R = rotary dims, n = rows.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as fc
from torch import nn

from vlm_sft.model.layers import GatedAttention, GatedDeltaNet
from vlm_sft.model.sequence_split import HeadBlock, SequenceSplit, kv_heads_layout, qkv_rank_order

if TYPE_CHECKING:
    from vlm_sft.model.backends import Backends
    from vlm_sft.model.varlen import Segments


@dataclass(frozen=True)
class ContextParallel(SequenceSplit):
    """This rank's place in its CP group; ``size == 1`` (or ``group`` None) is no context parallelism."""

    group: dist.ProcessGroup | None
    rank: int
    size: int

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
"""No context parallelism: the whole row on one rank, like the model's default ``WHOLE_ROW`` (a ``ContextParallel``,
so a run's ``cp`` has one type); ``apply_context_parallel(model, NO_CP)`` turns context parallelism off."""


# ---------------------------------------------------------------------------------- the token mixers' wrappers


class ContextParallelDecodeError(RuntimeError):
    """A token mixer wrapped for context parallelism was handed a decode cache: decoding runs with CP off (the
    trainer's eval and generation turn it off; ``Qwen3_5VLM._cached_logits`` refuses it before any layer runs), so
    this is a caller that skipped both."""


def _refuse_cache(cache: object, module: nn.Module) -> None:
    """A raised error, not an ``assert``: under ``python -O`` a cache would otherwise be ignored, silently."""
    if cache is not None:
        raise ContextParallelDecodeError(
            f"{type(module).__name__} got a decode cache while context parallelism is on: decode with it off "
            "(parallel.parallelize.context_parallel_off), as the trainer's eval and generation do"
        )


def _linear_attn_forward(
    module: GatedDeltaNet, cp: ContextParallel, x_tD: torch.Tensor, segments: Segments, backends: Backends, cache=None
) -> torch.Tensor:
    """``GatedDeltaNet.forward`` under CP: ``x_tD`` is this rank's tokens; the conv and the rule run on the whole
    sequence for this rank's block of heads, between two all-to-alls."""
    _refuse_cache(cache, module)
    qkv_tC, b_tH, a_tH = module.project(x_tD)
    qkv_TC, b_TH, a_TH = _linear_attn_to_heads(module, cp, qkv_tC, b_tH, a_tH)
    o_THV = module.core(qkv_TC, b_TH, a_TH, segments, backends, heads=HeadBlock(cp.rank, cp.size))
    return module.output(cp.heads_to_seq(o_THV), x_tD)


def _linear_attn_to_heads(module: GatedDeltaNet, cp: ContextParallel, qkv_tC, b_tH, a_tH):
    """One all-to-all for q, k, v (three channel blocks per rank), beta and the decay input."""
    t, size = qkv_tC.shape[0], cp.size
    order = qkv_rank_order(module.key_dim, module.value_dim, size, qkv_tC.device)
    parts = [qkv_tC[:, order].view(t, size, -1), b_tH.view(t, size, -1), a_tH.view(t, size, -1)]
    widths = [p.shape[-1] for p in parts]
    packed = cp.seq_to_heads(torch.cat([p.to(qkv_tC.dtype) for p in parts], dim=-1))  # [T, 1, sum(widths)]
    qkv_TC, b_TH, a_TH = packed.squeeze(1).split(widths, dim=-1)
    return qkv_TC, b_TH.to(b_tH.dtype), a_TH.to(a_tH.dtype)


def _attention_forward(
    module: GatedAttention,
    cp: ContextParallel,
    x_tD: torch.Tensor,
    cos_tR: torch.Tensor,
    sin_tR: torch.Tensor,
    segments: Segments,
    backends: Backends,
    cache=None,
) -> torch.Tensor:
    """``GatedAttention.forward`` under CP: ``x_tD`` is this rank's tokens; the attention runs on the whole sequence
    for this rank's query heads (and their kv heads), between two all-to-alls."""
    _refuse_cache(cache, module)
    q_tHD, k_tHD, v_tHD, gate_tHD = module.project(x_tD, cos_tR, sin_tR)
    q_THD, k_THD, v_THD = _attention_to_heads(module, cp, q_tHD, k_tHD, v_tHD)
    o_THD = module.core(q_THD, k_THD, v_THD, segments, backends)
    return module.output(cp.heads_to_seq(o_THD), gate_tHD)


def _attention_to_heads(module: GatedAttention, cp: ContextParallel, q_tHD, k_tHD, v_tHD):
    """One all-to-all for q, k and v: a rank gets its block of query heads and the kv heads they read (kv heads
    repeated first when ``cp`` exceeds them)."""
    repeat = kv_heads_layout(module.num_kv_heads, cp.size)
    if repeat > 1:
        k_tHD, v_tHD = k_tHD.repeat_interleave(repeat, dim=1), v_tHD.repeat_interleave(repeat, dim=1)
    t, size, head_dim = q_tHD.shape[0], cp.size, module.head_dim
    n_q, n_kv = q_tHD.shape[1] // size, k_tHD.shape[1] // size
    parts = [x.reshape(t, size, -1, head_dim) for x in (q_tHD, k_tHD, v_tHD)]
    packed = cp.seq_to_heads(torch.cat(parts, dim=2).reshape(t, -1, head_dim))
    return packed.split([n_q, n_kv, n_kv], dim=1)


_WRAPPERS = {GatedDeltaNet: _linear_attn_forward, GatedAttention: _attention_forward}
"""Each token mixer class and its CP forward."""


# ------------------------------------------------------------------------------------------- turning it on / off


def _cp_class(module: nn.Module) -> type:
    """The mixer class whose CP forward ``module`` takes (FSDP2 subclasses the class it shards)."""
    return next(cls for cls in _WRAPPERS if isinstance(module, cls))


def wrap_token_mixers(mixers: list[nn.Module], cp: SequenceSplit) -> None:
    """Wrap each token mixer (a ``GatedDeltaNet`` or ``GatedAttention``, FSDP2-wrapped or not) in ``cp``'s
    all-to-alls by replacing its instance's ``forward`` (accelerate's hook convention: the module tree and the
    parameter names stay); an inactive ``cp`` unwraps them. Which modules are the mixers is ``parallelize``'s."""
    for module in mixers:
        module.__dict__.pop("forward", None)  # back to the class's forward
        if cp.active:
            cls = _cp_class(module)
            module.forward = functools.update_wrapper(functools.partial(_WRAPPERS[cls], module, cp), cls.forward)
