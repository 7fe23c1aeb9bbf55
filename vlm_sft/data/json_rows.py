"""Lossless json / jsonl loading: every row reaches the renderer exactly as written, bad lines become counted skips.

Why not ``datasets.load_dataset("json")``: its builder infers one Arrow type per column, so a file whose rows mix
string and block content either fails outright or falls back to pandas ``read_json``, which decodes ``"4"``,
``"0.5"``, ``"true"`` into numbers, ``"007"`` into 7 and ``"null"`` into nothing; and one bad line (``{not json``,
a JSON array, a blank line) kills the whole file with no line number.

So the lines are parsed here, one at a time, and ``datasets`` is kept only as the storage (Arrow, memory-mapped,
cached): one row per data row holding its JSON text (``row_json``, decoded again on read, so types never meet), its
``row_file`` and 1-based ``row_line``, its top-level ``row_keys`` (so the source can see its columns without
decoding every row) and, for a line that is not a JSON object, the ``row_error`` that ``decode_row`` raises as
``RenderError("malformed_row", "<file>:<line>: ...")``. The cache is keyed on the files' paths, sizes and mtimes,
so an edited file is read again.

A ``.json`` file is one array of row objects, or ``{"data": [...]}``; its rows carry the line their object starts
on. A ``.json`` file that is not valid JSON as a whole cannot be split into rows, so it raises ``DataFileError``
naming the line and column (use ``.jsonl`` to make one bad row a skip rather than an error).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from collections.abc import Iterator, Sequence
from pathlib import Path

import datasets
import pyarrow.compute as pc

from renderers.errors import RenderError

logger = logging.getLogger(__name__)

ROW_JSON = "row_json"
"""Column holding a row's JSON text as written (None for a malformed line)."""
ROW_FILE = "row_file"
"""Column holding the absolute path of the file a row came from."""
ROW_LINE = "row_line"
"""Column holding the 1-based line a row (or a ``.json`` array element) starts on."""
ROW_ERROR = "row_error"
"""Column holding what is wrong with a malformed line (None for a good row)."""
ROW_KEYS = "row_keys"
"""Column holding a row's top-level keys, so the source knows its columns without decoding rows."""

FEATURES = datasets.Features(
    {
        ROW_JSON: datasets.Value("large_string"),  # rows with inline base64 images can exceed 2 GiB per batch
        ROW_FILE: datasets.Value("string"),
        ROW_LINE: datasets.Value("int64"),
        ROW_ERROR: datasets.Value("string"),
        ROW_KEYS: datasets.List(datasets.Value("string")),
    }
)
_FORMAT_VERSION = 1  # bump when the stored columns change, so old caches are not reused
_WHITESPACE = re.compile(r"[ \t\n\r]*")
_BOM = b"\xef\xbb\xbf"
_DECODER = json.JSONDecoder()


class DataFileError(ValueError):
    """A data file that cannot be split into rows at all (a ``.json`` file with broken syntax, or of the wrong shape)."""


def load_json_rows(files: Sequence[Path], cache_dir: str | None = None) -> datasets.Dataset:
    """The rows of json / jsonl ``files`` (in order) as a cached ``Dataset`` of ``FEATURES`` columns."""
    paths = [str(Path(f).resolve()) for f in files]
    stats = [(p, st.st_size, st.st_mtime_ns) for p, st in ((p, os.stat(p)) for p in paths)]
    fingerprint = hashlib.sha256(json.dumps([_FORMAT_VERSION, stats]).encode()).hexdigest()[:40]
    try:
        ds = datasets.Dataset.from_generator(
            _generate, features=FEATURES, cache_dir=cache_dir, gen_kwargs={"files": paths}, fingerprint=fingerprint
        )
    except datasets.exceptions.DatasetGenerationError as e:
        if isinstance(e.__cause__, DataFileError):  # our own message, not datasets' generic wrapper
            raise e.__cause__ from None
        raise
    errors = ds.data.column(ROW_ERROR)
    malformed = len(errors) - errors.null_count
    if malformed:
        first = ds[pc.index(pc.is_valid(errors), True).as_py()]
        logger.warning(
            "%d malformed line(s) will be skipped as malformed_row; the first: %s:%d: %s",
            malformed,
            first[ROW_FILE],
            first[ROW_LINE],
            first[ROW_ERROR],
        )
    return ds


def is_json_rows(dataset: datasets.Dataset) -> bool:
    """Whether ``dataset`` is the storage ``load_json_rows`` writes."""
    return set(dataset.column_names) == set(FEATURES)


def row_keys(dataset: datasets.Dataset) -> set[str]:
    """Every top-level key any row of a ``load_json_rows`` dataset has (its columns, as a table would see them)."""
    keys = pc.unique(pc.list_flatten(dataset.data.column(ROW_KEYS)))
    return {k for k in keys.to_pylist() if k is not None}


