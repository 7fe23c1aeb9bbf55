"""Synthetic ``RenderedSample`` generators for tests and benchmarks (no tokenizer, no images on disk).

Samples are built from a list of spans: text (random regular token ids, or given ids) and images
(``<|vision_start|>`` + ``prod(grid) // 4`` x ``<|image_pad|>`` + ``<|vision_end|>`` with random ``pixel_values``
rows), with the tiny tokenizer's special-token ids, so they satisfy the renderer's contract (``RenderedSample.check``).

Distributions:
- ``long_tail``: shaped like real VLM SFT data: chat turns, lengths log-normal (median 700) clipped to 50..8192,
  0-4 images of 4..40 patches a side (4..400 tokens each), trained assistant replies ending in ``<|im_end|>``.
- ``short``: shaped like the embedded shapes task: one exchange of 38-46 tokens with 0-2 images of 4 tokens.
Every sample is a pure function of ``(seed, index)``, so a pipeline can re-render any index (resume).
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from processors.special_tokens import (
    EOS_TOKEN,
    IMAGE_TOKEN,
    TINY_REGULAR_VOCAB_SIZE,
    VISION_END_TOKEN,
    VISION_START_TOKEN,
    tiny_token_id,
)
from renderers.types import IMAGE_TOKEN_TYPE, MultiModalData, PlaceholderRange, RenderedSample

VISION_START_ID = tiny_token_id(VISION_START_TOKEN)
VISION_END_ID = tiny_token_id(VISION_END_TOKEN)
IMAGE_PAD_ID = tiny_token_id(IMAGE_TOKEN)
IM_START_ID = tiny_token_id("<|im_start|>")
IM_END_ID = tiny_token_id(EOS_TOKEN)
PIXEL_DIM = 3 * 2 * 16 * 16
"""Values per patch row of the Qwen3.5 image processor (channels x temporal patch x patch x patch) = 1536."""

Distribution = Literal["long_tail", "short"]


@dataclass(frozen=True)
class TextSpan:
    """A run of text tokens."""

    length: int
    """Number of tokens."""
    trainable: bool = False
    """Whether these tokens are loss targets."""
    ids: tuple[int, ...] | None = None
    """Explicit token ids (``len == length``); None draws random regular-vocabulary ids."""


@dataclass(frozen=True)
class ImageSpan:
    """One image block: ``<|vision_start|>`` + placeholder run + ``<|vision_end|>``, never trained."""

    grid_h: int
    """Patch rows (even, so the 2x2 merge divides it)."""
    grid_w: int
    """Patch columns (even)."""
    grid_t: int = 1
    """Temporal patches (1 for a still image)."""


Span = TextSpan | ImageSpan


def compose_sample(
    spans: Sequence[Span], *, sample_index: int = -1, seed: int = 0, pixel_dim: int = PIXEL_DIM, merge_size: int = 2
) -> RenderedSample:
    """A ``RenderedSample`` from ``spans``; random ids and pixels are drawn from ``(seed, sample_index)``."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + sample_index + 7)
    ids, loss, types, pixels, grids, places = [], [], [], [], [], []
    pos = 0
    for span in spans:
        if isinstance(span, TextSpan):
            if span.ids is not None:
                assert len(span.ids) == span.length
                t = torch.tensor(span.ids, dtype=torch.long)
            else:
                t = torch.randint(0, TINY_REGULAR_VOCAB_SIZE, (span.length,), generator=gen)
            ids.append(t)
            loss.append(torch.full((span.length,), span.trainable, dtype=torch.bool))
            types.append(torch.zeros(span.length, dtype=torch.long))
            pos += span.length
            continue
        assert span.grid_h % merge_size == 0 and span.grid_w % merge_size == 0, "grid sides must be merge multiples"
        rows = span.grid_t * span.grid_h * span.grid_w
        n = rows // merge_size**2
        ids.append(torch.tensor([VISION_START_ID] + [IMAGE_PAD_ID] * n + [VISION_END_ID]))
        loss.append(torch.zeros(n + 2, dtype=torch.bool))
        types.append(torch.tensor([0] + [IMAGE_TOKEN_TYPE] * n + [0]))
        places.append(PlaceholderRange(offset=pos + 1, length=n))
        pixels.append(torch.randn(rows, pixel_dim, generator=gen))
        grids.append([span.grid_t, span.grid_h, span.grid_w])
        pos += n + 2
    mm = None
    if places:
        mm = MultiModalData(
            pixel_values=torch.cat(pixels),
            image_grid_thw=torch.tensor(grids, dtype=torch.long),
            placeholders=tuple(places),
            image_hashes=tuple(f"synthetic-{seed}-{sample_index}-{k}" for k in range(len(places))),
        )

    def cat(parts: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        return torch.cat(parts).to(dtype) if parts else torch.zeros(0, dtype=dtype)

    return RenderedSample(
        token_ids=cat(ids, torch.long),
        loss_mask=cat(loss, torch.bool),
        mm_token_type_ids=cat(types, torch.long),
        multi_modal_data=mm,
        sample_index=sample_index,
    )


def random_spans(rng: random.Random, *, max_tokens: int, max_images: int = 3, max_grid: int = 8) -> list[Span]:
    """Arbitrary spans for property tests: about 1..``max_tokens`` tokens, 0..``max_images`` images of even grid
    sides 2..``max_grid`` (1-16 tokens), text-only samples mixed in, images at the very start or end and adjacent
    images (empty text gaps), random trainable runs."""
    n_images = 0 if rng.random() < 0.3 else rng.randint(0, max_images)
    images = [ImageSpan(rng.randrange(2, max_grid + 1, 2), rng.randrange(2, max_grid + 1, 2)) for _ in range(n_images)]
    image_tokens = sum(im.grid_h * im.grid_w // 4 + 2 for im in images)
    text_total = max(rng.randint(1, max_tokens) - image_tokens, 0 if images else 1)
    # n_images + 1 gaps; a gap of 0 puts two images side by side, or an image at the very start / end
    cuts = sorted(rng.randint(0, text_total) for _ in range(n_images))
    gaps = [b - a for a, b in zip([0, *cuts], [*cuts, text_total], strict=True)]
    spans: list[Span] = []
    for k, gap in enumerate(gaps):
        while gap > 0:
            n = rng.randint(1, gap)
            spans.append(TextSpan(n, trainable=rng.random() < 0.5))
            gap -= n
        if k < n_images:
            spans.append(images[k])
    return spans


def _chat_turn(user: int, answer: int, images: Sequence[ImageSpan]) -> list[Span]:
    """``<|im_start|>user\\n`` [images] text ``<|im_end|>\\n<|im_start|>assistant\\n`` reply ``<|im_end|>`` ``\\n``."""
    return [
        TextSpan(1, ids=(IM_START_ID,)),
        TextSpan(2),  # "user\n"
        *images,
        TextSpan(max(user, 1)),
        TextSpan(1, ids=(IM_END_ID,)),
        TextSpan(2),  # "\n<|im_start|>" stands in as two regular ids; only the shape matters here
        TextSpan(2),  # "assistant\n"
        TextSpan(max(answer, 1), trainable=True),
        TextSpan(1, trainable=True, ids=(IM_END_ID,)),
        TextSpan(1),  # "\n"
    ]


TURN_OVERHEAD = 10
"""Tokens of ``_chat_turn`` besides the user text, the reply and the images."""


def long_tail_spans(rng: random.Random, *, max_len: int = 8192, min_len: int = 50) -> list[Span]:
    """One long-tailed chat sample (see the module docstring)."""
    total = int(min(max(rng.lognormvariate(math.log(700), 1.0), min_len), max_len))
    n_images = rng.choices(range(5), weights=[35, 35, 15, 10, 5])[0]
    images: list[ImageSpan] = []
    budget = int(0.7 * total)
    for _ in range(n_images):
        h, w = rng.randrange(4, 41, 2), rng.randrange(4, 41, 2)
        cost = h * w // 4 + 2
        if cost <= budget:
            images.append(ImageSpan(h, w))
            budget -= cost
    text = total - sum(im.grid_h * im.grid_w // 4 + 2 for im in images)
    turns = max(1, min(3, text // 200 + rng.randint(0, 1)))
    spans: list[Span] = []
    for k in range(turns):
        share = (text // turns) - TURN_OVERHEAD
        user = max(1, int(share * rng.uniform(0.15, 0.5)))
        spans += _chat_turn(user, max(1, share - user), images if k == 0 else ())
    return spans


def short_spans(rng: random.Random) -> list[Span]:
    """One shapes-like sample: 38-46 tokens, 0-2 images of grid (1, 4, 4) = 4 tokens each."""
    images = [ImageSpan(4, 4) for _ in range(rng.randint(0, 2))]
    total = rng.randint(38, 46)
    text = total - 6 * len(images) - TURN_OVERHEAD
    answer = rng.randint(4, 8)
    return _chat_turn(text - answer, answer, images)


class SyntheticSource:
    """An indexable synthetic dataset: ``source(index) -> RenderedSample``, usable as a pipeline ``render_fn``."""

    def __init__(
        self, num_samples: int, *, distribution: Distribution = "long_tail", seed: int = 0, pixel_dim: int = PIXEL_DIM
    ) -> None:
        if distribution not in ("long_tail", "short"):
            raise ValueError(f"distribution={distribution!r}: use 'long_tail' or 'short'")
        self.num_samples = num_samples
        self.distribution = distribution
        self.seed = seed
        self.pixel_dim = pixel_dim

    def __len__(self) -> int:
        return self.num_samples

    def spans(self, index: int) -> list[Span]:
        rng = random.Random(self.seed * 1_000_003 + index)
        return long_tail_spans(rng) if self.distribution == "long_tail" else short_spans(rng)

    def __call__(self, index: int) -> RenderedSample:
        if not 0 <= index < self.num_samples:
            raise IndexError(f"index {index} outside 0..{self.num_samples - 1}")
        return compose_sample(self.spans(index), sample_index=index, seed=self.seed, pixel_dim=self.pixel_dim)
