"""A conversation's images and videos as the renderer's vision items (``renderers.types``), and the video prompt text.

transformers 5.25's ``Qwen3VLProcessor`` writes a video as one ``<{t:.1f} seconds>`` timestamp plus
``<|vision_start|>`` + pads + ``<|vision_end|>`` per temporal group, and first collapses the chat template's own
``<|vision_start|><|video_pad|><|vision_end|>`` wrapper into the bare pad, so no outer pair remains (4.57 kept one;
see ``tests/test_video_processor.py``). ``expand_video_wrappers`` makes that replacement on the rendered text with
one pad per group; the renderer then widens each pad to its group's merged-token count, as it does for images.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from renderers.errors import RenderError
from renderers.image_cache import ProcessedImage
from renderers.types import IMAGE_TOKEN_TYPE, VIDEO_TOKEN_TYPE, MultiModalData, VideoSpan
from renderers.video import ProcessedVideo

VIDEO_WRAPPER = "<|vision_start|><|video_pad|><|vision_end|>"
"""What the chat template renders for a video block (the pad stands for the whole video)."""
_WRAPPER_RE = re.compile(re.escape(VIDEO_WRAPPER))


def group_text(timestamp: float) -> str:
    """One temporal group's prompt text before its pads are widened (``Qwen3VLProcessor.replace_video_token``)."""
    return f"<{timestamp:.1f} seconds><|vision_start|><|video_pad|><|vision_end|>"


def expand_video_wrappers(
    text: str, spans: Sequence[Sequence[int]], videos: Sequence[ProcessedVideo]
) -> tuple[str, list[list[int]]]:
    """``text`` with each video's template wrapper replaced by its groups' text, and ``spans`` (character ranges of
    ``text``) moved to match. Raises ``RenderError`` when the wrappers and the videos differ in number."""
    found = [m.start() for m in _WRAPPER_RE.finditer(text)]
    if len(found) != len(videos):
        raise RenderError(
            "video_count_mismatch", f"the template rendered {len(found)} video slots for {len(videos)} videos"
        )
    if not videos:
        return text, [list(s) for s in spans]
    pieces, deltas, last = [], [], 0
    for start, video in zip(found, videos, strict=True):
        replacement = "".join(group_text(t) for t in video.timestamps)
        pieces += [text[last:start], replacement]
        deltas.append((start, len(replacement) - len(VIDEO_WRAPPER)))
        last = start + len(VIDEO_WRAPPER)
    pieces.append(text[last:])

    def moved(position: int) -> int:
        return position + sum(delta for start, delta in deltas if start < position)

    return "".join(pieces), [[moved(a), moved(b)] for a, b in spans]


@dataclass(frozen=True)
class VisionItems:
    """The vision items of one sample in slot order, ready for ``MultiModalData``."""

    pixel_values: list[np.ndarray]
    """``[rows, D]`` float32 patch rows per item."""
    grids: list[tuple[int, int, int]]
    """(t, h, w) per item; a video group's t is 1."""
    hashes: list[str]
    """Content hash per item (a group's: its video's hash and ``#g<index>``)."""
    kinds: list[int]
    """``IMAGE_TOKEN_TYPE`` or ``VIDEO_TOKEN_TYPE`` per item."""
    videos: tuple[VideoSpan, ...]
    """Which items are which video's groups."""


def vision_items(processed: Sequence[ProcessedImage | ProcessedVideo], video_min_groups: int = 1) -> VisionItems:
    """Images stay one item each; a video becomes one item per temporal group (its rows are group-major).
    ``video_min_groups``: the fewest groups a too-long sample's video may be thinned to (``VideoSpan.min_groups``)."""
    pixels, grids, hashes, kinds, videos = [], [], [], [], []
    for p in processed:
        if isinstance(p, ProcessedImage):
            pixels.append(p.pixel_values.numpy())
            grids.append(tuple(p.grid_thw))
            hashes.append(p.content_hash)
            kinds.append(IMAGE_TOKEN_TYPE)
            continue
        t, h, w = p.grid_thw
        rows = p.pixel_values.numpy() if isinstance(p.pixel_values, torch.Tensor) else np.asarray(p.pixel_values)
        videos.append(VideoSpan(len(grids), t, tuple(p.timestamps), p.content_hash, min(video_min_groups, t)))
        for g in range(t):
            pixels.append(rows[g * h * w : (g + 1) * h * w])
            grids.append((1, h, w))
            hashes.append(f"{p.content_hash}#g{g}")
            kinds.append(VIDEO_TOKEN_TYPE)
    return VisionItems(pixels, grids, hashes, kinds, tuple(videos))


def transformers_inputs(mm: MultiModalData) -> dict[str, torch.Tensor]:
    """The vision inputs transformers' Qwen3.5 takes for ``mm``: ``pixel_values`` / ``image_grid_thw`` of the images
    and ``pixel_values_videos`` / ``video_grid_thw`` (one (T, h, w) row per video) of the videos, each present only
    when the sample has some (what ``Qwen3VLProcessor`` returns for the same conversation)."""
    kinds = mm.item_types()
    rows = torch.split(mm.pixel_values, mm.patches_per_image())
    out: dict[str, torch.Tensor] = {}
    images = [i for i, k in enumerate(kinds) if k == IMAGE_TOKEN_TYPE]
    if images:
        out["pixel_values"] = torch.cat([rows[i] for i in images])
        out["image_grid_thw"] = mm.image_grid_thw[images]
    if mm.videos:
        out["pixel_values_videos"] = torch.cat([rows[i] for v in mm.videos for i in v.items])
        out["video_grid_thw"] = torch.tensor(
            [[v.num_groups, *mm.image_grid_thw[v.first_item, 1:].tolist()] for v in mm.videos], dtype=torch.long
        )
    return out
