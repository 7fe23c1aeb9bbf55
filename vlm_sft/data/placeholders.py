"""Images vs placeholders: one rule for every row schema (``vlm_sft.data.schemas``), so the same images land in the
same places whatever the data's shape.

A placeholder is an ``<image>`` marker in a turn's text (string content or a text block) or a bare image block
(``{"type": "image"}`` with no source; with an ``index``, it names its image). Given the row's images (its images
column, in order):

- no placeholder at all: the images go before the first user turn's text, in column order (the card convention of
  HuggingFaceM4/the_cauldron and LLaVA, whose rows carry no markers); a row without images stays text;
- as many placeholders as images: each gets the image its ``index`` names, or the next in order;
- anything else is a ``RenderError`` with its own reason (a counted skip naming the row, never a crash and never a
  silent drop): more placeholders than images, some images marked and not all, an index the row does not have, images
  with no user turn to put them in.

Image blocks that carry their own source (a path, bytes, a data URI) are not placeholders; their paths go through the
image-root policy here too.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from renderers.content import string_content_to_blocks
from renderers.errors import RenderError
from vlm_sft.data.image_roots import ImageRoots

IMAGE_MARKER = "<image>"
"""The ShareGPT / LLaVA image placeholder in message text."""

REASON_MORE_PLACEHOLDERS = "more_placeholders_than_images"
"""Skip: a row with more ``<image>`` markers / image blocks than images."""
REASON_UNPLACED_IMAGES = "images_without_placeholders"
"""Skip: a row that marks some of its images but not all."""
REASON_BAD_IMAGE_INDEX = "image_index_out_of_range"
"""Skip: an image block names an index the row's images do not have."""
REASON_NO_USER_TURN = "images_without_user_turn"
"""Skip: a row with images but no placeholder and no user turn to put them in."""

_MARKER_RE = re.compile(re.escape(IMAGE_MARKER))
_SOURCE_KEYS = ("image", "url", "path", "base64", "image_url")


@dataclass
class _Placeholder:
    """An image slot found in a turn: where it is, and the image index it names (None: the next in order)."""

    message: int
    block: int
    index: int | None


def place_images(messages: list[dict], images: list, roots: ImageRoots) -> list[dict]:
    """The messages with every placeholder (``<image>`` marker, bare image block) filled from ``images``, or the
    images in front of the first user turn when there is none (the module docstring's rule); inline image sources
    resolved through ``roots``. A mismatch raises ``RenderError`` with its own reason."""
    messages, slots = _find_placeholders(messages, roots)
    if not slots:
        return _front_load(messages, images) if images else messages
    for slot in slots:
        if slot.index is not None and not 0 <= slot.index < len(images):
            raise RenderError(
                REASON_BAD_IMAGE_INDEX, f"an image block names index {slot.index}; the row has {len(images)} images"
            )
    if len(slots) > len(images):
        raise RenderError(
            REASON_MORE_PLACEHOLDERS, f"{len(slots)} {IMAGE_MARKER} markers / image blocks but {len(images)} images"
        )
    if len(slots) < len(images):
        raise RenderError(
            REASON_UNPLACED_IMAGES,
            f"{len(slots)} {IMAGE_MARKER} markers / image blocks for {len(images)} images: mark every image or none",
        )
    following = iter(range(len(images)))
    for slot in slots:
        image = images[slot.index if slot.index is not None else next(following)]
        messages[slot.message]["content"][slot.block] = {"type": "image", "image": image}
    return messages


def _find_placeholders(messages: list[dict], roots: ImageRoots) -> tuple[list[dict], list[_Placeholder]]:
    """Markers split out of the text into placeholder blocks; inline image sources resolved."""
    out: list[dict] = []
    slots: list[_Placeholder] = []
    for i, m in enumerate(messages):
        content = m.get("content")
        if isinstance(content, str):
            if IMAGE_MARKER not in content:
                out.append(m)
                continue
            content = [{"type": "text", "text": content}]
        if not isinstance(content, list):
            out.append(m)  # the renderer names what is wrong with it
            continue
        blocks: list = []
        for block in content:
            for piece in _split_markers(block):
                if _is_placeholder(piece):
                    index = piece.get("index")
                    slots.append(_Placeholder(i, len(blocks), index if isinstance(index, int) else None))
                    blocks.append(piece)
                else:
                    blocks.append(roots.resolve_block(piece))
        out.append({**m, "content": blocks})
    return out, slots


def _split_markers(block: Any) -> list:
    """A text block holding ``<image>`` markers as text / bare image blocks; anything else unchanged."""
    if not (isinstance(block, Mapping) and block.get("type", "text") == "text" and isinstance(block.get("text"), str)):
        return [block]
    text = block["text"]
    if IMAGE_MARKER not in text:
        return [block]
    pieces: list = []
    for k, part in enumerate(_MARKER_RE.split(text)):
        if k:
            pieces.append({"type": "image"})
        if part:
            pieces.append({"type": "text", "text": part})
    return pieces


def _is_placeholder(block: Any) -> bool:
    return (
        isinstance(block, Mapping)
        and block.get("type") == "image"
        and not any(block.get(k) is not None for k in _SOURCE_KEYS)
    )


def _front_load(messages: list[dict], images: list) -> list[dict]:
    """The images in front of the first user turn's text."""
    for i, m in enumerate(messages):
        if m.get("role") == "user":
            content = m.get("content")
            text = string_content_to_blocks(content if content is not None else "")
            messages[i] = {**m, "content": [*({"type": "image", "image": img} for img in images), *text]}
            return messages
    raise RenderError(REASON_NO_USER_TURN, f"{len(images)} images but no user turn to put them in")
