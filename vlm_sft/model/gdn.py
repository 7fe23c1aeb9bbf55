"""The GatedDeltaNet recurrence of Qwen3.5 over packed segments: the state resets at every segment start.

Recurrence (per head, per token ``t`` of a segment, state ``S`` of shape ``[K, V]`` starting at zero)::

    S = exp(g_t) * S
    S = S + k_t (beta_t * (v_t - S^T k_t))^T
    o_t = S^T q_t                      (q_t l2-normalised and scaled by K ** -0.5, k_t l2-normalised)

Backends: ``"fla"`` calls flash-linear-attention's ``chunk_gated_delta_rule`` with ``cu_seqlens`` (CUDA + triton; it
computes in the inputs' dtype, float32 included, and maps each value head to its key head itself, so q / k keep the
key-head count); ``"torch"`` is our varlen chunked rule: segments are padded to whole chunks inside the kernel, so no
chunk spans two segments, and the chunk size follows the key head dim (``default_chunk_size``: 16 for the tiny model,
64 for the real one). Segments longer than ``SINGLE_CHUNK_MAX`` form one multi-chunk group: the intra-chunk algebra of
all their chunks in one batched computation (decays, the UT transform's triangular solve, the ``[C, C]`` products), then
a scan of the states alone (``_StateScan``: ``S' = (decay I - kdec^T w) S + kdec^T u``, one batched matmul per step
over the segments still running, ranked by chunk count so they are a prefix, forward and backward), then every chunk's
read of its entering state at once. Shorter segments are bucketed by length (``varlen.grouped_chunk_layout``) into
single-chunk groups, each padded only to its own longest member; they never read or write a state, so they skip the
``w`` half of the solve and the scan. Tokens reach the groups' head-major padded rows in one scatter and return in one
gather (``varlen.to_rows`` / ``from_rows``). Log decays are floored at ``LOG_DECAY_FLOOR`` before ``exp`` (denormals
are tens of times slower on CPUs). ``naive_recurrent_gated_delta_rule`` is the reference the tests hold both against.

Incremental decoding (``vlm_sft.model.decode``): ``final_states`` gives each segment's state after a prefill (the
chunked algebra without the outputs, on every backend) and ``recurrent_step`` advances S sequences by one token each.

Legend: T = tokens of the flattened batch, H = (value) heads, K = key dim, V = value dim, N = chunks over all segments,
C = chunk size, S = segments, P = (token, head) pairs, R = rows of the padded chunk layout (N x H x C), F = features.
"""

from __future__ import annotations

import functools
import logging

import torch

from vlm_sft.model.varlen import (
    Segments,
    chunk_layout,
    chunk_successors,
    from_rows,
    gather_rows,
    grouped_chunk_layout,
    to_rows,
)

logger = logging.getLogger(__name__)

LOG_DECAY_FLOOR = -80.0
"""Log decays are floored here before ``exp`` (``exp(-80)`` ~ 1.8e-35 is still a normal fp32 number); see ``_exp``."""

L2NORM_EPS = 1e-6
"""Same epsilon and formula as transformers' ``l2norm`` (aligned with fla): ``x * rsqrt(sum(x^2) + eps)``."""


