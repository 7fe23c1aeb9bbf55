"""Video through our model, held to transformers' Qwen3.5 (dense and MoE): positions, logits, packing.

transformers takes a video as ``pixel_values_videos`` + ``video_grid_thw`` (T, h, w) and each temporal group's
pads after their own timestamp text; we take the same rows as T vision items of grid (1, h, w) with slot type 2
(``renderers.types``). These tests feed both the same tokens and pixels and compare.
"""

from __future__ import annotations

import pytest
import torch
from packing_helpers import TEXT_VOCAB, make_sample, max_delta_per_sample, packed_row
from transformers import Qwen3_5ForConditionalGeneration, Qwen3_5MoeForConditionalGeneration

from vlm_sft.data.mrope import batch_position_ids, mrope_position_ids, sample_position_ids
from vlm_sft.model import build_model, tiny_qwen3_5_config, tiny_qwen3_5_moe_config

PATCH_ROW = 3 * 2 * 16 * 16
TOL = 1e-5


def video_tokens(cfg, groups: int, h: int, w: int, gen: torch.Generator) -> tuple[list[int], list[int]]:
    """One video as the processor writes it: per group, timestamp text (3 tokens), vision start, pads, vision end."""
    n = h * w // cfg.vision_config.spatial_merge_size**2
    ids, types = [], []
    for _ in range(groups):
        ids += [*torch.randint(0, TEXT_VOCAB, (3,), generator=gen).tolist(), cfg.vision_start_token_id]
        ids += [cfg.video_token_id] * n + [cfg.vision_end_token_id]
        types += [0] * 4 + [2] * n + [0]
    return ids, types


def video_batch(cfg, gen: torch.Generator) -> dict:
    """Text, an image (1x4x4), text, a video of 3 groups of 4x6 patches, text: transformers' inputs, plus ours."""
    vs, ve, img = cfg.vision_start_token_id, cfg.vision_end_token_id, cfg.image_token_id
    text = torch.randint(0, TEXT_VOCAB, (9,), generator=gen).tolist()
    vid_ids, vid_types = video_tokens(cfg, 3, 4, 6, gen)
    ids = text[:3] + [vs] + [img] * 4 + [ve] + text[3:6] + vid_ids + text[6:]
    types = [0] * 4 + [1] * 4 + [0] * 4 + vid_types + [0] * 3
    image_grid, video_grid = torch.tensor([[1, 4, 4]]), torch.tensor([[3, 4, 6]])
    image_pixels = torch.randn(16, PATCH_ROW, generator=gen)
    video_pixels = torch.randn(3 * 24, PATCH_ROW, generator=gen)
    input_ids, mm = torch.tensor([ids]), torch.tensor([types])
    return {
        "theirs": {
            "input_ids": input_ids,
            "mm_token_type_ids": mm,
            "pixel_values": image_pixels,
            "image_grid_thw": image_grid,
            "pixel_values_videos": video_pixels,
            "video_grid_thw": video_grid,
        },
        "ours": {
            "mm_token_type_ids": mm,
            "pixel_values": torch.cat([image_pixels, video_pixels]),
            "image_grid_thw": torch.tensor([[1, 4, 4]] + [[1, 4, 6]] * 3),
        },
    }


@pytest.fixture(scope="module", params=["dense", "moe"])
def pair(request):
    cfg = tiny_qwen3_5_config() if request.param == "dense" else tiny_qwen3_5_moe_config()
    cls = Qwen3_5ForConditionalGeneration if request.param == "dense" else Qwen3_5MoeForConditionalGeneration
    torch.manual_seed(0)
    ref = cls(cfg).eval()
    ours = build_model(cfg)
    ours.load_state_dict(ref.state_dict())
    return cfg, ref, ours