def decode_row(record: dict) -> dict:
    """A stored record back to the row as written, or ``RenderError("malformed_row")`` naming file and line."""
    if record[ROW_ERROR] is not None:
        raise RenderError("malformed_row", f"{record[ROW_FILE]}:{record[ROW_LINE]}: {record[ROW_ERROR]}")
    return json.loads(record[ROW_JSON])


def column_values(dataset: datasets.Dataset, name: str) -> list | None:
    """Row ``name`` of every row (None where a row lacks it or is malformed); None when no row has the key."""
    if name not in row_keys(dataset):
        return None
    values: list = []
    for batch in dataset.select_columns([ROW_JSON]).iter(batch_size=4096):  # not the whole JSON text at once
        values += [None if text is None else json.loads(text).get(name) for text in batch[ROW_JSON]]
    return values


def _generate(files: list[str]) -> Iterator[dict]:
    for path in files:
        yield from (_jsonl_records if path.endswith(".jsonl") else _json_records)(path)


def _record(path: str, line: int, text: str | None, keys: list[str], error: str | None = None) -> dict:
    return {ROW_JSON: text, ROW_FILE: path, ROW_LINE: line, ROW_ERROR: error, ROW_KEYS: keys}


def _jsonl_records(path: str) -> Iterator[dict]:
    """One record per line; a line that is not one JSON object becomes an error record, never an exception."""
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            if number == 1:
                raw = raw.removeprefix(_BOM)
            try:
                text = raw.decode("utf-8").strip()
            except UnicodeDecodeError as e:
                yield _record(path, number, None, [], f"not valid UTF-8 ({e.reason} at byte {e.start})")
                continue
            if not text:
                yield _record(path, number, None, [], "blank line (a .jsonl file holds one JSON object per line)")
                continue
            try:
                value = json.loads(text)
            except json.JSONDecodeError as e:
                yield _record(path, number, None, [], f"not valid JSON: {e.msg} at column {e.colno}")
                continue
            except RecursionError:
                yield _record(path, number, None, [], "JSON nested too deeply to read")
                continue
            except ValueError as e:  # e.g. an integer past Python's 4300-digit conversion limit
                yield _record(path, number, None, [], f"not readable JSON: {e}")
                continue
            error = _not_a_row(value)
            yield _record(path, number, None if error else text, [] if error else list(value), error)


def _not_a_row(value: object) -> str | None:
    if isinstance(value, dict):
        return None
    kind = "array" if isinstance(value, list) else type(value).__name__
    return f"a JSON {kind} where a row object {{...}} was expected"


def _json_records(path: str) -> Iterator[dict]:
    """One record per element of the file's row array, each with the line its element starts on."""
    try:
        text = Path(path).read_bytes().removeprefix(_BOM).decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataFileError(f"{path}: not valid UTF-8 ({e.reason} at byte {e.start})") from e
    try:
        document = json.loads(text)
    except json.JSONDecodeError as e:
        raise DataFileError(
            f"{path}:{e.lineno}:{e.colno}: not valid JSON ({e.msg}); fix it, or write the rows as .jsonl (one object "
            "per line), where a bad line only skips that row"
        ) from e
    start = _rows_array_start(text, document, path)
    line, counted = 1, 0
    for begin, end, value in _array_elements(text, start):
        line += text.count("\n", counted, begin)
        counted = begin
        error = _not_a_row(value)
        yield _record(path, line, None if error else text[begin:end], [] if error else list(value), error)


def _rows_array_start(text: str, document: object, path: str) -> int:
    """Offset of the ``[`` of the row array: the document itself, or the value of its (last) ``"data"`` key."""
    if isinstance(document, list):
        return _skip_space(text, 0)
    if not isinstance(document, dict) or not isinstance(document.get("data"), list):
        shape = f"an object with keys {sorted(document)[:8]}" if isinstance(document, dict) else type(document).__name__
        raise DataFileError(f'{path}: a .json data file is an array of rows or {{"data": [rows]}}, got {shape}')
    pos, found = _skip_space(text, _skip_space(text, 0) + 1), -1
    while text[pos] != "}":
        key, pos = _DECODER.raw_decode(text, pos)
        pos = _skip_space(text, _skip_space(text, pos) + 1)  # past the ':'
        if key == "data":
            found = pos
        _, pos = _DECODER.raw_decode(text, pos)
        pos = _skip_space(text, pos)
        if text[pos] == ",":
            pos = _skip_space(text, pos + 1)
    return found


def _array_elements(text: str, start: int) -> Iterator[tuple[int, int, object]]:
    """``(begin, end, value)`` of each element of the (already validated) JSON array whose ``[`` is at ``start``."""
    pos = _skip_space(text, start + 1)
    while text[pos] != "]":
        value, end = _DECODER.raw_decode(text, pos)
        yield pos, end, value
        pos = _skip_space(text, end)
        if text[pos] == ",":
            pos = _skip_space(text, pos + 1)


def _skip_space(text: str, pos: int) -> int:
    match = _WHITESPACE.match(text, pos)
    assert match is not None  # the pattern matches the empty string
    return match.end()
