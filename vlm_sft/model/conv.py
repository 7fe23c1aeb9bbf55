"""The depthwise short causal conv of the GatedDeltaNet layer, with taps that never cross a segment start.

``y[t, c] = act(bias[c] + sum_w weight[c, w] * x[t - (W - 1) + w, c])`` where a tap that would read a token of an
earlier segment reads zero instead, exactly as if each segment were convolved alone with causal zero padding
(``nn.Conv1d(padding=W - 1)`` then the first ``L`` outputs, as transformers' Qwen3.5 does).

Backends: ``"fla"`` (flash-linear-attention's triton conv with ``cu_seqlens``), ``"causal_conv1d"`` (the CUDA
package, segments given as ``seq_idx``), ``"torch"``: W shifted copies of ``x`` summed with a mask that drops
each tap reaching before its token's segment start (no per-segment loop; W is 4 in Qwen3.5).

Legend: T = total tokens of the flattened batch, C = channels, W = kernel width.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from vlm_sft.model.varlen import Segments, position_in_segment, segment_index

ACTIVATIONS = (None, "silu", "swish")


def causal_conv1d(
    x_TC: torch.Tensor,
    weight_CW: torch.Tensor,
    bias_C: torch.Tensor | None,
    segments: Segments,
    *,
    backend: str,
    activation: str | None = "silu",
) -> torch.Tensor:
    """Segment-aware depthwise causal conv; ``weight_CW`` is ``nn.Conv1d.weight`` squeezed to ``[C, W]``."""
    if x_TC.dim() != 2 or weight_CW.dim() != 2 or weight_CW.shape[0] != x_TC.shape[1]:
        raise ValueError(
            f"causal_conv1d wants x [T, C] and weight [C, W]; got {tuple(x_TC.shape)}, {tuple(weight_CW.shape)}"
        )
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    segments.check_tokens(x_TC.shape[0], "causal_conv1d")
    if backend == "torch":
        return _torch_conv(x_TC, weight_CW, bias_C, segments.lengths, activation)
    if backend == "fla":
        return _fla_conv(x_TC, weight_CW, bias_C, segments, activation)
    if backend == "causal_conv1d":
        return _cuda_conv(x_TC, weight_CW, bias_C, segments, activation)
    raise ValueError(f"unknown conv backend {backend!r}; expected 'fla', 'causal_conv1d' or 'torch'")


def _torch_conv(x_TC, weight_CW, bias_C, lengths: tuple[int, ...], activation):
    total, width = x_TC.shape[0], weight_CW.shape[1]
    pos_T = position_in_segment(lengths, x_TC.device)
    x = x_TC.to(weight_CW.dtype)
    y_TC = x * weight_CW[:, width - 1]  # the tap on the token itself always exists
    for shift in range(1, width):
        if shift >= total:
            break
        shifted = F.pad(x[:-shift], (0, 0, shift, 0))  # row t holds x[t - shift]
        keep = (pos_T >= shift).to(x.dtype)[:, None]  # x[t - shift] is in t's segment
        y_TC = y_TC + shifted * keep * weight_CW[:, width - 1 - shift]
    if bias_C is not None:
        y_TC = y_TC + bias_C
    if activation is not None:
        y_TC = F.silu(y_TC)
    return y_TC.to(x_TC.dtype)


def _fla_conv(x_TC, weight_CW, bias_C, segments: Segments, activation):
    # CUDA-only import, this backend only; fla.modules.causal_conv1d is the conv's home (fla.modules.convolution is a
    # back-compat alias of it).
    from fla.modules.causal_conv1d import causal_conv1d as fla_causal_conv1d

    out = fla_causal_conv1d(
        x=x_TC.unsqueeze(0),
        weight=weight_CW,
        bias=bias_C,
        activation=activation,
        cu_seqlens=segments.cu_seqlens_long,
        cu_seqlens_cpu=segments.cu_seqlens_cpu,  # chunk indices from the host copy: no device-to-host read
    )
    y = out[0] if isinstance(out, tuple) else out  # (y, final_state) in fla >= 0.2
    return y.squeeze(0)


def _cuda_conv(x_TC, weight_CW, bias_C, segments: Segments, activation):
    from causal_conv1d import causal_conv1d_fn  # CUDA-only import, this backend only

    seq_idx = segment_index(segments.lengths, x_TC.device)
    # causal-conv1d takes x [B, C, T]; with seq_idx it needs the channel-last memory layout, which a transposed
    # [1, T, C] tensor has (stride 1 along C).
    x_1CT = x_TC.contiguous().unsqueeze(0).transpose(1, 2)
    y_1CT = causal_conv1d_fn(
        x_1CT,
        weight_CW.contiguous(),
        bias_C,
        seq_idx=seq_idx.unsqueeze(0),
        activation=activation,
    )
    return y_1CT.transpose(1, 2).squeeze(0)