def gated_delta_rule(
    q_THK: torch.Tensor,
    k_THK: torch.Tensor,
    v_THV: torch.Tensor,
    g_TH: torch.Tensor,
    beta_TH: torch.Tensor,
    segments: Segments,
    *,
    backend: str,
    use_qk_l2norm: bool = True,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """Gated delta rule over the flattened tokens of a packed row; returns ``o_THV`` in ``v``'s dtype.

    ``q``/``k`` carry the key heads, as many as ``v``'s value heads or a divisor of them: value head ``h`` reads key
    head ``h // (H_v // H_k)`` (transformers' ``repeat_interleave``). The torch backend repeats them here; fla reads
    the shared key heads in place (no ``H_v / H_k`` times larger copies of q / k and of their gradients). ``g`` is the
    log decay (<= 0), ``beta`` is already sigmoid-ed. ``chunk_size`` only applies to the torch backend (default
    ``default_chunk_size(K)``; any chunk size gives the same result up to rounding).
    """
    _check_shapes(q_THK, k_THK, v_THV, g_TH, beta_TH)
    segments.check_tokens(v_THV.shape[0], "gated_delta_rule")
    if backend == "torch":
        q_THK, k_THK = _repeat_to_value_heads(q_THK, k_THK, v_THV.shape[1])
        chunk_size = chunk_size or default_chunk_size(q_THK.shape[-1])
        return _torch_chunked(q_THK, k_THK, v_THV, g_TH, beta_TH, segments.lengths, use_qk_l2norm, chunk_size)
    if backend == "fla":
        return _fla_chunked(q_THK, k_THK, v_THV, g_TH, beta_TH, segments, use_qk_l2norm)
    raise ValueError(f"unknown linear-attention backend {backend!r}; expected 'fla' or 'torch'")


def default_chunk_size(k_dim: int) -> int:
    """The torch backend's chunk size for key heads of ``k_dim``: ``k_dim`` itself, within [16, 64].

    A chunk's own algebra costs ``C x C`` per head and token, the scan ``K x V / C``, so small heads want small chunks
    (16 for the tiny model, 64 for the real one; timings: bench/README.md, "GatedDeltaNet CPU kernel").
    """
    return min(64, max(16, k_dim))


def naive_recurrent_gated_delta_rule(
    q_THK: torch.Tensor,
    k_THK: torch.Tensor,
    v_THV: torch.Tensor,
    g_TH: torch.Tensor,
    beta_TH: torch.Tensor,
    segments: Segments,
    *,
    use_qk_l2norm: bool = True,
) -> torch.Tensor:
    """Token-by-token reference (the math of transformers' ``torch_recurrent_gated_delta_rule``), one segment at a time.

    Slow by design: it is the definition the chunked kernels are tested against, in float32 (float64 for float64
    inputs).
    """
    _check_shapes(q_THK, k_THK, v_THV, g_TH, beta_TH)
    segments.check_tokens(v_THV.shape[0], "naive_recurrent_gated_delta_rule")
    q_THK, k_THK = _repeat_to_value_heads(q_THK, k_THK, v_THV.shape[1])
    q, k, v, g, beta = _prepare(q_THK, k_THK, v_THV, g_TH, beta_TH, use_qk_l2norm)
    num_heads, k_dim, v_dim = v.shape[1], k.shape[-1], v.shape[-1]
    outputs = []
    start = 0
    for length in segments.lengths:
        state = v.new_zeros(num_heads, k_dim, v_dim)
        for t in range(start, start + length):
            state = state * g[t].exp()[:, None, None]
            predicted = (state * k[t][:, :, None]).sum(dim=1)  # [H, V]: what the state recalls for k_t
            delta = (v[t] - predicted) * beta[t][:, None]
            state = state + k[t][:, :, None] * delta[:, None, :]
            outputs.append((state * q[t][:, :, None]).sum(dim=1))
        start += length
    if not outputs:
        return v_THV.new_zeros(v_THV.shape)
    return torch.stack(outputs).to(v_THV.dtype)


def _check_shapes(q, k, v, g, beta) -> None:
    if q.dim() != 3 or k.shape != q.shape or v.dim() != 3 or v.shape[0] != q.shape[0]:
        raise ValueError(
            f"gated_delta_rule wants q, k [T, H, K] and v [T, H, V]; got {tuple(q.shape)}, {tuple(k.shape)}, "
            f"{tuple(v.shape)}"
        )
    if g.shape != v.shape[:2] or beta.shape != v.shape[:2]:
        raise ValueError(f"g and beta must be [T, H] = {tuple(v.shape[:2])}; got {tuple(g.shape)}, {tuple(beta.shape)}")
    if v.shape[1] % q.shape[1]:
        raise ValueError(f"value heads {v.shape[1]} must be a multiple of key heads {q.shape[1]}")


def _repeat_to_value_heads(q: torch.Tensor, k: torch.Tensor, num_v_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each key head serves ``num_v_heads // H_k`` consecutive value heads (transformers' ``repeat_interleave``)."""
    if q.shape[1] == num_v_heads:
        return q, k
    repeats = num_v_heads // q.shape[1]
    return q.repeat_interleave(repeats, dim=1), k.repeat_interleave(repeats, dim=1)


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + L2NORM_EPS)


def _prepare(q, k, v, g, beta, use_qk_l2norm: bool):
    """fp32 copies with the l2 norm and the ``K ** -0.5`` query scale applied, as transformers does before chunking.

    float64 values stay float64 (a reference finer than any kernel: the noise-floor checks' float64 model)."""
    dtype = torch.promote_types(v.dtype, torch.float32)
    q, k, v, g, beta = (x.to(dtype) for x in (q, k, v, g, beta))
    if use_qk_l2norm:
        q, k = _l2norm(q), _l2norm(k)
    return q * q.shape[-1] ** -0.5, k, v, g, beta


@functools.lru_cache(maxsize=8)
def _strictly_upper(chunk_size: int, device: torch.device) -> torch.Tensor:
    return torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=device).triu(1)


