"""Image-safe truncation of a rendered sample to the context length.

A sample longer than the context must lose its tail, but a cut in the middle of an image would leave
``<|image_pad|>`` slots without their vision features (or features without slots), and a cut between
``<|vision_start|>`` and ``<|vision_end|>`` would leave a marker the model never sees closed. So the cut moves back
to just before the ``<|vision_start|>`` of the image block it would split, and every image past the cut is dropped
whole: its placeholder tokens, its ``pixel_values`` rows and its ``image_grid_thw`` row together.

Length accounting (one convention for the whole data path): ``seq_len`` counts the tokens the model sees for a
sample, i.e. its *inputs after the causal shift*. A rendered sample of T tokens yields T - 1 inputs, so truncation
keeps at most ``seq_len + 1`` rendered tokens, and a sample truncated to ``seq_len`` fills a pack of length
``seq_len`` exactly. The last kept token is a target only.

The image block of placeholder range ``r`` is ``[r.offset - 1, r.end + 1)``: the renderer's contract puts
``<|vision_start|>`` right before the run and ``<|vision_end|>`` right after it (see ``PlaceholderRange``), so no
token ids are needed here and the tiny and real vocabularies are handled alike.

Videos are thinned first (``video_fit``: whole groups dropped evenly down to ``data.video_min_frames``); a video the
cut would still fall inside is a counted skip, ``video_too_long``, never a partial clip.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Literal

from renderers.errors import SkipSample
from renderers.types import MultiModalData, RenderedSample
from vlm_sft.data.video_fit import thin_videos

logger = logging.getLogger(__name__)

TruncationPolicy = Literal["drop", "truncate"]
"""What to do when the cut falls inside the final trainable turn (its closing token is lost):
``drop`` skips the sample (default: a reply without its end teaches the model to stop mid-sentence),
``truncate`` keeps the partial turn."""

REASON_NO_TRAINABLE = "truncated_no_trainable_tokens"
"""Skip reason: after the cut no target token is trainable any more."""
REASON_VIDEO_TOO_LONG = "video_too_long"
"""Skip reason: with every video thinned to its fewest groups the cut still falls inside one (a video is never cut)."""
REASON_FINAL_TURN = "truncated_final_turn"
"""Skip reason (policy ``drop``): the cut fell inside the last kept trainable turn, losing its closing token."""


def image_blocks(mm: MultiModalData | None) -> list[tuple[int, int]]:
    """``[start, end)`` token spans of each image block, ``<|vision_start|>`` through ``<|vision_end|>`` inclusive."""
    if mm is None:
        return []
    return [(r.offset - 1, r.end + 1) for r in mm.placeholders]


def safe_cut(num_tokens: int, keep: int, blocks: list[tuple[int, int]]) -> int:
    """The number of tokens to keep: ``min(num_tokens, keep)`` moved back so that no image block is split.

    A block ``[s, e)`` is split when ``s < cut < e``; the cut then becomes ``s`` (the block is dropped whole,
    ``<|vision_start|>`` included). Blocks are disjoint, so at most one can contain the cut.
    """
    cut = min(num_tokens, keep)
    for start, end in blocks:
        if start < cut < end:
            return start
    return cut


def slice_multimodal(mm: MultiModalData | None, num_items: int) -> MultiModalData | None:
    """The first ``num_items`` vision items of ``mm`` (pixel rows, grid rows, placeholders and hashes together); a
    video is kept or dropped whole (``truncate_sample`` refuses a cut inside one)."""
    if mm is None or num_items == 0:
        return None
    if num_items == mm.num_items:
        return mm
    rows = int(mm.image_grid_thw[:num_items].prod(-1).sum())
    videos = tuple(
        dataclasses.replace(
            v,
            num_groups=min(v.num_groups, num_items - v.first_item),
            timestamps=v.timestamps[: num_items - v.first_item],
        )
        for v in mm.videos
        if v.first_item < num_items
    )
    return MultiModalData(
        pixel_values=mm.pixel_values[:rows],
        image_grid_thw=mm.image_grid_thw[:num_items],
        placeholders=mm.placeholders[:num_items],
        image_hashes=mm.image_hashes[:num_items],
        videos=videos,
    )


def truncate_sample(sample: RenderedSample, seq_len: int, *, policy: TruncationPolicy = "drop") -> RenderedSample:
    """Cut ``sample`` so that it yields at most ``seq_len`` inputs after the causal shift (keeps <= seq_len + 1 tokens).

    Returns the sample unchanged when it already fits. Raises ``SkipSample`` (naming the sample) when the kept part
    has no trainable target (``truncated_no_trainable_tokens``), or, with ``policy="drop"``, when the cut falls
    inside the final kept trainable span so that its closing token is lost (``truncated_final_turn``). A trainable
    span is a maximal run of True in the loss mask; it "continues past the cut" when the last kept token and the
    first dropped one are both trainable.
    """
    if seq_len < 1:
        raise ValueError(f"seq_len={seq_len}: must be >= 1 (it counts model inputs after the causal shift)")
    if policy not in ("drop", "truncate"):
        raise ValueError(f"truncation policy {policy!r}: use 'drop' or 'truncate'")
    n = len(sample)
    keep = seq_len + 1
    if n <= keep:
        return sample
    sample = thin_videos(sample, keep)
    if len(sample) <= keep:
        return sample
    mm = sample.multi_modal_data
    blocks = image_blocks(mm)
    cut = safe_cut(len(sample), keep, blocks)
    where = f"{n} tokens cut to {cut} (seq_len={seq_len})"
    for video in mm.videos if mm is not None else ():
        first, last = mm.placeholders[video.first_item], mm.placeholders[video.items[-1]]
        if first.offset - 1 < cut < last.end + 1:
            raise SkipSample(
                REASON_VIDEO_TOO_LONG,
                f"{where}: a video of {video.num_groups} groups (its fewest) does not fit; lower data.video_max_pixels or "
                "data.video_min_frames, or raise data.seq_len",
                sample_index=sample.sample_index,
            )
    if cut < 2 or not bool(sample.loss_mask[1:cut].any()):
        raise SkipSample(REASON_NO_TRAINABLE, where, sample_index=sample.sample_index)
    if policy == "drop" and bool(sample.loss_mask[cut - 1]) and bool(sample.loss_mask[cut]):
        raise SkipSample(
            REASON_FINAL_TURN,
            f"{where}: the last trainable turn lost its closing token (policy 'drop'; 'truncate' keeps it)",
            sample_index=sample.sample_index,
        )
    kept_images = sum(1 for _, end in blocks if end <= cut)
    return dataclasses.replace(
        sample,
        token_ids=sample.token_ids[:cut],
        loss_mask=sample.loss_mask[:cut],
        mm_token_type_ids=sample.mm_token_type_ids[:cut],
        multi_modal_data=slice_multimodal(mm, kept_images),
        metadata={**sample.metadata, "truncated_from": n},
    )
