"""Dataset sources: load chat data with Hugging Face ``datasets`` and hand out conversations in one shape.

Accepted row shapes (detected from the columns):

- **messages** (OpenAI / HF chat): ``messages: [{role, content}]`` where ``content`` is a string or typed blocks;
  image blocks hold a path / bytes / data URI, or are bare ``{"type": "image"}`` placeholders filled in order from
  an ``images`` (or ``image``) column. Optional ``tools`` column (a list, or a JSON string).
- **ShareGPT / LLaVA**: ``conversations: [{from, value}]`` with ``<image>`` markers in the text, images from an
  ``image`` / ``images`` column (paths, or the datasets ``Image`` feature). Without any marker the images go in
  front of the first user turn (LLaVA's convention). Optional ``system`` and ``tools`` columns.

Files whose rows mix plain-string and block content cannot become one Arrow table as they are ("cannot mix list
and non-list values"); ``normalize_row_for_arrow`` turns string content into ``[{"type": "text", ...}]`` blocks
(and tool-call arguments / tools into JSON strings) so they can. Arrow then fills every struct field another row
had with ``None``; ``drop_none`` removes those again when a row is read. Image columns are read with
``Image(decode=False)`` so images stay encoded bytes until the renderer decodes (and hashes) them. Relative image
paths resolve against ``image_root``, by default the data file's folder. Every ``Conversation`` carries its row
index, and conversion problems raise ``RenderError`` naming that row.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import datasets
import pyarrow as pa

from renderers.content import drop_none, string_content_to_blocks
from renderers.errors import RenderError
from renderers.types import RenderedSample

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

_FILE_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}
_IMAGE_COLUMNS = ("images", "image")


@dataclass(frozen=True)
class Conversation:
    """One dataset row as a chat conversation."""

    messages: list[dict]
    """Messages in the OpenAI / HF chat shape (roles system / user / assistant / tool, typed blocks)."""
    tools: list[dict] | None
    """Tool schemas offered in this conversation, or None."""
    index: int
    """Row index in the source dataset, for error reports and accounting."""


def normalize_row_for_arrow(row: Mapping) -> dict:
    """A row that Arrow can store next to any other row: block content, JSON-string arguments and tools.

    Use before ``Dataset.from_list`` / ``to_parquet`` on data whose rows mix string and block content.
    """
    out = dict(row)
    if isinstance(out.get("messages"), list):
        messages = []
        for m in out["messages"]:
            m = dict(m)
            m["content"] = string_content_to_blocks(m.get("content") if m.get("content") is not None else "")
            if m.get("tool_calls"):
                m["tool_calls"] = [_arguments_to_json(c) for c in m["tool_calls"]]
            messages.append(m)
        out["messages"] = messages
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


def _read_json_rows(path: Path) -> list[dict]:
    if path.suffix == ".jsonl":
        with path.open(encoding="utf-8") as f:
            return [json.loads(line) for line in f if line.strip()]
    data = json.loads(path.read_text(encoding="utf-8"))
    return data if isinstance(data, list) else list(data.get("data", []))


def _load_local(path: Path, cache_dir: str | None) -> datasets.Dataset:
    files = sorted(p for p in path.iterdir() if p.suffix in _FILE_BUILDERS) if path.is_dir() else [path]
    if not files:
        raise FileNotFoundError(f"no .jsonl / .json / .parquet files in {path}")
    kinds = {_FILE_BUILDERS.get(p.suffix) for p in files}
    if None in kinds or len(kinds) != 1:
        raise ValueError(f"data files must all be .jsonl / .json or all .parquet, got {[p.name for p in files]}")
    builder = kinds.pop()
    data_files = [str(p) for p in files]
    try:
        return datasets.load_dataset(builder, data_files=data_files, split="train", cache_dir=cache_dir)
    except (pa.ArrowInvalid, pa.ArrowTypeError, datasets.exceptions.DatasetGenerationError) as e:
        if builder != "json":
            raise
        logger.info("%s: Arrow could not unify the rows as they are (%s); normalizing content blocks", path, e)
        return load_json_normalized(files)


def rows_to_dataset(rows: list[Mapping]) -> datasets.Dataset:
    """``normalize_row_for_arrow`` rows as a ``Dataset`` whose columns are the union of all rows' keys.

    (``Dataset.from_list`` and ``pa.Table.from_pylist`` take the columns from the first row only and silently
    drop a ``tools`` column that row lacks.)
    """
    normalized = [normalize_row_for_arrow(r) for r in rows]
    columns = list(dict.fromkeys(k for r in normalized for k in r))
    return datasets.Dataset.from_dict({k: [r.get(k) for r in normalized] for k in columns})


def load_json_normalized(files: list[Path]) -> datasets.Dataset:
    """Read json / jsonl rows in Python and build the Arrow table from normalized rows (``rows_to_dataset``)."""
    return rows_to_dataset([r for f in files for r in _read_json_rows(Path(f))])


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
    cache_dir: str | None = None,
    **load_kwargs: Any,
) -> ConversationSource:
    """Load a local file / folder (jsonl, json, parquet) or a hub dataset id as a ``ConversationSource``.

    ``split`` applies to hub datasets (a local file is one split). Relative image paths resolve against
    ``image_root``, by default the data file's folder.
    """
    path = Path(path_or_id)
    if path.exists():
        ds = _load_local(path, cache_dir)
        base = Path(image_root) if image_root is not None else (path if path.is_dir() else path.parent)
    else:
        ds = datasets.load_dataset(str(path_or_id), split=split, cache_dir=cache_dir, **load_kwargs)
        base = Path(image_root) if image_root is not None else None
    return ConversationSource(ds, image_root=base, name=str(path_or_id))


class ConversationSource:
    """Random access to the conversations of a ``datasets.Dataset`` (rows converted on read)."""

    def __init__(self, dataset: datasets.Dataset, *, image_root: Path | None = None, name: str = "dataset"):
        columns = set(dataset.column_names)
        if "messages" in columns:
            self.shape = "messages"
        elif "conversations" in columns:
            self.shape = "sharegpt"
        else:
            raise ValueError(
                f"{name}: no 'messages' or 'conversations' column (columns: {sorted(columns)}); "
                "expected the OpenAI/HF chat shape or ShareGPT/LLaVA"
            )
        self.dataset = _lazy_images(dataset)
        """The underlying rows (image columns not decoded)."""
        self.image_root = image_root
        """Folder that relative image paths resolve against (None: the working directory)."""
        self.name = name

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> Conversation:
        if not 0 <= index < len(self.dataset):
            raise IndexError(f"{self.name}: row {index} out of range (len {len(self.dataset)})")
        row = drop_none(self.dataset[index])
        try:
            tools = _tools(row.get("tools"))
            messages = self._messages_row(row) if self.shape == "messages" else self._sharegpt_row(row)
        except RenderError as e:
            raise e.with_index(index) from e
        return Conversation(messages=messages, tools=tools, index=index)

    def _resolve(self, source: Any) -> Any:
        """Relative path strings (also inside ``{"bytes", "path"}`` dicts without bytes) against ``image_root``."""
        if isinstance(source, Mapping):
            if source.get("bytes") is None and isinstance(source.get("path"), str):
                return {"bytes": None, "path": self._resolve(source["path"])}
            return source
        if not isinstance(source, str) or self.image_root is None:
            return source
        if source.startswith(("data:", "file://", "http://", "https://")) or os.path.isabs(source):
            return source
        return str(self.image_root / source)

    def _column_images(self, row: Mapping) -> list:
        for column in _IMAGE_COLUMNS:
            if column in row:
                value = row[column]
                return [self._resolve(v) for v in (value if isinstance(value, list) else [value])]
        return []

    def _messages_row(self, row: Mapping) -> list[dict]:
        if not isinstance(row["messages"], list):
            raise RenderError("bad_message", f"'messages' is a {type(row['messages']).__name__}, not a list")
        pending = self._column_images(row)
        used = 0
        messages = []
        for m in row["messages"]:
            m = dict(m)
            content = m.get("content")
            if isinstance(content, list):
                blocks = []
                for block in content:
                    if isinstance(block, Mapping) and block.get("type") == "image" and not _has_source(block):
                        if used >= len(pending):
                            raise RenderError(
                                "image_count_mismatch", f"more image blocks than the {len(pending)} images"
                            )
                        block = {"type": "image", "image": pending[used]}
                        used += 1
                    elif isinstance(block, Mapping) and block.get("type") in ("image", "image_url"):
                        block = {k: self._resolve(v) if k in ("image", "path", "url") else v for k, v in block.items()}
                    blocks.append(block)
                m["content"] = blocks
            messages.append(m)
        if pending and used == 0 and not any(_has_image_block(m) for m in messages):
            return _front_load(messages, pending)
        if used != len(pending):
            raise RenderError("image_count_mismatch", f"{used} image placeholders but {len(pending)} images in the row")
        return messages

    def _sharegpt_row(self, row: Mapping) -> list[dict]:
        turns = row["conversations"]
        if not isinstance(turns, list):
            raise RenderError("bad_message", f"'conversations' is a {type(turns).__name__}, not a list")
        images = self._column_images(row)
        markers = sum(str(t.get("value", "")).count(IMAGE_MARKER) for t in turns)
        if markers and markers != len(images):
            raise RenderError("image_count_mismatch", f"{markers} {IMAGE_MARKER} markers but {len(images)} images")
        messages: list[dict] = []
        if isinstance(row.get("system"), str) and row["system"].strip():
            messages.append({"role": "system", "content": row["system"]})
        queue = list(images)
        front_loaded = not markers and bool(images)
        for turn in turns:
            speaker = str(turn.get("from", turn.get("role", "")))
            role = SHAREGPT_ROLES.get(speaker.lower())
            if role is None:
                raise RenderError("unknown_role", f"ShareGPT speaker {speaker!r}; known: {', '.join(SHAREGPT_ROLES)}")
            value = turn.get("value", turn.get("content", ""))
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
        conversation = self.source[index]  # conversion errors already name the row
        return self.renderer.render(conversation.messages, tools=conversation.tools, sample_index=index)


def render_fn(source: ConversationSource, renderer: Any) -> Callable[[int], RenderedSample]:
    """The adapter the packing pipeline calls: a rendered sample with ``sample_index`` set, or a ``RenderError``
    naming the row (a ``SampleError`` subclass, which the pipeline counts as a skip)."""
    return RenderFn(source, renderer)
