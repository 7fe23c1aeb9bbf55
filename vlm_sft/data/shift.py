"""Causal shift of one sample into (input, target) pairs, before packing.

Shifting each sample on its own, before samples share a row, is what makes "no target crosses a sample boundary"
true by construction: the last input of a sample predicts that sample's last token, never the first token of the
next sample in the pack. Per position ``i``: ``input_ids[i] = ids[i]``, ``target_ids[i] = ids[i + 1]``, the loss mask
is the target's (we train on predicting a trainable token), and the modality type is the input's (the vision
features are scattered into input slots).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from renderers.errors import SkipSample
from renderers.types import VIDEO_TOKEN_TYPE, RenderedSample, vision_slots

REASON_TOO_SHORT = "too_short"
"""Skip reason: fewer than 2 tokens, so no (input, target) pair exists."""
REASON_NO_TRAINABLE = "no_trainable_tokens"
"""Skip reason: no target position is trainable."""
REASON_IMAGE_AT_END = "image_run_at_sample_end"
"""Skip reason: a placeholder run reaches the last token, so the shift would cut it (no ``<|vision_end|>`` after it)."""


@dataclass(frozen=True)
class ShiftedSample:
    """One sample after the causal shift: n = T - 1 aligned (input, target) positions plus its vision items (images
    and video groups, ``renderers.types``)."""

    input_ids: torch.Tensor
    """``[n]`` int64 model inputs (``ids[:-1]``)."""
    target_ids: torch.Tensor
    """``[n]`` int64 next-token targets (``ids[1:]``)."""
    loss_mask: torch.Tensor
    """``[n]`` bool; True where the target is trained on (the rendered loss mask of ``ids[1:]``)."""
    mm_token_type_ids: torch.Tensor
    """``[n]`` int64 modality of each input (0 text, 1 image slot, 2 video slot)."""
    pixel_values: torch.Tensor | None
    """``[P, D]`` patch rows of the items whose placeholders lie in the inputs, or None without any."""
    image_grid_thw: torch.Tensor | None
    """``[N, 3]`` int64 patch grid per item, in placeholder order, or None without any."""
    sample_index: int
    """Row index in the source dataset: packs record it, and a resumed pipeline re-renders the sample from it."""
    num_videos: int = 0
    """Videos among the items (the data report counts them)."""
    num_video_groups: int = 0
    """Items that are video groups."""

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_images(self) -> int:
        items = 0 if self.image_grid_thw is None else int(self.image_grid_thw.shape[0])
        return items - self.num_video_groups

    @property
    def num_video_tokens(self) -> int:
        """Video slots among the inputs."""
        return int((self.mm_token_type_ids == VIDEO_TOKEN_TYPE).sum()) if self.num_videos else 0

    @property
    def num_patches(self) -> int:
        """Rows of ``pixel_values``: what this sample costs the vision tower."""
        return 0 if self.pixel_values is None else int(self.pixel_values.shape[0])

    @property
    def num_trainable_tokens(self) -> int:
        return int(self.loss_mask.sum())


def shift_sample(sample: RenderedSample) -> ShiftedSample:
    """Shift ``sample`` by one token. Raises ``SkipSample`` when no trainable (input, target) pair remains.

    Every placeholder run must end before the last token (the renderer always puts ``<|vision_end|>`` after a run,
    and truncation never keeps a partial block), so the images travel unchanged.
    """
    n = len(sample)
    if n < 2:
        raise SkipSample(REASON_TOO_SHORT, f"{n} token(s)", sample_index=sample.sample_index)
    loss_mask = sample.loss_mask[1:]
    if not bool(loss_mask.any()):
        raise SkipSample(REASON_NO_TRAINABLE, f"{n} tokens, none trained as a target", sample_index=sample.sample_index)
    mm = sample.multi_modal_data
    if mm is not None and mm.num_items and mm.placeholders[-1].end > n - 1:
        raise SkipSample(
            REASON_IMAGE_AT_END,
            f"placeholder run ends at token {mm.placeholders[-1].end} of {n}: no <|vision_end|> after it",
            sample_index=sample.sample_index,
        )
    types = sample.mm_token_type_ids[:-1]
    has_images = mm is not None and mm.num_items > 0
    if has_images:
        assert int(vision_slots(types).sum()) == sum(r.length for r in mm.placeholders)
    return ShiftedSample(
        input_ids=sample.token_ids[:-1],
        target_ids=sample.token_ids[1:],
        loss_mask=loss_mask,
        mm_token_type_ids=types,
        pixel_values=mm.pixel_values if has_images else None,
        image_grid_thw=mm.image_grid_thw if has_images else None,
        sample_index=sample.sample_index,
        num_videos=mm.num_videos if has_images else 0,
        num_video_groups=sum(v.num_groups for v in mm.videos) if has_images else 0,
    )
