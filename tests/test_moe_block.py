"""Our Qwen3.5-MoE block vs transformers' ``Qwen3_5MoeSparseMoeBlock``: same names, same outputs and gradients,
per-token routing (packed == alone) and no token dropped even when every token picks the same expert; the grouped
GEMM expert path (``grouped_mm``) against the sorted reference, including empty experts, empty input, broadcast
gradients, autocast and the meta device (no value read on the host)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import Qwen3_5MoeTextConfig
from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeSparseMoeBlock

from vlm_sft.model import moe
from vlm_sft.model.moe import (
    SparseMoeBlock,
    check_grouped_mm_widths,
    grouped_experts_mlp,
    init_moe_weights,
    sorted_experts_mlp,
)

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


@pytest.mark.parametrize("ours_impl", ["sorted", "grouped_mm"])
@pytest.mark.parametrize("experts_implementation", ["eager", "grouped_mm"])
def test_parity_with_transformers(experts_implementation, ours_impl):
    """Forward and backward match for transformers' eager loop and its default (``grouped_mm``) path, with either
    of our expert paths."""
    cfg = tiny_config(experts_implementation)
    ref = random_reference(cfg)
    ours = ours_from(ref, cfg)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(57, HIDDEN, generator=gen)
    cotangent = torch.randn(57, HIDDEN, generator=gen)

    x_ref, x_ours = x.clone().requires_grad_(), x.clone().requires_grad_()
    y_ref, logits_ref = reference_run(ref, x_ref)
    y_ours, logits_ours = ours(x_ours, experts_impl=ours_impl)
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


@pytest.mark.parametrize("impl", ["sorted", "grouped_mm"])
def test_no_token_dropped_when_one_expert_gets_all(impl):
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
        assert rel_err(block(x, experts_impl=impl)[0], expected) <= 1e-6
        # The check can fail: a capacity-limited block drops expert 0 for all but its first T * K / E tokens.
        shared = torch.sigmoid(block.shared_expert_gate(x)) * block.shared_expert(x)
        experts = block.experts
        capped = capacity_experts_mlp(x, experts.gate_up_proj, experts.down_proj, experts_TK, weights_TK) + shared
        assert rel_err(capped, expected) > 1e-2


# ------------------------------------------------------------------------------------ grouped GEMM vs sorted


def random_experts(tokens: int, num_experts: int = EXPERTS, inter: int = 16, seed: int = 5, unused: tuple = (3,)):
    """Inputs of the expert functions: ``x`` ``[T, D]``, fused weights, each token's ``TOP_K`` distinct experts
    drawn from all but ``unused`` (those get no token), and positive routing weights."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, HIDDEN, generator=gen)
    gate_up = 0.2 * torch.randn(num_experts, 2 * inter, HIDDEN, generator=gen)
    down = 0.2 * torch.randn(num_experts, HIDDEN, inter, generator=gen)
    allowed = torch.tensor([e for e in range(num_experts) if e not in unused])
    rows = [allowed[torch.randperm(len(allowed), generator=gen)[:TOP_K]] for _ in range(tokens)]
    experts = torch.stack(rows) if rows else torch.zeros(0, TOP_K, dtype=torch.long)
    return x, gate_up, down, experts, torch.rand(tokens, TOP_K, generator=gen)


def run_with_grads(fn, x, gate_up, down, experts, weights, cotangent=None):
    """``fn``'s output and the gradients of ``(y * cotangent).sum()`` (or ``y.sum()``) w.r.t. x, weights, routing."""
    leaves = [t.clone().requires_grad_() for t in (x, gate_up, down, weights)]
    y = fn(leaves[0], leaves[1], leaves[2], experts, leaves[3])
    (y.sum() if cotangent is None else (y * cotangent).sum()).backward()
    return [y.detach()] + [t.grad for t in leaves]


@pytest.mark.parametrize("tokens", [1, 57])
def test_grouped_equals_sorted(tokens):
    """Forward and every gradient (input, both expert weights, routing weights) agree, with expert 3 unused.

    Measured: bitwise equal with one thread (torch runs the same ``mm`` per expert on the CPU); with two threads the
    input gradient of large layers differed by 9e-8 relative (BLAS splits the work differently), hence 1e-6."""
    x, gate_up, down, experts, weights = random_experts(tokens)
    assert not (experts == 3).any()
    cotangent = torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(6))
    want = run_with_grads(sorted_experts_mlp, x, gate_up, down, experts, weights, cotangent)
    got = run_with_grads(grouped_experts_mlp, x, gate_up, down, experts, weights, cotangent)
    for name, g, w in zip(("y", "x", "gate_up", "down", "weights"), got, want, strict=True):
        assert g.shape == w.shape and g.dtype == w.dtype, name
        assert rel_err(g, w) <= 1e-6, name
    assert got[2][3].abs().max() == 0 and got[3][3].abs().max() == 0  # the unused expert: zero gradient
    assert got[2][experts[0, 0]].abs().max() > 0


