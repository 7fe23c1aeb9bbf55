"""Our Qwen3.5-MoE block vs transformers' ``Qwen3_5MoeSparseMoeBlock``: same names, same outputs and gradients,
per-token routing (packed == alone) and no token dropped even when every token picks the same expert."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import Qwen3_5MoeTextConfig
from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeSparseMoeBlock

from vlm_sft.model import moe
from vlm_sft.model.moe import SparseMoeBlock, init_moe_weights, sorted_experts_mlp

HIDDEN, EXPERTS, TOP_K = 32, 8, 2


def tiny_config(experts_implementation: str = "eager") -> Qwen3_5MoeTextConfig:
    cfg = Qwen3_5MoeTextConfig(
        hidden_size=HIDDEN,
        num_experts=EXPERTS,
        num_experts_per_tok=TOP_K,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=24,
        num_hidden_layers=1,
    )
    # Standalone (outside a PreTrainedModel) the experts dispatch on this; None means eager plus a warning.
    cfg._experts_implementation = experts_implementation
    return cfg


def random_reference(cfg: Qwen3_5MoeTextConfig, seed: int = 0) -> Qwen3_5MoeSparseMoeBlock:
    """transformers' block with every parameter ~ N(0, 0.2): standalone it leaves the experts uninitialised
    (``torch.empty``) and the router at zero, so we fill them; 0.2 keeps the routing far from uniform."""
    torch.manual_seed(seed)
    ref = Qwen3_5MoeSparseMoeBlock(cfg)
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_(0.0, 0.2)
    return ref


def ours_from(ref: Qwen3_5MoeSparseMoeBlock, cfg: Qwen3_5MoeTextConfig) -> SparseMoeBlock:
    ours = SparseMoeBlock(cfg)
    ours.load_state_dict(ref.state_dict(), strict=True)
    return ours


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def reference_run(ref: Qwen3_5MoeSparseMoeBlock, x_TD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' block on ``[1, T, D]``; its router logits captured from the router's output (index 0)."""
    captured = []
    handle = ref.gate.register_forward_hook(lambda _m, _i, out: captured.append(out[0]))
    try:
        y = ref(x_TD.unsqueeze(0)).squeeze(0)
    finally:
        handle.remove()
    return y, captured[0]


@pytest.mark.parametrize("experts_implementation", ["eager", "grouped_mm"])
def test_parity_with_transformers(experts_implementation):
    """Forward and backward match for transformers' eager loop and its default (``grouped_mm``) path."""
    cfg = tiny_config(experts_implementation)
    ref = random_reference(cfg)
    ours = ours_from(ref, cfg)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(57, HIDDEN, generator=gen)
    cotangent = torch.randn(57, HIDDEN, generator=gen)

    x_ref, x_ours = x.clone().requires_grad_(), x.clone().requires_grad_()
    y_ref, logits_ref = reference_run(ref, x_ref)
    y_ours, logits_ours = ours(x_ours)
    assert logits_ours.shape == (57, EXPERTS)
    assert torch.equal(logits_ours, logits_ref)
    assert rel_err(y_ours, y_ref) <= 1e-6

    (y_ref * cotangent).sum().backward()
    (y_ours * cotangent).sum().backward()
    assert rel_err(x_ours.grad, x_ref.grad) <= 1e-5
    ref_params = dict(ref.named_parameters())
    for name, p in ours.named_parameters():
        assert p.grad is not None and ref_params[name].grad is not None, name
        assert rel_err(p.grad, ref_params[name].grad) <= 1e-5, name


def test_state_dict_round_trips_to_transformers():
    """Ours -> theirs loads strictly (same names and shapes) and gives the same block."""
    cfg = tiny_config()
    torch.manual_seed(2)
    ours = SparseMoeBlock(cfg)
    ours.apply(lambda m: init_moe_weights(m, std=0.2))
    with torch.no_grad():
        for lin in (*ours.shared_expert.children(), ours.shared_expert_gate):
            lin.weight.normal_(0.0, 0.2)
    theirs = Qwen3_5MoeSparseMoeBlock(cfg)
    theirs.load_state_dict(ours.state_dict(), strict=True)
    for name, tensor in theirs.state_dict().items():
        assert torch.equal(tensor, ours.state_dict()[name]), name
    x = torch.randn(9, HIDDEN)
    assert rel_err(ours(x)[0], reference_run(theirs, x)[0]) <= 1e-6


