"""Local json / jsonl / parquet rows reach the renderer exactly as written; bad lines are counted skips with file:line.

The bugs these guard against (``datasets.load_dataset("json")``): one bad line (``{not json``, a JSON array, a blank
line) killed the whole file; in files mixing string and block content pandas decoded ``"4"`` / ``"0.5"`` /
``"true"`` into numbers, ``"007"`` into 7 and ``"null"`` into nothing, so those rows were skipped; in ShareGPT one
raw integer ``"value": 12`` turned every numeric-string answer of other rows into a skip.
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path

import pytest
import torch
from PIL import Image

from renderers import RenderError
from vlm_sft.data.json_rows import DataFileError
from vlm_sft.data.sources import load_conversations, render_fn, rows_to_dataset

ANSWERS = ["4", "0.5", "007", "true", "null", 12]
"""Assistant answers: numeric-looking strings pandas would decode, and one raw JSON number (trains as "12")."""


def message_row(answer, question="How many?") -> dict:
    """User content as blocks with an image, assistant content a plain string (or a raw number)."""
    return {
        "messages": [
            {
                "role": "user",
                "content": [{"type": "image", "image": "images/red.png"}, {"type": "text", "text": question}],
            },
            {"role": "assistant", "content": answer},
        ],
        "task": f"task-{answer}",
    }


GOOD_ROWS = [message_row(a) for a in ANSWERS] + [
    {  # a raw number inside a text block, and a text-only row with string content
        "messages": [{"role": "user", "content": [{"type": "text", "text": 4}]}, {"role": "assistant", "content": "2"}]
    },
]
MALFORMED = {2: b"{not json", 4: b"[1, 2]", 6: b"", 8: b"\xff\xfe not utf-8"}
"""1-based line -> a raw line that is not a row (bad JSON, an array, blank, bad UTF-8)."""


def write_lines(path: Path, rows: list[dict], bad: dict[int, bytes]) -> dict[int, int]:
    """Write ``rows`` as jsonl with the ``bad`` lines at their 1-based positions; returns row index -> line."""
    lines, where = [], {}
    good = iter(enumerate(rows))
    for number in range(1, len(rows) + len(bad) + 1):
        if number in bad:
            lines.append(bad[number])
        else:
            i, row = next(good)
            where[i] = number
            lines.append(json.dumps(row).encode())
    path.write_bytes(b"\n".join(lines) + b"\n")
    return where


def expected(row: dict, root: Path) -> list[dict]:
    """The original messages with image paths made absolute and raw numbers as their JSON text."""
    messages = copy.deepcopy(row["messages"])
    for m in messages:
        if isinstance(m["content"], list):
            for b in m["content"]:
                if b.get("type") == "image":
                    b["image"] = str(root / b["image"])
                elif not isinstance(b.get("text"), str):
                    b["text"] = json.dumps(b["text"])
        elif not isinstance(m["content"], str):
            m["content"] = json.dumps(m["content"])
    return messages


def assert_renders_as(renderer, source, index: int, messages: list[dict]) -> None:
    ours = render_fn(source, renderer)(index)
    ours.check()
    reference = renderer.render(messages)
    assert ours.sample_index == index
    assert torch.equal(ours.token_ids, reference.token_ids)
    assert torch.equal(ours.loss_mask, reference.loss_mask)


def assert_malformed(source, index: int, file_name: str, line: int) -> RenderError:
    with pytest.raises(RenderError) as info:
        source[index]
    assert info.value.reason == "malformed_row" and info.value.sample_index == index
    assert f"{file_name}:{line}:" in info.value.detail
    return info.value


@pytest.fixture
def data_dir(tmp_path) -> Path:
    (tmp_path / "images").mkdir()
    Image.new("RGB", (64, 64), "red").save(tmp_path / "images" / "red.png")
    return tmp_path


def test_jsonl_bad_lines_are_skips_and_numeric_strings_stay_text(renderer, data_dir):
    where = write_lines(data_dir / "train.jsonl", GOOD_ROWS, MALFORMED)
    source = load_conversations(data_dir / "train.jsonl", cache_dir=str(data_dir / "cache"))
    assert len(source) == len(GOOD_ROWS) + len(MALFORMED)  # one row per line, bad ones included
    for i, row in enumerate(GOOD_ROWS):
        index = where[i] - 1
        assert_renders_as(renderer, source, index, expected(row, data_dir))
    assert source[where[0] - 1].messages[1]["content"] == "4"
    assert source[where[2] - 1].messages[1]["content"] == "007"
    assert source[where[4] - 1].messages[1]["content"] == "null"
    assert source[where[5] - 1].messages[1]["content"] == "12"
    details = {line: assert_malformed(source, line - 1, "train.jsonl", line).detail for line in MALFORMED}
    assert "not valid JSON" in details[2] and "array" in details[4]
    assert "blank line" in details[6] and "UTF-8" in details[8]
    tasks = source.column("task")
    assert tasks[where[1] - 1] == "task-0.5" and tasks[1] is None and source.column("nope") is None


def test_sharegpt_raw_integer_value_leaves_other_rows_alone(renderer, data_dir):
    rows = [
        {
            "conversations": [{"from": "human", "value": "<image>\nHow many?"}, {"from": "gpt", "value": answer}],
            "image": "images/red.png",
        }
        for answer in ANSWERS
    ]
    where = write_lines(data_dir / "sharegpt.jsonl", rows, {3: b"{not json", 5: b"   "})
    source = load_conversations(data_dir / "sharegpt.jsonl", cache_dir=str(data_dir / "cache"))
    assert source.schema.format == "sharegpt"
    red = str(data_dir / "images" / "red.png")
    for i, answer in enumerate(ANSWERS):
        messages = [
            {"role": "user", "content": [{"type": "image", "image": red}, {"type": "text", "text": "\nHow many?"}]},
            {"role": "assistant", "content": answer if isinstance(answer, str) else json.dumps(answer)},
        ]
        assert source[where[i] - 1].messages == messages
        assert_renders_as(renderer, source, where[i] - 1, messages)
    assert_malformed(source, 2, "sharegpt.jsonl", 3)
    assert_malformed(source, 4, "sharegpt.jsonl", 5)
    # the same rows through parquet: the raw 12 would make Arrow refuse (or coerce) the column; it is text instead
    rows_to_dataset(rows).to_parquet(data_dir / "sharegpt.parquet")
    typed = load_conversations(data_dir / "sharegpt.parquet", cache_dir=str(data_dir / "cache"))
    for i in range(len(rows)):
        assert typed[i].messages == source[where[i] - 1].messages


def test_parquet_from_mixed_rows_is_lossless(renderer, data_dir):
    rows_to_dataset(GOOD_ROWS).to_parquet(data_dir / "train.parquet")
    source = load_conversations(data_dir / "train.parquet", cache_dir=str(data_dir / "cache"))
    assert not source.json_rows
    for i, row in enumerate(GOOD_ROWS):
        assert_renders_as(renderer, source, i, expected(row, data_dir))
    assert source.column("task")[:2] == ["task-4", "task-0.5"] and source.column("nope") is None


def test_json_array_and_data_object_files(renderer, data_dir):
    rows = [GOOD_ROWS[0], [1, 2], GOOD_ROWS[3]]
    (data_dir / "array.json").write_text("[\n" + ",\n".join(json.dumps(r, indent=1) for r in rows) + "\n]\n")
    (data_dir / "wrapped.json").write_text(json.dumps({"version": 1, "data": rows}, indent=2))
    for name in ("array.json", "wrapped.json"):
        source = load_conversations(data_dir / name, cache_dir=str(data_dir / "cache"))
        assert len(source) == 3
        assert_renders_as(renderer, source, 0, expected(GOOD_ROWS[0], data_dir))
        assert_renders_as(renderer, source, 2, expected(GOOD_ROWS[3], data_dir))
        lines = (data_dir / name).read_text().splitlines()
        bad_line = next(n for n, text in enumerate(lines, 1) if text.strip().startswith("[") and n > 1)
        assert "array" in assert_malformed(source, 1, name, bad_line).detail
    (data_dir / "broken.json").write_text('[\n{"messages": []},\n{"messages": [}\n]')
    with pytest.raises(DataFileError, match=r"broken\.json:3:15: not valid JSON.*\.jsonl"):
        load_conversations(data_dir / "broken.json", cache_dir=str(data_dir / "cache"))
    (data_dir / "scalar.json").write_text('{"rows": []}')
    with pytest.raises(DataFileError, match=r'\{"data": \[rows\]\}'):
        load_conversations(data_dir / "scalar.json", cache_dir=str(data_dir / "cache"))


def test_editing_the_file_invalidates_the_cache(data_dir):
    path = data_dir / "train.jsonl"
    path.write_text(json.dumps(message_row("before")) + "\n")
    cache = str(data_dir / "cache")
    first = load_conversations(path, cache_dir=cache)
    assert first[0].messages[1]["content"] == "before"
    again = load_conversations(path, cache_dir=cache)
    assert again.dataset.cache_files == first.dataset.cache_files  # unchanged file: the cached Arrow table
    stat = path.stat()
    path.write_text(json.dumps(message_row("after!")) + "\n")  # same size: only the mtime tells them apart
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    edited = load_conversations(path, cache_dir=cache)
    assert edited[0].messages[1]["content"] == "after!"
    path.write_text(json.dumps(message_row("edited")) + "\n" + json.dumps(message_row("added")) + "\n")
    assert len(load_conversations(path, cache_dir=cache)) == 2
