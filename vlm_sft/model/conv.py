"""The depthwise short causal conv of the GatedDeltaNet layer, with taps that never cross a segment start.

``y[t, c] = act(bias[c] + sum_w weight[c, w] * x[t - (W - 1) + w, c])`` where a tap that would read a token of an
earlier segment reads zero instead, exactly as if each segment were convolved alone with causal zero padding
(``nn.Conv1d(padding=W - 1)`` then the first ``L`` outputs, as transformers' Qwen3.5 does).

Backends: ``"fla"`` (flash-linear-attention's triton conv with ``cu_seqlens``), ``"causal_conv1d"`` (the CUDA
package, segments given as ``seq_idx``), ``"torch"``: W shifted copies of ``x`` summed with a mask that drops
each tap reaching before its token's segment start (no per-segment loop; W is 4 in Qwen3.5).

Incremental decoding (``vlm_sft.model.decode``): ``conv_tail`` keeps each segment's last ``W - 1`` inputs after a
prefill, ``conv_step`` convolves one new token per sequence over them.

Legend: T = total tokens of the flattened batch, S = segments (sequences), C = channels, W = kernel width (a ``W``
suffix on a tail is its ``W - 1`` rows).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from vlm_sft.model.varlen import Segments, gather_rows, position_in_segment, segment_index

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


# ------------------------------------------------------------------------------------- incremental decoding


def conv_tail(x_TC: torch.Tensor, segments: Segments, width: int) -> torch.Tensor:
    """``[S, W - 1, C]``: the last ``W - 1`` conv inputs of every segment, oldest first, the state ``conv_step``
    continues a segment from. A segment shorter than ``W - 1`` gets zero rows in front, which is what its own causal
    zero padding would read (so the first decode step sees exactly the taps the full conv would)."""
    segments.check_tokens(x_TC.shape[0], "conv_tail")
    total, keep = x_TC.shape[0], width - 1
    index, end = [], 0
    for n in segments.lengths:  # host ints: the gather index is built without reading the device
        end += n
        index += [t if t >= end - n else total for t in range(end - keep, end)]  # ``total`` reads gather_rows' zero row
    index_t = torch.tensor(index, dtype=torch.int64).to(x_TC.device)
    return gather_rows(x_TC, index_t).view(len(segments.lengths), keep, x_TC.shape[1])


def conv_step(
    x_SC: torch.Tensor,
    tail_SWC: torch.Tensor,
    weight_CW: torch.Tensor,
    bias_C: torch.Tensor | None,
    *,
    activation: str | None = "silu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """One new token of each of S sequences: ``(y_SC, new tail_SWC)``; ``tail_SWC`` holds each sequence's last
    ``W - 1`` inputs, oldest first (``conv_tail``), and the new tail drops the oldest and appends ``x``.

    The taps are summed in the order of the torch varlen conv (the token's own tap first, then one shift at a time),
    in the weight's dtype, so a step gives what the full conv gives that token.
    """
    width = weight_CW.shape[1]
    if x_SC.dim() != 2 or tail_SWC.shape != (x_SC.shape[0], width - 1, x_SC.shape[1]):
        raise ValueError(
            f"conv_step wants x [S, C] and tail [S, W - 1, C] for width {width}; got {tuple(x_SC.shape)}, "
            f"{tuple(tail_SWC.shape)}"
        )
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    x = x_SC.to(weight_CW.dtype)
    y_SC = x * weight_CW[:, width - 1]
    for shift in range(1, width):
        y_SC = y_SC + tail_SWC[:, width - 1 - shift].to(x.dtype) * weight_CW[:, width - 1 - shift]
    if bias_C is not None:
        y_SC = y_SC + bias_C
    if activation is not None:
        y_SC = F.silu(y_SC)
    new_tail_SWC = torch.cat([tail_SWC[:, 1:], x_SC[:, None].to(tail_SWC.dtype)], dim=1)
    return y_SC.to(x_SC.dtype), new_tail_SWC
