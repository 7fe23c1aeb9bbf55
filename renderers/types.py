"""Typed contracts between the renderer and the data pipeline.

A renderer turns one conversation into exactly the tokens the model trains on. Everything downstream
(truncation, shifting, packing, collation) works on these values and never re-tokenizes, so the
alignment between token ids, loss mask, modality types and image tensors is decided once, here.

Legend for shapes: T = tokens in the sample, P = patch rows of ``pixel_values``, D = C * temporal_patch * patch *
patch values per patch row, N = vision items in the sample.

A *vision item* is what one run of placeholders receives: an image, or one temporal group (two frames) of a video.
transformers' ``get_rope_index`` splits every video into groups with t = 1, each between its own
``<|vision_start|>`` / ``<|vision_end|>`` after a timestamp, and the vision tower encodes a video frame by frame, so
a group is, to positions, packing and the tower, exactly an image whose two temporal frames differ. Everything
after the renderer handles items; only the slot type (1 or 2) and ``MultiModalData.videos`` tell them apart.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

TEXT_TOKEN_TYPE = 0
"""``mm_token_type_ids`` value of a text token (also padding)."""
IMAGE_TOKEN_TYPE = 1
"""``mm_token_type_ids`` value of an ``<|image_pad|>`` slot that receives one merged vision feature."""
VIDEO_TOKEN_TYPE = 2
"""``mm_token_type_ids`` value of a ``<|video_pad|>`` slot: one merged feature of a video group."""
VISION_TOKEN_TYPES = (IMAGE_TOKEN_TYPE, VIDEO_TOKEN_TYPE)
"""The slot types that receive a vision feature (every type but text)."""


def vision_slots(mm_token_type_ids: torch.Tensor) -> torch.Tensor:
    """Bool mask of the tokens that receive a vision feature (image or video slots)."""
    return mm_token_type_ids != TEXT_TOKEN_TYPE


@dataclass(frozen=True)
class PlaceholderRange:
    """Where one image's run of ``<|image_pad|>`` tokens sits in a sample."""

    offset: int
    """Index of the first ``<|image_pad|>`` token of the run (the token after ``<|vision_start|>``)."""
    length: int
    """Number of ``<|image_pad|>`` tokens: ``prod(image_grid_thw[i]) // merge_size**2``."""

    @property
    def end(self) -> int:
        """One past the last placeholder token (the index of ``<|vision_end|>``)."""
        return self.offset + self.length


@dataclass(frozen=True)
class VideoSpan:
    """Which vision items of a sample are the groups of one video, and what the renderer wrote for them."""

    first_item: int
    """Index of the video's first group among the sample's vision items."""
    num_groups: int
    """Temporal groups kept (the video processor's ``grid_t``); items ``first_item .. first_item + num_groups - 1``."""
    timestamps: tuple[float, ...]
    """Seconds of each group in the source video (the mean of its two frames' times), as the prompt states them."""
    content_hash: str = ""
    """Content hash of the video source (hex)."""
    min_groups: int = 1
    """Fewest groups the data path may thin the video to when its sample is too long (``min_frames`` over the
    temporal patch, never more than it has)."""

    @property
    def items(self) -> range:
        return range(self.first_item, self.first_item + self.num_groups)