SINGLE_CHUNK_MAX = 64
"""Segments up to this long form single-chunk groups at their own width even when the chunk size is shorter (faster
on rows of short segments; bench/README.md, "GatedDeltaNet CPU kernel")."""
GROUP_LINEAR_COST = 32
"""Bucketing weight of the per-slot (``[C, K]``-sized) work against the ``[C, C]``-sized work of a chunk."""
GROUP_FIXED_COST = 12_000
"""Fixed cost of one more chunk group (its ~70 kernel calls, forward and backward), in the units of ``C * (C + 32)``
per chunk: about what a group of ten 30-token chunks costs on a CPU. Only the speed depends on it, never the result."""


def _torch_chunked(q_THK, k_THK, v_THV, g_TH, beta_TH, lengths: tuple[int, ...], use_qk_l2norm: bool, chunk_size: int):
    total, num_heads, v_dim = v_THV.shape
    k_dim = q_THK.shape[-1]
    if total == 0:
        return v_THV.new_zeros(v_THV.shape)
    # Segments longer than SINGLE_CHUNK_MAX share one chunked scan; shorter ones are bucketed by length into
    # single-chunk groups, each padded only to its own longest member (any chunk size gives the same result).
    device, single_max = torch.device(v_THV.device), max(chunk_size, SINGLE_CHUNK_MAX)
    layout = grouped_chunk_layout(
        lengths, chunk_size, device, GROUP_LINEAR_COST, GROUP_FIXED_COST, num_heads, single_max
    )
    q, k, v, g, beta = _prepare(q_THK, k_THK, v_THV, g_TH, beta_TH, use_qk_l2norm)
    # One scatter for all five inputs of every group: [T * H, 2K + V + 2] -> the groups' rows, each group
    # [N, H, C, 2K + V + 2] (head-major: its batched matmuls read q, k, v in place).
    x_PF = torch.cat([q, k, v, g[..., None], beta[..., None]], dim=-1).view(total * num_heads, -1)
    rows_RF = to_rows(x_PF, layout)
    outputs = []
    for group in layout.groups:
        n, c = group.num_chunks, group.chunk_size
        x = rows_RF[group.first_row : group.first_row + n * num_heads * c].view(n, num_heads, c, -1)
        q_NHCK, k_NHCK, v_NHCV, g_NHC, beta_NHC = x.split([k_dim, k_dim, v_dim, 1, 1], dim=-1)
        g_NHC, beta_NHC = g_NHC.squeeze(-1), beta_NHC.squeeze(-1)
        if group.single_chunk:
            o_NHCV = _single_chunks(q_NHCK, k_NHCK, v_NHCV, g_NHC, beta_NHC)
        else:
            o_NHCV = _chunked_scan(q_NHCK, k_NHCK, v_NHCV, g_NHC, beta_NHC, group.step_sizes)
        outputs.append(o_NHCV.reshape(-1, v_dim))
    o_RV = torch.cat(outputs) if len(outputs) > 1 else outputs[0]
    return from_rows(o_RV, layout).view(total, num_heads, v_dim).to(v_THV.dtype)


