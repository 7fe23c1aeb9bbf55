"""Text rotary embedding of Qwen3.5: interleaved multimodal RoPE (MRoPE) over a partial rotary dimension.

Qwen3.5 rotates only the first ``head_dim * partial_rotary_factor`` dims of each query / key head. Each rotary
frequency index is owned by one of three position axes (temporal, height, width): interleaved, so frequency ``i``
belongs to height when ``i % 3 == 1`` and ``i < 3 * mrope_section[1]``, to width when ``i % 3 == 2`` and
``i < 3 * mrope_section[2]``, and to the temporal axis otherwise. Text tokens carry the same position on all three
axes, so on text this is plain RoPE. The math follows transformers' ``Qwen3_5TextRotaryEmbedding`` and
``apply_rotary_pos_emb`` exactly, but runs in float32 on the flattened token layout.

The positions themselves come from the data pipeline (``vlm_sft.data.mrope``), which numbers every segment the
way transformers' ``get_rope_index`` numbers that sample alone; the model calls the same function when a forward
gets no ``position_ids``.

Legend: T = tokens (all rows flattened), H = heads, D = head dim, R = rotary dims, N = images.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import Qwen3_5TextConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS


def _default_inv_freq(config: Qwen3_5TextConfig) -> tuple[torch.Tensor, float]:
    """Inverse frequencies of the partial rotary dims, as transformers' ``compute_default_rope_parameters``."""
    base = config.rope_parameters["rope_theta"]
    partial = config.rope_parameters.get("partial_rotary_factor", 1.0)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    dim = int(head_dim * partial)
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32, device="cpu") / dim))
    return inv_freq, 1.0


class MRopeRotary(nn.Module):
    """Maps ``[3, T]`` positions to the float32 ``(cos, sin)`` tables ``[T, R]`` of interleaved MRoPE.

    The inverse frequencies are a plain float32 attribute, not a buffer: ``model.to(torch.bfloat16)`` must not
    round them, and a model materialized from the meta device needs nothing recomputed.
    """

    def __init__(self, config: Qwen3_5TextConfig) -> None:
        super().__init__()
        rope_type = config.rope_parameters.get("rope_type", "default")
        if rope_type == "default":
            inv_freq, scaling = _default_inv_freq(config)
        else:
            inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, device="cpu")
        self.inv_freq: torch.Tensor = inv_freq.float()
        self.attention_scaling = float(scaling)
        self.mrope_section = list(config.rope_parameters.get("mrope_section", [11, 11, 10]))
        if sum(self.mrope_section) != self.inv_freq.numel():
            raise ValueError(
                f"rope_parameters.mrope_section={self.mrope_section} sums to {sum(self.mrope_section)}, but the "
                f"partial rotary dim has {self.inv_freq.numel()} frequencies: the sections must sum to half the "
                "rotary dim (head_dim * partial_rotary_factor / 2)"
            )

    @property
    def rotary_dim(self) -> int:
        return 2 * self.inv_freq.numel()

    def forward(self, position_ids_3T: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        inv_freq = self.inv_freq.to(position_ids_3T.device)
        freqs_3TF = position_ids_3T[..., None].float() * inv_freq
        # Interleave: the temporal axis owns every frequency except the strided slots of height and width.
        freqs_TF = freqs_3TF[0].clone()
        for axis in (1, 2):
            idx = slice(axis, 3 * self.mrope_section[axis], 3)
            freqs_TF[..., idx] = freqs_3TF[axis, ..., idx]
        emb_TR = torch.cat((freqs_TF, freqs_TF), dim=-1)
        return emb_TR.cos() * self.attention_scaling, emb_TR.sin() * self.attention_scaling


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_partial_rotary(x_THD: torch.Tensor, cos_TR: torch.Tensor, sin_TR: torch.Tensor) -> torch.Tensor:
    """Rotates the first R dims of every head (in float32) and passes the rest through; returns x's dtype."""
    rotary_dim = cos_TR.shape[-1]
    x_rot, x_pass = x_THD[..., :rotary_dim].float(), x_THD[..., rotary_dim:]
    cos, sin = cos_TR[:, None, :], sin_TR[:, None, :]
    x_rot = x_rot * cos + _rotate_half(x_rot) * sin
    return torch.cat((x_rot.to(x_THD.dtype), x_pass), dim=-1)
