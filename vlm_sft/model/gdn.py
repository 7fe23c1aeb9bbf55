"""The GatedDeltaNet recurrence of Qwen3.5 over packed segments: the state resets at every segment start.

Recurrence (per head, per token ``t`` of a segment, state ``S`` of shape ``[K, V]`` starting at zero)::

    S = exp(g_t) * S
    S = S + k_t (beta_t * (v_t - S^T k_t))^T
    o_t = S^T q_t                      (q_t l2-normalised and scaled by K ** -0.5, k_t l2-normalised)

Backends: ``"fla"`` calls flash-linear-attention's ``chunk_gated_delta_rule`` with ``cu_seqlens`` (CUDA + triton; it
computes in the inputs' dtype, float32 included, and maps each value head to its key head itself, so q / k keep the
key-head count); ``"torch"`` is our varlen chunked rule: every segment is padded to whole chunks inside the kernel, so
no chunk spans two segments. Segments longer than a chunk form one multi-chunk group: all their chunks go through the
intra-chunk algebra in one batched computation, and the inter-chunk scan carries one state per segment (segments ranked
by chunk count, so the ones still running at scan step ``j`` are a prefix and each step is one batched matmul). Shorter
segments are bucketed by length (``varlen.grouped_chunk_layout``) into single-chunk groups, each padded only to its own
longest member; a single-chunk segment never reads or writes a state, so those groups skip the ``w`` half of the
triangular solve and the scan entirely. Log decays are floored at ``LOG_DECAY_FLOOR`` before ``exp`` (denormal fp32
values are tens of times slower on CPUs; the floor is far below fp32 resolution). ``naive_recurrent_gated_delta_rule``
is the token-by-token reference the tests hold both against.

Incremental decoding (``vlm_sft.model.decode``): ``final_states`` gives each segment's state after a prefill (the
chunked algebra without the outputs, on every backend) and ``recurrent_step`` advances S sequences by one token each.

Legend: T = total tokens of the flattened batch, H = heads (value heads), K = key dim, V = value dim,
N = chunks over all segments, C = chunk size, S = segments.
"""

from __future__ import annotations

import functools
import logging

import torch

