"""The torch GatedDeltaNet's chunked scan: every chunk size, ragged scans, strong decays, the scan's own backward.

``gated_delta_rule`` picks its chunk size from the key head dim (``default_chunk_size``: 16 for the tiny model), so
these rows are built to end segments at every step of the scan: segments of 1 to several hundred tokens, lengths just
under, at and over a chunk, a zero-length segment. Each chunk size must give the token-by-token recurrence's outputs
and gradients (``test_kernels.py`` holds the default chunk size to it and to transformers' chunked rule).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vlm_sft.model.gdn import (
    UnitLowerSolve,
    _StateScan,
    default_chunk_size,
    gated_delta_rule,
    naive_recurrent_gated_delta_rule,
    unit_lower_inverse,
)
from vlm_sft.model.varlen import Segments, chunk_successors

RAGGED_LENS = [300, 17, 64, 65, 1, 0, 130, 33, 16, 8]
TOL = 1e-5


def _inputs(lens: list[int], *, strong_decay: bool, seed: int = 0) -> list[torch.Tensor]:
    """Tiny-preset heads (2 key heads, 4 value heads, dim 16). ``strong_decay``: the model's own decays at init
    (``-A * softplus(a + 1)``, ``A ~ U(0.01, 16)``: up to ~40 per token, so most intra-chunk decays hit the floor)."""
    gen = torch.Generator().manual_seed(seed)
    t = sum(lens)
    q, k = torch.randn(t, 2, 16, generator=gen), torch.randn(t, 2, 16, generator=gen)
    v = torch.randn(t, 4, 16, generator=gen)
    if strong_decay:
        g = -torch.empty(4).uniform_(0.01, 16, generator=gen) * F.softplus(torch.randn(t, 4, generator=gen) + 1)
    else:
        g = F.logsigmoid(torch.randn(t, 4, generator=gen) + 2.0)  # decays near 1: the state carries far
    beta = torch.rand(t, 4, generator=gen)
    return [x.requires_grad_() for x in (q, k, v, g, beta)]


@pytest.mark.parametrize("strong_decay", [False, True], ids=["weak-decay", "strong-decay"])
@pytest.mark.parametrize("chunk_size", [8, 16, 32, 64])
def test_every_chunk_size_matches_the_recurrence(chunk_size: int, strong_decay: bool) -> None:
    inputs = _inputs(RAGGED_LENS, strong_decay=strong_decay)
    segs = Segments.from_lengths(RAGGED_LENS)
    out = gated_delta_rule(*inputs, segs, backend="torch", chunk_size=chunk_size)
    ref = naive_recurrent_gated_delta_rule(*inputs, segs)
    torch.testing.assert_close(out, ref, rtol=0, atol=TOL)
    weight = torch.randn_like(out)
    got = torch.autograd.grad((out * weight).sum(), inputs)
    want = torch.autograd.grad((ref * weight).sum(), inputs)
    for name, a, b in zip(["q", "k", "v", "g", "beta"], got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=TOL, msg=lambda m, name=name: f"d{name}: {m}")


def test_dropping_the_boundaries_changes_the_ragged_row() -> None:
    """The check above can fail: the same row as one segment (what a boundary-blind scan computes) is far off."""
    inputs = _inputs(RAGGED_LENS, strong_decay=False)
    exact = gated_delta_rule(*inputs, Segments.from_lengths(RAGGED_LENS), backend="torch", chunk_size=16)
    blind = gated_delta_rule(*inputs, Segments.from_lengths([sum(RAGGED_LENS)]), backend="torch", chunk_size=16)
    assert (exact[: RAGGED_LENS[0]] - blind[: RAGGED_LENS[0]]).abs().max() < TOL  # nothing before the first segment
    assert (exact - blind).abs().max() > 1e-2


def test_state_scan_gradients_float64() -> None:
    """The scan's hand-written backward (reverse scan, then the batched gradients) against finite differences, on a
    ragged step-major layout: 3 segments of 5, 3 and 1 chunks."""
    gen = torch.Generator().manual_seed(0)
    step_sizes = (3, 2, 2, 1, 1)
    n, h, k, v = sum(step_sizes), 2, 3, 2
    decay = torch.rand(n, h, generator=gen, dtype=torch.float64).requires_grad_()
    kw = (0.3 * torch.randn(n, h, k, k, generator=gen, dtype=torch.float64)).requires_grad_()
    ku = torch.randn(n, h, k, v, generator=gen, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b, c: _StateScan.apply(a, b, c, step_sizes), (decay, kw, ku))


def test_state_scan_matches_the_loop_it_replaces() -> None:
    """Entering states of every chunk: zero for a segment's first chunk, then ``S' = (decay I - KW) S + KU``."""
    gen = torch.Generator().manual_seed(1)
    step_sizes = (3, 3, 1)
    n, h, k, v = sum(step_sizes), 2, 4, 3
    decay, kw, ku = torch.rand(n, h, generator=gen), torch.randn(n, h, k, k, generator=gen), torch.randn(n, h, k, v)
    got = _StateScan.apply(decay, kw, ku, step_sizes)
    eye = torch.eye(k)
    seg = [[0, 3, 6], [1, 4], [2, 5]]  # chunk indices of each segment, step-major
    for chunks in seg:
        state = torch.zeros(h, k, v)
        for c in chunks:
            torch.testing.assert_close(got[c], state)
            state = (decay[c][:, None, None] * eye - kw[c]) @ state + ku[c]


@pytest.mark.parametrize("size", [1, 2, 8, 16, 64])
def test_unit_lower_inverse(size: int) -> None:
    gen = torch.Generator().manual_seed(size)
    a = 0.3 * torch.randn(3, 2, size, size, generator=gen, dtype=torch.float64)  # diagonal, upper part: never read
    inv = unit_lower_inverse(a)
    eye = torch.eye(size, dtype=torch.float64)
    torch.testing.assert_close(inv @ (eye + a.tril(-1)), eye.expand_as(inv), rtol=0, atol=1e-12)


def test_unit_lower_solve_by_inverse_equals_torch_solve_triangular() -> None:
    """A power-of-two size takes the inverse path (the 9 x 9 case in test_kernels.py the ``solve_triangular`` one):
    float64 gradcheck, and torch's own solve and gradients."""
    gen = torch.Generator().manual_seed(0)
    a = (0.3 * torch.randn(3, 2, 16, 16, generator=gen, dtype=torch.float64)).requires_grad_()
    b = torch.randn(3, 2, 16, 5, generator=gen, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(UnitLowerSolve.apply, (a, b))
    ours = UnitLowerSolve.apply(a, b)
    ref = torch.linalg.solve_triangular(a, b, upper=False, unitriangular=True)
    torch.testing.assert_close(ours, ref, rtol=1e-12, atol=1e-12)
    weight = torch.randn_like(ref)
    for got, want in zip(
        torch.autograd.grad(ours, (a, b), weight), torch.autograd.grad(ref, (a, b), weight), strict=True
    ):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


def test_chunk_successors() -> None:
    has_next, next_chunk = chunk_successors((3, 2, 2, 1), torch.device("cpu"))
    assert has_next.tolist() == [0, 1, 3, 4, 5]
    assert next_chunk.tolist() == [3, 4, 5, 6, 7]


def test_default_chunk_size_follows_the_key_dim() -> None:
    assert [default_chunk_size(k) for k in (8, 16, 32, 128, 256)] == [16, 16, 32, 64, 64]