@dataclass(frozen=True)
class MultiModalData:
    """The vision tensors of one sample: images and video groups (items), in the order their placeholders appear."""

    pixel_values: torch.Tensor
    """``[P, D]`` float32 patch rows, as the Qwen-VL image and video processors flatten them; items concatenated."""
    image_grid_thw: torch.Tensor
    """``[N, 3]`` int64 (temporal, height, width) patch grid per item (a video group's t is 1);
    ``P == image_grid_thw.prod(-1).sum()``."""
    placeholders: tuple[PlaceholderRange, ...]
    """One range per item, ascending offsets; ``len == N``."""
    image_hashes: tuple[str, ...] = ()
    """Content hash per item (hex; a video group's is its video's hash and group index), for caching and for
    finding duplicates across a dataset."""
    videos: tuple[VideoSpan, ...] = ()
    """The videos among the items, in order (empty without video)."""

    @property
    def num_items(self) -> int:
        """Images plus video groups: rows of ``image_grid_thw``."""
        return int(self.image_grid_thw.shape[0])

    @property
    def num_images(self) -> int:
        return self.num_items - sum(v.num_groups for v in self.videos)

    @property
    def num_videos(self) -> int:
        return len(self.videos)

    def item_types(self) -> list[int]:
        """``IMAGE_TOKEN_TYPE`` or ``VIDEO_TOKEN_TYPE`` per item."""
        types = [IMAGE_TOKEN_TYPE] * self.num_items
        for video in self.videos:
            for item in video.items:
                types[item] = VIDEO_TOKEN_TYPE
        return types

    @property
    def num_patches(self) -> int:
        return int(self.pixel_values.shape[0])

    def patches_per_image(self) -> list[int]:
        """Rows of ``pixel_values`` that belong to each item, in order."""
        return [int(n) for n in self.image_grid_thw.prod(-1).tolist()]


@dataclass(frozen=True)
class RenderedSample:
    """One conversation rendered to training tokens. All per-token tensors have the same length T."""

    token_ids: torch.Tensor
    """``[T]`` int64 token ids, exactly as the chat template tokenizes the conversation."""
    loss_mask: torch.Tensor
    """``[T]`` bool; True where the token is a training target (assistant content and its ``<|im_end|>``)."""
    mm_token_type_ids: torch.Tensor
    """``[T]`` int64; 0 text, 1 image slot, 2 video slot (``TEXT_TOKEN_TYPE`` / ``IMAGE_TOKEN_TYPE`` /
    ``VIDEO_TOKEN_TYPE``)."""
    multi_modal_data: MultiModalData | None = None
    """Vision tensors and placeholder ranges, or None for a text-only sample."""
    sample_index: int = -1
    """Row index in the source dataset, carried through packing for error reports and accounting (-1: unknown)."""
    metadata: dict = field(default_factory=dict, compare=False)
    """Free-form notes (e.g. the escaped special-token strings); never read by the model path."""

    def __len__(self) -> int:
        return int(self.token_ids.shape[0])

    @property
    def num_images(self) -> int:
        return 0 if self.multi_modal_data is None else self.multi_modal_data.num_images

    @property
    def num_videos(self) -> int:
        return 0 if self.multi_modal_data is None else self.multi_modal_data.num_videos

    @property
    def num_trainable_tokens(self) -> int:
        return int(self.loss_mask.sum())

    def check(self, merge_size: int = 2) -> None:
        """Assert the internal invariants of a sample (for tests and debug builds; raises AssertionError)."""
        n = len(self)
        assert self.loss_mask.shape == (n,) and self.mm_token_type_ids.shape == (n,), "per-token lengths differ"
        assert self.token_ids.dtype == torch.long and self.mm_token_type_ids.dtype == torch.long
        assert self.loss_mask.dtype == torch.bool
        slots = int(vision_slots(self.mm_token_type_ids).sum())
        mm = self.multi_modal_data
        if mm is None:
            assert slots == 0, "vision slots without vision data"
            return
        assert mm.num_patches == int(mm.image_grid_thw.prod(-1).sum()), "pixel rows != sum(prod(grid))"
        assert len(mm.placeholders) == mm.num_items
        expected = [p // merge_size**2 for p in mm.patches_per_image()]
        assert [r.length for r in mm.placeholders] == expected, "placeholder lengths != prod(grid) // merge**2"
        assert slots == sum(expected)
        for r, kind in zip(mm.placeholders, mm.item_types(), strict=True):
            assert bool((self.mm_token_type_ids[r.offset : r.end] == kind).all())
            assert not bool(self.loss_mask[r.offset : r.end].any()), "vision slots must never be trained"
