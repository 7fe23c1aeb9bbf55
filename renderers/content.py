"""Typed content blocks and the normalization of chat messages into them.

Datasets spell the same conversation many ways: ``content`` as a string or a list of blocks, images under
``image`` / ``url`` / ``path`` / ``base64`` / OpenAI's ``image_url``, reasoning under ``reasoning_content`` /
``thinking`` / ``reasoning``, tool-call arguments as a dict or as a JSON string, and rows that went through Arrow
carry ``None`` for every key another row had. This module turns all of them into one typed shape (``Message`` with
``TextBlock`` / ``ImageBlock`` / ``VideoBlock``), checks the conversation's structure, and hands the chat template plain dicts it
renders exactly as it would render the original. Structural problems raise ``RenderError`` with a stable reason.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from renderers.errors import RenderError

ROLES = ("system", "user", "assistant", "tool")
"""Roles the renderer accepts (the Qwen3.5 template knows no others)."""

IMAGE_KEYS = ("image", "url", "path", "base64", "image_url")
"""Keys an image block may carry its source under, in the order they are looked up."""

VIDEO_KEYS = ("video", "video_url", "path", "url")
"""Keys a video block may carry its source under, in the order they are looked up."""

_REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")
_VIDEO_TYPES = frozenset({"video", "video_url", "input_video"})
_IMAGE_TYPES = frozenset({"image", "image_url", "input_image"})
_TEXT_TYPES = frozenset({"text", "input_text", "output_text"})


@dataclass(frozen=True)
class TextBlock:
    """A run of text inside a message."""

    text: str
    """The text, verbatim (the chat template decides about surrounding whitespace)."""


@dataclass(frozen=True)
class ImageBlock:
    """One image inside a message; the source is loaded later, by the renderer, so bad files fail per sample."""

    source: Any
    """A local path / ``file://`` URI / ``data:`` URI / base64 string, raw bytes, a PIL image, a numpy array, or a
    ``{"bytes", "path"}`` dict as the datasets ``Image(decode=False)`` feature yields it."""
    key: str = "image"
    """The key the source came under; ``base64`` lets a bare string be read as base64 rather than as a path."""


@dataclass(frozen=True)
class VideoBlock:
    """One video inside a message, loaded later by the renderer (``renderers.video``) so bad files fail per sample."""

    source: Any
    """A local path / ``file://`` URI, raw bytes, a ``{"bytes", "path"}`` dict as the datasets ``Video`` feature
    yields it, or a list of frame images (each any image source)."""
    fps: float | None = None
    """For a file, the frames sampled per second (overrides ``data.video_fps``, as qwen-vl-utils reads a block's
    ``fps``); for a frame list, the frames' own rate (required: timestamps are stated in seconds)."""


Block = TextBlock | ImageBlock | VideoBlock


@dataclass(frozen=True)
class Message:
    """One chat message in normalized form."""

    role: str
    """One of ``ROLES``."""
    content: str | tuple[Block, ...]
    """A plain string (kept as a string so the template sees what the user wrote) or typed blocks."""
    reasoning_content: str | None = None
    """Assistant reasoning (rendered inside ``<think>``), from any of the accepted reasoning keys."""
    tool_calls: tuple[dict, ...] = ()
    """Assistant tool calls, OpenAI shape ``{"type": "function", "function": {"name", "arguments": dict}}``."""
    extra: tuple[tuple[str, Any], ...] = ()
    """Other keys of the message (``name``, ``tool_call_id``, ...), passed to the template unchanged."""
    trained: bool = True
    """False for an assistant turn given ``weight: 0`` (OpenAI's fine-tuning convention): rendered as context, never
    a training target (a prompt's own assistant turns in TRL's prompt / completion form)."""

    @property
    def blocks(self) -> tuple[Block, ...]:
        """The content as blocks (a string content is one text block)."""
        return (TextBlock(self.content),) if isinstance(self.content, str) else self.content

    @property
    def images(self) -> list[ImageBlock]:
        return [b for b in self.blocks if isinstance(b, ImageBlock)]

    @property
    def visuals(self) -> list[ImageBlock | VideoBlock]:
        """The image and video blocks, in order."""
        return [b for b in self.blocks if not isinstance(b, TextBlock)]

    def has_content(self) -> bool:
        """True when the message carries any image, video or non-blank text."""
        return any(not isinstance(b, TextBlock) or b.text.strip() for b in self.blocks)


