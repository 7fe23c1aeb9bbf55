"""Speed fixes to transformers' Qwen3.5 vision tower that keep its modules, parameter names and results.

The tower itself is transformers' ``Qwen3_5VisionModel`` (or the MoE family's), unchanged apart from what is swapped
here, so checkpoints and the parity tests keep holding.

- **Patch embedding as one matmul.** transformers embeds patches with a ``Conv3d`` whose kernel equals its stride
  and its input (``[P, C, T, p, p]`` -> ``[P, D]``): each output is one dot product of a patch row with a filter, i.e.
  ``patches @ W.view(D, -1).T + b``. On CPUs the ``Conv3d`` backward (oneDNN) took a quarter of a whole training step
  of the tiny model on long-tail rows, 4-6x a matmul of the same size. ``MatmulPatchEmbed`` computes the same values
  from the same ``proj.weight`` / ``proj.bias`` (summation order aside: ~1e-7 relative).
"""

from __future__ import annotations

import torch
from torch import nn


class MatmulPatchEmbed(nn.Module):
    """transformers' ``...VisionPatchEmbed`` computed as a matmul; keeps its ``proj`` (a ``Conv3d``) and its names."""

    def __init__(self, conv_embed: nn.Module) -> None:
        super().__init__()
        self.proj = conv_embed.proj
        self.embed_dim = conv_embed.embed_dim
        if tuple(self.proj.kernel_size) != tuple(self.proj.stride) or self.proj.padding != (0, 0, 0):
            raise ValueError(f"patch embedding kernel {self.proj.kernel_size} != stride {self.proj.stride}")

    def forward(self, hidden_states_PD: torch.Tensor) -> torch.Tensor:
        weight = self.proj.weight
        flat = weight.reshape(weight.shape[0], -1)
        return nn.functional.linear(hidden_states_PD.to(weight.dtype).reshape(-1, flat.shape[1]), flat, self.proj.bias)


def speed_up_vision_tower(visual: nn.Module) -> nn.Module:
    """Swaps in the exact speed fixes above (in place, before any wrapping or sharding); returns ``visual``."""
    visual.patch_embed = MatmulPatchEmbed(visual.patch_embed)
    return visual
