"""Collate packs into a ``PackedBatch``: pad every row to its length, record segments, build MRoPE positions.

Runs in dataloader workers on the CPU. Each row is its samples in pack order followed by one padding segment (when
the row is not full) of ``<|endoftext|>`` inputs and targets, type 0, loss masked. Positions are computed for the
whole flattened batch at once from the segment lengths (see ``vlm_sft.data.mrope``); ``stack`` batches get the
same positions (sample, then padding from 0) and an attention mask instead of ``seq_lens``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from processors.special_tokens import PAD_TOKEN, tiny_token_id
from renderers.types import TEXT_TOKEN_TYPE
from vlm_sft.data.batch import PackedBatch
from vlm_sft.data.mrope import mrope_position_ids
from vlm_sft.data.pack import Pack

TINY_PAD_ID = tiny_token_id(PAD_TOKEN)
"""``<|endoftext|>`` in the tiny tokenizer; pass the real tokenizer's id (``pad_token_id``) for a real model."""


def collate(packs: Sequence[Pack], *, pad_id: int = TINY_PAD_ID, spatial_merge_size: int = 2) -> PackedBatch:
    """One ``PackedBatch`` from the rows of ``packs`` (all with the same row length and kind), in order."""
    if not packs:
        raise ValueError("collate needs at least one pack")
    length, stacked = packs[0].row_len, packs[0].stacked
    if any(p.row_len != length or p.stacked != stacked for p in packs):
        raise ValueError(
            f"packs differ in row length or kind: {sorted({(p.row_len, p.stacked) for p in packs})}; "
            "collate packs of one packer configuration (stack batches one at a time)"
        )
    rows = [row for p in packs for row in p.rows]
    inputs, targets, masks, types, seg_lens = [], [], [], [], []
    pixels, grids = [], []
    for row in rows:
        used = 0
        for s in row:
            inputs.append(s.input_ids)
            targets.append(s.target_ids)
            masks.append(s.loss_mask)
            types.append(s.mm_token_type_ids)
            seg_lens.append(len(s))
            used += len(s)
            if s.pixel_values is not None:
                pixels.append(s.pixel_values)
                grids.append(s.image_grid_thw)
        pad = length - used
        assert pad >= 0, f"row of {used} tokens exceeds its length {length}"
        if pad:
            inputs.append(torch.full((pad,), pad_id, dtype=torch.long))
            targets.append(torch.full((pad,), pad_id, dtype=torch.long))
            masks.append(torch.zeros(pad, dtype=torch.bool))
            types.append(torch.full((pad,), TEXT_TOKEN_TYPE, dtype=torch.long))
            seg_lens.append(pad)
    b = len(rows)
    input_ids = torch.cat(inputs).view(b, length)
    loss_mask = torch.cat(masks).view(b, length)
    mm_types = torch.cat(types).view(b, length)
    seq_lens = torch.tensor(seg_lens, dtype=torch.long)
    grid = torch.cat(grids) if grids else None
    positions = mrope_position_ids(mm_types.view(-1), grid, seq_lens, spatial_merge_size=spatial_merge_size)
    num_real = sum(len(s) for row in rows for s in row)
    attention_mask = None
    if stacked:
        real = torch.tensor([len(row[0]) for row in rows])
        attention_mask = torch.arange(length) < real[:, None]
    return PackedBatch(
        input_ids=input_ids,
        target_ids=torch.cat(targets).view(b, length),
        loss_mask=loss_mask,
        position_ids=positions.view(3, b, length),
        seq_lens=None if stacked else seq_lens,
        pixel_values=torch.cat(pixels) if pixels else None,
        image_grid_thw=grid,
        mm_token_type_ids=mm_types,
        num_trainable_tokens=int(loss_mask.sum()),
        num_real_tokens=num_real,
        sample_indices=tuple(tuple(s.sample_index for s in row) for row in rows),
        attention_mask=attention_mask,
        spatial_merge_size=spatial_merge_size,
    )
