"""Dataset sources: load chat data and hand out conversations in one canonical shape, exactly as the data wrote them.

Which row schemas are read (``messages``, ShareGPT, ``texts`` pairs, prompt / completion, question / answer, or
columns mapped by the config) and how each becomes the canonical conversation is ``vlm_sft.data.schemas``'; where
the rows come from (a file, a folder of shards, a local snapshot of a hub dataset with its subsets, a hub id) is
decided here and in ``vlm_sft.data.snapshots``.

Storage. Local json / jsonl files are read line by line in Python (``json_rows``) and stored as their JSON text, so
a string stays a string whatever the other rows hold and a bad line is one ``malformed_row`` skip naming its file
and line. Parquet files and hub datasets go through ``datasets.load_dataset`` (typed columns): Arrow fills every
struct field another row had with ``None``, which ``drop_none`` removes again on read; image columns are read with
``Image(decode=False)`` so images stay encoded bytes until the renderer decodes (and hashes) them. To write parquet
from rows that mix string and block content, use ``rows_to_dataset`` (``normalize_row_for_arrow``).

Image paths resolve against the image root (by default the data file's folder) and must lie inside it or an allowed
root (``image_roots``). Every ``Conversation`` carries its row index, and conversion problems raise ``RenderError``
naming that row.
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
from vlm_sft.data.schemas import (
    AUTO,
    Conversation,
    RowConverter,
    RowMapping,
    Schema,
    as_text,
    detect_schema,
    message_numbers_as_text,
)
from vlm_sft.data.snapshots import DATA_SUFFIXES, snapshot_files

logger = logging.getLogger(__name__)


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
        or text.lower().endswith(tuple(DATA_SUFFIXES))
        or text.startswith((".", "/", "~"))
        or text.count("/") > 1
        or (len(parts) > 1 and Path(parts[0]).is_dir())
    )
    if looks_local:
        raise FileNotFoundError(
            f"no such file or folder: {path.absolute()} (fix the data path; a hub dataset is given as org/name)"
        )
    return None


def _load_local(path: Path, *, subset: str | None, split: str, cache_dir: str | None) -> tuple[datasets.Dataset, str]:
    """The rows of a local file, folder or snapshot (``snapshots``), and how its files were picked."""
    found = snapshot_files(path, subset=subset, split=split)
    what = found.layout + (f", subset {found.subset!r}" if found.subset else "") + f", {len(found.files)} file(s)"
    if found.kind == "parquet":
        ds = datasets.load_dataset("parquet", data_files=list(found.files), split="train", cache_dir=cache_dir)
        return ds, what
    return load_json_rows([Path(f) for f in found.files], cache_dir), what


def hub_cache_roots(cache_dir: str | None) -> tuple[str, ...]:
    """Where ``datasets`` itself puts a hub dataset's image files (an image folder's images stay paths there)."""
    return (str(cache_dir or datasets.config.HF_DATASETS_CACHE), str(huggingface_hub.constants.HF_HUB_CACHE))


def _lazy_images(ds: datasets.Dataset) -> datasets.Dataset:
    """Cast image and video columns to ``decode=False``: decoding (and its failures) happens per sample, in the
    renderer (``datasets``' own video decoding would need torchcodec)."""
    for name, feature in ds.features.items():
        if isinstance(feature, datasets.Image | datasets.Video) and feature.decode:
            ds = ds.cast_column(name, type(feature)(decode=False))
        elif isinstance(feature, datasets.List | datasets.Sequence):
            inner = feature.feature
            if isinstance(inner, datasets.Image | datasets.Video) and inner.decode:
                ds = ds.cast_column(name, datasets.List(type(inner)(decode=False)))
    return ds


def load_conversations(
    path_or_id: str | os.PathLike,
    *,
    split: str = "train",
    subset: str | None = None,
    mapping: RowMapping = AUTO,
    image_root: str | os.PathLike | None = None,
    allowed_image_roots: Iterable[str | os.PathLike] = (),
    cache_dir: str | None = None,
    **load_kwargs: Any,
) -> ConversationSource:
    """Load a local file / folder / hub snapshot (jsonl, json, parquet) or a hub dataset id as a
    ``ConversationSource`` read by ``mapping`` (``auto``: the schema recognised from the columns).

    ``subset`` is ``datasets``' config name (a snapshot's subset, ``snapshots``); ``split`` picks a hub dataset's or a
    snapshot's files (a single local file is one split). Image paths resolve against ``image_root``, by default the
    data file's folder (a hub dataset has none), and must lie in it or in ``allowed_image_roots`` (a hub dataset may
    also read the ``datasets`` / hub caches, where ``datasets`` keeps its own image files). A missing local path
    raises ``FileNotFoundError`` without asking the hub.
    """
    local = local_path(path_or_id)
    allowed = tuple(allowed_image_roots)
    if local is not None:
        ds, files = _load_local(local, subset=subset, split=split, cache_dir=cache_dir)
        root = image_root if image_root is not None else (local if local.is_dir() else local.parent)
    else:
        if subset is not None:
            load_kwargs = {"name": subset, **load_kwargs}
        ds = datasets.load_dataset(str(path_or_id), split=split, cache_dir=cache_dir, **load_kwargs)
        root, allowed = image_root, allowed + hub_cache_roots(cache_dir)
        files = f"hub dataset, subset {subset!r}, split {split!r}" if subset else f"hub dataset, split {split!r}"
    source = ConversationSource(
        ds, mapping=mapping, image_root=root, allowed_image_roots=allowed, name=os.fspath(path_or_id)
    )
    source.files = files
    return source


class ConversationSource:
    """Random access to the canonical conversations of a ``datasets.Dataset`` (rows converted on read)."""

    def __init__(
        self,
        dataset: datasets.Dataset,
        *,
        mapping: RowMapping = AUTO,
        image_root: str | os.PathLike | None = None,
        allowed_image_roots: Iterable[str | os.PathLike] = (),
        name: str = "dataset",
    ):
        self.json_rows = is_json_rows(dataset)
        """True for ``json_rows`` storage (rows kept as JSON text), False for typed columns (parquet, hub)."""
        columns = row_keys(dataset) if self.json_rows else set(dataset.column_names)
        self.schema: Schema = detect_schema(columns, mapping, name=name)
        """How the rows are read (``schemas.detect_schema``), named in the start log and the data report."""
        self.dataset = dataset if self.json_rows else _lazy_images(dataset)
        """The underlying rows (image columns not decoded)."""
        self.images = ImageRoots(image_root, tuple(allowed_image_roots))
        """Where images may be read from; every image path goes through it before the renderer sees it."""
        self.image_root = None if self.images.root is None else Path(self.images.root)
        """Folder that relative image paths resolve against (None: none; only allowed roots' images are read)."""
        self.convert = RowConverter(self.schema, self.images)
        """Row dict -> canonical ``Conversation``."""
        self.name = name
        self.files = "in memory"
        """How the rows' files were found (``snapshots``), for the start log."""

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
