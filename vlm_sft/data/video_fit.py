"""Thin the videos of a sample that is too long: whole temporal groups dropped evenly, each kept group with its own
true timestamp, down to each video's ``min_groups``.

A video's prompt is, per group, ``<{t:.1f} seconds>`` + ``<|vision_start|>`` + pads + ``<|vision_end|>``, with
nothing between one group and the next, so a group after the first is exactly the tokens from the end of the group
before it through its own ``<|vision_end|>``. Dropping it removes those tokens, its pixel rows and its grid row; the
groups kept are the ones ``linspace`` picks over the video (the first and the last always), so the clip still spans
its whole length. The timestamps are special-token separated text, so the kept tokens are what the tokenizer gives
for the thinned prompt. Frame sizes stay as sampled for the whole clip.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import torch

from renderers.types import MultiModalData, PlaceholderRange, RenderedSample, VideoSpan


def kept_groups(num_groups: int, keep: int) -> list[int]:
    """Indices of ``keep`` groups of ``num_groups`` spread evenly, the first and the last included."""
    if keep >= num_groups:
        return list(range(num_groups))
    return sorted({int(i) for i in np.linspace(0, num_groups - 1, keep).round()})


def _group_tokens(mm: MultiModalData, video: VideoSpan) -> list[int]:
    """Tokens each group of ``video`` takes; a group after the first counts its timestamp text too."""
    places = mm.placeholders
    sizes = [places[video.first_item].length + 2]
    for item in video.items[1:]:
        sizes.append(places[item].end - places[item - 1].end)
    return sizes


def _plan(mm: MultiModalData, excess: int) -> list[list[int]] | None:
    """Groups to keep per video, the most of each (the same share of every video) that removes ``excess`` tokens;
    None when nothing needs to go or the videos at their minimum still leave the sample too long."""
    sizes = [_group_tokens(mm, v) for v in mm.videos]
    most = max(v.num_groups for v in mm.videos)
    for step in range(most - 1, -1, -1):
        plan = [kept_groups(v.num_groups, max(v.min_groups, math.ceil(v.num_groups * step / most))) for v in mm.videos]
        saved = sum(sum(s) - sum(s[g] for g in keep) for s, keep in zip(sizes, plan, strict=True))
        if saved >= excess:
            return plan
    return None


def thin_videos(sample: RenderedSample, max_tokens: int) -> RenderedSample:
    """``sample`` with its videos thinned evenly (module docstring) until it has at most ``max_tokens`` tokens; the
    sample unchanged when it fits already, has no video, or cannot fit with every video at its ``min_groups`` (the
    caller's truncation then decides)."""
    mm = sample.multi_modal_data
    excess = len(sample) - max_tokens
    if mm is None or not mm.videos or excess <= 0:
        return sample
    plan = _plan(mm, excess)
    if plan is None:
        return sample
    keep_token = np.ones(len(sample), dtype=bool)
    dropped_items: set[int] = set()
    for video, keep in zip(mm.videos, plan, strict=True):
        for g in set(range(video.num_groups)) - set(keep):
            item = video.first_item + g
            keep_token[mm.placeholders[item - 1].end + 1 : mm.placeholders[item].end + 1] = False
            dropped_items.add(item)
    kept = torch.from_numpy(keep_token)
    return dataclasses.replace(
        sample,
        token_ids=sample.token_ids[kept],
        loss_mask=sample.loss_mask[kept],
        mm_token_type_ids=sample.mm_token_type_ids[kept],
        multi_modal_data=_without_items(mm, dropped_items, keep_token, plan),
        metadata={**sample.metadata, "video_groups_dropped": len(dropped_items)},
    )


def _without_items(
    mm: MultiModalData, dropped: set[int], keep_token: np.ndarray, plan: list[list[int]]
) -> MultiModalData:
    """``mm`` without the ``dropped`` items; placeholders moved to the kept tokens, spans renumbered."""
    rows = mm.image_grid_thw.prod(-1).tolist()
    starts = np.concatenate([[0], np.cumsum(rows)])
    kept_items = [i for i in range(mm.num_items) if i not in dropped]
    removed_before = np.concatenate([[0], np.cumsum(~keep_token)])
    new_index = {item: n for n, item in enumerate(kept_items)}
    videos = tuple(
        dataclasses.replace(
            v,
            first_item=new_index[v.first_item],
            num_groups=len(keep),
            timestamps=tuple(v.timestamps[g] for g in keep),
        )
        for v, keep in zip(mm.videos, plan, strict=True)
    )
    return MultiModalData(
        pixel_values=torch.cat([mm.pixel_values[starts[i] : starts[i + 1]] for i in kept_items]),
        image_grid_thw=mm.image_grid_thw[kept_items],
        placeholders=tuple(
            PlaceholderRange(p.offset - int(removed_before[p.offset]), p.length)
            for i, p in enumerate(mm.placeholders)
            if i not in dropped
        ),
        image_hashes=tuple(h for i, h in enumerate(mm.image_hashes) if i not in dropped),
        videos=videos,
    )
