"""Dataset sources: load chat data and hand out conversations in one shape, exactly as the data wrote them.

Accepted row shapes (detected from the columns):

- **messages** (OpenAI / HF chat): ``messages: [{role, content}]`` where ``content`` is a string or typed blocks;
  image blocks hold a path / bytes / data URI, or are bare ``{"type": "image"}`` placeholders filled in order from
  an ``images`` (or ``image``) column. Optional ``tools`` column (a list, or a JSON string).
- **ShareGPT / LLaVA**: ``conversations: [{from, value}]`` with ``<image>`` markers in the text, images from an
  ``image`` / ``images`` column (paths, or the datasets ``Image`` feature). Without any marker the images go in
  front of the first user turn (LLaVA's convention). Optional ``system`` and ``tools`` columns.

Storage. Local json / jsonl files are read line by line in Python (``json_rows``) and stored as their JSON text, so
a string stays a string whatever the other rows hold and a bad line is one ``malformed_row`` skip naming its file
and line. Parquet files and hub datasets go through ``datasets.load_dataset`` (typed columns): Arrow fills every
struct field another row had with ``None``, which ``drop_none`` removes again on read; image columns are read with
``Image(decode=False)`` so images stay encoded bytes until the renderer decodes (and hashes) them. To write parquet
from rows that mix string and block content, use ``rows_to_dataset`` (``normalize_row_for_arrow``).

Numbers where text is expected (``"content": 12``, a ShareGPT ``"value": 12``, ``{"type": "text", "text": 4}``)
train as their JSON text (``"12"``), in every storage form. Image paths resolve against the image root (by default
the data file's folder) and must lie inside it or an allowed root (``image_roots``). Every ``Conversation`` carries
its row index, and conversion problems raise ``RenderError`` naming that row.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import datasets
import huggingface_hub.constants

from renderers.content import drop_none, string_content_to_blocks
from renderers.errors import RenderError
from renderers.types import RenderedSample
from vlm_sft.data.image_roots import ImageRoots
from vlm_sft.data.json_rows import column_values, decode_row, is_json_rows, load_json_rows, row_keys

logger = logging.getLogger(__name__)

IMAGE_MARKER = "<image>"
"""The ShareGPT / LLaVA image placeholder in message text."""

SHAREGPT_ROLES: dict[str, str] = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "model": "assistant",
    "bot": "assistant",
    "chatgpt": "assistant",
    "system": "system",
    "tool": "tool",
    "observation": "tool",
    "function_response": "tool",
}
"""ShareGPT ``from`` values and the chat role each means."""

_FILE_KINDS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}
_IMAGE_COLUMNS = ("images", "image")
_REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")


@dataclass(frozen=True)
class Conversation:
    """One dataset row as a chat conversation."""

    messages: list[dict]
    """Messages in the OpenAI / HF chat shape (roles system / user / assistant / tool, typed blocks)."""
    tools: list[dict] | None
    """Tool schemas offered in this conversation, or None."""
    index: int
    """Row index in the source dataset, for error reports and accounting."""


def as_text(value: Any) -> Any:
    """A raw JSON number or boolean where text is expected, as its JSON text (``12`` -> ``"12"``, ``true`` ->
    ``"true"``): the answer the data meant, where a type error would only skip the row. Anything else unchanged."""
    if isinstance(value, bool | int | float):
        return json.dumps(value)
    return value


def message_numbers_as_text(message: Mapping) -> dict:
    """The message with ``as_text`` applied to its content (a scalar, text blocks, bare list entries) and its
    reasoning; a single block dict as content becomes a one-block list (``normalize_content`` reads it so too)."""
    out = dict(message)
    content = out.get("content")
    if isinstance(content, Mapping):
        content = [content]
    if isinstance(content, list):
        out["content"] = [
            {**b, "text": as_text(b["text"])} if isinstance(b, Mapping) and "text" in b else as_text(b) for b in content
        ]
    elif "content" in out:
        out["content"] = as_text(content)
    for key in _REASONING_KEYS:
        if key in out:
            out[key] = as_text(out[key])
    return out


def normalize_row_for_arrow(row: Mapping) -> dict:
    """A row that Arrow can store next to any other row without changing what it says: block content (numbers as
    their JSON text), JSON-string tool-call arguments and tools, ShareGPT values and system prompts as text.

    Use before ``Dataset.from_list`` / ``to_parquet`` on data whose rows mix string and block content.
    """
    out = dict(row)
    if isinstance(out.get("messages"), list):
        messages = []
        for m in out["messages"]:
            m = message_numbers_as_text(m)
            m["content"] = string_content_to_blocks(m.get("content") if m.get("content") is not None else "")
            if m.get("tool_calls"):
                m["tool_calls"] = [_arguments_to_json(c) for c in m["tool_calls"]]
            messages.append(m)
        out["messages"] = messages
    if isinstance(out.get("conversations"), list):
        out["conversations"] = [
            {k: as_text(v) if k in ("value", "content") else v for k, v in t.items()} if isinstance(t, Mapping) else t
            for t in out["conversations"]
        ]
    if "system" in out:
        out["system"] = as_text(out["system"])
    if out.get("tools") is not None and not isinstance(out["tools"], str):
        out["tools"] = json.dumps(out["tools"], ensure_ascii=False)
    return out


def _arguments_to_json(call: Mapping) -> dict:
    call = dict(call)
    function = dict(call.get("function") or {})
    if isinstance(function.get("arguments"), Mapping):
        function["arguments"] = json.dumps(function["arguments"], ensure_ascii=False)
    call["function"] = function
    return call


def rows_to_dataset(rows: list[Mapping]) -> datasets.Dataset:
    """``normalize_row_for_arrow`` rows as a ``Dataset`` whose columns are the union of all rows' keys.

    (``Dataset.from_list`` and ``pa.Table.from_pylist`` take the columns from the first row only and silently
    drop a ``tools`` column that row lacks.)
    """
    normalized = [normalize_row_for_arrow(r) for r in rows]
    columns = list(dict.fromkeys(k for r in normalized for k in r))
    return datasets.Dataset.from_dict({k: [r.get(k) for r in normalized] for k in columns})


def local_path(path_or_id: str | os.PathLike) -> Path | None:
    """The local file or folder ``path_or_id`` names; None for a hub dataset id (prepared and streamed sources alike).

    A name that looks local (a path object, a data-file suffix, a leading ``.`` / ``/`` / ``~``, more than one ``/``,
    or a first component that is a local folder) but does not exist is a ``FileNotFoundError`` now, never a hub lookup
    (which would fail later with a confusing "Couldn't reach ... on the Hub").
    """
    text = os.fspath(path_or_id)
    path = Path(os.path.expanduser(text))
    if path.exists():
        return path
    parts = Path(text).parts
    looks_local = (
        isinstance(path_or_id, os.PathLike)
        or text.lower().endswith(tuple(_FILE_KINDS))
        or text.startswith((".", "/", "~"))
        or text.count("/") > 1
        or (len(parts) > 1 and Path(parts[0]).is_dir())
    )
    if looks_local:
        raise FileNotFoundError(
            f"no such file or folder: {path.absolute()} (fix the data path; a hub dataset is given as org/name)"
        )
    return None


def _load_local(path: Path, cache_dir: str | None) -> datasets.Dataset:
    files = sorted(p for p in path.iterdir() if p.suffix.lower() in _FILE_KINDS) if path.is_dir() else [path]
    if not files:
        raise FileNotFoundError(f"no .jsonl / .json / .parquet files in {path.absolute()}")
    kinds = {_FILE_KINDS.get(p.suffix.lower()) for p in files}
    if None in kinds or len(kinds) != 1:
        raise ValueError(f"data files must all be .jsonl / .json or all .parquet, got {[p.name for p in files]}")
    if kinds == {"parquet"}:
        data_files = [str(p) for p in files]
        return datasets.load_dataset("parquet", data_files=data_files, split="train", cache_dir=cache_dir)
    return load_json_rows(files, cache_dir)


def hub_cache_roots(cache_dir: str | None) -> tuple[str, ...]:
    """Where ``datasets`` itself puts a hub dataset's image files (an image folder's images stay paths there)."""
    return (str(cache_dir or datasets.config.HF_DATASETS_CACHE), str(huggingface_hub.constants.HF_HUB_CACHE))


def _lazy_images(ds: datasets.Dataset) -> datasets.Dataset:
    """Cast image columns to ``decode=False``: decoding (and its failures) happens per sample, in the renderer."""
    for name, feature in ds.features.items():
        if isinstance(feature, datasets.Image) and feature.decode:
            ds = ds.cast_column(name, datasets.Image(decode=False))
        elif isinstance(feature, datasets.List | datasets.Sequence):
            inner = feature.feature
            if isinstance(inner, datasets.Image) and inner.decode:
                ds = ds.cast_column(name, datasets.List(datasets.Image(decode=False)))
    return ds


def load_conversations(
    path_or_id: str | os.PathLike,
    *,
    split: str = "train",
    image_root: str | os.PathLike | None = None,
    allowed_image_roots: Iterable[str | os.PathLike] = (),
    cache_dir: str | None = None,
    **load_kwargs: Any,
) -> ConversationSource:
    """Load a local file / folder (jsonl, json, parquet) or a hub dataset id as a ``ConversationSource``.

    ``split`` applies to hub datasets (a local file is one split). Image paths resolve against ``image_root``, by
    default the data file's folder (a hub dataset has none), and must lie in it or in ``allowed_image_roots`` (a
    hub dataset may also read the ``datasets`` / hub caches, where ``datasets`` keeps its own image files).
    A missing local path raises ``FileNotFoundError`` without asking the hub.
    """
    local = local_path(path_or_id)
    allowed = tuple(allowed_image_roots)
    if local is not None:
        ds = _load_local(local, cache_dir)
        root = image_root if image_root is not None else (local if local.is_dir() else local.parent)
    else:
        ds = datasets.load_dataset(str(path_or_id), split=split, cache_dir=cache_dir, **load_kwargs)
        root, allowed = image_root, allowed + hub_cache_roots(cache_dir)
    return ConversationSource(ds, image_root=root, allowed_image_roots=allowed, name=os.fspath(path_or_id))


class ConversationSource:
    """Random access to the conversations of a ``datasets.Dataset`` (rows converted on read)."""

    def __init__(
        self,
        dataset: datasets.Dataset,
        *,
        image_root: str | os.PathLike | None = None,
        allowed_image_roots: Iterable[str | os.PathLike] = (),
        name: str = "dataset",
    ):
        self.json_rows = is_json_rows(dataset)
        """True for ``json_rows`` storage (rows kept as JSON text), False for typed columns (parquet, hub)."""
        columns = row_keys(dataset) if self.json_rows else set(dataset.column_names)
        if "messages" in columns:
            self.shape = "messages"
        elif "conversations" in columns:
            self.shape = "sharegpt"
        else:
            raise ValueError(
                f"{name}: no 'messages' or 'conversations' column (columns: {sorted(columns)}); "
                "expected the OpenAI/HF chat shape or ShareGPT/LLaVA"
            )
        self.dataset = dataset if self.json_rows else _lazy_images(dataset)
        """The underlying rows (image columns not decoded)."""
        self.images = ImageRoots(image_root, tuple(allowed_image_roots))
        """Where images may be read from; every image path goes through it before the renderer sees it."""
        self.image_root = None if self.images.root is None else Path(self.images.root)
        """Folder that relative image paths resolve against (None: none; only allowed roots' images are read)."""
        self.convert = RowConverter(self.shape, self.images)
        """Row dict -> ``Conversation``."""
        self.name = name

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> Conversation:
        if not 0 <= index < len(self.dataset):
            raise IndexError(f"{self.name}: row {index} out of range (len {len(self.dataset)})")
        try:
            row = self.row(index)
        except RenderError as e:
            raise e.with_index(index) from e
        return self.convert(row, index)

    def row(self, index: int) -> dict:
        """Row ``index`` as stored (``RenderError("malformed_row")`` for a line that was not a JSON object)."""
        if self.json_rows:
            return decode_row(self.dataset[index])
        return drop_none(self.dataset[index])

    def column(self, name: str) -> list | None:
        """Column ``name`` of every row, in row order (None for rows without it); None when no row has it.

        Works for both storage forms (``dataset[name]`` does not: json rows are stored as JSON text).
        """
        if self.json_rows:
            return column_values(self.dataset, name)
        return list(self.dataset[name]) if name in self.dataset.column_names else None


@dataclass(frozen=True)
class RowConverter:
    """One raw row (a dict as the data holds it) to a ``Conversation``: the row shape's rules, numbers as text, every
    image path through the image-root policy. Picklable; usable on rows from anywhere (a streamed row too)."""

    shape: str | None
    """``messages`` or ``sharegpt``; None: decided per row by its keys."""
    images: ImageRoots
    """Where images may be read from."""

    def __call__(self, row: Mapping, index: int = -1) -> Conversation:
        """The conversation of ``row``; ``RenderError`` naming ``index`` when the row cannot be one."""
        try:
            shape = self.shape or _shape_of(row)
            tools = _tools(row.get("tools"))
            messages = self._messages_row(row) if shape == "messages" else self._sharegpt_row(row)
        except RenderError as e:
            raise e.with_index(index) from e
        return Conversation(messages=messages, tools=tools, index=index)

    def _column_images(self, row: Mapping) -> list:
        for column in _IMAGE_COLUMNS:
            if row.get(column) is not None:
                value = row[column]
                return [self.images.resolve(v) for v in (value if isinstance(value, list) else [value])]
        return []

    def _messages_row(self, row: Mapping) -> list[dict]:
        if not isinstance(row.get("messages"), list):
            kind = type(row.get("messages")).__name__ if "messages" in row else "missing"
            raise RenderError("bad_message", f"'messages' is {kind}, not a list")
        pending = self._column_images(row)
        used = 0
        messages = []
        for m in row["messages"]:
            if not isinstance(m, Mapping):
                messages.append(m)  # the renderer names what is wrong with it
                continue
            m = message_numbers_as_text(m)
            if isinstance(m.get("content"), list):
                blocks = []
                for block in m["content"]:
                    if isinstance(block, Mapping) and block.get("type") == "image" and not _has_source(block):
                        if used >= len(pending):
                            raise RenderError(
                                "image_count_mismatch", f"more image blocks than the {len(pending)} images"
                            )
                        block = {"type": "image", "image": pending[used]}  # already resolved
                        used += 1
                    else:
                        block = self.images.resolve_block(block)
                    blocks.append(block)
                m["content"] = blocks
            messages.append(m)
        if pending and used == 0 and not any(_has_image_block(m) for m in messages):
            return _front_load(messages, pending)
        if used != len(pending):
            raise RenderError("image_count_mismatch", f"{used} image placeholders but {len(pending)} images in the row")
        return messages

    def _sharegpt_row(self, row: Mapping) -> list[dict]:
        turns = row.get("conversations")
        if not isinstance(turns, list):
            kind = type(turns).__name__ if "conversations" in row else "missing"
            raise RenderError("bad_message", f"'conversations' is {kind}, not a list")
        if not all(isinstance(t, Mapping) for t in turns):
            raise RenderError("bad_message", "a ShareGPT turn is not an object {from, value}")
        images = self._column_images(row)
        values = [_turn_text(t) for t in turns]
        markers = sum(v.count(IMAGE_MARKER) for v in values if isinstance(v, str))
        if markers and markers != len(images):
            raise RenderError("image_count_mismatch", f"{markers} {IMAGE_MARKER} markers but {len(images)} images")
        messages: list[dict] = []
        system = as_text(row.get("system"))
        if isinstance(system, str) and system.strip():
            messages.append({"role": "system", "content": system})
        queue = list(images)
        front_loaded = not markers and bool(images)
        for turn, value in zip(turns, values, strict=True):
            speaker = str(turn.get("from", turn.get("role", "")))
            role = SHAREGPT_ROLES.get(speaker.lower())
            if role is None:
                raise RenderError("unknown_role", f"ShareGPT speaker {speaker!r}; known: {', '.join(SHAREGPT_ROLES)}")
            if not isinstance(value, str):
                raise RenderError("bad_content", f"ShareGPT value of type {type(value).__name__}")
            blocks: list[dict] = []
            if front_loaded and role == "user":
                blocks += [{"type": "image", "image": img} for img in queue]
                queue, front_loaded = [], False
            pieces = value.split(IMAGE_MARKER)
            for i, piece in enumerate(pieces):
                if i > 0:
                    blocks.append({"type": "image", "image": queue.pop(0)})
                if piece:
                    blocks.append({"type": "text", "text": piece})
            messages.append({"role": role, "content": blocks if any(b["type"] == "image" for b in blocks) else value})
        if queue:
            raise RenderError("image_count_mismatch", f"{len(queue)} images left over: no user turn to put them in")
        return messages


def _shape_of(row: Mapping) -> str:
    if "messages" in row:
        return "messages"
    if "conversations" in row:
        return "sharegpt"
    raise RenderError("bad_message", f"a row with neither 'messages' nor 'conversations' (keys: {sorted(row)[:8]})")


def _turn_text(turn: Mapping) -> Any:
    """A ShareGPT turn's text: ``value`` (or ``content``), a number as its JSON text, null as empty."""
    value = turn.get("value", turn.get("content"))
    return "" if value is None else as_text(value)


def _front_load(messages: list[dict], images: list) -> list[dict]:
    """Put images in front of the first user turn (LLaVA's convention when the text has no placeholder)."""
    for i, m in enumerate(messages):
        if m.get("role") == "user":
            content = m.get("content")
            text = string_content_to_blocks(content if content is not None else "")
            messages[i] = {**m, "content": [*({"type": "image", "image": img} for img in images), *text]}
            return messages
    raise RenderError("image_count_mismatch", f"{len(images)} images but no user turn to put them in")


def _has_source(block: Mapping) -> bool:
    return any(block.get(k) is not None for k in ("image", "url", "path", "base64", "image_url"))


def _has_image_block(message: Mapping) -> bool:
    content = message.get("content")
    return isinstance(content, list) and any(isinstance(b, Mapping) and b.get("type") == "image" for b in content)


def _tools(value: Any) -> list[dict] | None:
    if value is None or value == "" or value == []:
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise RenderError("bad_tools", f"'tools' is not valid JSON: {value!r:.80}") from e
    if not isinstance(value, list) or not all(isinstance(t, Mapping) for t in value):
        raise RenderError("bad_tools", f"'tools' must be a list of tool schemas, got {type(value).__name__}")
    return [dict(t) for t in value]


@dataclass(frozen=True)
class RenderFn:
    """``index -> RenderedSample`` for the packing pipeline; picklable, so dataloader workers can hold it."""

    source: ConversationSource
    """Where rows come from."""
    renderer: Any
    """Anything with ``render(messages, *, tools, sample_index) -> RenderedSample``."""

    def __call__(self, index: int) -> RenderedSample:
        return render_conversation(self.renderer, self.source[index])  # conversion errors already name the row


@dataclass(frozen=True)
class RowRenderFn:
    """``(raw row, index) -> RenderedSample`` for rows read elsewhere (a stream): the same conversion, image policy
    and rendering as ``RenderFn``; picklable."""

    convert: RowConverter
    """Row shape rules, numbers as text, the image-root policy."""
    renderer: Any
    """Anything with ``render(messages, *, tools, sample_index) -> RenderedSample``."""

    def __call__(self, row: Mapping, index: int) -> RenderedSample:
        return render_conversation(self.renderer, self.convert(row, index))


def render_conversation(renderer: Any, conversation: Conversation) -> RenderedSample:
    """The rendered sample of ``conversation``, carrying its row index."""
    return renderer.render(conversation.messages, tools=conversation.tools, sample_index=conversation.index)


def render_fn(source: ConversationSource, renderer: Any) -> Callable[[int], RenderedSample]:
    """The adapter the packing pipeline calls: a rendered sample with ``sample_index`` set, or a ``RenderError``
    naming the row (a ``SampleError`` subclass, which the pipeline counts as a skip)."""
    return RenderFn(source, renderer)
