"""Process each distinct image once: a bounded LRU of image-processor outputs keyed by content hash.

SFT datasets repeat images (several questions about one picture, a fixed pool cycled for many epochs), and the
image processor (resize, normalize, patchify) is the most expensive part of rendering. The key is a hash of the
encoded file bytes, so a hit skips decoding too; a decoded PIL source is hashed on its pixels. The cache is per
renderer (so per processor settings) and per dataloader worker process; it is bounded by entries and by bytes.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from renderers.errors import RenderError
from renderers.images import content_hash, load_raw, read_image_source

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ProcessedImage:
    """The image processor's output for one image."""

    pixel_values: torch.Tensor
    """``[P, D]`` float32 patch rows (P = t * h * w of the grid). Shared by cache hits: never modify in place."""
    grid_thw: tuple[int, int, int]
    """(temporal, height, width) patch grid."""
    content_hash: str
    """Hex blake2b of the encoded bytes (or of the decoded pixels for in-memory images)."""

    @property
    def num_patches(self) -> int:
        t, h, w = self.grid_thw
        return t * h * w

    @property
    def nbytes(self) -> int:
        return self.pixel_values.element_size() * self.pixel_values.nelement()


class ImageCache:
    """A least-recently-used map ``content hash -> ProcessedImage``, bounded by entry count and by tensor bytes."""

    def __init__(self, max_items: int = 2048, max_bytes: int = 512 * 2**20) -> None:
        if max_items < 0 or max_bytes < 0:
            raise ValueError(f"cache bounds must be >= 0, got max_items={max_items}, max_bytes={max_bytes}")
        self.max_items = max_items
        """Most entries kept (0 disables the cache)."""
        self.max_bytes = max_bytes
        """Most bytes of ``pixel_values`` kept."""
        self._entries: OrderedDict[str, ProcessedImage] = OrderedDict()
        self.nbytes = 0
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def get(self, key: str) -> ProcessedImage | None:
        entry = self._entries.get(key)
        if entry is None:
            self.misses += 1
            return None
        self._entries.move_to_end(key)
        self.hits += 1
        return entry

    def put(self, key: str, value: ProcessedImage) -> None:
        if self.max_items == 0 or value.nbytes > self.max_bytes:
            return
        old = self._entries.pop(key, None)
        if old is not None:
            self.nbytes -= old.nbytes
        self._entries[key] = value
        self.nbytes += value.nbytes
        while len(self._entries) > self.max_items or self.nbytes > self.max_bytes:
            _, evicted = self._entries.popitem(last=False)
            self.nbytes -= evicted.nbytes

    def clear(self) -> None:
        self._entries.clear()
        self.nbytes = 0


class CachedImageProcessor:
    """Load, check and process one image source, going through an ``ImageCache``."""

    def __init__(self, image_processor: Any, cache: ImageCache | None = None, *, max_pixels: int | None = None):
        self.image_processor = image_processor
        """A Qwen2-VL style image processor (``merge_size``, returns ``pixel_values`` + ``image_grid_thw``)."""
        self.cache = cache if cache is not None else ImageCache()
        self.max_pixels = max_pixels
        """Decompression-bomb limit in pixels (None: PIL's ``Image.MAX_IMAGE_PIXELS``)."""

    @property
    def merge_size(self) -> int:
        return int(self.image_processor.merge_size)

    def process(self, source: Any, key: str = "image") -> ProcessedImage:
        """The processed image for a source; raises ``RenderError`` for sources that cannot be used."""
        raw = read_image_source(source, key)
        digest = content_hash(raw)
        hit = self.cache.get(digest)
        if hit is not None:
            return hit
        image = load_raw(raw, max_pixels=self.max_pixels)
        pixel_values, grid = self._run(image, raw.origin)
        processed = ProcessedImage(pixel_values=pixel_values, grid_thw=grid, content_hash=digest)
        self.cache.put(digest, processed)
        return processed

    def _run(self, image: Any, origin: str) -> tuple[torch.Tensor, tuple[int, int, int]]:
        try:
            out = self.image_processor(images=[image], return_tensors=None)
        except ValueError as e:
            # smart_resize refuses aspect ratios above 200:1; other ValueErrors are just as image-specific.
            reason = "bad_aspect_ratio" if "aspect ratio" in str(e) else "image_processing_failed"
            raise RenderError(reason, f"{origin} ({image.width}x{image.height}): {e}") from e
        pixel_values = torch.from_numpy(np.ascontiguousarray(out["pixel_values"], dtype=np.float32))
        grid = tuple(int(v) for v in np.asarray(out["image_grid_thw"]).reshape(-1, 3)[0])
        assert pixel_values.shape[0] == grid[0] * grid[1] * grid[2], "image processor rows != prod(grid)"
        return pixel_values, grid  # type: ignore[return-value]
