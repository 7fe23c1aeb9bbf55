"""``PackedBatch``: the typed contract between the data pipeline and the model.

The model is called as ``model(**batch.model_kwargs())``, i.e.
``model(input_ids, seq_lens=..., position_ids=..., pixel_values=..., image_grid_thw=..., mm_token_type_ids=...,
target_ids=..., loss_mask=...)``; padded ``stack`` batches pass ``seq_lens=None`` (see ``model_kwargs``).

Legend: B rows, L tokens per row, S segments over the whole batch, P image patch rows, D values per patch row,
N images.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from renderers.types import vision_slots
from vlm_sft.data.mrope import image_token_counts, mrope_position_ids


@dataclass(frozen=True)
class PackedBatch:
    """One micro-batch of packed (or padded) rows, built on the CPU by the collator."""

    input_ids: torch.Tensor
    """``[B, L]`` int64 model inputs; padding is ``<|endoftext|>``."""
    target_ids: torch.Tensor
    """``[B, L]`` int64 next-token targets, shifted per sample (never the next sample's first token)."""
    loss_mask: torch.Tensor
    """``[B, L]`` bool; True where the target is trained on (never on padding or image slots)."""
    position_ids: torch.Tensor
    """``[3, B, L]`` int64 MRoPE (temporal, height, width) positions, restarting at 0 in every segment."""
    seq_lens: torch.Tensor | None
    """``[S]`` int64 segment lengths covering the B*L tokens in row-major order; each row's segments sum to L;
    padding is its own segment; no zero-length segments. None for padded ``stack`` batches. Kept on the CPU by
    ``to()`` and handed to the model as host ints: the model builds its one segment layout (``cu_seqlens`` on the
    device included) from them, without reading anything back from the device."""
    pixel_values: torch.Tensor | None
    """``[P, D]`` float patch rows of every image, in row then pack order; None when the batch has no image."""
    image_grid_thw: torch.Tensor | None
    """``[N, 3]`` int64 patch grid per image, same order; None when the batch has no image."""
    mm_token_type_ids: torch.Tensor
    """``[B, L]`` int64: 1 at image slots, 0 for text and padding."""
    num_trainable_tokens: int
    """``loss_mask.sum()``: the local term of the global loss normalizer."""
    num_real_tokens: int
    """Tokens that belong to a sample (B*L minus padding)."""
    sample_indices: tuple[tuple[int, ...], ...]
    """Dataset indices of the samples in each row, in order (B entries)."""
    attention_mask: torch.Tensor | None = None
    """``[B, L]`` bool, True on real tokens; only for ``stack`` batches (rows are one sample then right padding)."""
    spatial_merge_size: int = 2
    """Vision merge size the positions and token counts were computed with."""

    @property
    def shape(self) -> tuple[int, int]:
        return int(self.input_ids.shape[0]), int(self.input_ids.shape[1])

    @property
    def num_images(self) -> int:
        return 0 if self.image_grid_thw is None else int(self.image_grid_thw.shape[0])

    @property
    def num_patches(self) -> int:
        return 0 if self.pixel_values is None else int(self.pixel_values.shape[0])

    def _map_tensors(self, fn, *, skip: tuple[str, ...] = ()) -> PackedBatch:
        changes = {
            f.name: fn(getattr(self, f.name))
            for f in dataclasses.fields(self)
            if isinstance(getattr(self, f.name), torch.Tensor) and f.name not in skip
        }
        return dataclasses.replace(self, **changes)

    def to(self, device: torch.device | str, non_blocking: bool = True) -> PackedBatch:
        """The same batch on ``device`` (asynchronous copies from pinned memory when ``non_blocking``).

        ``seq_lens`` stays on the CPU: the model reads it as Python ints, and a device copy would cost a host sync
        to read back.
        """
        return self._map_tensors(lambda t: t.to(device, non_blocking=non_blocking), skip=("seq_lens",))

    def pin_memory(self) -> PackedBatch:
        """Page-locked copies for asynchronous host-to-device transfer; unchanged when no accelerator is present.

        ``DataLoader(pin_memory=True)`` calls this on custom batch types.
        """
        if not torch.accelerator.is_available():
            return self
        return self._map_tensors(lambda t: t.pin_memory())

    def model_kwargs(self) -> dict[str, torch.Tensor | None]:
        """Keyword arguments of ``Qwen3_5VLM.forward`` (the contract in the module docstring).

        ``seq_lens`` goes as a tuple of ints: FSDP moves every tensor argument to the GPU before the forward, and
        the model would then have to read the lengths back (a host sync). ``stack`` batches pass ``seq_lens=None``
        (one segment per row): their padding is on the right, after every real token, so causal attention and the
        recurrent layers never let a real token see it, and its loss is masked; ``attention_mask`` is informational.
        """
        return {
            "input_ids": self.input_ids,
            "seq_lens": None if self.seq_lens is None else tuple(self.seq_lens.tolist()),
            "position_ids": self.position_ids,
            "pixel_values": self.pixel_values,
            "image_grid_thw": self.image_grid_thw,
            "mm_token_type_ids": self.mm_token_type_ids,
            "target_ids": self.target_ids,
            "loss_mask": self.loss_mask,
        }

    def segment_lengths(self) -> torch.Tensor:
        """``seq_lens`` for packed batches; for ``stack`` one segment per row plus its padding (as the collator had)."""
        if self.seq_lens is not None:
            return self.seq_lens
        length = self.shape[1]
        real = self.attention_mask.sum(-1)
        segs = torch.stack([real, length - real], dim=1).reshape(-1)
        return segs[segs > 0]

    def real_mask(self) -> torch.Tensor:
        """``[B, L]`` bool on the batch's device, True on tokens that belong to a sample (padding False).

        Rows hold their samples first and padding last, so row ``r``'s real tokens are the sum of its first
        ``len(sample_indices[r])`` segments (``row_segments``); built on the CPU from ``seq_lens`` (no device
        read), then copied.
        """
        if self.attention_mask is not None:
            return self.attention_mask
        rows, length = self.shape
        real = [sum(e - s for s, e, index in self.row_segments(row) if index is not None) for row in range(rows)]
        mask = torch.arange(length)[None, :] < torch.tensor(real)[:, None]
        return mask.to(self.input_ids.device, non_blocking=True)

    def row_segments(self, row: int) -> list[tuple[int, int, int | None]]:
        """``(start, end, dataset index or None for padding)`` of every segment of ``row``, in order.

        Rows hold their samples first, in ``sample_indices`` order, then padding.
        """
        length = self.shape[1]
        ends = self.segment_lengths().cumsum(0).tolist()
        first = row * length
        spans = [
            (s - first, e - first) for s, e in zip([0, *ends[:-1]], ends, strict=True) if first <= s < first + length
        ]
        samples = self.sample_indices[row]
        return [(s, e, samples[k] if k < len(samples) else None) for k, (s, e) in enumerate(spans)]

    def check(self, *, positions: bool = True) -> None:
        """Assert every invariant of the contract (for tests and debug runs; raises AssertionError).

        Checks shapes and dtypes; segments cover the batch and never straddle rows; inside every segment each target is the next input (the last target of a segment is the sample's own
        final token, which the batch alone cannot show: tests check it against the samples);
        image slots count == sum(prod(grid)) // merge**2 == features the vision tower returns, pixel rows ==
        sum(prod(grid)); no loss on image slots; token counters; and (``positions``) the MRoPE positions.
        """
        b, length = self.shape
        for name in ("target_ids", "loss_mask", "mm_token_type_ids"):
            assert getattr(self, name).shape == (b, length), f"{name} shape {tuple(getattr(self, name).shape)}"
        assert self.position_ids.shape == (3, b, length), f"position_ids shape {tuple(self.position_ids.shape)}"
        assert self.input_ids.dtype == self.target_ids.dtype == torch.long and self.loss_mask.dtype == torch.bool
        assert len(self.sample_indices) == b
        if self.seq_lens is None:
            assert self.attention_mask is not None and self.attention_mask.shape == (b, length)
            real = self.attention_mask.sum(-1)
            # right padding only: the mask is a prefix of True per row
            assert bool((self.attention_mask == (torch.arange(length) < real[:, None])).all()), "mask not a prefix"
            assert all(len(r) == 1 for r in self.sample_indices), "stack rows hold exactly one sample"
        else:
            assert self.attention_mask is None
            sl = self.seq_lens
            assert sl.dim() == 1 and bool((sl > 0).all()), "zero-length or negative segment"
            assert int(sl.sum()) == b * length, f"sum(seq_lens)={int(sl.sum())} != B*L={b * length}"
            ends = sl.cumsum(0)
            row_ends = torch.arange(1, b + 1) * length
            assert bool(torch.isin(row_ends, ends).all()), "a segment straddles two rows"
        segs = self.segment_lengths()
        flat_in, flat_tgt = self.input_ids.reshape(-1), self.target_ids.reshape(-1)
        last = segs.cumsum(0) - 1
        inner = torch.ones(b * length, dtype=torch.bool)
        inner[last] = False
        idx = inner.nonzero(as_tuple=True)[0]
        assert bool((flat_tgt[idx] == flat_in[idx + 1]).all()), "a target is not the next input of its own segment"
        flat_types = self.mm_token_type_ids.reshape(-1)
        image_target = vision_slots(flat_types[idx + 1])
        assert not bool(self.loss_mask.reshape(-1)[idx][image_target].any()), "a vision slot is trained as a target"
        slots = int(vision_slots(flat_types).sum())
        if self.image_grid_thw is None:
            assert self.pixel_values is None and slots == 0, "image slots without images"
        else:
            grid = self.image_grid_thw
            assert self.pixel_values is not None and self.pixel_values.dim() == 2
            assert self.num_patches == int(grid.prod(-1).sum()), "pixel rows != sum(prod(grid))"
            features = int(image_token_counts(grid, self.spatial_merge_size).sum())
            assert slots == features == int(grid.prod(-1).sum()) // self.spatial_merge_size**2, (
                f"{slots} image slots, vision tower returns {features} features"
            )
        assert self.num_trainable_tokens == int(self.loss_mask.sum())
        assert self.num_trainable_tokens <= self.num_real_tokens <= b * length
        if positions:
            expected = mrope_position_ids(
                self.mm_token_type_ids.reshape(-1),
                self.image_grid_thw,
                segs,
                spatial_merge_size=self.spatial_merge_size,
            )
            assert torch.equal(self.position_ids.reshape(3, -1), expected), "position_ids differ from per-segment MRoPE"