def _exp(log_x: torch.Tensor) -> torch.Tensor:
    """``exp`` of a log decay, floored at ``exp(LOG_DECAY_FLOOR)``: fp32 results below ~1e-38 are denormal, and CPUs
    compute and multiply denormals tens of times slower (measured: 35x for ``exp``). The floor changes a term by less
    than 2e-35 of its neighbours' scale, far below fp32 resolution."""
    return log_x.clamp_min(LOG_DECAY_FLOOR).exp()


class UnitLowerSolve(torch.autograd.Function):
    """``X = (I + strictly_lower(A))^-1 B``, batched, with the textbook gradients ``dB = L^-T dX`` and
    ``dA = -strictly_lower(dB X^T)``; ``A``'s diagonal and upper triangle are never read. By the size ``C``:

    - a power of two (the multi-chunk groups): ``L^-1`` by blocked inversion (``unit_lower_inverse``), then ``X`` and
      ``dB`` are matmuls: torch's batched ``solve_triangular`` of many small matrices is slow on several threads;
    - otherwise (single-chunk groups, as wide as their longest segment): ``solve_triangular``, and ``dB^T`` by the same
      lower solve from the right (``dB^T L = dX^T``) on the contiguous ``L``, half the cost of torch's own backward.

    The timings behind both choices: bench/README.md, "GatedDeltaNet CPU kernel".
    """

    @staticmethod
    def forward(ctx, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        c = a.shape[-1]
        ctx.inverse = c & (c - 1) == 0
        with torch.autocast(a.device.type, enabled=False):  # in the inputs' dtype, as solve_triangular under autocast
            if ctx.inverse:
                l_inv = unit_lower_inverse(a)
                x = l_inv @ b
                ctx.save_for_backward(l_inv, x)
            else:
                x = torch.linalg.solve_triangular(a, b, upper=False, unitriangular=True)
                ctx.save_for_backward(a, x)
        return x

    @staticmethod
    def backward(ctx, grad_x: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
        saved, x = ctx.saved_tensors
        grad_x = grad_x.to(x.dtype)
        with torch.autocast(x.device.type, enabled=False):
            if ctx.inverse:
                grad_b = saved.mT @ grad_x
            else:
                grad_b = torch.linalg.solve_triangular(saved, grad_x.mT, upper=False, left=False, unitriangular=True).mT
            grad_a = -(grad_b @ x.mT).tril(-1) if ctx.needs_input_grad[0] else None
        return grad_a, grad_b


def unit_lower_inverse(a: torch.Tensor) -> torch.Tensor:
    """``(I + strictly_lower(a))^-1`` of ``[..., C, C]`` matrices, ``C`` a power of two: blocked recursive inversion
    (LAPACK's ``trtri`` scheme), every diagonal block of a level at once. Level ``s`` joins pairs of inverted ``s x s``
    blocks: ``[[T11, 0], [-T22 A21 T11, T22]]``; ``log2(C)`` levels of two batched matmuls each."""
    c = a.shape[-1]
    assert c & (c - 1) == 0, f"unit_lower_inverse wants a power-of-two size, got {c}"
    lower = a.tril(-1)
    batch = lower.shape[:-2]
    inv = lower.new_ones(*batch, c, 1, 1)  # the 1 x 1 diagonal blocks of a unit triangular matrix
    s = 1
    while s < c:
        pairs = c // (2 * s)
        # The 2s x 2s diagonal blocks of A, [..., pairs, 2s, 2s], and their lower-left s x s quarters.
        blocks = lower.view(*batch, pairs, 2 * s, pairs, 2 * s).diagonal(dim1=-4, dim2=-2).movedim(-1, -3)
        t11, t22 = inv[..., 0::2, :, :], inv[..., 1::2, :, :]
        t21 = -((t22 @ blocks[..., s:, :s]) @ t11)
        inv = torch.cat([torch.cat([t11, torch.zeros_like(t11)], dim=-1), torch.cat([t21, t22], dim=-1)], dim=-2)
        s *= 2
    return inv.view(*batch, c, c)


def _intra(q_NHCK, k_NHCK, g_NHC, beta_NHC):
    """Intra-chunk terms shared by both paths: cumulative log decay, ``k beta``, and the ``[C, C]`` matrices ``A``
    (for the UT transform) and ``attn`` (lower incl. the diagonal, for the outputs).

    ``A`` keeps its diagonal: ``solve_triangular(unitriangular=True)`` never reads it (nor the upper triangle) and
    its backward returns a strictly lower gradient, so masking it would only cost time. The decay is zero above the
    diagonal: the masked entries are set to a log decay of 0 before ``exp`` (``exp(-inf)`` is slow on CPUs too) and
    to 0 after.
    """
    strictly_upper = _strictly_upper(q_NHCK.shape[-2], q_NHCK.device)
    gcum_NHC = g_NHC.cumsum(-1)
    log_decay_NHCC = (gcum_NHC[..., :, None] - gcum_NHC[..., None, :]).masked_fill(strictly_upper, 0.0)
    decay_NHCC = _exp(log_decay_NHCC).masked_fill(strictly_upper, 0.0)
    kbeta_NHCK = k_NHCK * beta_NHC[..., None]
    a_NHCC = (kbeta_NHCK @ k_NHCK.transpose(-1, -2)) * decay_NHCC
    attn_NHCC = (q_NHCK @ k_NHCK.transpose(-1, -2)) * decay_NHCC
    return gcum_NHC, kbeta_NHCK, a_NHCC, attn_NHCC


def _single_chunks(q_NHCK, k_NHCK, v_NHCV, g_NHC, beta_NHC):
    """Every chunk is a whole segment: the state starts at zero and is never read, so only ``attn @ u`` remains
    (no ``w``, no state, half the triangular solve)."""
    _, _, a_NHCC, attn_NHCC = _intra(q_NHCK, k_NHCK, g_NHC, beta_NHC)
    u_NHCV = UnitLowerSolve.apply(a_NHCC, v_NHCV * beta_NHC[..., None])
    return attn_NHCC @ u_NHCV


def _chunked_scan(q_NHCK, k_NHCK, v_NHCV, g_NHC, beta_NHC, step_sizes: tuple[int, ...]):
    """Segments of several chunks, step-major (``ChunkLayout``): intra-chunk algebra for all chunks at once, then the
    inter-chunk scan of the states alone (``_StateScan``), then every chunk's read of its entering state at once."""
    k_dim, v_dim = q_NHCK.shape[-1], v_NHCV.shape[-1]
    gcum_NHC, kbeta_NHCK, a_NHCC, attn_NHCC = _intra(q_NHCK, k_NHCK, g_NHC, beta_NHC)
    egcum_NHC = _exp(gcum_NHC)
    rhs = torch.cat([v_NHCV * beta_NHC[..., None], kbeta_NHCK * egcum_NHC[..., None]], dim=-1)
    solved_NHCF = UnitLowerSolve.apply(a_NHCC, rhs)  # (I + A)^-1 rhs = [u | w]
    u_NHCV, w_NHCK = solved_NHCF.split([v_dim, k_dim], dim=-1)
    # The state after a chunk: S' = decay S + kdec^T (u - w S) = (decay I - kdec^T w) S + kdec^T u, with kdec = k
    # decayed to the chunk end; both products come from one batched kdec^T [u | w] over every chunk.
    kdec_NHCK = k_NHCK * _exp(gcum_NHC[..., -1:] - gcum_NHC)[..., None]
    ku_NHKV, kw_NHKK = (kdec_NHCK.transpose(-1, -2) @ solved_NHCF).split([v_dim, k_dim], dim=-1)
    states_NHKV = _StateScan.apply(egcum_NHC[..., -1], kw_NHKK, ku_NHKV, step_sizes)
    # o = attn @ (u - w S) + (q * exp(gcum)) S = attn @ u + (q * exp(gcum) - attn @ w) S, every chunk at once.
    read_NHCK = q_NHCK * egcum_NHC[..., None] - attn_NHCC @ w_NHCK
    return attn_NHCC @ u_NHCV + read_NHCK @ states_NHKV


class _StateScan(torch.autograd.Function):
    """The inter-chunk recurrence of the states alone: one batched matmul per scan step, forward and backward.

    Chunks are step-major (``ChunkLayout``): step ``j`` holds chunk ``j`` of the ``step_sizes[j]`` segments that have
    one, ranked so the segments still running are a prefix. With ``S`` the state a chunk starts from (zero for a
    segment's first chunk) and ``F = decay I - KW``, the next chunk of the segment starts from ``F S + KU``. Returns
    every chunk's entering state ``[N, H, K, V]``.

    Backward, with ``G`` the gradient of the state after a chunk: ``G = dS_next + F_next^T G_next`` in reverse step
    order (zero after a segment's last chunk), then ``dKU = G``, ``dKW = -G S^T``, ``d decay = trace(G S^T)``, all
    chunks at once (autograd of the loop: ~10 kernels a step, each slice's gradient copied into zeros of its source).
    """

    @staticmethod
    def forward(ctx, decay_NH, kw_NHKK, ku_NHKV, step_sizes: tuple[int, ...]):
        (n, h, k_dim, v_dim), dtype = ku_NHKV.shape, torch.promote_types(decay_NH.dtype, ku_NHKV.dtype)  # float32 state
        f_NHKK = -kw_NHKK.to(dtype)
        f_NHKK.diagonal(dim1=-2, dim2=-1).add_(decay_NH[..., None])
        states = ku_NHKV.new_zeros(n, h, k_dim, v_dim, dtype=dtype)  # a segment's first chunk starts from zero
        rows = [size * h for size in step_sizes]
        f_steps, s_steps = f_NHKK.view(-1, k_dim, k_dim).split(rows), states.view(-1, k_dim, v_dim).split(rows)
        ku_steps = ku_NHKV.to(dtype).contiguous().view(-1, k_dim, v_dim).split(rows)
        with torch.autocast(states.device.type, enabled=False):
            for j in range(1, len(rows)):
                active = rows[j]  # the segments with a chunk j: a prefix of those of step j - 1
                if j == 1:
                    s_steps[1].copy_(ku_steps[0][:active])
                else:
                    f_s, ku_s, s_s = f_steps[j - 1][:active], ku_steps[j - 1][:active], s_steps[j - 1][:active]
                    torch.baddbmm(ku_s, f_s, s_s, out=s_steps[j])
        ctx.save_for_backward(f_NHKK, states)
        ctx.step_sizes = step_sizes
        return states

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_states):
        f_NHKK, states = ctx.saved_tensors
        n, h, k_dim, v_dim = states.shape
        rows = [size * h for size in ctx.step_sizes]
        has_next, next_chunk = chunk_successors(ctx.step_sizes, grad_states.device)
        # G starts as the gradient of the next chunk's entering state (zero after a segment's last chunk) ...
        g_NHKV = states.new_zeros(n, h, k_dim, v_dim)
        grad_next = grad_states.to(states.dtype).reshape(n, -1).index_select(0, next_chunk)
        g_NHKV.view(n, -1).index_copy_(0, has_next, grad_next)
        f_steps, g_steps = f_NHKK.view(-1, k_dim, k_dim).split(rows), g_NHKV.view(-1, k_dim, v_dim).split(rows)
        with torch.autocast(states.device.type, enabled=False):
            for j in range(len(rows) - 3, -1, -1):  # ... plus what flows back through the state after the next chunk
                later = rows[j + 2]  # segments with chunks j, j + 1 and j + 2
                g_steps[j][:later].baddbmm_(f_steps[j + 1][:later].mT, g_steps[j + 1][:later])
            grad_f = g_NHKV @ states.transpose(-1, -2)
        return grad_f.diagonal(dim1=-2, dim2=-1).sum(-1), -grad_f, g_NHKV, None


def _fla_chunked(q_THK, k_THK, v_THV, g_TH, beta_TH, segments: Segments, use_qk_l2norm: bool):
    """flash-linear-attention's varlen chunked kernel: inputs ``[1, T, H, *]`` with ``cu_seqlens``, computed in
    ``v``'s dtype (fla 0.6 has float32 kernels: a float32 config gets float32, not a silent bf16 downcast)."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule  # CUDA-only import: only reached on that backend

    dtype = v_THV.dtype
    q, k, v, beta = (x.to(dtype).unsqueeze(0) for x in (q_THK, k_THK, v_THV, beta_TH))
    o, _ = chunk_gated_delta_rule(
        q,
        k,
        v,
        g=g_TH.float().unsqueeze(0),
        beta=beta,
        scale=q_THK.shape[-1] ** -0.5,
        initial_state=None,
        output_final_state=False,
        use_qk_l2norm_in_kernel=use_qk_l2norm,
        cu_seqlens=segments.cu_seqlens_long,
        cu_seqlens_cpu=segments.cu_seqlens_cpu,  # chunk indices from the host copy: no device-to-host read
    )
    return o.squeeze(0)


# ------------------------------------------------------------------------------------- incremental decoding


def final_states(
    q_THK: torch.Tensor,
    k_THK: torch.Tensor,
    v_THV: torch.Tensor,
    g_TH: torch.Tensor,
    beta_TH: torch.Tensor,
    segments: Segments,
    *,
    use_qk_l2norm: bool = True,
    chunk_size: int = 64,
) -> torch.Tensor:
    """Each segment's recurrent state after its last token, ``[S, H_v, K, V]`` (zero for an empty segment).

    A prefill needs the state a segment ends with, to continue it one token at a time (``recurrent_step``); the
    chunked kernels return outputs only. This is their algebra without the output reads: every segment padded to
    whole chunks of the step-major ``chunk_layout``, the intra-chunk terms of all chunks at once (``_intra``, the UT
    transform through ``UnitLowerSolve``), then the inter-chunk scan, a few batched matmuls per step, keeping each
    segment's state when its last chunk is done. Padding rows are zeros (``g = 0``, ``k = beta = 0``):
    they neither decay nor write the state. Pure torch, so every backend (fla included) gets its states here.

    Arguments as ``gated_delta_rule``'s; the state never reads ``q`` (it is taken for the same signature). Computed
    in float32 (float64 for float64 inputs), whatever the inputs' dtype, and returned so.
    """
    _check_shapes(q_THK, k_THK, v_THV, g_TH, beta_TH)
    segments.check_tokens(v_THV.shape[0], "final_states")
    q_THK, k_THK = _repeat_to_value_heads(q_THK, k_THK, v_THV.shape[1])
    _, k, v, g, beta = _prepare(q_THK, k_THK, v_THV, g_TH, beta_TH, use_qk_l2norm)
    lengths, (_, num_heads, v_dim), k_dim = segments.lengths, v.shape, k.shape[-1]
    states_SHKV = v.new_zeros(len(lengths), num_heads, k_dim, v_dim)
    layout = chunk_layout(lengths, chunk_size, torch.device(v.device))
    if layout.num_chunks == 0:
        return states_SHKV
    packed_THF = torch.cat([k, v, g[..., None], beta[..., None]], dim=-1)
    x = gather_rows(packed_THF, layout.slot_to_token).view(layout.num_chunks, chunk_size, num_heads, -1).transpose(1, 2)
    k_NHCK, v_NHCV, g_NHC, beta_NHC = x.split([k_dim, v_dim, 1, 1], dim=-1)
    g_NHC, beta_NHC = g_NHC.squeeze(-1), beta_NHC.squeeze(-1)
    # _intra's q only feeds its output matrix ``attn``, which the state does not use: k stands in for it.
    gcum_NHC, kbeta_NHCK, a_NHCC, _ = _intra(k_NHCK, k_NHCK, g_NHC, beta_NHC)
    rhs = torch.cat([v_NHCV * beta_NHC[..., None], kbeta_NHCK * _exp(gcum_NHC)[..., None]], dim=-1)
    u_NHCV, w_NHCK = UnitLowerSolve.apply(a_NHCC, rhs).split([v_dim, k_dim], dim=-1)
    kdec_NHCK = k_NHCK * _exp(gcum_NHC[..., -1:] - gcum_NHC)[..., None]
    sizes = list(layout.step_sizes)
    u_steps, w_steps, kdec_steps = u_NHCV.split(sizes), w_NHCK.split(sizes), kdec_NHCK.split(sizes)
    decay_steps = _exp(gcum_NHC[..., -1]).split(sizes)
    state = kdec_steps[0].transpose(-1, -2) @ u_steps[0]  # every segment's first chunk starts from a zero state
    done = []  # states of the segments whose last chunk was the previous step (the highest ranks still running)
    for j in range(1, len(sizes)):
        done.append(state[sizes[j] :])
        state = state[: sizes[j]]
        v_new = u_steps[j] - w_steps[j] @ state
        state = state * decay_steps[j][..., None, None] + kdec_steps[j].transpose(-1, -2) @ v_new
    done.append(state)
    by_rank = torch.cat(done[::-1])  # ranks 0, 1, ...: the segments with chunks, most chunks first
    # chunk_layout's ranking: by chunk count, most first, ties in packing order (a stable sort).
    n_chunks = [-(-n // chunk_size) for n in lengths]
    ranked = sorted((s for s in range(len(lengths)) if n_chunks[s]), key=lambda s: -n_chunks[s])
    return states_SHKV.index_copy(0, torch.tensor(ranked, device=v.device), by_rank)


def recurrent_step(
    q_SHK: torch.Tensor,
    k_SHK: torch.Tensor,
    v_SHV: torch.Tensor,
    g_SH: torch.Tensor,
    beta_SH: torch.Tensor,
    state_SHKV: torch.Tensor,
    *,
    use_qk_l2norm: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of each of S sequences from their states: ``(o_SHV in v's dtype, new state_SHKV)``.

    The recurrence of the module docstring, once (the math of ``naive_recurrent_gated_delta_rule``'s inner loop,
    batched over sequences), with the same l2 norm and ``K ** -0.5`` query scale as the chunked kernels
    (``_prepare``). ``q``/``k`` carry the key heads as in ``gated_delta_rule``. The state is computed and returned in
    float32 (float64 for float64 inputs): a bf16 state would lose the small updates of a long generation.
    """
    _check_shapes(q_SHK, k_SHK, v_SHV, g_SH, beta_SH)
    num_seqs, num_heads, v_dim = v_SHV.shape
    if state_SHKV.shape != (num_seqs, num_heads, q_SHK.shape[-1], v_dim):
        raise ValueError(
            f"recurrent_step: state must be [S, H_v, K, V] = {(num_seqs, num_heads, q_SHK.shape[-1], v_dim)}, "
            f"got {tuple(state_SHKV.shape)}"
        )
    q_SHK, k_SHK = _repeat_to_value_heads(q_SHK, k_SHK, num_heads)
    q, k, v, g, beta = _prepare(q_SHK, k_SHK, v_SHV, g_SH, beta_SH, use_qk_l2norm)
    state = state_SHKV.to(v.dtype) * g.exp()[..., None, None]
    recalled_SHV = (k[..., None, :] @ state).squeeze(-2)  # what the decayed state recalls for k
    delta_SHV = (v - recalled_SHV) * beta[..., None]
    state = state + k[..., :, None] * delta_SHV[..., None, :]
    o_SHV = (q[..., None, :] @ state).squeeze(-2)
    return o_SHV.to(v_SHV.dtype), state
