"""Data sources: the three row shapes from generated jsonl / parquet files, Arrow's None-filling, row indices."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import datasets
import pyarrow as pa
import pytest
import torch
from PIL import Image

from renderers import RenderError
from renderers.images import content_hash, read_image_source
from vlm_sft.data.image_roots import ImageRoots
from vlm_sft.data.sources import (
    ConversationSource,
    RowConverter,
    load_conversations,
    normalize_row_for_arrow,
    render_fn,
    rows_to_dataset,
)


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture
def data_dir(tmp_path) -> Path:
    (tmp_path / "images").mkdir()
    for name, colour, size in (("red", "red", (64, 64)), ("blue", "blue", (96, 96)), ("green", "green", (64, 32))):
        Image.new("RGB", size, colour).save(tmp_path / "images" / f"{name}.png")
    return tmp_path


def assert_same_render(renderer, source, index: int, messages: list[dict], tools=None):
    ours = render_fn(source, renderer)(index)
    ours.check()
    assert ours.sample_index == index
    expected = renderer.render(messages, tools=tools)
    assert torch.equal(ours.token_ids, expected.token_ids)
    assert torch.equal(ours.loss_mask, expected.loss_mask)
    if expected.multi_modal_data is not None:
        assert torch.equal(ours.multi_modal_data.pixel_values, expected.multi_modal_data.pixel_values)
    return ours


MESSAGE_ROWS = [
    {
        "messages": [
            {
                "role": "user",
                "content": [{"type": "image", "image": "images/red.png"}, {"type": "text", "text": "Colour?"}],
            },
            {"role": "assistant", "content": [{"type": "text", "text": "Red."}]},
        ]
    },
    {
        "messages": [
            {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
            {"role": "user", "content": [{"type": "text", "text": "2+2?"}]},
            {"role": "assistant", "content": [{"type": "text", "text": "4"}]},
        ]
    },
    {
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "Weather?"}]},
            {
                "role": "assistant",
                "content": [{"type": "text", "text": ""}],
                "tool_calls": [
                    {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}
                ],
            },
            {"role": "tool", "content": [{"type": "text", "text": "Snow"}]},
            {
                "role": "assistant",
                "content": [{"type": "text", "text": "Snowing."}],
                "reasoning_content": "Tool says snow.",
            },
        ],
        "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}],
    },
]


def absolute(rows: list[dict], root: Path) -> list[dict]:
    """The same rows with image paths made absolute, for rendering the originals directly."""
    out = json.loads(json.dumps(rows))
    for row in out:
        for m in row["messages"]:
            if isinstance(m["content"], list):
                for b in m["content"]:
                    if b.get("type") == "image":
                        b["image"] = str(root / b["image"])
    return out


def test_messages_jsonl_shape_a(renderer, data_dir):
    source = load_conversations(write_jsonl(data_dir / "train.jsonl", MESSAGE_ROWS), cache_dir=str(data_dir / "cache"))
    assert len(source) == 3 and source.schema.format == "messages"
    expected = absolute(MESSAGE_ROWS, data_dir)
    for i in range(3):
        conversation = source[i]
        assert conversation.index == i
        assert_same_render(renderer, source, i, expected[i]["messages"], expected[i].get("tools"))
    assert source[2].tools[0]["function"]["name"] == "get_weather"
    assert source[0].messages[0]["content"][0]["image"] == str(data_dir / "images" / "red.png")


def test_image_root_overrides_the_data_folder(renderer, data_dir, tmp_path_factory):
    elsewhere = tmp_path_factory.mktemp("elsewhere")
    path = write_jsonl(elsewhere / "rows.jsonl", MESSAGE_ROWS[:1])
    source = load_conversations(path, image_root=data_dir, cache_dir=str(data_dir / "cache"))
    assert source[0].messages[0]["content"][0]["image"] == str(data_dir / "images" / "red.png")
    missing = load_conversations(path, cache_dir=str(data_dir / "cache"))
    with pytest.raises(RenderError) as info:
        render_fn(missing, renderer)(0)
    assert info.value.reason == "missing_image" and info.value.sample_index == 0


MIXED_ROWS = [
    {"messages": [{"role": "user", "content": "plain text"}, {"role": "assistant", "content": "plain answer"}]},
    {
        "messages": [
            {
                "role": "user",
                "content": [{"type": "image", "image": "images/blue.png"}, {"type": "text", "text": "Colour?"}],
            },
            {"role": "assistant", "content": "Blue."},
        ]
    },
    {
        "messages": [
            {"role": "user", "content": "Call it"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": {"a": 1, "b": [1, 2]}}}],
            },
            {"role": "tool", "content": "done"},
            {"role": "assistant", "content": "Done."},
        ],
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}],
    },
]


def test_mixed_string_and_block_content_cannot_be_one_arrow_table_as_is():
    """The bug shape (c) guards against: Arrow refuses rows mixing string and list content."""
    with pytest.raises(pa.ArrowInvalid):
        pa.Table.from_pylist(MIXED_ROWS)
    assert pa.Table.from_pylist([normalize_row_for_arrow(r) for r in MIXED_ROWS]).num_rows == 3


def test_mixed_rows_jsonl_shape_c(renderer, data_dir):
    source = load_conversations(write_jsonl(data_dir / "mixed.jsonl", MIXED_ROWS), cache_dir=str(data_dir / "cache"))
    expected = absolute(MIXED_ROWS, data_dir)
    for i, row in enumerate(expected):
        assert_same_render(renderer, source, i, row["messages"], row.get("tools"))


def test_mixed_rows_normalized_to_parquet_with_arrow_none_filling(renderer, data_dir):
    rows_to_dataset(MIXED_ROWS).to_parquet(data_dir / "mixed.parquet")
    raw = datasets.load_dataset("parquet", data_files=str(data_dir / "mixed.parquet"), split="train")
    # Arrow filled the absent union members with None: a text block has an `image: None` key, etc.
    first_block = raw[0]["messages"][0]["content"][0]
    assert first_block == {"type": "text", "image": None, "text": "plain text"}
    source = load_conversations(data_dir / "mixed.parquet", cache_dir=str(data_dir / "cache"))
    assert source[0].messages[0]["content"] == [{"type": "text", "text": "plain text"}]
    assert "tool_calls" not in source[0].messages[1]
    expected = absolute(MIXED_ROWS, data_dir)
    for i, row in enumerate(expected):
        assert_same_render(renderer, source, i, row["messages"], row.get("tools"))


def test_jsonl_rows_are_stored_as_written(renderer, data_dir):
    """json / jsonl rows are kept as JSON text: no Arrow type unification, no None-filling, no normalizing."""
    source = load_conversations(write_jsonl(data_dir / "asis.jsonl", MIXED_ROWS), cache_dir=str(data_dir / "cache"))
    assert source.json_rows and source.dataset.column_names != ["messages", "tools"]
    assert [source.row(i) for i in range(len(source))] == MIXED_ROWS
    assert source.column("tools") == [None, None, MIXED_ROWS[2]["tools"]] and source.column("task") is None


SHAREGPT_ROWS = [
    {
        "conversations": [
            {"from": "human", "value": "<image>\nWhat colour is this?"},
            {"from": "gpt", "value": "It is red."},
            {"from": "human", "value": "Sure?"},
            {"from": "gpt", "value": "Yes."},
        ],
        "image": "images/red.png",
    },
    {
        "conversations": [
            {"from": "system", "value": "Compare pictures."},
            {"from": "human", "value": "First <image> then <image>: same?"},
            {"from": "gpt", "value": "No."},
        ],
        "images": ["images/red.png", "images/blue.png"],
    },
    {
        "conversations": [{"from": "human", "value": "Describe."}, {"from": "gpt", "value": "Green."}],
        "image": "images/green.png",
    },
    {"conversations": [{"from": "human", "value": "Text only"}, {"from": "gpt", "value": "Fine."}]},
]


def test_sharegpt_jsonl_shape_b(renderer, data_dir):
    source = load_conversations(
        write_jsonl(data_dir / "sharegpt.jsonl", SHAREGPT_ROWS), cache_dir=str(data_dir / "cache")
    )
    assert source.schema.format == "sharegpt" and len(source) == 4
    red, blue, green = (str(data_dir / "images" / f"{c}.png") for c in ("red", "blue", "green"))
    expected = [
        [
            {
                "role": "user",
                "content": [{"type": "image", "image": red}, {"type": "text", "text": "\nWhat colour is this?"}],
            },
            {"role": "assistant", "content": "It is red."},
            {"role": "user", "content": "Sure?"},
            {"role": "assistant", "content": "Yes."},
        ],
        [
            {"role": "system", "content": "Compare pictures."},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "First "},
                    {"type": "image", "image": red},
                    {"type": "text", "text": " then "},
                    {"type": "image", "image": blue},
                    {"type": "text", "text": ": same?"},
                ],
            },
            {"role": "assistant", "content": "No."},
        ],
        [  # no marker: the image goes in front of the first user turn
            {"role": "user", "content": [{"type": "image", "image": green}, {"type": "text", "text": "Describe."}]},
            {"role": "assistant", "content": "Green."},
        ],
        [{"role": "user", "content": "Text only"}, {"role": "assistant", "content": "Fine."}],
    ]
    for i, messages in enumerate(expected):
        assert source[i].messages == messages
        sample = assert_same_render(renderer, source, i, messages)
        assert sample.num_images == [1, 2, 1, 0][i]


def test_sharegpt_parquet_with_lazy_image_feature(renderer, data_dir):
    red, blue = (str(data_dir / "images" / f"{c}.png") for c in ("red", "blue"))
    ds = datasets.Dataset.from_dict(
        {
            "conversations": [
                [{"from": "human", "value": "<image><image> same?"}, {"from": "gpt", "value": "No."}],
                [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}],
            ],
            "images": [[{"bytes": Path(red).read_bytes(), "path": "red.png"}, {"bytes": None, "path": blue}], []],
        },
        features=datasets.Features(
            {
                "conversations": datasets.List({"from": datasets.Value("string"), "value": datasets.Value("string")}),
                "images": datasets.List(datasets.Image()),
            }
        ),
    )
    ds.to_parquet(data_dir / "llava.parquet")
    source = load_conversations(data_dir / "llava.parquet", cache_dir=str(data_dir / "cache"))
    assert source.dataset.features["images"] == datasets.List(datasets.Image(decode=False))
    image_block = source[0].messages[0]["content"][0]
    assert isinstance(image_block["image"], dict) and image_block["image"]["bytes"]  # still encoded: decoded lazily
    assert source[0].messages[0]["content"][1]["image"] == {"bytes": None, "path": blue}
    sample = render_fn(source, renderer)(0)
    assert sample.num_images == 2
    expected_hash = content_hash(read_image_source(Path(red).read_bytes()))
    assert sample.multi_modal_data.image_hashes[0] == expected_hash
    assert render_fn(source, renderer)(1).num_images == 0


def test_messages_with_placeholder_blocks_and_images_column(renderer, data_dir):
    red, green = (str(data_dir / "images" / f"{c}.png") for c in ("red", "green"))
    ds = datasets.Dataset.from_dict(
        {
            "messages": [
                [
                    {"role": "user", "content": [{"type": "image", "text": None}, {"type": "text", "text": "Colour?"}]},
                    {"role": "assistant", "content": [{"type": "text", "text": "Red."}]},
                ]
            ],
            "images": [[red]],
        }
    ).cast_column("images", datasets.List(datasets.Image()))
    source = ConversationSource(ds, image_root=data_dir)
    sample = render_fn(source, renderer)(0)
    assert sample.num_images == 1
    expected = [
        {"role": "user", "content": [{"type": "image", "image": red}, {"type": "text", "text": "Colour?"}]},
        {"role": "assistant", "content": "Red."},
    ]
    assert torch.equal(sample.token_ids, renderer.render(expected).token_ids)
    # one placeholder, two images: a counted error naming the row
    rows = {"messages": ds["messages"], "images": [[red, green]]}
    bad = ConversationSource(datasets.Dataset.from_dict(rows), image_root=data_dir)
    with pytest.raises(RenderError) as info:
        bad[0]
    assert info.value.reason == "images_without_placeholders" and info.value.sample_index == 0


def test_bad_rows_raise_with_their_index(renderer, data_dir):
    rows = [
        SHAREGPT_ROWS[3],
        {
            "conversations": [{"from": "human", "value": "<image> <image>"}, {"from": "gpt", "value": "x"}],
            "image": "images/red.png",
        },
        {"conversations": [{"from": "wizard", "value": "hi"}, {"from": "gpt", "value": "x"}]},
        {
            "conversations": [{"from": "human", "value": "<image> hi"}, {"from": "gpt", "value": "x"}],
            "image": "images/nope.png",
        },
        {"conversations": [{"from": "human", "value": "only a question"}]},
    ]
    source = load_conversations(write_jsonl(data_dir / "bad.jsonl", rows), cache_dir=str(data_dir / "cache"))
    fn = render_fn(source, renderer)
    assert fn(0).sample_index == 0
    reasons = {}
    for i in range(1, len(rows)):
        with pytest.raises(RenderError) as info:
            fn(i)
        assert info.value.sample_index == i
        reasons[i] = info.value.reason
    assert reasons == {
        1: "more_placeholders_than_images",
        2: "unknown_role",
        3: "missing_image",
        4: "no_assistant_turn",
    }


def test_unknown_columns_refused(data_dir):
    path = write_jsonl(data_dir / "odd.jsonl", [{"dialog": "x", "reply": "y"}])
    with pytest.raises(ValueError, match=r"no schema fits \(its columns: dialog, reply\)"):
        load_conversations(path, cache_dir=str(data_dir / "cache"))


def test_render_fn_pickles_for_dataloader_workers(renderer, data_dir):
    source = load_conversations(write_jsonl(data_dir / "p.jsonl", MESSAGE_ROWS), cache_dir=str(data_dir / "cache"))
    fn = pickle.loads(pickle.dumps(render_fn(source, renderer)))
    assert torch.equal(fn(0).token_ids, render_fn(source, renderer)(0).token_ids)


def test_missing_local_file_is_not_looked_up_on_the_hub(tmp_path, monkeypatch):
    """A local-looking name that does not exist fails at once; only an ``org/name`` id goes to ``load_dataset``."""
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    asked: list[str] = []

    def hub(name, *args, **kwargs):
        asked.append(name)
        raise ConnectionError(f"Couldn't reach {name!r} on the Hub")

    monkeypatch.setattr(datasets, "load_dataset", hub)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()
    for name in ("data/train.jsonl", "data/train", "train.parquet", "./rows", "~/no-such-folder-vlm-sft/x", "a.json"):
        with pytest.raises(FileNotFoundError) as info:
            load_conversations(name)
        message = str(info.value)
        assert str(Path(name).expanduser().absolute()) in message and "org/name" in message
    assert asked == []
    with pytest.raises(ConnectionError):
        load_conversations("someorg/some-dataset")
    assert asked == ["someorg/some-dataset"]


def test_row_converter_detects_the_shape_per_row(data_dir):
    """The conversion ``ConversationSource`` applies, usable on rows that come from elsewhere (a stream)."""
    convert = pickle.loads(pickle.dumps(RowConverter(None, ImageRoots(data_dir))))
    red = str(data_dir / "images" / "red.png")
    assert convert(MESSAGE_ROWS[0], 7).messages[0]["content"][0]["image"] == red
    sharegpt = convert(SHAREGPT_ROWS[0], 8)
    assert sharegpt.index == 8 and sharegpt.messages[0]["content"][0] == {"type": "image", "image": red}
    with pytest.raises(RenderError) as info:
        convert({"prompt": "x"}, 9)
    assert info.value.reason == "unrecognised_row" and info.value.sample_index == 9
