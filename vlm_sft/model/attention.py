"""Causal varlen attention over packed segments: a query attends only to earlier keys of its own segment.

Backends:
- ``"flash_attn"``: flash-attn's ``flash_attn_varlen_func`` (CUDA, fp16/bf16);
- ``"torch_varlen"``: torch's built-in ``torch.nn.attention.varlen.varlen_attn`` (CUDA flash kernel, fp16/bf16);
- ``"sdpa"``: ``F.scaled_dot_product_attention`` on a padded batch. Segments are grouped into buckets of similar
  length (``varlen.length_buckets``: padded score work traded against the fixed cost of one more call), every
  bucket becomes one batched SDPA call with ``is_causal=True``; a segment's padding sits after its last token, so
  causality alone keeps it out of every real output and no mask tensor is built. One segment is a single plain call.

GQA: ``k``/``v`` may have fewer heads than ``q`` (``H_q`` a multiple of ``H_kv``); each kv head serves
``H_q // H_kv`` consecutive query heads, as in transformers' ``repeat_kv``.

Legend: T = total tokens of the flattened batch, H = heads (``k``/``v`` may have fewer than ``q``), D = head dim,
B = segments in a bucket, L = bucket length.
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F

from vlm_sft.model.varlen import Segments, bucket_layout, gather_rows

logger = logging.getLogger(__name__)


BUCKET_LINEAR_COST = 16
"""Bucketing weight of per-slot work (gathers, output) against the ``L^2`` score work of a padded segment."""
BUCKET_FIXED_COST = 20_000
"""Fixed cost of one more SDPA call (forward and backward), in units of one padded query-key pair: about 150 us on
a CPU core at the tiny model's 2 heads x 32. Only the speed depends on it, never the result."""


def varlen_attention(
    q_THD: torch.Tensor,
    k_THD: torch.Tensor,
    v_THD: torch.Tensor,
    segments: Segments,
    *,
    scale: float,
    backend: str,
) -> torch.Tensor:
    """Causal attention within each of ``segments``; returns ``o_THD`` like ``q``."""
    if q_THD.dim() != 3 or k_THD.shape != v_THD.shape or k_THD.shape[0] != q_THD.shape[0]:
        raise ValueError(
            f"varlen_attention wants q [T, H, D], k and v [T, H_kv, D]; got {tuple(q_THD.shape)}, "
            f"{tuple(k_THD.shape)}, {tuple(v_THD.shape)}"
        )
    if q_THD.shape[1] % k_THD.shape[1]:
        raise ValueError(f"query heads {q_THD.shape[1]} must be a multiple of kv heads {k_THD.shape[1]}")
    segments.check_tokens(q_THD.shape[0], "varlen_attention")
    if backend == "sdpa":
        return _sdpa(q_THD, k_THD, v_THD, segments.lengths, scale)
    if backend == "flash_attn":
        return _flash_attn(q_THD, k_THD, v_THD, segments, scale)
    if backend == "torch_varlen":
        return _torch_varlen(q_THD, k_THD, v_THD, segments, scale)
    raise ValueError(f"unknown attention backend {backend!r}; expected 'flash_attn', 'torch_varlen' or 'sdpa'")


def _sdpa(q_THD, k_THD, v_THD, lengths: tuple[int, ...], scale):
    total, heads, head_dim = q_THD.shape
    gqa = heads != k_THD.shape[1]
    if total == 0:
        return q_THD.new_zeros(q_THD.shape)
    if sum(1 for n in lengths if n) == 1:
        q, k, v = (x.transpose(0, 1).unsqueeze(0) for x in (q_THD, k_THD, v_THD))
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
        return o.squeeze(0).transpose(0, 1)

    layout = bucket_layout(lengths, torch.device(q_THD.device), BUCKET_LINEAR_COST, BUCKET_FIXED_COST)
    q_all, k_all, v_all = (gather_rows(x, layout.slot_to_token) for x in (q_THD, k_THD, v_THD))
    outputs = []
    start = 0
    for batch, length in layout.buckets:
        stop = start + batch * length

        def bucket(x: torch.Tensor, start=start, stop=stop, batch=batch, length=length) -> torch.Tensor:
            return x[start:stop].view(batch, length, *x.shape[1:]).transpose(1, 2)  # [B, heads, L, D]

        o = F.scaled_dot_product_attention(
            bucket(q_all), bucket(k_all), bucket(v_all), is_causal=True, scale=scale, enable_gqa=gqa
        )
        outputs.append(o.transpose(1, 2).reshape(batch * length, heads, head_dim))
        start = stop
    o_all = torch.cat(outputs) if len(outputs) > 1 else outputs[0]
    return o_all.index_select(0, layout.token_to_slot)


def _half_precision(*xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The flash kernels have no fp32 path: fp32 inputs are computed in bf16 (what CUDA autocast feeds them anyway)."""
    if xs[0].dtype in (torch.float16, torch.bfloat16):
        return xs
    _warn_fp32_once()
    return tuple(x.to(torch.bfloat16) for x in xs)


@functools.cache
def _warn_fp32_once() -> None:
    logger.warning("flash attention kernels have no float32 path: float32 q/k/v are computed in bfloat16")


def _flash_attn(q_THD, k_THD, v_THD, segments: Segments, scale):
    from flash_attn import flash_attn_varlen_func  # CUDA-only import, this backend only

    q, k, v = _half_precision(q_THD, k_THD, v_THD)
    cu, longest = segments.cu_seqlens, segments.max_len
    o = flash_attn_varlen_func(
        q, k, v, cu, cu, longest, longest, dropout_p=0.0, softmax_scale=scale, causal=True
    )  # GQA is native: kv heads divide query heads
    return o.to(q_THD.dtype)


def _torch_varlen(q_THD, k_THD, v_THD, segments: Segments, scale):
    from torch.nn.attention.varlen import varlen_attn

    q, k, v = _half_precision(q_THD, k_THD, v_THD)
    cu, longest = segments.cu_seqlens, segments.max_len
    o = varlen_attn(
        q,
        k,
        v,
        cu,
        cu,
        longest,
        longest,
        scale=scale,
        window_size=(-1, 0),  # (-1, 0) is how this API spells causal
        enable_gqa=q.shape[1] != k.shape[1],
    )
    return o.to(q_THD.dtype)
