"""Samples for the packing tests: text, images and padding segments as ``check_packing`` takes them (CPU tensors)."""

from __future__ import annotations

import torch
from transformers import Qwen3_5Config

from vlm_sft.data.mrope import sample_position_ids

TEXT_VOCAB = 2048
"""Regular tokens drawn for samples (the tiny tokenizer's special ids sit above them)."""


def make_sample(
    cfg: Qwen3_5Config, n_before: int, grids: list[tuple[int, int, int]], n_after: int, gen: torch.Generator
) -> dict:
    """Text, then the images back to back (``<vision_start> slots <vision_end>`` each), then text; shifted targets."""
    vcfg = cfg.vision_config
    merge = vcfg.spatial_merge_size
    ids = torch.randint(0, TEXT_VOCAB, (n_before,), generator=gen).tolist()
    types = [0] * n_before
    for t, h, w in grids:
        n = t * h * w // merge**2
        ids += [cfg.vision_start_token_id] + [cfg.image_token_id] * n + [cfg.vision_end_token_id]
        types += [0] + [1] * n + [0]
    ids += torch.randint(0, TEXT_VOCAB, (n_after,), generator=gen).tolist()
    types += [0] * n_after
    input_ids = torch.tensor(ids)
    mm = torch.tensor(types)
    target_ids = torch.cat([input_ids[1:], torch.tensor([-100])])
    loss_mask = (target_ids >= 0) & (torch.cat([mm[1:], torch.tensor([0])]) == 0)
    grid = torch.tensor(grids, dtype=torch.long) if grids else None
    n_patches = sum(t * h * w for t, h, w in grids)
    patch_row = vcfg.in_channels * vcfg.temporal_patch_size * vcfg.patch_size**2
    return {
        "input_ids": input_ids,
        "position_ids": sample_position_ids(mm, grid, spatial_merge_size=merge),
        "mm_token_type_ids": mm,
        "target_ids": target_ids,
        "loss_mask": loss_mask,
        "pixel_values": torch.randn(n_patches, patch_row, generator=gen) if grids else None,
        "image_grid_thw": grid,
    }


def padding_segment(cfg: Qwen3_5Config, n: int) -> dict:
    """A padding segment as the collator writes one: pad tokens, positions from 0, no loss."""
    return {
        "input_ids": torch.full((n,), cfg.text_config.pad_token_id),
        "position_ids": torch.arange(n).expand(3, -1),
        "mm_token_type_ids": torch.zeros(n, dtype=torch.long),
        "target_ids": torch.full((n,), -100),
        "loss_mask": torch.zeros(n, dtype=torch.bool),
        "pixel_values": None,
        "image_grid_thw": None,
    }


def mixed_row(cfg: Qwen3_5Config, seed: int = 1) -> list[dict]:
    """Text-only, one-image and two-adjacent-image samples of 1, 2, 17, 3, 17, 64 and 65 tokens, then 7 of padding:
    segments shorter than the conv kernel, one GatedDeltaNet chunk, a chunk and one token."""
    gen = torch.Generator().manual_seed(seed)
    out = [
        make_sample(cfg, 1, [], 0, gen),
        make_sample(cfg, 2, [], 0, gen),
        make_sample(cfg, 5, [(1, 4, 4)], 6, gen),  # one image: 16 patches, 4 slots
        make_sample(cfg, 3, [], 0, gen),
        make_sample(cfg, 4, [(1, 2, 4), (1, 4, 2)], 5, gen),  # two adjacent images
        make_sample(cfg, 64, [], 0, gen),
        make_sample(cfg, 65, [], 0, gen),
        padding_segment(cfg, 7),
    ]
    assert [len(s["input_ids"]) for s in out] == [1, 2, 17, 3, 17, 64, 65, 7]
    return out


def packed_row(samples: list[dict]) -> dict:
    """The model inputs of ``samples`` concatenated into one row (batch size 1), images in sample order."""
    images = [s for s in samples if s["pixel_values"] is not None]
    return {
        "input_ids": torch.cat([s["input_ids"] for s in samples])[None],
        "position_ids": torch.cat([s["position_ids"] for s in samples], dim=1)[:, None],
        "mm_token_type_ids": torch.cat([s["mm_token_type_ids"] for s in samples])[None],
        "pixel_values": torch.cat([s["pixel_values"] for s in images]),
        "image_grid_thw": torch.cat([s["image_grid_thw"] for s in images]),
    }


def alone_logits(model, s: dict) -> torch.Tensor:
    """Logits ``[L, V]`` of sample ``s`` run alone (a row of its own)."""
    return model(
        s["input_ids"][None],
        position_ids=s["position_ids"][:, None],
        mm_token_type_ids=s["mm_token_type_ids"][None],
        pixel_values=s["pixel_values"],
        image_grid_thw=s["image_grid_thw"],
    )[0]


def max_delta_per_sample(packed_logits: torch.Tensor, samples: list[dict], model, alone=alone_logits) -> float:
    """Largest |packed - alone| logit difference over the samples packed in order into ``packed_logits[0]``;
    ``alone(model, sample)`` gives a sample's own logits."""
    worst, start = 0.0, 0
    for s in samples:
        n = len(s["input_ids"])
        worst = max(worst, float((packed_logits[0, start : start + n] - alone(model, s)).abs().max()))
        start += n
    return worst


def packed_batch(cfg: Qwen3_5Config, rows: list[list[dict]], length: int):
    """A ``PackedBatch`` of ``rows`` (each a list of samples as ``make_sample`` returns), every row padded to
    ``length`` with its own padding segment; dataset indices number the samples in order."""
    from vlm_sft.data.batch import PackedBatch

    segments, seq_lens, indices, index = [], [], [], 0
    for row in rows:
        n = sum(len(s["input_ids"]) for s in row)
        assert n <= length, (n, length)
        pad = [] if n == length else [padding_segment(cfg, length - n)]
        segments.append(row + pad)
        seq_lens += [len(s["input_ids"]) for s in row + pad]
        indices.append(tuple(range(index, index + len(row))))
        index += len(row)
    flat = [s for row in segments for s in row]
    images = [s for s in flat if s["pixel_values"] is not None]
    cat = lambda key: torch.cat([s[key] for s in flat]).view(len(rows), length)  # noqa: E731
    loss_mask = cat("loss_mask")
    return PackedBatch(
        input_ids=cat("input_ids"),
        target_ids=cat("target_ids"),
        loss_mask=loss_mask,
        position_ids=torch.cat([s["position_ids"] for s in flat], dim=1).view(3, len(rows), length),
        seq_lens=torch.tensor(seq_lens),
        pixel_values=torch.cat([s["pixel_values"] for s in images]) if images else None,
        image_grid_thw=torch.cat([s["image_grid_thw"] for s in images]) if images else None,
        mm_token_type_ids=cat("mm_token_type_ids"),
        num_trainable_tokens=int(loss_mask.sum()),
        num_real_tokens=sum(len(s["input_ids"]) for row in rows for s in row),
        sample_indices=tuple(indices),
    )