def test_grouped_empty_input():
    """No token at all: an empty output, and zero gradients of the right shapes."""
    x, gate_up, down, experts, weights = random_experts(0)
    y, dx, dgate_up, ddown, dweights = run_with_grads(grouped_experts_mlp, x, gate_up, down, experts, weights)
    assert y.shape == (0, HIDDEN) and torch.equal(y, sorted_experts_mlp(x, gate_up, down, experts, weights))
    assert dx.shape == (0, HIDDEN) and dweights.shape == (0, TOP_K)
    assert dgate_up.shape == gate_up.shape and not dgate_up.any() and not ddown.any()


def test_grouped_product_takes_a_broadcast_gradient(monkeypatch):
    """``y.sum().backward()`` hands the product a stride-0 gradient, which ``_grouped_mm``'s backward refuses; the
    densified gradient gives the per-expert matmul's gradients. Without the densifying hook it raises."""
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(10, HIDDEN, generator=gen, requires_grad=True)
    weight = torch.randn(4, 16, HIDDEN, generator=gen, requires_grad=True)
    offsets = torch.tensor([3, 3, 7, 10], dtype=torch.int32)  # expert 1 empty
    moe._grouped_linear(x, weight, offsets).sum().backward()
    x_ref, weight_ref = x.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()
    bounds = [0, 3, 3, 7, 10]
    torch.cat([F.linear(x_ref[bounds[e] : bounds[e + 1]], weight_ref[e]) for e in range(4)]).sum().backward()
    assert rel_err(x.grad, x_ref.grad) <= 1e-6 and rel_err(weight.grad, weight_ref.grad) <= 1e-6

    monkeypatch.setattr(moe, "_dense_grad", lambda grad: grad)
    with pytest.raises(RuntimeError, match="strides"):
        moe._grouped_linear(x, weight, offsets).sum().backward()


def test_grouped_under_autocast_matches_sorted():
    """Inside a CPU bf16 autocast region the grouped path casts its operands as ``F.linear`` would (it is not
    autocast-enabled itself) and gives the sorted path's bf16 result."""
    x, gate_up, down, experts, weights = random_experts(33)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = sorted_experts_mlp(x, gate_up, down, experts, weights.bfloat16())
        got = grouped_experts_mlp(x, gate_up, down, experts, weights.bfloat16())
    assert got.dtype == want.dtype == torch.bfloat16
    assert rel_err(got.float(), want.float()) <= 1e-2  # measured: bitwise equal


def test_grouped_reads_no_value_on_the_host():
    """On the meta device (no values; its ``_grouped_mm`` checks are CUDA's: bf16, 16-byte strides) the grouped path
    runs forward and backward, so it never reads a value (each read is a sync on CUDA); the sorted path cannot."""
    x, gate_up, down, experts, weights = (t.to("meta") for t in random_experts(9))
    leaves = [t.bfloat16().requires_grad_() for t in (x, gate_up, down)]
    y = grouped_experts_mlp(*leaves, experts, weights.bfloat16())
    y.sum().backward()
    assert y.shape == (9, HIDDEN) and leaves[1].grad.shape == gate_up.shape
    with pytest.raises((NotImplementedError, RuntimeError)):  # its per-expert counts have no meta value
        sorted_experts_mlp(*leaves, experts, weights.bfloat16())


def test_grouped_rejects_misaligned_widths_and_unknown_paths():
    x, gate_up, down, experts, weights = random_experts(5)
    with pytest.raises(ValueError, match=r"multiples of 4 in torch\.float32.*experts_impl='sorted'"):
        grouped_experts_mlp(x[:, :30], gate_up[:, :, :30], down[:, :30], experts, weights)
    with pytest.raises(ValueError, match=r"multiples of 8 in torch\.bfloat16"):
        check_grouped_mm_widths(2048, 100)
    check_grouped_mm_widths(2048, 512)  # Qwen3.5-35B-A3B
    cfg = tiny_config()
    with pytest.raises(ValueError, match="'eager' is not one of sorted, grouped_mm"):
        SparseMoeBlock(cfg)(x, experts_impl="eager")