def test_positions_equal_transformers_get_rope_index_with_video(pair):
    cfg, ref, _ = pair
    b = video_batch(cfg, torch.Generator().manual_seed(0))
    t = b["theirs"]
    theirs, _ = ref.model.get_rope_index(
        t["input_ids"], t["mm_token_type_ids"], image_grid_thw=t["image_grid_thw"], video_grid_thw=t["video_grid_thw"]
    )
    ours = mrope_position_ids(b["ours"]["mm_token_type_ids"][0], b["ours"]["image_grid_thw"], spatial_merge_size=2)
    assert torch.equal(ours, theirs[:, 0])
    # The guard: the video as one item of grid (3, 4, 6) (time in the positions, as Qwen2.5-VL did) is not theirs.
    whole = torch.tensor([[1, 4, 4], [3, 4, 6]])
    wrong = mrope_position_ids(b["ours"]["mm_token_type_ids"][0], whole, spatial_merge_size=2)
    assert not torch.equal(wrong, theirs[:, 0])


@torch.no_grad()
def test_logits_equal_transformers_with_video_and_image(pair):
    cfg, ref, ours = pair
    b = video_batch(cfg, torch.Generator().manual_seed(1))
    t = b["theirs"]
    theirs = ref(**t).logits
    pos = batch_position_ids(b["ours"]["mm_token_type_ids"], b["ours"]["image_grid_thw"])
    mine = ours(t["input_ids"], position_ids=pos, **b["ours"])
    assert float(theirs.abs().max()) > 0.1
    assert float((mine - theirs).abs().max()) <= TOL
    # The guard: the video's groups in reverse order are other features (the bound can fail).
    groups = b["ours"]["pixel_values"][16:].view(3, 24, -1).flip(0).reshape(72, -1)
    flipped = {**b["ours"], "pixel_values": torch.cat([b["ours"]["pixel_values"][:16], groups])}
    assert float((ours(t["input_ids"], position_ids=pos, **flipped) - theirs).abs().max()) > 1e3 * TOL


def video_sample(cfg, n_before: int, groups: int, n_after: int, gen: torch.Generator) -> dict:
    """A training sample holding one video (groups of 2x4 patches) between two texts."""
    sample = make_sample(cfg, n_before, [], 0, gen)
    vid_ids, vid_types = video_tokens(cfg, groups, 2, 4, gen)
    after = torch.randint(0, TEXT_VOCAB, (n_after,), generator=gen).tolist()
    input_ids = torch.tensor(sample["input_ids"].tolist() + vid_ids + after)
    mm = torch.tensor([0] * n_before + vid_types + [0] * n_after)
    grid = torch.tensor([[1, 2, 4]] * groups)
    target_ids = torch.cat([input_ids[1:], torch.tensor([-100])])
    return {
        "input_ids": input_ids,
        "position_ids": sample_position_ids(mm, grid, spatial_merge_size=2),
        "mm_token_type_ids": mm,
        "target_ids": target_ids,
        "loss_mask": (target_ids >= 0) & (torch.cat([mm[1:], torch.tensor([0])]) == 0),
        "pixel_values": torch.randn(groups * 8, PATCH_ROW, generator=gen),
        "image_grid_thw": grid,
    }


@torch.no_grad()
def test_packed_video_image_and_text_samples_equal_each_alone(pair):
    cfg, _, ours = pair
    gen = torch.Generator().manual_seed(2)
    samples = [
        video_sample(cfg, 3, 2, 4, gen),
        make_sample(cfg, 5, [(1, 4, 4)], 6, gen),
        make_sample(cfg, 7, [], 0, gen),
        video_sample(cfg, 1, 3, 2, gen),
    ]
    seq_lens = torch.tensor([len(s["input_ids"]) for s in samples])
    logits = ours(**packed_row(samples), seq_lens=seq_lens)
    assert max_delta_per_sample(logits, samples, ours) <= TOL
    assert max_delta_per_sample(ours(**packed_row(samples)), samples, ours) > 1e3 * TOL  # without seq_lens: leaks
