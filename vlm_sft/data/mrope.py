"""MRoPE (3-axis rotary) position ids for packed rows, computed on the CPU in the data path.

Qwen3.5 gives every token a (temporal, height, width) position. Text advances all three axes together by 1 per
token; an image's (or a video group's: ``renderers.types``) merged tokens take ``start + (t, h, w)`` over its grid (grid h and w divided by the spatial
merge size), and the text after it resumes at ``start + max(h, w)`` (the temporal extent is not added). This module
reproduces transformers' ``Qwen3_5Model.get_rope_index`` for one sample, and does it for all segments of a packed
row (or of a whole flattened batch) at once, restarting at 0 at every segment start, so a sample packed with others
gets exactly the positions it would get alone.

Padding: a padding segment gets ``0, 1, ..., p - 1`` on all three axes, which is what ``get_rope_index`` gives a
text-only sample of that length. It is harmless: padding is its own segment with its loss masked, so no real token
attends to it and none of its outputs is trained.

Vectorized: one cumulative sum over the row plus per-image-token index arithmetic; no Python loop over tokens,
images or segments. Images are matched to type-1 tokens by count, in order (the renderer wraps every run in
``<|vision_start|>`` / ``<|vision_end|>``, so runs of different images are never adjacent as transformers' grouping
would require).
"""

from __future__ import annotations

import torch

from renderers.types import TEXT_TOKEN_TYPE, VISION_TOKEN_TYPES


def image_token_counts(image_grid_thw: torch.Tensor, spatial_merge_size: int = 2) -> torch.Tensor:
    """``[N]`` merged tokens per image: ``t * (h // m) * (w // m)`` == ``prod(grid) // m**2``."""
    m = spatial_merge_size
    return image_grid_thw[:, 0] * (image_grid_thw[:, 1] // m) * (image_grid_thw[:, 2] // m)


def mrope_position_ids(
    mm_token_type_ids: torch.Tensor,
    image_grid_thw: torch.Tensor | None,
    seq_lens: torch.Tensor | list[int] | None = None,
    *,
    spatial_merge_size: int = 2,
) -> torch.Tensor:
    """``[3, M]`` int64 positions for ``M`` tokens split into segments of ``seq_lens`` (None: one segment).

    ``mm_token_type_ids`` is ``[M]`` (0 text, 1 image slot, 2 video slot); ``image_grid_thw`` is ``[N, 3]`` for the
    vision items (images and video groups) in token order (None or empty without any). Raises ``ValueError`` on an
    unknown type or when the slot count does not match the grids.
    """
    types = mm_token_type_ids.reshape(-1)
    total = int(types.shape[0])
    if bool(((types < TEXT_TOKEN_TYPE) | (types > max(VISION_TOKEN_TYPES))).any()):
        raise ValueError("mm_token_type_ids holds a value other than 0 (text), 1 (image) or 2 (video)")
    if total == 0:
        return torch.zeros(3, 0, dtype=torch.long)
    is_image = types != TEXT_TOKEN_TYPE
    num_image_tokens = int(is_image.sum())
    # Per-token advance of the running position: 1 per text token; an image advances by max(h, w) at its last token,
    # so that every token of the image sees the same exclusive prefix sum (the image's start position).
    advance = (~is_image).long()
    image_idx = None
    if image_grid_thw is not None and image_grid_thw.shape[0] > 0:
        m = spatial_merge_size
        grid = image_grid_thw.long()
        counts = image_token_counts(grid, m)
        if int(counts.sum()) != num_image_tokens or bool((counts <= 0).any()):
            raise ValueError(
                f"{num_image_tokens} image tokens but the grids {grid.tolist()} give {counts.tolist()} "
                f"(prod(grid) // {m}**2 each)"
            )
        image_idx = is_image.nonzero(as_tuple=True)[0]
        last_token = image_idx[counts.cumsum(0) - 1]
        advance[last_token] = torch.maximum(grid[:, 1], grid[:, 2]) // m
    elif num_image_tokens:
        raise ValueError(f"{num_image_tokens} image tokens but no image_grid_thw")
    start = advance.cumsum(0) - advance
    if seq_lens is None:
        seq_lens = torch.tensor([total])
    seq_lens = torch.as_tensor(seq_lens, dtype=torch.long)
    assert int(seq_lens.sum()) == total, f"seq_lens sum {int(seq_lens.sum())} != {total} tokens"
    seg_first = seq_lens.cumsum(0) - seq_lens
    start = start - torch.repeat_interleave(start[seg_first.clamp(max=total - 1)], seq_lens)
    pos = start.unsqueeze(0).repeat(3, 1)
    if image_idx is not None:
        # Index of each image token inside its image, then its (t, h, w) offset on the merged grid.
        local = torch.arange(num_image_tokens) - torch.repeat_interleave(counts.cumsum(0) - counts, counts)
        gh = torch.repeat_interleave(grid[:, 1] // m, counts)
        gw = torch.repeat_interleave(grid[:, 2] // m, counts)
        pos[0, image_idx] += local // (gh * gw)
        pos[1, image_idx] += (local // gw) % gh
        pos[2, image_idx] += local % gw
    return pos


def sample_position_ids(
    mm_token_type_ids: torch.Tensor, image_grid_thw: torch.Tensor | None, *, spatial_merge_size: int = 2
) -> torch.Tensor:
    """``[3, n]`` positions of one sample alone (what ``get_rope_index`` returns for it, batch dim dropped)."""
    return mrope_position_ids(mm_token_type_ids, image_grid_thw, None, spatial_merge_size=spatial_merge_size)


def batch_position_ids(
    mm_token_type_ids: torch.Tensor,
    image_grid_thw: torch.Tensor | None = None,
    seq_lens: torch.Tensor | list[int] | None = None,
    *,
    spatial_merge_size: int = 2,
) -> torch.Tensor:
    """``[3, B, L]`` positions of a ``[B, L]`` batch (the model's ``position_ids``); ``seq_lens`` None: one segment
    per row. For text-only rows pass ``torch.zeros_like(input_ids)`` as the token types."""
    if mm_token_type_ids.dim() != 2:
        raise ValueError(f"mm_token_type_ids must be [B, L], got shape {tuple(mm_token_type_ids.shape)}")
    rows, length = mm_token_type_ids.shape
    if seq_lens is None:
        seq_lens = [length] * rows
    pos = mrope_position_ids(
        mm_token_type_ids.reshape(-1), image_grid_thw, seq_lens, spatial_merge_size=spatial_merge_size
    )
    return pos.view(3, rows, length)