from vlm_sft.model.varlen import Segments, chunk_layout, gather_rows, grouped_chunk_layout

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
    chunk_size: int = 64,
) -> torch.Tensor:
    """Gated delta rule over the flattened tokens of a packed row; returns ``o_THV`` in ``v``'s dtype.

    ``q``/``k`` carry the key heads, as many as ``v``'s value heads or a divisor of them: value head ``h`` reads key
    head ``h // (H_v // H_k)`` (transformers' ``repeat_interleave``). The torch backend repeats them here; fla reads
    the shared key heads in place (no ``H_v / H_k`` times larger copies of q / k and of their gradients). ``g`` is the
    log decay (<= 0), ``beta`` is already sigmoid-ed. ``chunk_size`` only applies to the torch backend.
    """
    _check_shapes(q_THK, k_THK, v_THV, g_TH, beta_TH)
    segments.check_tokens(v_THV.shape[0], "gated_delta_rule")
    if backend == "torch":
        q_THK, k_THK = _repeat_to_value_heads(q_THK, k_THK, v_THV.shape[1])
        return _torch_chunked(q_THK, k_THK, v_THV, g_TH, beta_TH, segments.lengths, use_qk_l2norm, chunk_size)
    if backend == "fla":
        return _fla_chunked(q_THK, k_THK, v_THV, g_TH, beta_TH, segments, use_qk_l2norm)
    raise ValueError(f"unknown linear-attention backend {backend!r}; expected 'fla' or 'torch'")


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
def _masks(chunk_size: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(strictly upper, upper incl. diagonal) boolean ``[C, C]`` masks."""
    ones = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=device)
    return ones.triu(1), ones.triu(0)


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
    # Segments longer than a chunk share one chunked scan; shorter ones are bucketed by length into single-chunk
    # groups, each padded only to its own longest member (any chunk size gives the same result).
    layout = grouped_chunk_layout(lengths, chunk_size, torch.device(v_THV.device), GROUP_LINEAR_COST, GROUP_FIXED_COST)
    q, k, v, g, beta = _prepare(q_THK, k_THK, v_THV, g_TH, beta_TH, use_qk_l2norm)
    # One gather per group for all five inputs: [T, H, 2K + V + 2] -> [N, H, C, 2K + V + 2].
    packed_THF = torch.cat([q, k, v, g[..., None], beta[..., None]], dim=-1)
    outputs = []
    for group in layout.groups:
        n, c = group.num_chunks, group.chunk_size
        x = gather_rows(packed_THF, group.slot_to_token).view(n, c, num_heads, -1).transpose(1, 2)
        q_NHCK, k_NHCK, v_NHCV, g_NHC, beta_NHC = x.split([k_dim, k_dim, v_dim, 1, 1], dim=-1)
        g_NHC, beta_NHC = g_NHC.squeeze(-1), beta_NHC.squeeze(-1)
        if group.single_chunk:
            o_NHCV = _single_chunks(q_NHCK, k_NHCK, v_NHCV, g_NHC, beta_NHC)
        else:
            o_NHCV = _chunked_scan(q_NHCK, k_NHCK, v_NHCV, g_NHC, beta_NHC, group.step_sizes)
        outputs.append(o_NHCV.transpose(1, 2).reshape(n * c, num_heads, v_dim))
    o_flat = torch.cat(outputs) if len(outputs) > 1 else outputs[0]
    return o_flat.index_select(0, layout.token_to_slot).to(v_THV.dtype)


def _exp(log_x: torch.Tensor) -> torch.Tensor:
    """``exp`` of a log decay, floored at ``exp(LOG_DECAY_FLOOR)``: fp32 results below ~1e-38 are denormal, and CPUs
    compute and multiply denormals tens of times slower (measured: 35x for ``exp``). The floor changes a term by less
    than 2e-35 of its neighbours' scale, far below fp32 resolution."""
    return log_x.clamp_min(LOG_DECAY_FLOOR).exp()


class UnitLowerSolve(torch.autograd.Function):
    """``X = (I + strictly_lower(A))^-1 B``, batched: ``solve_triangular(unitriangular=True)`` with a cheaper backward.

    The gradients are the textbook ones, ``dB = L^-T dX`` and ``dA = -strictly_lower(dB X^T)``, as torch's own backward
    computes them; torch solves ``L^T`` as an upper-triangular system on a transposed view, which on CPUs took 2x
    the forward solve. Here ``dB^T`` comes from the same lower-triangular solve from the right (``dB^T L = dX^T``) on
    the contiguous ``L``: the backward of the whole solve costs about half of torch's (measured at the chunk
    kernel's shapes, ``[496, 64, 64]``). Neither direction reads ``A``'s diagonal or upper triangle.
    """

    @staticmethod
    def forward(ctx, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        x = torch.linalg.solve_triangular(a, b, upper=False, unitriangular=True)
        ctx.save_for_backward(a, x)
        return x

    @staticmethod
    def backward(ctx, grad_x: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
        a, x = ctx.saved_tensors
        grad_b = torch.linalg.solve_triangular(a, grad_x.mT, upper=False, left=False, unitriangular=True).mT
        grad_a = None
        if ctx.needs_input_grad[0]:
            grad_a = -(grad_b @ x.mT).tril(-1)
        return grad_a, grad_b


def _intra(q_NHCK, k_NHCK, g_NHC, beta_NHC):
    """Intra-chunk terms shared by both paths: cumulative log decay, ``k beta``, and the ``[C, C]`` matrices ``A``
    (for the UT transform) and ``attn`` (lower incl. the diagonal, for the outputs).

    ``A`` keeps its diagonal: ``solve_triangular(unitriangular=True)`` never reads it (nor the upper triangle) and
    its backward returns a strictly lower gradient, so masking it would only cost time. The decay is zero above the
    diagonal: the masked entries are set to a log decay of 0 before ``exp`` (``exp(-inf)`` is slow on CPUs too) and
    to 0 after.
    """
    strictly_upper, _ = _masks(q_NHCK.shape[-2], q_NHCK.device)
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
    inter-chunk scan, one batched matmul per step over the segments still running."""
    c, k_dim, v_dim = q_NHCK.shape[-2], q_NHCK.shape[-1], v_NHCV.shape[-1]
    gcum_NHC, kbeta_NHCK, a_NHCC, attn_NHCC = _intra(q_NHCK, k_NHCK, g_NHC, beta_NHC)
    rhs = torch.cat([v_NHCV * beta_NHC[..., None], kbeta_NHCK * _exp(gcum_NHC)[..., None]], dim=-1)
    solved = UnitLowerSolve.apply(a_NHCC, rhs)  # (I + A)^-1 rhs
    u_NHCV, w_NHCK = solved.split([v_dim, k_dim], dim=-1)
    # o = attn @ (u - w S) + (q * exp(gcum)) S = attn @ u + (q * exp(gcum) - attn @ w) S: the [C, C] products are
    # batched here so the sequential scan only does [C, K] x [K, V] work.
    intra_NHCV = attn_NHCC @ u_NHCV
    read_NHCK = q_NHCK * _exp(gcum_NHC)[..., None] - attn_NHCC @ w_NHCK
    kdec_NHCK = k_NHCK * _exp(gcum_NHC[..., -1:] - gcum_NHC)[..., None]  # decayed to the chunk end
    chunk_decay_NH = _exp(gcum_NHC[..., -1])

    # Inter-chunk scan: step j handles chunk j of every segment that has one; the state rows are those segments.
    sizes = list(step_sizes)
    read_w = torch.cat([read_NHCK, w_NHCK], dim=-2).split(sizes)  # one matmul per step for both reads of S
    u_steps, kdec_steps, decay_steps = u_NHCV.split(sizes), kdec_NHCK.split(sizes), chunk_decay_NH.split(sizes)
    intra_steps = intra_NHCV.split(sizes)
    out_steps = [intra_steps[0]]  # the first chunk of every segment starts from a zero state
    state = kdec_steps[0].transpose(-1, -2) @ u_steps[0]  # [S_active, H, K, V]
    for j in range(1, len(sizes)):
        active = sizes[j]
        state = state[:active]
        reads = read_w[j] @ state  # [active, H, 2C, V]
        out_steps.append(intra_steps[j] + reads[..., :c, :])
        if j + 1 < len(sizes):
            v_new = u_steps[j] - reads[..., c:, :]
            state = state * decay_steps[j][..., None, None] + kdec_steps[j].transpose(-1, -2) @ v_new
    return torch.cat(out_steps) if len(out_steps) > 1 else out_steps[0]


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
    transform through ``UnitLowerSolve``), then the inter-chunk scan of ``_chunked_scan``, one batched matmul per step,
    keeping each segment's state when its last chunk is done. Padding rows are zeros (``g = 0``, ``k = beta = 0``):
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