def capacity_experts_mlp(x_TD, gate_up_EFD, down_EDI, experts_TK, weights_TK):
    """A deliberately broken variant: each expert keeps only its first ``T * K / E`` slots (capacity factor 1,
    earlier tokens win), the usual capacity-dropping MoE. A token's output then depends on its neighbours."""
    capacity = experts_TK.numel() // EXPERTS
    expert_N = experts_TK.reshape(-1)
    rank_N = torch.zeros_like(expert_N)
    for expert in range(EXPERTS):
        slots = (expert_N == expert).nonzero().squeeze(1)
        rank_N[slots] = torch.arange(slots.numel())
    kept_TK = (rank_N < capacity).view_as(weights_TK)
    return sorted_experts_mlp(x_TD, gate_up_EFD, down_EDI, experts_TK, weights_TK * kept_TK)


def packing_gap(block: SparseMoeBlock, a_TD: torch.Tensor, b_TD: torch.Tensor) -> float:
    """Relative gap between the block on ``cat(a, b)`` and on each part alone (output and router logits)."""
    y_packed, logits_packed = block(torch.cat([a_TD, b_TD]))
    (y_a, logits_a), (y_b, logits_b) = block(a_TD), block(b_TD)
    return max(rel_err(y_packed, torch.cat([y_a, y_b])), rel_err(logits_packed, torch.cat([logits_a, logits_b])))


def test_packed_equals_alone(monkeypatch):
    """Routing is per token, so packing two token sets changes nothing; a capacity-dropping block fails this check."""
    cfg = tiny_config()
    block = ours_from(random_reference(cfg), cfg)
    gen = torch.Generator().manual_seed(3)
    a, b = torch.randn(40, HIDDEN, generator=gen), torch.randn(23, HIDDEN, generator=gen)
    with torch.no_grad():
        assert packing_gap(block, a, b) <= 1e-6
        monkeypatch.setattr(moe, "sorted_experts_mlp", capacity_experts_mlp)
        assert packing_gap(block, a, b) > 1e-2


def per_token_reference(block: SparseMoeBlock, x_TD: torch.Tensor) -> torch.Tensor:
    """The block written token by token from its parameters: float32 softmax, top-k, renormalise, SwiGLU experts,
    sigmoid-gated shared expert. Independent of any sorting or batching."""
    rows = []
    for x_D in x_TD:
        probs_E = torch.softmax(block.gate.weight @ x_D, dim=-1, dtype=torch.float32)
        top_K, experts_K = torch.topk(probs_E, TOP_K)
        y_D = torch.zeros_like(x_D)
        for w, e in zip(top_K / top_K.sum(), experts_K.tolist(), strict=True):
            gate_I, up_I = (block.experts.gate_up_proj[e] @ x_D).chunk(2)
            y_D = y_D + w * (block.experts.down_proj[e] @ (F.silu(gate_I) * up_I))
        rows.append(y_D + torch.sigmoid(block.shared_expert_gate(x_D)) * block.shared_expert(x_D))
    return torch.stack(rows)


def test_no_token_dropped_when_one_expert_gets_all():
    """Every token's first choice is expert 0 (8x the mean load): each still gets both of its experts."""
    cfg = tiny_config()
    block = ours_from(random_reference(cfg), cfg)
    with torch.no_grad():
        block.gate.weight[0] = 2.0  # positive inputs -> expert 0 has by far the largest logit for every token
    x = torch.rand(64, HIDDEN, generator=torch.Generator().manual_seed(4)) + 0.1
    with torch.no_grad():
        _, weights_TK, experts_TK = block.gate(x)
        assert (experts_TK[:, 0] == 0).all()
        assert experts_TK[:, 1].unique().numel() > 1  # the second choices spread over other experts
        expected = per_token_reference(block, x)
        assert rel_err(block(x)[0], expected) <= 1e-6
        # The check can fail: a capacity-limited block drops expert 0 for all but its first T * K / E tokens.
        shared = torch.sigmoid(block.shared_expert_gate(x)) * block.shared_expert(x)
        experts = block.experts
        capped = capacity_experts_mlp(x, experts.gate_up_proj, experts.down_proj, experts_TK, weights_TK) + shared
        assert rel_err(capped, expected) > 1e-2
