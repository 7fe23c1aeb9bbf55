"""Template parity: does our renderer produce exactly what the checkpoint's own processor produces?

The trainer calls ``check_template_parity`` at start-up with the loaded checkpoint's processor, and refuses to
train on a mismatch: a renderer that disagrees with the chat template by one token trains a model on a format
it will never see at inference. The comparison covers token ids, modality types, pixel values and image grids,
and (for a renderer that trains all assistant turns) the loss mask against the template's
``return_assistant_tokens_mask``. The probe must not contain control-token strings in its text (for those the
renderer deliberately differs; see ``renderers.qwen3_5``).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from PIL import Image

logger = logging.getLogger(__name__)

_CONTEXT = 12


class TemplateParityError(RuntimeError):
    """The renderer's output differs from ``processor.apply_chat_template`` on the probe conversation."""

    def __init__(self, field: str, position: int, detail: str) -> None:
        self.field = field
        """Which output differs: ``token_ids``, ``mm_token_type_ids``, ``loss_mask``, ``pixel_values`` or ``image_grid_thw``."""
        self.position = position
        """First differing index along that output (-1 when only shapes differ)."""
        super().__init__(f"template parity failed on {field} at position {position}: {detail}")


def probe_image(width: int = 96, height: int = 64) -> Image.Image:
    """A deterministic RGB picture (a colour gradient with a square), so pixel parity is checked on real data."""
    y, x = np.mgrid[0:height, 0:width]
    arr = np.stack([x * 255 // max(width - 1, 1), y * 255 // max(height - 1, 1), (x + y) % 256], axis=-1)
    arr[height // 4 : height // 2, width // 4 : width // 2] = (240, 200, 30)
    return Image.fromarray(arr.astype(np.uint8), "RGB")


def default_probe() -> list[dict]:
    """A conversation with a system prompt, an image, reasoning, and a second turn."""
    return [
        {"role": "system", "content": "You are a careful assistant."},
        {
            "role": "user",
            "content": [{"type": "image", "image": probe_image()}, {"type": "text", "text": "What is in the picture?"}],
        },
        {"role": "assistant", "reasoning_content": "A yellow square on a gradient.", "content": "A yellow square."},
        {"role": "user", "content": [{"type": "text", "text": "Where is it, roughly?"}]},
        {"role": "assistant", "content": "Near the top left, über the middle: ünïcödé 😀."},
    ]


def _context(tokenizer: Any, ids: torch.Tensor, position: int) -> str:
    lo, hi = max(0, position - _CONTEXT), position + _CONTEXT
    return repr(tokenizer.decode(ids[lo:hi].tolist()))


def _first_difference(a: torch.Tensor, b: torch.Tensor) -> int:
    n = min(len(a), len(b))
    diff = torch.nonzero(a[:n] != b[:n])
    return int(diff[0, 0]) if len(diff) else n


def check_template_parity(
    renderer: Any,
    processor: Any,
    probe: Sequence[Mapping] | None = None,
    *,
    tools: Sequence[Mapping] | None = None,
) -> None:
    """Raise ``TemplateParityError`` unless rendering ``probe`` equals the processor's own output.

    ``probe`` defaults to ``default_probe()`` (text, an image, reasoning, two turns).
    """
    messages = list(probe) if probe is not None else default_probe()
    ours = renderer.render(messages, tools=tools)
    ref = processor.apply_chat_template(
        messages,
        tools=list(tools) if tools else None,
        tokenize=True,
        return_dict=True,
        return_tensors="pt",
        return_assistant_tokens_mask=True,
    )
    tokenizer = processor.tokenizer
    ref_ids = ref["input_ids"][0].long()
    if not torch.equal(ours.token_ids, ref_ids):
        pos = _first_difference(ours.token_ids, ref_ids)
        raise TemplateParityError(
            "token_ids",
            pos,
            f"ours ({len(ours.token_ids)} tokens) {_context(tokenizer, ours.token_ids, pos)} vs the processor's "
            f"({len(ref_ids)} tokens) {_context(tokenizer, ref_ids, pos)}",
        )
    ref_types = ref["mm_token_type_ids"][0].long() if "mm_token_type_ids" in ref else None
    if ref_types is not None and not torch.equal(ours.mm_token_type_ids, ref_types):
        pos = _first_difference(ours.mm_token_type_ids, ref_types)
        raise TemplateParityError("mm_token_type_ids", pos, f"near {_context(tokenizer, ref_ids, pos)}")
    if getattr(renderer, "loss_on", "all_assistant") == "all_assistant":
        vision = torch.isin(ref_ids, torch.as_tensor(renderer.vision_ids)) | (ref_ids == renderer.image_token_id)
        ref_mask = ref["assistant_masks"][0].bool() & ~vision
        if not torch.equal(ours.loss_mask, ref_mask):
            pos = _first_difference(ours.loss_mask, ref_mask)
            raise TemplateParityError(
                "loss_mask",
                pos,
                f"ours {bool(ours.loss_mask[pos])} vs template {bool(ref_mask[pos])} near "
                f"{_context(tokenizer, ref_ids, pos)}",
            )
    _check_images(ours, ref)
    logger.info("template parity ok: %d tokens, %d images", len(ours), ours.num_images)


def _check_images(ours: Any, ref: Mapping) -> None:
    mm = ours.multi_modal_data
    ref_grid = ref.get("image_grid_thw")
    if mm is None or ref_grid is None:
        if (mm is None) != (ref_grid is None):
            raise TemplateParityError(
                "image_grid_thw",
                -1,
                f"ours has {ours.num_images} images, the processor's {0 if ref_grid is None else len(ref_grid)}",
            )
        return
    if not torch.equal(mm.image_grid_thw, ref_grid.long()):
        raise TemplateParityError("image_grid_thw", -1, f"ours {mm.image_grid_thw.tolist()} vs {ref_grid.tolist()}")
    ref_pixels = ref["pixel_values"]
    if mm.pixel_values.shape != ref_pixels.shape:
        raise TemplateParityError(
            "pixel_values", -1, f"shape {tuple(mm.pixel_values.shape)} vs {tuple(ref_pixels.shape)}"
        )
    if not torch.equal(mm.pixel_values, ref_pixels.to(mm.pixel_values.dtype)):
        row = int(torch.nonzero((mm.pixel_values != ref_pixels).any(-1))[0, 0])
        raise TemplateParityError("pixel_values", row, "patch row differs")