def drop_none(value: Any) -> Any:
    """Remove ``None`` dict values recursively: Arrow fills every struct field another row had with ``None``.

    A value that really was ``null`` in the data (say a tool argument) is dropped too; Arrow cannot tell them apart.
    """
    if isinstance(value, Mapping):
        return {k: drop_none(v) for k, v in value.items() if v is not None}
    if isinstance(value, list | tuple):
        return [drop_none(v) for v in value]
    return value


def _image_source(block: Mapping) -> tuple[Any, str] | None:
    for key in IMAGE_KEYS:
        if key not in block:
            continue
        value = block[key]
        if key == "image_url" and isinstance(value, Mapping):
            value = value.get("url")
        if value is not None:
            return value, key
    return None


def _video_block(block: Mapping) -> VideoBlock:
    for key in VIDEO_KEYS:
        value = block.get(key)
        if key == "video_url" and isinstance(value, Mapping):
            value = value.get("url")
        if value is None:
            continue
        fps = block.get("fps", block.get("sample_fps"))
        if fps is not None and (isinstance(fps, bool) or not isinstance(fps, int | float) or not fps > 0):
            raise RenderError("bad_video_source", f"video fps must be a positive number, got {fps!r:.40}")
        return VideoBlock(value, None if fps is None else float(fps))
    raise RenderError("bad_video_source", f"video block without a source: {sorted(block)}")


def normalize_block(block: Any) -> Block:
    """One content entry to a typed block; unsupported entries raise ``RenderError``."""
    if isinstance(block, str):
        return TextBlock(block)
    if not isinstance(block, Mapping):
        raise RenderError("unknown_block_type", f"content block of type {type(block).__name__}: {block!r:.80}")
    block = {k: v for k, v in block.items() if v is not None}
    kind = block.get("type")
    if kind is not None and not isinstance(kind, str):  # e.g. ["x"]: unhashable, and no type we know
        raise RenderError("unknown_block_type", f"content block type of type {type(kind).__name__}: {kind!r:.60}")
    if kind in _VIDEO_TYPES or (kind is None and "video" in block):
        return _video_block(block)
    if kind in _IMAGE_TYPES or (kind is None and _image_source(block) is not None):
        found = _image_source(block)
        if found is None:
            raise RenderError("bad_image_source", f"image block without a source: {sorted(block)}")
        return ImageBlock(found[0], found[1])
    if kind in _TEXT_TYPES or (kind is None and "text" in block):
        text = block.get("text", "")
        if not isinstance(text, str):
            raise RenderError("bad_content", f"text block whose text is a {type(text).__name__}")
        return TextBlock(text)
    raise RenderError("unknown_block_type", f"content block type {kind!r} (keys {sorted(block)})")


