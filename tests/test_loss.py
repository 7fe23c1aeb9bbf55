"""Chunked cross-entropy equals full ``F.cross_entropy(reduction="sum")``: value, count and gradients."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vlm_sft.model.loss import chunked_cross_entropy

TOKENS, HIDDEN, VOCAB = 300, 32, 500


def _inputs(dtype: torch.dtype, masked_target: int = -100):
    hidden = torch.randn(TOKENS, HIDDEN, dtype=dtype, requires_grad=True)
    weight = (0.3 * torch.randn(VOCAB, HIDDEN, dtype=dtype)).requires_grad_()
    targets = torch.randint(0, VOCAB, (TOKENS,))
    mask = torch.rand(TOKENS) > 0.3
    targets[~mask] = masked_target  # any id may sit under the mask: it must be ignored, not indexed
    return hidden, weight, targets, mask


def _full(hidden, weight, targets, mask):
    logits = (hidden @ weight.T).to(torch.promote_types(hidden.dtype, torch.float32))
    return F.cross_entropy(logits, targets.masked_fill(~mask, -100), reduction="sum")


@pytest.mark.parametrize("chunk_size", [1, 64, 299, 1024])
def test_chunked_loss_equals_full_cross_entropy_float64(chunk_size: int) -> None:
    hidden, weight, targets, mask = _inputs(torch.float64)
    loss, count = chunked_cross_entropy(hidden, weight, targets, mask, chunk_size=chunk_size)
    full = _full(hidden, weight, targets, mask)
    assert loss.dtype == count.dtype == torch.float32 and loss.dim() == count.dim() == 0
    assert count.item() == mask.sum().item()
    assert abs(loss.item() - full.item()) <= 1e-6 * abs(full.item())  # fp32 return: relative
    grads = torch.autograd.grad(loss, [hidden, weight])
    want = torch.autograd.grad(full, [hidden, weight])
    for got, ref in zip(grads, want, strict=True):
        torch.testing.assert_close(got, ref, rtol=0, atol=1e-6)


def test_chunked_loss_equals_full_cross_entropy_float32() -> None:
    hidden, weight, targets, mask = _inputs(torch.float32, masked_target=VOCAB + 7)
    loss, count = chunked_cross_entropy(hidden, weight, targets, mask, chunk_size=64)
    full = _full(hidden, weight, targets, mask)
    assert abs(loss.item() - full.item()) / count.item() <= 1e-6  # per-token mean within 1e-6
    grads = torch.autograd.grad(loss / count, [hidden, weight])
    want = torch.autograd.grad(full / count, [hidden, weight])
    for got, ref in zip(grads, want, strict=True):
        torch.testing.assert_close(got, ref, rtol=0, atol=1e-6)


def test_masked_tokens_do_not_contribute() -> None:
    hidden, weight, targets, mask = _inputs(torch.float32)
    targets = torch.where(mask, targets, 0)
    loss, _ = chunked_cross_entropy(hidden, weight, targets, mask, chunk_size=64)
    everything, _ = chunked_cross_entropy(hidden, weight, targets, torch.ones_like(mask), chunk_size=64)
    assert everything.item() > loss.item() + 1.0
    grad_h = torch.autograd.grad(loss, hidden)[0]
    assert grad_h[~mask].abs().max() == 0


def test_gradient_scales_with_upstream_gradient() -> None:
    hidden, weight, targets, mask = _inputs(torch.float64)
    (g1,) = torch.autograd.grad(chunked_cross_entropy(hidden, weight, targets, mask, chunk_size=64)[0], hidden)
    (g3,) = torch.autograd.grad(3.0 * chunked_cross_entropy(hidden, weight, targets, mask, chunk_size=64)[0], hidden)
    torch.testing.assert_close(g3, 3.0 * g1)


def test_second_backward_through_the_same_forward_raises() -> None:
    hidden, weight, targets, mask = _inputs(torch.float32)
    loss, _ = chunked_cross_entropy(hidden, weight, targets, mask, chunk_size=64)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="one backward per forward"):
        loss.backward()


def test_no_grad_inputs_give_the_same_value() -> None:
    hidden, weight, targets, mask = _inputs(torch.float32)
    with torch.no_grad():
        loss, _ = chunked_cross_entropy(hidden, weight, targets, mask, chunk_size=64)
    torch.testing.assert_close(loss, chunked_cross_entropy(hidden, weight, targets, mask, chunk_size=64)[0])


def test_bad_shapes_and_backend_raise() -> None:
    hidden, weight, targets, mask = _inputs(torch.float32)
    with pytest.raises(ValueError, match="targets and loss mask"):
        chunked_cross_entropy(hidden, weight, targets[:-1], mask)
    with pytest.raises(ValueError, match="unknown loss backend"):
        chunked_cross_entropy(hidden, weight, targets, mask, backend="nope")


def test_a_frozen_head_never_reaches_the_fused_kernel(monkeypatch):
    """fla's fused loss always computes an fp32 ``lm_head`` gradient (a LoRA run's frozen 248k x 4096 head: ~4 GB and
    a matmul per chunk for nothing), so a head that needs no gradient takes the chunked path, with the same numbers;
    a trainable head still reaches the fused kernel (here a stub that says so, since fla needs CUDA)."""
    from vlm_sft.model import loss as loss_module

    def fused(*args, **kwargs):
        raise AssertionError("reached the fused kernel")

    monkeypatch.setattr(loss_module, "_fla_fused", fused)
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(12, 8, generator=gen, requires_grad=True)
    head = torch.randn(40, 8, generator=gen)
    targets, mask = torch.randint(0, 40, (12,), generator=gen), torch.rand(12, generator=gen) > 0.3
    got, count = chunked_cross_entropy(hidden, head, targets, mask, backend="fla_fused")
    expected, _ = chunked_cross_entropy(hidden, head, targets, mask, backend="chunked")
    assert torch.equal(got, expected) and int(count) == int(mask.sum())
    with pytest.raises(AssertionError, match="fused kernel"):
        chunked_cross_entropy(hidden, head.requires_grad_(), targets, mask, backend="fla_fused")
