"""CUDA kernel backends against the pure-torch paths (``gpu`` marker: skipped without CUDA).

Every CUDA path must give each packed segment what the exact torch path gives it. The fast kernels compute in
bf16, so the comparisons use bf16-representable fp32 inputs and bf16-sized tolerances; a boundary leak is still
orders of magnitude larger (the CPU tests pin that down). A backend whose package is missing is skipped by name.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.nn.functional as F

from vlm_sft.model import backends
from vlm_sft.model.attention import varlen_attention
from vlm_sft.model.conv import causal_conv1d
from vlm_sft.model.gdn import gated_delta_rule
from vlm_sft.model.loss import chunked_cross_entropy
from vlm_sft.model.varlen import Segments

pytestmark = pytest.mark.gpu

LENS = [1, 2, 3, 63, 64, 65, 130, 500, 7]
DEVICE = "cuda"


def _needs(module: str) -> None:
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{module} is not installed")


def _bf16_exact(*shape: int, scale: float = 1.0) -> torch.Tensor:
    """fp32 values that bf16 represents exactly, so a bf16 kernel and an fp32 reference see the same inputs."""
    return (scale * torch.randn(*shape, device=DEVICE)).bfloat16().float()


def _grads(out: torch.Tensor, inputs: list[torch.Tensor], weight: torch.Tensor) -> list[torch.Tensor]:
    return list(torch.autograd.grad((out.float() * weight).sum(), inputs))


def _assert_close(got: torch.Tensor, want: torch.Tensor, rel: float) -> None:
    """Max error relative to the reference's magnitude (bf16 kernels: ~1e-2)."""
    err = (got.float() - want.float()).abs().max().item()
    assert err <= rel * max(want.abs().max().item(), 1e-3), f"max |delta| {err:.3g} vs scale {want.abs().max():.3g}"


def test_resolve_backends_on_cuda_uses_what_is_installed() -> None:
    backends._resolve.cache_clear()
    chosen = backends.resolve_backends(DEVICE)
    if importlib.util.find_spec("fla") and importlib.util.find_spec("triton"):
        assert chosen.linear_attention == "fla" and chosen.conv == "fla" and chosen.loss == "fla_fused"
    if importlib.util.find_spec("flash_attn"):
        assert chosen.attention == "flash_attn"


def _gdn_inputs(lens: list[int], heads: int = 4, dim: int = 64, k_heads: int | None = None) -> list[torch.Tensor]:
    """``k_heads`` < ``heads``: key heads shared by value heads (fla maps them natively, the torch path repeats)."""
    t = sum(lens)
    k_heads = k_heads or heads
    q, k, v = _bf16_exact(t, k_heads, dim), _bf16_exact(t, k_heads, dim), _bf16_exact(t, heads, dim)
    g = F.logsigmoid(torch.randn(t, heads, device=DEVICE) + 2.0)
    beta = torch.rand(t, heads, device=DEVICE).bfloat16().float()
    return [x.requires_grad_() for x in (q, k, v, g, beta)]


@pytest.mark.parametrize("k_heads", [4, 2])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_gdn_fla_matches_torch(k_heads: int, dtype: torch.dtype) -> None:
    _needs("fla")
    inputs = _gdn_inputs(LENS, k_heads=k_heads)
    segs = Segments.from_lengths(LENS, DEVICE)
    want = gated_delta_rule(*inputs, segs, backend="torch")
    got = gated_delta_rule(*[x.to(dtype) if x.dim() == 3 else x for x in inputs], segs, backend="fla")
    assert got.dtype == dtype  # fla's float32 kernel, no bf16 downcast
    _assert_close(got, want, 2e-2 if dtype == torch.bfloat16 else 5e-3)  # float32 dots may run as tf32 on a GPU
    w = torch.randn_like(want)
    for g_got, g_want in zip(_grads(got, inputs, w), _grads(want, inputs, w), strict=True):
        _assert_close(g_got, g_want, 5e-2)


def test_gdn_torch_on_cuda_matches_cpu() -> None:
    inputs = _gdn_inputs(LENS)
    segs = Segments.from_lengths(LENS, DEVICE)
    got = gated_delta_rule(*inputs, segs, backend="torch")
    want = gated_delta_rule(*[x.detach().cpu() for x in inputs], Segments.from_lengths(LENS), backend="torch")
    torch.testing.assert_close(got.cpu(), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("backend", ["fla", "causal_conv1d"])
def test_conv_cuda_matches_torch(backend: str) -> None:
    _needs("fla" if backend == "fla" else "causal_conv1d")
    channels = 256
    x = _bf16_exact(sum(LENS), channels).requires_grad_()
    weight = _bf16_exact(channels, 4).requires_grad_()
    bias = _bf16_exact(channels).requires_grad_()
    segs = Segments.from_lengths(LENS, DEVICE)
    want = causal_conv1d(x, weight, bias, segs, backend="torch")
    got = causal_conv1d(x.bfloat16(), weight.bfloat16(), bias.bfloat16(), segs, backend=backend)
    _assert_close(got, want, 2e-2)
    w = torch.randn_like(want)
    for g_got, g_want in zip(_grads(got, [x, weight, bias], w), _grads(want, [x, weight, bias], w), strict=True):
        _assert_close(g_got, g_want, 5e-2)


@pytest.mark.parametrize("backend", ["flash_attn", "torch_varlen"])
@pytest.mark.parametrize("kv_heads", [2, 8])
def test_attention_cuda_matches_sdpa(backend: str, kv_heads: int) -> None:
    if backend == "flash_attn":
        _needs("flash_attn")
    elif not backends._torch_varlen_ready():
        pytest.skip("torch's varlen attention needs the flash kernel on sm80+")
    t = sum(LENS)
    q = _bf16_exact(t, 8, 128).requires_grad_()
    k = _bf16_exact(t, kv_heads, 128).requires_grad_()
    v = _bf16_exact(t, kv_heads, 128).requires_grad_()
    segs = Segments.from_lengths(LENS, DEVICE)
    want = varlen_attention(q, k, v, segs, scale=128**-0.5, backend="sdpa")
    got = varlen_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), segs, scale=128**-0.5, backend=backend)
    _assert_close(got, want, 2e-2)
    w = torch.randn_like(want)
    for g_got, g_want in zip(_grads(got, [q, k, v], w), _grads(want, [q, k, v], w), strict=True):
        _assert_close(g_got, g_want, 5e-2)


def test_loss_fla_fused_matches_chunked() -> None:
    _needs("fla")
    tokens, hidden, vocab = 1000, 256, 32_000
    h = _bf16_exact(tokens, hidden).requires_grad_()
    w = _bf16_exact(vocab, hidden, scale=0.05).requires_grad_()
    targets = torch.randint(0, vocab, (tokens,), device=DEVICE)
    mask = torch.rand(tokens, device=DEVICE) > 0.3
    want, count = chunked_cross_entropy(h, w, targets, mask, chunk_size=256)
    got, count_fused = chunked_cross_entropy(h.bfloat16(), w.bfloat16(), targets, mask, backend="fla_fused")
    assert count_fused.item() == count.item()
    assert abs(got.item() - want.item()) <= 1e-2 * abs(want.item())
    g_want = torch.autograd.grad(want, [h, w])
    g_got = torch.autograd.grad(got, [h, w])
    for a, b in zip(g_got, g_want, strict=True):
        _assert_close(a, b, 5e-2)