def normalize_content(content: Any) -> str | tuple[Block, ...]:
    """A message's content: a string stays a string; a list becomes typed blocks; ``None`` becomes ``""``."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, Mapping):
        content = [content]
    if not isinstance(content, list | tuple):
        raise RenderError("bad_content", f"message content of type {type(content).__name__}")
    return tuple(normalize_block(b) for b in content)


def normalize_tools(tools: Any) -> list[dict] | None:
    """Tool schemas offered to a conversation: a list of objects, or that list as a JSON string (as Arrow stores
    it); None for none (None, "", [])."""
    if tools is None or tools == "" or tools == []:
        return None
    if isinstance(tools, str):
        try:
            tools = json.loads(tools)
        except json.JSONDecodeError as e:
            raise RenderError("bad_tools", f"'tools' is not valid JSON: {tools!r:.80}") from e
    if not isinstance(tools, list | tuple) or not all(isinstance(t, Mapping) for t in tools):
        raise RenderError("bad_tools", f"'tools' must be a list of tool schemas, got {type(tools).__name__}")
    return [dict(t) for t in tools] or None


def normalize_tool_call(call: Any) -> dict:
    """A tool call in OpenAI shape with its arguments as a dict (a JSON-string argument object is parsed)."""
    if not isinstance(call, Mapping):
        raise RenderError("bad_tool_call", f"tool call of type {type(call).__name__}")
    call = dict(call)
    function = call.get("function", call)
    if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
        raise RenderError("bad_tool_call", f"tool call without a function name: {call!r:.120}")
    function = dict(function)
    arguments = function.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as e:
            raise RenderError("bad_tool_call", f"tool call arguments are not JSON: {arguments!r:.120}") from e
    if not isinstance(arguments, Mapping):
        raise RenderError("bad_tool_call", f"tool call arguments must be an object, got {type(arguments).__name__}")
    function["arguments"] = dict(arguments)
    if "function" in call:
        call["function"] = function
        return call
    return {"type": "function", "function": function}


def normalize_message(message: Any) -> Message:
    """A raw message dict (any accepted spelling) to a ``Message``."""
    if not isinstance(message, Mapping):
        raise RenderError("bad_message", f"message of type {type(message).__name__}")
    message = {k: v for k, v in message.items() if v is not None}
    role = message.get("role")
    if role not in ROLES:
        raise RenderError("unknown_role", f"role {role!r}; expected one of {', '.join(ROLES)}")
    reasoning = next((message[k] for k in _REASONING_KEYS if k in message), None)
    if reasoning is not None and not isinstance(reasoning, str):
        raise RenderError("bad_content", f"reasoning of type {type(reasoning).__name__}")
    calls = message.get("tool_calls") or ()
    if not isinstance(calls, list | tuple):
        raise RenderError("bad_tool_call", f"tool_calls of type {type(calls).__name__}")
    weight = message.get("weight", 1)
    if isinstance(weight, bool) or weight not in (0, 1):
        raise RenderError("bad_weight", f"weight {weight!r}; a turn's weight is 0 (context only) or 1 (trained)")
    skip = {"role", "content", "tool_calls", "weight", *_REASONING_KEYS}
    return Message(
        role=role,
        content=normalize_content(message.get("content")),
        reasoning_content=reasoning,
        tool_calls=tuple(normalize_tool_call(c) for c in calls),
        extra=tuple((k, v) for k, v in message.items() if k not in skip),
        trained=weight == 1,
    )


def validate_structure(messages: Sequence[Message], *, require_assistant: bool = True) -> None:
    """Raise ``RenderError`` for conversations the template cannot render meaningfully or that teach nothing.

    Rules (from the Qwen3.5 template's own checks plus what SFT needs): a system message only first; the first
    other message is a user turn; a tool result directly follows an assistant turn with tool calls or another tool
    result; every message has content (an assistant turn may instead carry only tool calls); at least one
    assistant turn (``require_assistant``; a generation prompt has none). Consecutive assistant turns are allowed:
    the template renders them.
    """
    if not messages:
        raise RenderError("empty_conversation", "no messages")
    for i, m in enumerate(messages):
        if m.role == "system" and i != 0:
            raise RenderError("bad_role_order", f"system message at position {i}; it must be first")
    first = 1 if messages[0].role == "system" else 0
    if first >= len(messages) or messages[first].role != "user":
        role = messages[first].role if first < len(messages) else "nothing"
        raise RenderError("bad_role_order", f"the first non-system message must be a user turn, got {role}")
    for i, m in enumerate(messages):
        if m.role == "tool":
            prev = messages[i - 1]
            if not (prev.role == "tool" or (prev.role == "assistant" and prev.tool_calls)):
                raise RenderError("bad_role_order", f"tool result at position {i} without a preceding tool call")
        if not m.has_content() and not (m.role == "assistant" and m.tool_calls):
            raise RenderError("empty_content", f"{m.role} message at position {i} has no content")
    if require_assistant and not any(m.role == "assistant" for m in messages):
        raise RenderError("no_assistant_turn", "no assistant turn: nothing to train on")


def normalize_messages(messages: Any, *, require_assistant: bool = True) -> tuple[Message, ...]:
    """Normalize and validate a whole conversation (``require_assistant``: see ``validate_structure``)."""
    if not isinstance(messages, list | tuple):
        raise RenderError("bad_message", f"messages must be a list, got {type(messages).__name__}")
    normalized = tuple(normalize_message(m) for m in messages)
    validate_structure(normalized, require_assistant=require_assistant)
    return normalized


def text_runs(message: Message) -> list[list[str]]:
    """The texts of each run of adjacent text blocks (the template concatenates a run into one string)."""
    runs: list[list[str]] = [[]]
    for b in message.blocks:
        if isinstance(b, TextBlock):
            runs[-1].append(b.text)
        elif runs[-1]:
            runs.append([])
    return [r for r in runs if r]


def merge_text_runs(message: Message) -> Message:
    """The message with each run of adjacent text blocks merged into one block (same rendered text)."""
    if isinstance(message.content, str):
        return message
    blocks: list[Block] = []
    for b in message.content:
        if isinstance(b, TextBlock) and blocks and isinstance(blocks[-1], TextBlock):
            blocks[-1] = TextBlock(blocks[-1].text + b.text)
        else:
            blocks.append(b)
    return Message(
        message.role, tuple(blocks), message.reasoning_content, message.tool_calls, message.extra, message.trained
    )


def map_strings(value: Any, fn: Callable[[str], str]) -> Any:
    """Apply ``fn`` to every string inside nested dicts / lists (keys included), returning new containers."""
    if isinstance(value, str):
        return fn(value)
    if isinstance(value, Mapping):
        return {map_strings(k, fn): map_strings(v, fn) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [map_strings(v, fn) for v in value]
    return value


def map_message_text(message: Message, fn: Callable[[str], str]) -> Message:
    """The message with ``fn`` applied to every user-written string (content, reasoning, tool calls, extras)."""
    content = (
        fn(message.content)
        if isinstance(message.content, str)
        else tuple(TextBlock(fn(b.text)) if isinstance(b, TextBlock) else b for b in message.content)
    )
    return Message(
        role=message.role,
        content=content,
        reasoning_content=None if message.reasoning_content is None else fn(message.reasoning_content),
        tool_calls=tuple(map_strings(c, fn) for c in message.tool_calls),
        extra=tuple((k, map_strings(v, fn)) for k, v in message.extra),
        trained=message.trained,
    )


def iter_text(messages: Sequence[Message], tools: Sequence[Mapping] | None = None):
    """Every user-written string of a conversation (and its tools), for scanning."""
    found: list[str] = []

    def keep(s: str) -> str:
        found.append(s)
        return s

    for m in messages:
        map_message_text(m, keep)
    if tools:
        map_strings(list(tools), keep)
    return found


def _template_block(block: Block) -> dict:
    if isinstance(block, TextBlock):
        return {"type": "text", "text": block.text}
    return {"type": "image"} if isinstance(block, ImageBlock) else {"type": "video"}


def to_template_message(message: Message) -> dict:
    """The dict the chat template sees: images become ``{"type": "image"}`` and videos ``{"type": "video"}``
    (templates only test for the type)."""
    if isinstance(message.content, str):
        content: Any = message.content
    else:
        content = [_template_block(b) for b in message.content]
    out: dict[str, Any] = {"role": message.role, "content": content}
    if message.reasoning_content is not None:
        out["reasoning_content"] = message.reasoning_content
    if message.tool_calls:
        out["tool_calls"] = [dict(c) for c in message.tool_calls]
    out.update(message.extra)
    return out


def string_content_to_blocks(content: Any) -> Any:
    """Content as a list of typed blocks, so Arrow can store text-only and image rows in one column."""
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    return content
