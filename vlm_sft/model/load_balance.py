"""Router statistics of the Qwen3.5-MoE layers and the auxiliary load-balancing loss built from them.

transformers' ``load_balancing_loss_func`` (the Switch Transformer loss as Qwen3.5-MoE uses it) pools every MoE
layer's router decisions into one per-expert table: with ``C_e`` the number of top-k selections of expert index
``e`` and ``P_e`` the sum of its softmax probability, both summed over the real (non-padding) tokens of every layer,
and ``N`` = layers x real tokens::

    aux = E * sum_e (C_e / N) * (P_e / N)

(expert ``e`` of layer 1 and expert ``e`` of layer 2 share one entry: that is transformers' definition, kept so a
checkpoint's ``router_aux_loss_coef`` means what it meant in pre-training). ``C`` is a count, so the gradient
flows through ``P`` only: ``d aux = E / N^2 * sum_e C_e dP_e``.

The loss is a product of two sums over the whole batch, not a sum over tokens, which is why packing changes it
and why the trainer defines it on the **step**: ``C``, ``P`` and ``N`` summed over every micro-batch and rank
(``vlm_sft.trainer.router_balance``). The model only reports each forward's sums (``RouterStats``); it never
forms the loss itself.

Legend: T = tokens, E = experts, K = experts per token, M = MoE layers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RouterStats:
    """One forward's router sums over its real tokens, per MoE layer (what the load-balancing loss is built from)."""

    counts_ME: torch.Tensor
    """float32 ``[M, E]``: top-k selections of each expert (no gradient; a count). Row sums are K x tokens."""
    probs_ME: torch.Tensor
    """float32 ``[M, E]``: summed softmax probabilities; carries the router's gradient when asked for."""
    tokens: torch.Tensor
    """float32 scalar: real tokens counted (the same in every layer)."""

    @property
    def num_experts(self) -> int:
        return int(self.counts_ME.shape[1])


def router_stats(
    logits: Sequence[torch.Tensor], mask_T: torch.Tensor | None, top_k: int, *, probs_grad: bool
) -> RouterStats:
    """Per-layer ``RouterStats`` from the router logits ``[T, E]`` of each MoE layer, over the tokens of ``mask_T``
    (bool ``[T]``; None: every token). ``probs_grad``: keep ``probs_ME`` in the autograd graph (the load-balancing
    loss trains the routers through it); otherwise everything is detached, so the statistics cost no memory.

    The softmax is float32 and the top-k is taken on it, as the router itself routes; all sums stay on the device.
    """
    if not logits:
        raise ValueError("router_stats needs the logits of at least one MoE layer")
    weight_T1 = None if mask_T is None else mask_T.to(torch.float32).unsqueeze(-1)
    counts, probs = [], []
    for logits_TE in logits:
        with torch.set_grad_enabled(probs_grad and torch.is_grad_enabled()):
            probs_TE = torch.softmax(logits_TE, dim=-1, dtype=torch.float32)
            probs.append((probs_TE if weight_T1 is None else probs_TE * weight_T1).sum(0))
        with torch.no_grad():
            experts_TK = torch.topk(probs_TE.detach(), top_k, dim=-1).indices
            chosen_TE = torch.zeros_like(probs_TE, dtype=torch.float32).scatter_(-1, experts_TK, 1.0)
            counts.append((chosen_TE if weight_T1 is None else chosen_TE * weight_T1).sum(0))
    num_tokens = logits[0].shape[0] if mask_T is None else mask_T.sum()
    tokens = torch.as_tensor(num_tokens, dtype=torch.float32, device=logits[0].device)
    return RouterStats(counts_ME=torch.stack(counts), probs_ME=torch.stack(probs), tokens=tokens)


def load_balancing_loss(
    counts_ME: torch.Tensor, probs_ME: torch.Tensor, num_tokens: torch.Tensor | float
) -> torch.Tensor:
    """``E * sum_e (C_e / N) * (P_e / N)`` with layers pooled per expert index and ``N = M * num_tokens``.

    ``counts_ME`` / ``probs_ME`` may be any sums (one forward, a step, all ranks): the caller decides which
    tokens the loss is defined on. Equals transformers' ``load_balancing_loss_func`` on one unpacked batch.
    """
    num_layers, num_experts = counts_ME.shape
    total = num_layers * num_tokens
    return num_experts * (counts_ME.sum(0) * probs_ME.sum(0)).sum() / (total * total)
