"""Typed contracts between the renderer and the data pipeline.

A renderer turns one conversation into exactly the tokens the model trains on. Everything downstream
(truncation, shifting, packing, collation) works on these values and never re-tokenizes, so the
alignment between token ids, loss mask, modality types and image tensors is decided once, here.

Legend for shapes: T = tokens in the sample, P = image patches (rows of ``pixel_values``),
D = C * temporal_patch * patch * patch values per patch row, N = images in the sample.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

TEXT_TOKEN_TYPE = 0
"""``mm_token_type_ids`` value of a text token (also padding)."""
IMAGE_TOKEN_TYPE = 1
"""``mm_token_type_ids`` value of an ``<|image_pad|>`` slot that receives one merged vision feature."""
VIDEO_TOKEN_TYPE = 2
"""Reserved for video slots; video input is rejected for now."""


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
class MultiModalData:
    """The image tensors of one sample, in the order their placeholders appear in the tokens."""

    pixel_values: torch.Tensor
    """``[P, D]`` float32 patch rows, as the Qwen2-VL image processor flattens them; images concatenated."""
    image_grid_thw: torch.Tensor
    """``[N, 3]`` int64 (temporal, height, width) patch grid per image; ``P == image_grid_thw.prod(-1).sum()``."""
    placeholders: tuple[PlaceholderRange, ...]
    """One range per image, ascending offsets; ``len == N``."""
    image_hashes: tuple[str, ...] = ()
    """Content hash per image (hex), for caching and for finding duplicate images across a dataset."""

    @property
    def num_images(self) -> int:
        return int(self.image_grid_thw.shape[0])

    @property
    def num_patches(self) -> int:
        return int(self.pixel_values.shape[0])

    def patches_per_image(self) -> list[int]:
        """Rows of ``pixel_values`` that belong to each image, in order."""
        return [int(n) for n in self.image_grid_thw.prod(-1).tolist()]


@dataclass(frozen=True)
class RenderedSample:
    """One conversation rendered to training tokens. All per-token tensors have the same length T."""

    token_ids: torch.Tensor
    """``[T]`` int64 token ids, exactly as the chat template tokenizes the conversation."""
    loss_mask: torch.Tensor
    """``[T]`` bool; True where the token is a training target (assistant content and its ``<|im_end|>``)."""
    mm_token_type_ids: torch.Tensor
    """``[T]`` int64; 0 text, 1 image slot (see ``TEXT_TOKEN_TYPE`` / ``IMAGE_TOKEN_TYPE``)."""
    multi_modal_data: MultiModalData | None = None
    """Image tensors and placeholder ranges, or None for a text-only sample."""
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
    def num_trainable_tokens(self) -> int:
        return int(self.loss_mask.sum())

    def check(self, merge_size: int = 2) -> None:
        """Assert the internal invariants of a sample (for tests and debug builds; raises AssertionError)."""
        n = len(self)
        assert self.loss_mask.shape == (n,) and self.mm_token_type_ids.shape == (n,), "per-token lengths differ"
        assert self.token_ids.dtype == torch.long and self.mm_token_type_ids.dtype == torch.long
        assert self.loss_mask.dtype == torch.bool
        image_slots = int((self.mm_token_type_ids == IMAGE_TOKEN_TYPE).sum())
        mm = self.multi_modal_data
        if mm is None:
            assert image_slots == 0, "image slots without image data"
            return
        assert mm.num_patches == int(mm.image_grid_thw.prod(-1).sum()), "pixel rows != sum(prod(grid))"
        assert len(mm.placeholders) == mm.num_images
        expected = [p // merge_size**2 for p in mm.patches_per_image()]
        assert [r.length for r in mm.placeholders] == expected, "placeholder lengths != prod(grid) // merge**2"
        assert image_slots == sum(expected)
        for r in mm.placeholders:
            assert bool((self.mm_token_type_ids[r.offset : r.end] == IMAGE_TOKEN_TYPE).all())
            assert not bool(self.loss_mask[r.offset : r.end].any()), "image slots must never be trained"
