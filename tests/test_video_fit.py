"""A sample too long for ``data.seq_len`` thins its videos: whole temporal groups dropped evenly with their true
timestamps, down to ``data.video_min_frames``, then a counted skip; a video is never cut (``vlm_sft.data.video_fit``).

The thinned sample is held to what the tokenizer gives for the thinned prompt text and to transformers' logits for
the thinned video, so the tokens, pixel rows and positions agree with each other after the cut.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from test_video_render import CLIP, SMALL, assert_transformers_logits

from renderers import Qwen3_5Renderer
from renderers.errors import SkipSample
from renderers.video import video_placeholder_text
from vlm_sft.data.pipeline import PackingPipeline
from vlm_sft.data.truncate import truncate_sample
from vlm_sft.data.video_fit import kept_groups, thin_videos

CONVERSATION = [
    {"role": "user", "content": [{"type": "video", "video": CLIP, "fps": 8}, {"type": "text", "text": "What?"}]},
    {"role": "assistant", "content": "the red one"},
]


@pytest.fixture(scope="module")
def renderer(processor):
    return Qwen3_5Renderer(processor, video_settings=SMALL)


@pytest.fixture(scope="module")
def sample(renderer):
    return renderer.render(CONVERSATION)


def _video_text(sample, timestamps) -> str:
    """The prompt text of the sample's video with these groups."""
    _, h, w = sample.multi_modal_data.image_grid_thw[0].tolist()
    groups = SimpleNamespace(grid_thw=(len(timestamps), h, w), timestamps=tuple(timestamps))
    return video_placeholder_text(groups, 2)


def test_kept_groups_are_even_and_keep_both_ends():
    assert kept_groups(7, 5) == [0, 2, 3, 4, 6]
    assert kept_groups(7, 2) == [0, 6]
    assert kept_groups(3, 5) == [0, 1, 2]


def test_a_thinned_sample_is_the_tokenized_thinned_prompt_with_the_kept_groups_pixels(renderer, sample):
    video = sample.multi_modal_data.videos[0]
    assert video.num_groups == 7 and video.min_groups == 2
    thinned = truncate_sample(sample, len(sample) - 20)  # two groups (10 tokens each) must go
    thinned.check()
    mm = thinned.multi_modal_data
    keep = [0, 2, 3, 4, 6]
    assert mm.videos[0].num_groups == 5 and mm.videos[0].timestamps == tuple(video.timestamps[g] for g in keep)
    assert thinned.metadata["video_groups_dropped"] == 2 and "truncated_from" not in thinned.metadata
    rows = sample.multi_modal_data.pixel_values.reshape(7, -1, mm.pixel_values.shape[-1])
    assert torch.equal(mm.pixel_values, rows[keep].reshape(-1, rows.shape[-1]))
    tok = renderer.processor.tokenizer
    text = tok.decode(sample.token_ids)
    assert tok(text, add_special_tokens=False).input_ids == sample.token_ids.tolist()  # the text round-trips
    old, new = _video_text(sample, video.timestamps), _video_text(sample, mm.videos[0].timestamps)
    expected = tok(text.replace(old, new), add_special_tokens=False).input_ids
    assert old in text and thinned.token_ids.tolist() == expected
    assert int(thinned.loss_mask.sum()) == int(sample.loss_mask.sum())


def test_a_thinned_video_gives_transformers_logits(sample):
    """Positions, slots and pixel rows of the thinned sample agree: transformers, fed the thinned video, computes
    the same logits as our model on the thinned sample."""
    thinned = thin_videos(sample, len(sample) - 30)
    assert thinned.multi_modal_data.videos[0].num_groups == 4
    assert_transformers_logits(thinned)


def test_a_video_too_long_at_its_fewest_groups_is_a_counted_skip_never_a_cut(sample):
    fewest = thin_videos(sample, 1)
    assert fewest is sample  # cannot fit even at 2 groups: left for truncation to refuse
    at_two = len(sample) - 5 * 10
    assert thin_videos(sample, at_two).multi_modal_data.videos[0].num_groups == 2
    with pytest.raises(SkipSample) as e:
        truncate_sample(sample, at_two - 3, policy="truncate")  # the cut would fall inside the second group
    assert e.value.reason == "video_too_long" and "data.seq_len" in str(e.value)


def test_the_pipeline_thins_fits_and_counts_a_video_that_cannot_fit(sample):
    samples = [sample, sample]

    def render(index):
        return samples[index]

    pipeline = PackingPipeline(2, render, seq_len=len(sample) - 20, pack_len=len(sample), shuffle=False)
    fitted = pipeline.prepare(0)
    assert fitted.num_videos == 1 and fitted.num_video_groups == 5 and len(fitted) == len(sample) - 21
    pipeline = PackingPipeline(2, render, seq_len=20, pack_len=len(sample), shuffle=False)
    packs = list(pipeline)
    assert packs == [] and pipeline.skips.counts == {"video_too_long": 2}
