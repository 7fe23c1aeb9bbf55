"""The Qwen3.5-MoE routed-expert MLP block on the flattened token axis: per-token routing, no token ever dropped.

Math (transformers' ``Qwen3_5MoeSparseMoeBlock``, per token ``x`` of width D)::

    logits = W_router x                                    (in x's dtype; returned for the load-balancing loss)
    p = softmax(logits) in float32
    (w_1..w_k, e_1..e_k) = topk(p, k);  w_i = w_i / sum_j w_j;  w cast back to x's dtype
    routed = sum_i w_i * down_{e_i}(silu(gate_{e_i} x) * up_{e_i} x)
    y = routed + sigmoid(g . x) * shared_expert(x)

The renormalisation over the top k is unconditional: ``Qwen3_5MoeTextConfig`` deletes ``norm_topk_prob`` (its
router always divides by the top-k sum). Every step above is per token, so a packed row needs no ``seq_lens`` here:
a token's output and gradients do not depend on which other tokens share the batch. (The auxiliary load-balancing
loss is the exception; it is computed later from the returned router logits, never inside this block.)

Parameter names and shapes equal transformers' in-memory modules, so a state dict loads either way unchanged:
``gate.weight`` ``[E, D]``; ``experts.gate_up_proj`` ``[E, 2I, D]`` (the I gate rows, then the I up rows);
``experts.down_proj`` ``[E, D, I]``; ``shared_expert.{gate,up,down}_proj.weight``; ``shared_expert_gate.weight``
``[1, D]``. (On disk transformers writes per-expert keys through a conversion mapping; that is the checkpoint
adapter's job, not this module's.)

Expert compute: ``sorted_experts_mlp`` is the exact pure-torch path. Token slots are sorted by expert, each active
expert runs one matmul pair over its contiguous slice, and the slots are put back in token order. There is no
capacity factor: an expert takes however many tokens choose it, so no token is ever dropped.

Legend: T = tokens, D = hidden size, E = experts, K = experts per token (top-k), I = expert intermediate size,
F = 2I (fused gate and up rows), N = T * K routed token slots.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import Qwen3_5MoeTextConfig

from vlm_sft.model.layers import MLP


def is_moe_text_config(config: object) -> bool:
    """True for a Qwen3.5-MoE text config (its decoder layers hold a ``SparseMoeBlock`` instead of a dense MLP)."""
    return isinstance(config, Qwen3_5MoeTextConfig)


def route(x_TD: torch.Tensor, weight_ED: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Top-k softmax routing as ``Qwen3_5MoeTopKRouter`` computes it; returns ``(logits_TE, weights_TK, experts_TK)``.

    The softmax runs in float32 whatever the input dtype (bf16 probabilities would tie and flip near-equal experts);
    the top-k weights are renormalised to sum to 1 and cast back to the logits' dtype, which is the dtype the expert
    outputs are scaled in. ``experts_TK`` is int64, ordered by descending probability like ``torch.topk``.
    """
    logits_TE = F.linear(x_TD, weight_ED)
    probs_TE = torch.softmax(logits_TE, dim=-1, dtype=torch.float32)
    top_TK, experts_TK = torch.topk(probs_TE, top_k, dim=-1)
    weights_TK = (top_TK / top_TK.sum(dim=-1, keepdim=True)).to(logits_TE.dtype)
    return logits_TE, weights_TK, experts_TK


def sorted_experts_mlp(
    x_TD: torch.Tensor,
    gate_up_EFD: torch.Tensor,
    down_EDI: torch.Tensor,
    experts_TK: torch.Tensor,
    weights_TK: torch.Tensor,
) -> torch.Tensor:
    """Exact routed-expert SwiGLU: ``y_t = sum_k w_tk * down_e(silu(gate_e x_t) * up_e x_t)`` with ``e = experts_TK[t, k]``.

    The N = T * K token slots are stably sorted by expert so each expert's tokens are one contiguous slice; every
    expert with at least one token runs one ``[n, D] x [D, F]`` and one ``[n, I] x [I, D]`` matmul on exactly its
    tokens (no capacity, no padding, no dropping). The slot outputs are scaled by their routing weight, put back in
    ``(t, k)`` order by a gather and summed over k, which is deterministic (no atomic ``index_add``).

    Reading the per-expert counts (``tolist``) is one host sync per call; a grouped-GEMM backend with the same
    signature can take the counts as a device tensor instead.
    """
    num_tokens, top_k = experts_TK.shape
    num_experts, _, hidden = gate_up_EFD.shape
    assert x_TD.shape == (num_tokens, hidden), (x_TD.shape, experts_TK.shape, gate_up_EFD.shape)
    assert weights_TK.shape == experts_TK.shape, (weights_TK.shape, experts_TK.shape)
    if num_tokens == 0:
        return x_TD.new_zeros(0, hidden)

    expert_N = experts_TK.reshape(-1)
    order_N = torch.argsort(expert_N, stable=True)  # slot n of the sorted layout is flat slot order_N[n]
    token_N = order_N // top_k
    counts = torch.bincount(expert_N, minlength=num_experts).tolist()
    x_ND = x_TD[token_N]

    outputs = []
    for expert, x_nD in enumerate(torch.split(x_ND, counts)):
        if x_nD.shape[0] == 0:
            continue
        gate_nI, up_nI = F.linear(x_nD, gate_up_EFD[expert]).chunk(2, dim=-1)
        outputs.append(F.linear(F.silu(gate_nI) * up_nI, down_EDI[expert]))
    y_ND = torch.cat(outputs) * weights_TK.reshape(-1)[order_N, None]

    inverse_N = torch.empty_like(order_N)
    inverse_N[order_N] = torch.arange(order_N.numel(), device=order_N.device)
    return y_ND[inverse_N].view(num_tokens, top_k, hidden).sum(dim=1)


