"""Images (and videos) vs placeholders: one rule for every row schema (``vlm_sft.data.schemas``), so the same images
land in the same places whatever the data's shape.

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
image-root policy here too. Videos follow the same rule on their own: ``<video>`` markers and bare video blocks take
the row's videos column (LLaVA-Video's ShareGPT rows), and unmarked videos go before the first user turn's text.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from renderers.content import string_content_to_blocks
from renderers.errors import RenderError
from vlm_sft.data.image_roots import ImageRoots

IMAGE_MARKER = "<image>"
"""The ShareGPT / LLaVA image placeholder in message text."""
VIDEO_MARKER = "<video>"
"""The ShareGPT / LLaVA-Video video placeholder in message text."""

REASON_MORE_PLACEHOLDERS = "more_placeholders_than_images"
"""Skip: a row with more ``<image>`` markers / image blocks than images."""
REASON_UNPLACED_IMAGES = "images_without_placeholders"
"""Skip: a row that marks some of its images but not all."""
REASON_BAD_IMAGE_INDEX = "image_index_out_of_range"
"""Skip: an image block names an index the row's images do not have."""
REASON_NO_USER_TURN = "images_without_user_turn"
"""Skip: a row with images but no placeholder and no user turn to put them in."""

_SOURCE_KEYS = ("image", "url", "path", "base64", "image_url")
_VIDEO_SOURCE_KEYS = ("video", "url", "path", "video_url")


@dataclass(frozen=True)
class _Kind:
    """What the rule is applied to: images or videos (their marker, block type and skip reasons)."""

    name: str
    marker: str
    source_keys: tuple[str, ...]
    more_placeholders: str
    unplaced: str
    bad_index: str
    no_user_turn: str


_IMAGES = _Kind(
    "image", IMAGE_MARKER, _SOURCE_KEYS,
    REASON_MORE_PLACEHOLDERS, REASON_UNPLACED_IMAGES, REASON_BAD_IMAGE_INDEX, REASON_NO_USER_TURN,
)  # fmt: skip
_VIDEOS = _Kind(
    "video", VIDEO_MARKER, _VIDEO_SOURCE_KEYS,
    "more_placeholders_than_videos", "videos_without_placeholders", "video_index_out_of_range",
    "videos_without_user_turn",
)  # fmt: skip


@dataclass
class _Placeholder:
    """An image slot found in a turn: where it is, and the image index it names (None: the next in order)."""

    message: int
    block: int
    index: int | None


def place_images(messages: list[dict], images: list, roots: ImageRoots, videos: list | None = None) -> list[dict]:
    """The messages with every placeholder (``<image>`` marker, bare image block) filled from ``images``, or the
    images in front of the first user turn when there is none (the module docstring's rule), then the same for
    ``videos``; inline image and video sources resolved through ``roots``. A mismatch raises ``RenderError`` with its
    own reason."""
    messages = _place(messages, images, roots, _IMAGES)
    return _place(messages, videos or [], roots, _VIDEOS)


def _place(messages: list[dict], items: list, roots: ImageRoots, kind: _Kind) -> list[dict]:
    messages, slots = _find_placeholders(messages, roots, kind)
    if not slots:
        return _front_load(messages, items, kind) if items else messages
    plural = f"{kind.name}s"
    for slot in slots:
        if slot.index is not None and not 0 <= slot.index < len(items):
            raise RenderError(
                kind.bad_index, f"{_a(kind.name)} block names index {slot.index}; the row has {len(items)} {plural}"
            )
    if len(slots) > len(items):
        raise RenderError(
            kind.more_placeholders, f"{len(slots)} {kind.marker} markers / {kind.name} blocks but {len(items)} {plural}"
        )
    if len(slots) < len(items):
        raise RenderError(
            kind.unplaced,
            f"{len(slots)} {kind.marker} markers / {kind.name} blocks for {len(items)} {plural}: mark every "
            f"{kind.name} or none",
        )
    following = iter(range(len(items)))
    for slot in slots:
        item = items[slot.index if slot.index is not None else next(following)]
        messages[slot.message]["content"][slot.block] = {"type": kind.name, kind.name: item}
    return messages


def _a(noun: str) -> str:
    return f"an {noun}" if noun[0] in "aeiou" else f"a {noun}"


def _find_placeholders(messages: list[dict], roots: ImageRoots, kind: _Kind) -> tuple[list[dict], list[_Placeholder]]:
    """Markers split out of the text into placeholder blocks; inline sources resolved."""
    out: list[dict] = []
    slots: list[_Placeholder] = []
    for i, m in enumerate(messages):
        content = m.get("content")
        if isinstance(content, str):
            if kind.marker not in content:
                out.append(m)
                continue
            content = [{"type": "text", "text": content}]
        if not isinstance(content, list):
            out.append(m)  # the renderer names what is wrong with it
            continue
        blocks: list = []
        for block in content:
            for piece in _split_markers(block, kind):
                if _is_placeholder(piece, kind):
                    index = piece.get("index")
                    slots.append(_Placeholder(i, len(blocks), index if isinstance(index, int) else None))
                    blocks.append(piece)
                else:
                    blocks.append(roots.resolve_block(piece))
        out.append({**m, "content": blocks})
    return out, slots


def _split_markers(block: Any, kind: _Kind) -> list:
    """A text block holding markers as text / bare placeholder blocks; anything else unchanged."""
    if not (isinstance(block, Mapping) and block.get("type", "text") == "text" and isinstance(block.get("text"), str)):
        return [block]
    text = block["text"]
    if kind.marker not in text:
        return [block]
    pieces: list = []
    for k, part in enumerate(text.split(kind.marker)):
        if k:
            pieces.append({"type": kind.name})
        if part:
            pieces.append({"type": "text", "text": part})
    return pieces


def _is_placeholder(block: Any, kind: _Kind) -> bool:
    return (
        isinstance(block, Mapping)
        and block.get("type") == kind.name
        and not any(block.get(k) is not None for k in kind.source_keys)
    )


def _front_load(messages: list[dict], items: list, kind: _Kind) -> list[dict]:
    """The items in front of the first user turn's content (videos before images when both are unmarked)."""
    for i, m in enumerate(messages):
        if m.get("role") == "user":
            content = m.get("content")
            rest = string_content_to_blocks(content if content is not None else "")
            messages[i] = {**m, "content": [*({"type": kind.name, kind.name: x} for x in items), *rest]}
            return messages
    raise RenderError(kind.no_user_turn, f"{len(items)} {kind.name}s but no user turn to put them in")
