"""Video samples through every packer mode: each sample is packed once, whole, with its own positions and every
video group's rows beside its slots, and the per-pack vision budget counts video patches as it counts images'."""

from __future__ import annotations

import pytest
from test_video_render import CLIP, SMALL

from renderers import Qwen3_5Renderer
from vlm_sft.data.collate import collate
from vlm_sft.data.pipeline import PackingPipeline


@pytest.fixture(scope="module")
def samples(processor, image_files):
    renderer = Qwen3_5Renderer(processor, video_settings=SMALL)
    video = {"type": "video", "video": CLIP}
    conversations = [
        [{"role": "user", "content": [video, {"type": "text", "text": "What moves?"}]}, {"role": "assistant", "content": "a square"}],
        [{"role": "user", "content": [{"type": "image", "image": image_files[0]}, video]}, {"role": "assistant", "content": "both"}],
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}],
    ]  # fmt: skip
    return [renderer.render(c) for c in conversations * 4]


@pytest.mark.parametrize("packing", ["cat", "bfd", "stack"])
def test_every_packer_mode_keeps_video_samples_whole_and_within_the_vision_budget(samples, packing):
    most = max(s.multi_modal_data.num_patches for s in samples if s.multi_modal_data)
    pipeline = PackingPipeline(len(samples), samples.__getitem__, seq_len=200, pack_len=256, packing=packing,
                               batch_size=3, max_image_patches_per_pack=most, shuffle=False)  # fmt: skip
    packs = list(pipeline)
    packed = sorted(s.sample_index for p in packs for s in p.samples)
    assert packed == list(range(len(samples))) and pipeline.skips.total == 0
    for pack in packs:
        batch = collate([pack])
        batch.check(positions=True)
        assert sum(s.num_patches for s in pack.samples) <= most  # video groups count against the budget
        rows = 0 if batch.pixel_values is None else batch.pixel_values.shape[0]  # None: a text-only stack batch
        assert rows == sum(s.num_patches for s in pack.samples)
        assert int((batch.mm_token_type_ids == 2).sum()) == sum(s.num_video_tokens for s in pack.samples)
    assert sum(s.num_videos for p in packs for s in p.samples) == 8