class TopKRouter(nn.Module):
    """The router: holds ``weight`` ``[E, D]`` like ``Qwen3_5MoeTopKRouter``; see ``route`` for the math."""

    def __init__(self, config: Qwen3_5MoeTextConfig) -> None:
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.weight = nn.Parameter(torch.zeros(config.num_experts, config.hidden_size))

    def forward(self, x_TD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return route(x_TD, self.weight, self.top_k)


class Experts(nn.Module):
    """The E routed experts as two fused 3-D parameters, named and shaped like ``Qwen3_5MoeExperts``."""

    def __init__(self, config: Qwen3_5MoeTextConfig) -> None:
        super().__init__()
        num_experts, hidden, inter = config.num_experts, config.hidden_size, config.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.zeros(num_experts, 2 * inter, hidden))
        self.down_proj = nn.Parameter(torch.zeros(num_experts, hidden, inter))

    def forward(self, x_TD: torch.Tensor, experts_TK: torch.Tensor, weights_TK: torch.Tensor) -> torch.Tensor:
        return sorted_experts_mlp(x_TD, self.gate_up_proj, self.down_proj, experts_TK, weights_TK)


class SparseMoeBlock(nn.Module):
    """Routed experts plus the sigmoid-gated shared expert; the MLP of a Qwen3.5-MoE decoder layer.

    Takes the flattened tokens ``x_TD`` of a packed batch and returns ``(y_TD, router_logits_TE)``; the logits are
    in ``x``'s dtype, as transformers records them for its load-balancing loss.
    """

    def __init__(self, config: Qwen3_5MoeTextConfig) -> None:
        super().__init__()
        if config.hidden_act != "silu":
            raise ValueError(f"hidden_act={config.hidden_act!r}: only 'silu' (the Qwen3.5 activation) is supported")
        if not 1 <= config.num_experts_per_tok <= config.num_experts:
            raise ValueError(
                f"num_experts_per_tok={config.num_experts_per_tok} with num_experts={config.num_experts}: "
                "set num_experts_per_tok between 1 and num_experts"
            )
        self.gate = TopKRouter(config)
        self.experts = Experts(config)
        self.shared_expert = MLP(config.hidden_size, config.shared_expert_intermediate_size)
        self.shared_expert_gate = nn.Linear(config.hidden_size, 1, bias=False)

    def forward(self, x_TD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if x_TD.dim() != 2:
            raise ValueError(f"SparseMoeBlock takes flattened tokens [T, D]; got shape {tuple(x_TD.shape)}")
        logits_TE, weights_TK, experts_TK = self.gate(x_TD)
        routed_TD = self.experts(x_TD, experts_TK, weights_TK)
        shared_TD = torch.sigmoid(self.shared_expert_gate(x_TD)) * self.shared_expert(x_TD)
        return routed_TD + shared_TD, logits_TE


@torch.no_grad()
def init_moe_weights(module: nn.Module, std: float) -> None:
    """Random init of the MoE-specific parameters as transformers' ``Qwen3_5MoePreTrainedModel._init_weights`` does.

    Fused expert weights and the router weight ~ N(0, std) (the ``nn.Linear`` of the shared expert and its gate are
    left to ``init_text_weights``). Call through ``Module.apply``.
    """
    if isinstance(module, Experts):
        module.gate_up_proj.normal_(0.0, std)
        module.down_proj.normal_(0.0, std)
    elif isinstance(module, TopKRouter):
        module.weight.normal_(0.0, std)
