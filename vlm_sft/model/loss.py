"""Cross-entropy of the LM head over hidden states, without ever materialising ``[T, vocab]`` fp32 logits.

Qwen3.5's vocabulary is 248,320 tokens: full fp32 logits for 8k tokens take 8 GB, and ``F.cross_entropy`` keeps a
second copy (its log-softmax) for backward. Both backends return ``(loss_sum, token_count)`` as fp32 scalars so the
trainer can divide by the global count of trainable tokens across ranks and micro-batches.

Backends:
- ``"chunked"`` (any device): an ``autograd.Function`` walks the tokens in chunks; per chunk it computes the logits
  (fp32), the loss, and right away the softmax gradient, turns it into the hidden-state gradient and adds it to the
  LM-head weight gradient, then frees the chunk. Backward only scales these stored gradients by the incoming grad,
  so at most one chunk of logits is alive at any time, in forward or backward. Gradients are computed in forward
  only when an input needs them (eval pays one matmul per chunk); one backward per forward (no ``retain_graph``
  second pass: the stored gradients are scaled in place and handed over).
- ``"fla_fused"`` (CUDA): flash-linear-attention's fused linear cross-entropy (the same scheme in triton). It always
  allocates and computes an fp32 ``lm_head`` weight gradient, so when the head needs none (a frozen head under LoRA,
  or eval: ~4 GB and one extra matmul per chunk at 248k x 4096) the ``"chunked"`` path runs instead.

``token_scores`` is the eval side of the same scheme: per-token loss and argmax, one chunk of fp32 logits at a time
(eval and the notebooks' teacher-forced scoring both use it, through ``Qwen3_5VLM.forward(..., scores=True)``).

Legend: T = total tokens of the flattened batch, D = hidden size, V = vocabulary size, N = tokens in one chunk.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

DEFAULT_CHUNK = 1024
"""Tokens per chunk: at the real vocabulary (248,320) one fp32 chunk of logits is ~1 GB."""


@dataclass(frozen=True)
class TokenScores:
    """Teacher-forced per-token results of one forward (what eval and the notebooks need, without full logits)."""

    nll: Tensor
    """fp32 ``[B, L]``: cross-entropy of each target where the loss mask is True, 0 elsewhere."""
    argmax: Tensor
    """int64 ``[B, L]``: the most likely next token at every position."""


def chunked_cross_entropy(
    hidden_TD: Tensor,
    lm_head_weight_VD: Tensor,
    target_ids_T: Tensor,
    loss_mask_T: Tensor,
    *,
    chunk_size: int = DEFAULT_CHUNK,
    backend: str = "chunked",
) -> tuple[Tensor, Tensor]:
    """Sum of token cross-entropies where ``loss_mask_T`` is True, and the number of those tokens (fp32 scalars).

    Targets at masked-out positions are ignored (they may be padding or any placeholder id).
    """
    if hidden_TD.dim() != 2 or lm_head_weight_VD.dim() != 2 or hidden_TD.shape[1] != lm_head_weight_VD.shape[1]:
        raise ValueError(
            f"chunked_cross_entropy wants hidden [T, D] and weight [V, D]; got {tuple(hidden_TD.shape)}, "
            f"{tuple(lm_head_weight_VD.shape)}"
        )
    if target_ids_T.shape != hidden_TD.shape[:1] or loss_mask_T.shape != hidden_TD.shape[:1]:
        raise ValueError(
            f"targets and loss mask must be [T] = [{hidden_TD.shape[0]}]; got {tuple(target_ids_T.shape)}, "
            f"{tuple(loss_mask_T.shape)}"
        )
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    mask = loss_mask_T.to(torch.bool)
    count = mask.sum().to(torch.float32)
    if backend == "fla_fused" and not (torch.is_grad_enabled() and lm_head_weight_VD.requires_grad):
        backend = "chunked"  # fla would compute the head's gradient anyway (see the module docstring)
    if backend == "chunked":
        targets = torch.where(mask, target_ids_T, torch.zeros_like(target_ids_T)).long()
        loss = _ChunkedLinearCrossEntropy.apply(hidden_TD, lm_head_weight_VD, targets, mask, chunk_size)
        return loss, count
    if backend == "fla_fused":
        return _fla_fused(hidden_TD, lm_head_weight_VD, target_ids_T, mask), count
    raise ValueError(f"unknown loss backend {backend!r}; expected 'chunked' or 'fla_fused'")


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """Loss sum with gradients precomputed chunk by chunk in forward (no logits kept for backward)."""

    @staticmethod
    def forward(
        ctx, hidden_TD: Tensor, weight_VD: Tensor, targets_T: Tensor, mask_T: Tensor, chunk_size: int
    ) -> Tensor:
        need_dh, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        total = hidden_TD.shape[0]
        acc = torch.promote_types(hidden_TD.dtype, torch.float32)  # fp32, or fp64 for fp64 inputs (tests)
        losses_T = torch.zeros(total, dtype=acc, device=hidden_TD.device)
        grad_h_TD = torch.empty_like(hidden_TD) if need_dh else None
        grad_w_VD = torch.zeros(weight_VD.shape, dtype=acc, device=weight_VD.device) if need_dw else None
        for start in range(0, total, chunk_size):
            stop = min(start + chunk_size, total)
            h_ND, tgt_N, m_N = hidden_TD[start:stop], targets_T[start:stop], mask_T[start:stop]
            logits_NV = (h_ND @ weight_VD.T).to(acc)
            target_logit_N = logits_NV.gather(1, tgt_N[:, None]).squeeze(1)
            max_N = logits_NV.amax(dim=1)
            # From here the chunk's logits buffer is reused in place: exp(logits - max), then the softmax gradient.
            probs_NV = logits_NV.sub_(max_N[:, None]).exp_()
            sumexp_N = probs_NV.sum(dim=1)
            lse_N = max_N + sumexp_N.log()
            losses_T[start:stop] = torch.where(m_N, lse_N - target_logit_N, 0.0)
            if need_dh or need_dw:
                # d(loss)/d(logits) = softmax - onehot(target), zero on masked-out rows.
                probs_NV.div_(sumexp_N[:, None])
                probs_NV.scatter_add_(1, tgt_N[:, None], probs_NV.new_full((stop - start, 1), -1.0))
                probs_NV.mul_(m_N[:, None])
                dlogits_NV = probs_NV.to(weight_VD.dtype)
                if need_dh:
                    grad_h_TD[start:stop] = dlogits_NV @ weight_VD
                if need_dw:
                    grad_w_VD.addmm_(probs_NV.T, h_ND.to(acc))
                del dlogits_NV
            del logits_NV, probs_NV  # free this chunk's buffer before the next chunk allocates its own
        # Kept on ctx (not save_for_backward) so backward can scale them in place and hand them over: a second
        # [V, D] buffer for the weight gradient would cost as much as the vocabulary projection itself.
        ctx.grads = (grad_h_TD, grad_w_VD)
        ctx.weight_dtype = weight_VD.dtype
        return losses_T.sum().float()

    @staticmethod
    def backward(ctx, grad_loss: Tensor):
        if ctx.grads is None:
            raise RuntimeError("chunked_cross_entropy supports one backward per forward (its gradients are consumed)")
        grad_h_TD, grad_w_VD = ctx.grads
        ctx.grads = None
        dh = grad_h_TD.mul_(grad_loss.to(grad_h_TD.dtype)) if grad_h_TD is not None else None
        dw = grad_w_VD.mul_(grad_loss.to(grad_w_VD.dtype)).to(ctx.weight_dtype) if grad_w_VD is not None else None
        return dh, dw, None, None, None


@torch.no_grad()
def token_scores(
    hidden_TD: Tensor,
    lm_head_weight_VD: Tensor,
    target_ids_T: Tensor,
    loss_mask_T: Tensor,
    *,
    chunk_size: int = DEFAULT_CHUNK,
) -> tuple[Tensor, Tensor]:
    """Per-token cross-entropy (fp32 ``[T]``, 0 where ``loss_mask_T`` is False) and argmax (int64 ``[T]``).

    Walks the tokens in chunks like the training loss: one ``[chunk, V]`` fp32 buffer alive at a time, reused in
    place for ``exp``, so eval fits the training loss's memory budget at any sequence length.
    """
    if hidden_TD.dim() != 2 or lm_head_weight_VD.dim() != 2 or hidden_TD.shape[1] != lm_head_weight_VD.shape[1]:
        raise ValueError(
            f"token_scores wants hidden [T, D] and weight [V, D]; got {tuple(hidden_TD.shape)}, "
            f"{tuple(lm_head_weight_VD.shape)}"
        )
    total = hidden_TD.shape[0]
    mask = loss_mask_T.to(torch.bool)
    targets = torch.where(mask, target_ids_T, torch.zeros_like(target_ids_T)).long()
    nll_T = torch.zeros(total, dtype=torch.float32, device=hidden_TD.device)
    argmax_T = torch.zeros(total, dtype=torch.long, device=hidden_TD.device)
    for start in range(0, total, chunk_size):
        stop = min(start + chunk_size, total)
        logits_NV = (hidden_TD[start:stop] @ lm_head_weight_VD.T).float()
        argmax_T[start:stop] = logits_NV.argmax(dim=1)
        target_logit_N = logits_NV.gather(1, targets[start:stop, None]).squeeze(1)
        max_N = logits_NV.amax(dim=1)
        lse_N = max_N + logits_NV.sub_(max_N[:, None]).exp_().sum(dim=1).log()
        nll_T[start:stop] = torch.where(mask[start:stop], lse_N - target_logit_N, 0.0)
        del logits_NV
    return nll_T, argmax_T


def _fla_fused(hidden_TD: Tensor, weight_VD: Tensor, target_ids_T: Tensor, mask_T: Tensor) -> Tensor:
    from fla.modules.fused_linear_cross_entropy import fused_linear_cross_entropy_loss  # CUDA-only import

    ignore_index = -100
    targets = torch.where(mask_T, target_ids_T.long(), torch.full_like(target_ids_T, ignore_index, dtype=torch.long))
    loss = fused_linear_cross_entropy_loss(hidden_TD, targets, weight_VD, ignore_index=ignore_index, reduction="sum")
    return loss.float()
