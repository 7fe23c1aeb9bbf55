"""CPU kernels vs references: each packed segment must come out exactly as if it ran alone.

GatedDeltaNet (torch) vs the token-by-token recurrence and vs transformers' chunked rule; the conv vs per-segment
``F.conv1d``; attention vs per-segment SDPA. Each op also gets the case that shows the bug it guards against: the
same packed row run as one segment (what the stock fallbacks do) must differ by far more than the tolerance.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule

from vlm_sft.model.attention import varlen_attention
from vlm_sft.model.conv import causal_conv1d
from vlm_sft.model.gdn import UnitLowerSolve, gated_delta_rule, naive_recurrent_gated_delta_rule
from vlm_sft.model.varlen import Segments

BOUNDARY_LENS = [1, 2, 3, 63, 64, 65, 130]  # shorter than the conv, around one chunk of 64, two chunks
TOL = 1e-5
LEAK = 1e-2  # a boundary leak shows up orders of magnitude above TOL


def _segments(x: torch.Tensor, lens: list[int]) -> list[torch.Tensor]:
    return list(torch.split(x, lens))


# ---------------------------------------------------------------- GatedDeltaNet


def _gdn_inputs(lens: list[int], k_heads: int = 2, v_heads: int = 4, dim: int = 16) -> list[torch.Tensor]:
    """Tiny-preset shapes: 2 key heads x 16, 4 value heads x 16 (q/k not yet repeated: the kernel repeats them)."""
    t = sum(lens)
    q = torch.randn(t, k_heads, dim)
    k = torch.randn(t, k_heads, dim)
    v = torch.randn(t, v_heads, dim)
    g = F.logsigmoid(torch.randn(t, v_heads) + 2.0)  # decays near 1 so state carries far: leaks would show
    beta = torch.rand(t, v_heads)
    return [x.requires_grad_() for x in (q, k, v, g, beta)]


def _grads(out: torch.Tensor, inputs: list[torch.Tensor], weight: torch.Tensor) -> list[torch.Tensor]:
    return list(torch.autograd.grad((out * weight).sum(), inputs))


@pytest.mark.parametrize(
    "lens",
    [BOUNDARY_LENS, [40, 40, 7, 40, 1], [30, 60] * 5 + [130], [130], [1], [64]],
    ids=["packed", "packed-short", "two-short-groups", "one-130", "one-1", "one-64"],
)
def test_gdn_torch_matches_recurrent_reference(lens: list[int]) -> None:
    inputs = _gdn_inputs(lens)
    segs = Segments.from_lengths(lens)
    out = gated_delta_rule(*inputs, segs, backend="torch")
    ref = naive_recurrent_gated_delta_rule(*inputs, segs)
    assert out.shape == (sum(lens), 4, 16)
    torch.testing.assert_close(out, ref, rtol=0, atol=TOL)
    weight = torch.randn_like(out)
    for got, want in zip(_grads(out, inputs, weight), _grads(ref, inputs, weight), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=TOL)


@pytest.mark.parametrize("chunk_size", [16, 32])
def test_gdn_torch_chunk_size_does_not_change_the_result(chunk_size: int) -> None:
    inputs = _gdn_inputs(BOUNDARY_LENS)
    segs = Segments.from_lengths(BOUNDARY_LENS)
    out = gated_delta_rule(*inputs, segs, backend="torch", chunk_size=chunk_size)
    torch.testing.assert_close(out, gated_delta_rule(*inputs, segs, backend="torch"), rtol=0, atol=TOL)


def test_unit_lower_solve_gradients_equal_torch_solve_triangular() -> None:
    """The chunk kernel's own backward of ``(I + A)^-1 B``: float64 gradcheck, and the same gradients as torch's
    ``solve_triangular(unitriangular=True)``, whose diagonal and upper triangle of ``A`` get none."""
    gen = torch.Generator().manual_seed(0)
    a = (0.3 * torch.randn(3, 2, 9, 9, generator=gen, dtype=torch.float64)).requires_grad_()
    b = torch.randn(3, 2, 9, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(UnitLowerSolve.apply, (a, b))
    weight = torch.randn(3, 2, 9, 4, generator=gen, dtype=torch.float64)
    ours = torch.autograd.grad(UnitLowerSolve.apply(a, b), (a, b), weight)
    ref = torch.autograd.grad(torch.linalg.solve_triangular(a, b, upper=False, unitriangular=True), (a, b), weight)
    for got, want in zip(ours, ref, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert ours[0].triu().abs().max() == 0 and ref[0].tril(-1).abs().max() > 0.1  # only the strict lower part


def test_gdn_torch_matches_transformers_chunked_rule_per_segment() -> None:
    inputs = _gdn_inputs(BOUNDARY_LENS)
    out = gated_delta_rule(*inputs, Segments.from_lengths(BOUNDARY_LENS), backend="torch")
    per_input = [_segments(x.detach(), BOUNDARY_LENS) for x in inputs]
    for i, out_seg in enumerate(_segments(out.detach(), BOUNDARY_LENS)):
        q, k, v, g, beta = (seg[i].unsqueeze(0) for seg in per_input)
        ref, _ = torch_chunk_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)
        torch.testing.assert_close(out_seg, ref[0], rtol=0, atol=TOL)


def test_gdn_pre_repeated_heads_equal_grouped_heads() -> None:
    inputs = _gdn_inputs(BOUNDARY_LENS)
    segs = Segments.from_lengths(BOUNDARY_LENS)
    q, k, *rest = (x.detach() for x in inputs)
    repeated = [q.repeat_interleave(2, dim=1), k.repeat_interleave(2, dim=1), *rest]
    torch.testing.assert_close(
        gated_delta_rule(*repeated, segs, backend="torch"), gated_delta_rule(q, k, *rest, segs, backend="torch")
    )


def test_gdn_one_segment_over_the_packed_row_leaks() -> None:
    """What a boundary-blind kernel computes: far from the per-segment result, so the tests above can fail."""
    inputs = _gdn_inputs(BOUNDARY_LENS)
    exact = gated_delta_rule(*inputs, Segments.from_lengths(BOUNDARY_LENS), backend="torch")
    blind = gated_delta_rule(*inputs, Segments.from_lengths([sum(BOUNDARY_LENS)]), backend="torch")
    first = BOUNDARY_LENS[0]
    assert (exact[:first] - blind[:first]).abs().max() < TOL  # the first segment has nothing before it
    assert (exact - blind).abs().max() > LEAK


def test_gdn_rejects_bad_shapes() -> None:
    q, k, v, g, beta = _gdn_inputs([5])
    with pytest.raises(ValueError, match=r"g and beta must be \[T, H\]"):
        gated_delta_rule(q, k, v, g[:, :2], beta, Segments.from_lengths([5]), backend="torch")
    with pytest.raises(ValueError, match="the segments cover 4 tokens but the input has 5"):
        gated_delta_rule(q, k, v, g, beta, Segments.from_lengths([4]), backend="torch")


# ---------------------------------------------------------------- short causal conv

CONV_LENS = [1, 2, 3, 4, 5, 0, 64, 9]  # shorter than, equal to and longer than the kernel; an empty segment


def _conv_reference(x, weight, bias, lens, activation):
    outs = []
    for seg in _segments(x, lens):
        if not len(seg):
            continue
        y = F.conv1d(seg.T[None], weight[:, None, :], bias, padding=weight.shape[1] - 1, groups=x.shape[1])
        y = y[0, :, : len(seg)].T
        outs.append(F.silu(y) if activation else y)
    return torch.cat(outs)


@pytest.mark.parametrize("activation", ["silu", None])
@pytest.mark.parametrize("with_bias", [True, False])
def test_conv_torch_matches_per_segment_conv1d(activation: str | None, with_bias: bool) -> None:
    channels, width = 24, 4
    x = torch.randn(sum(CONV_LENS), channels, requires_grad=True)
    weight = torch.randn(channels, width, requires_grad=True)
    bias = torch.randn(channels, requires_grad=True) if with_bias else None
    out = causal_conv1d(x, weight, bias, Segments.from_lengths(CONV_LENS), backend="torch", activation=activation)
    ref = _conv_reference(x, weight, bias, CONV_LENS, activation)
    torch.testing.assert_close(out, ref, rtol=0, atol=TOL)
    params = [x, weight] + ([bias] if with_bias else [])
    w = torch.randn_like(out)
    for got, want in zip(_grads(out, params, w), _grads(ref, params, w), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=TOL)


def test_conv_one_segment_over_the_packed_row_leaks() -> None:
    x, weight = torch.randn(sum(CONV_LENS), 8), torch.randn(8, 4)
    exact = causal_conv1d(x, weight, None, Segments.from_lengths(CONV_LENS), backend="torch")
    blind = causal_conv1d(x, weight, None, Segments.from_lengths([sum(CONV_LENS)]), backend="torch")
    assert (exact - blind).abs().max() > LEAK


def test_conv_rejects_unknown_activation() -> None:
    with pytest.raises(ValueError, match="activation must be one of"):
        causal_conv1d(
            torch.randn(3, 2), torch.randn(2, 4), None, Segments.from_lengths([3]), backend="torch", activation="gelu"
        )


# ---------------------------------------------------------------- attention

ATTN_LENS = [1, 2, 3, 64, 65, 7, 0, 130, 33]


def _attention_reference(q, k, v, lens, scale):
    groups = q.shape[1] // k.shape[1]
    outs = []
    for qs, ks, vs in zip(_segments(q, lens), _segments(k, lens), _segments(v, lens), strict=True):
        if not len(qs):
            continue
        ks, vs = (x.repeat_interleave(groups, dim=1) for x in (ks, vs))
        o = F.scaled_dot_product_attention(
            qs.transpose(0, 1), ks.transpose(0, 1), vs.transpose(0, 1), is_causal=True, scale=scale
        )
        outs.append(o.transpose(0, 1))
    return torch.cat(outs)


@pytest.mark.parametrize("kv_heads", [1, 2, 4], ids=["gqa-4:1", "gqa-2:1", "mha"])
@pytest.mark.parametrize("lens", [ATTN_LENS, [130]], ids=["packed", "one-segment"])
def test_sdpa_varlen_matches_per_segment_sdpa(kv_heads: int, lens: list[int]) -> None:
    t, dim, scale = sum(lens), 32, 32**-0.5
    q = torch.randn(t, 4, dim, requires_grad=True)
    k = torch.randn(t, kv_heads, dim, requires_grad=True)
    v = torch.randn(t, kv_heads, dim, requires_grad=True)
    out = varlen_attention(q, k, v, Segments.from_lengths(lens), scale=scale, backend="sdpa")
    ref = _attention_reference(q, k, v, lens, scale)
    assert out.shape == q.shape
    torch.testing.assert_close(out, ref, rtol=0, atol=TOL)
    w = torch.randn_like(out)
    for got, want in zip(_grads(out, [q, k, v], w), _grads(ref, [q, k, v], w), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=TOL)


def test_sdpa_one_segment_over_the_packed_row_leaks() -> None:
    t = sum(ATTN_LENS)
    q, k, v = torch.randn(t, 4, 32), torch.randn(t, 2, 32), torch.randn(t, 2, 32)
    exact = varlen_attention(q, k, v, Segments.from_lengths(ATTN_LENS), scale=0.2, backend="sdpa")
    blind = varlen_attention(q, k, v, Segments.from_lengths([t]), scale=0.2, backend="sdpa")
    assert (exact - blind).abs().max() > LEAK


def test_unknown_backend_names_raise() -> None:
    segs = Segments.from_lengths([3])
    with pytest.raises(ValueError, match="unknown attention backend"):
        varlen_attention(torch.randn(3, 2, 4), torch.randn(3, 2, 4), torch.randn(3, 2, 4), segs, scale=1.0, backend="x")
    with pytest.raises(ValueError, match="unknown conv backend"):
        causal_conv1d(torch.randn(3, 2), torch.randn(2, 4), None, segs, backend="x")
    inputs = _gdn_inputs([3])
    with pytest.raises(ValueError, match="unknown linear-attention backend"):
        gated_delta_rule(*inputs, segs, backend="x")
