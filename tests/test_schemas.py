"""Every public row schema renders token for token as the same rows in the canonical ``messages`` form: the same
tokens, images in the same places and the same loss mask. Each fixture is written with ``datasets`` features exactly
as the hub's parquet files store them (Image features in list columns, the struct field orders found there, the
nulls of merged structs), then read the way a user's run reads it (``load_conversations`` on the file)."""

from __future__ import annotations

import json
from pathlib import Path

import datasets
import pytest
import torch
from PIL import Image

from renderers import RenderError
from vlm_sft.data.schemas import RowMapping, SchemaError
from vlm_sft.data.sources import load_conversations, render_fn

COLOURS = {"red": (64, 64), "blue": (96, 64), "green": (64, 32)}
"""Image name -> size; each a PNG file under ``img/`` for the canonical rows and its bytes in the hub rows."""


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("schemas")
    (root / "img").mkdir()
    for name, size in COLOURS.items():
        Image.new("RGB", size, name).save(root / "img" / f"{name}.png")
    return root


def png(folder: Path, name: str) -> dict:
    """An image as the ``datasets`` Image feature stores it embedded: ``{"bytes", "path"}``."""
    return {"bytes": (folder / "img" / f"{name}.png").read_bytes(), "path": None}


def img(name: str) -> dict:
    """A canonical image block (a path relative to the data file)."""
    return {"type": "image", "image": f"img/{name}.png"}


def text(value: str) -> dict:
    return {"type": "text", "text": value}


def write_parquet(folder: Path, name: str, columns: dict, features: datasets.Features) -> Path:
    path = folder / f"{name}.parquet"
    datasets.Dataset.from_dict(columns, features=features).to_parquet(path)
    return path


def write_canonical(folder: Path, name: str, conversations: list[list[dict]]) -> Path:
    path = folder / f"{name}.jsonl"
    path.write_text("".join(json.dumps({"messages": m}) + "\n" for m in conversations))
    return path


def assert_same_samples(renderer, hub: Path, canonical: Path, *, fmt: str, cache: Path, **kwargs) -> list:
    """Every row of ``hub`` renders exactly as the same row of ``canonical``; returns the hub source."""
    source = load_conversations(hub, cache_dir=str(cache), **kwargs)
    expected = load_conversations(canonical, cache_dir=str(cache))
    assert source.schema.format == fmt, source.schema.describe()
    assert len(source) == len(expected)
    ours, theirs = render_fn(source, renderer), render_fn(expected, renderer)
    for i in range(len(source)):
        a, b = ours(i), theirs(i)
        assert torch.equal(a.token_ids, b.token_ids), i
        assert torch.equal(a.loss_mask, b.loss_mask), i
        assert torch.equal(a.mm_token_type_ids, b.mm_token_type_ids), i
        if b.multi_modal_data is None:
            assert a.multi_modal_data is None, i
        else:
            assert torch.equal(a.multi_modal_data.pixel_values, b.multi_modal_data.pixel_values), i
            assert torch.equal(a.multi_modal_data.image_grid_thw, b.multi_modal_data.image_grid_thw), i
            assert a.multi_modal_data.placeholders == b.multi_modal_data.placeholders, i
    return source


IMAGES = datasets.List(datasets.Image())

# ---------------------------------------------------------------------------------------------- pairs


def test_the_cauldron_pairs_put_the_images_before_the_first_question(renderer, folder, tmp_path):
    """HuggingFaceM4/the_cauldron (and Docmatix): ``images`` + ``texts: [{user, assistant, source}]``."""
    features = datasets.Features(
        {
            "images": IMAGES,
            "texts": datasets.List(
                {
                    "user": datasets.Value("string"),
                    "assistant": datasets.Value("string"),
                    "source": datasets.Value("string"),
                }
            ),
        }
    )
    columns = {
        "images": [[png(folder, "red")], [png(folder, "red"), png(folder, "blue")], []],
        "texts": [
            [{"user": "Colour?", "assistant": "Red.", "source": "ai2d"}],
            [
                {"user": "Compare them.", "assistant": "Red, then blue.", "source": "x"},
                {"user": "Same size?", "assistant": "No.", "source": "x"},
            ],
            [{"user": "2+2?", "assistant": "4", "source": "text"}],
        ],
    }
    canonical = [
        [{"role": "user", "content": [img("red"), text("Colour?")]}, {"role": "assistant", "content": "Red."}],
        [
            {"role": "user", "content": [img("red"), img("blue"), text("Compare them.")]},
            {"role": "assistant", "content": "Red, then blue."},
            {"role": "user", "content": "Same size?"},
            {"role": "assistant", "content": "No."},
        ],
        [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}],
    ]
    hub = write_parquet(folder, "cauldron", columns, features)
    source = assert_same_samples(
        renderer, hub, write_canonical(folder, "cauldron_canonical", canonical), fmt="pairs", cache=tmp_path
    )
    assert "texts" in source.schema.reason


def test_finevision_pairs_with_the_assistant_field_first_and_extra_columns(renderer, folder, tmp_path):
    """HuggingFaceM4/FineVision: some subsets store ``{assistant, user}`` in that order, beside rating columns."""
    features = datasets.Features(
        {
            "images": IMAGES,
            "texts": datasets.List({"assistant": datasets.Value("string"), "user": datasets.Value("string")}),
            "source": datasets.Value("string"),
            "relevance_ratings": datasets.List(datasets.Value("int64")),
        }
    )
    columns = {
        "images": [[png(folder, "green")]],
        "texts": [[{"assistant": "Green.", "user": "Colour?"}, {"assistant": "Small.", "user": "Size?"}]],
        "source": ["chart"],
        "relevance_ratings": [[5, 4]],
    }
    canonical = [
        [
            {"role": "user", "content": [img("green"), text("Colour?")]},
            {"role": "assistant", "content": "Green."},
            {"role": "user", "content": "Size?"},
            {"role": "assistant", "content": "Small."},
        ]
    ]
    hub = write_parquet(folder, "finevision", columns, features)
    assert_same_samples(renderer, hub, write_canonical(folder, "fv_canonical", canonical), fmt="pairs", cache=tmp_path)


# ----------------------------------------------------------------------------------- prompt / completion


def test_trl_prompt_completion_trains_the_completion_only(renderer, folder, tmp_path):
    """trl-lib/llava-instruct-mix: ``images`` + ``prompt`` / ``completion`` message lists with ``{text, type}``
    blocks (``text`` null on the image block); a prompt's own assistant turn is context (``weight: 0``)."""
    block = {"text": datasets.Value("string"), "type": datasets.Value("string")}
    turns = datasets.List({"content": datasets.List(block), "role": datasets.Value("string")})
    features = datasets.Features({"images": IMAGES, "prompt": turns, "completion": turns})
    columns = {
        "images": [[png(folder, "red")], [png(folder, "blue")]],
        "prompt": [
            [{"content": [{"text": None, "type": "image"}, {"text": "Colour?", "type": "text"}], "role": "user"}],
            [
                {"content": [{"text": None, "type": "image"}, {"text": "Colour?", "type": "text"}], "role": "user"},
                {"content": [{"text": "Blue.", "type": "text"}], "role": "assistant"},
                {"content": [{"text": "Sure?", "type": "text"}], "role": "user"},
            ],
        ],
        "completion": [
            [{"content": [{"text": "Red.", "type": "text"}], "role": "assistant"}],
            [{"content": [{"text": "Yes.", "type": "text"}], "role": "assistant"}],
        ],
    }
    canonical = [
        [{"role": "user", "content": [img("red"), text("Colour?")]}, {"role": "assistant", "content": [text("Red.")]}],
        [
            {"role": "user", "content": [img("blue"), text("Colour?")]},
            {"role": "assistant", "content": [text("Blue.")], "weight": 0},
            {"role": "user", "content": [text("Sure?")]},
            {"role": "assistant", "content": [text("Yes.")]},
        ],
    ]
    hub = write_parquet(folder, "trl", columns, features)
    source = assert_same_samples(
        renderer, hub, write_canonical(folder, "trl_canonical", canonical), fmt="prompt_completion", cache=tmp_path
    )
    # The context turn is rendered but not trained: all turns trained would hold more targets.
    everything = [{k: v for k, v in m.items() if k != "weight"} for m in canonical[1]]
    whole = renderer.render(json.loads(json.dumps(everything).replace("img/", f"{folder}/img/")))
    assert torch.equal(render_fn(source, renderer)(1).token_ids, whole.token_ids)
    assert int(render_fn(source, renderer)(1).loss_mask.sum()) < int(whole.loss_mask.sum())


def test_string_prompt_completion(renderer, folder, tmp_path):
    """TRL's standard (non-conversational) form: two strings, an ``image`` column."""
    features = datasets.Features(
        {"image": datasets.Image(), "prompt": datasets.Value("string"), "completion": datasets.Value("string")}
    )
    columns = {"image": [png(folder, "red"), None], "prompt": ["Colour?", "2+2?"], "completion": ["Red.", "4"]}
    canonical = [
        [{"role": "user", "content": [img("red"), text("Colour?")]}, {"role": "assistant", "content": "Red."}],
        [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}],
    ]
    hub = write_parquet(folder, "trl_strings", columns, features)
    canonical_path = write_canonical(folder, "trl_strings_canonical", canonical)
    assert_same_samples(renderer, hub, canonical_path, fmt="prompt_completion", cache=tmp_path)


# -------------------------------------------------------------------------------------- question / answer


def test_question_answer_rows_train_the_first_answer_and_keep_the_rest(renderer, folder, tmp_path):
    """lmms-lab/DocVQA: ``image`` + ``question`` + ``answers: [str]`` beside id columns."""
    features = datasets.Features(
        {
            "questionId": datasets.Value("string"),
            "question": datasets.Value("string"),
            "image": datasets.Image(),
            "answers": datasets.List(datasets.Value("string")),
        }
    )
    columns = {
        "questionId": ["1", "2"],
        "question": ["What colour?", "What is the date?"],
        "image": [png(folder, "red"), png(folder, "blue")],
        "answers": [["red", "Red"], ["1 May"]],
    }
    canonical = [
        [{"role": "user", "content": [img("red"), text("What colour?")]}, {"role": "assistant", "content": "red"}],
        [
            {"role": "user", "content": [img("blue"), text("What is the date?")]},
            {"role": "assistant", "content": "1 May"},
        ],
    ]
    hub = write_parquet(folder, "docvqa", columns, features)
    source = assert_same_samples(
        renderer, hub, write_canonical(folder, "docvqa_canonical", canonical), fmt="qa", cache=tmp_path
    )
    assert source[0].references == ("red", "Red") and source[1].references == ("1 May",)


def test_chartqa_query_label_and_vqav2_answer_objects(renderer, folder, tmp_path):
    """HuggingFaceM4/ChartQA (``query`` + ``label: [str]``) and VQAv2's ``answers: [{answer, ...}]``."""
    chartqa = datasets.Features(
        {"image": datasets.Image(), "query": datasets.Value("string"), "label": datasets.List(datasets.Value("string"))}
    )
    hub = write_parquet(
        folder, "chartqa", {"image": [png(folder, "green")], "query": ["Peak?"], "label": [["12"]]}, chartqa
    )
    canonical = [[{"role": "user", "content": [img("green"), text("Peak?")]}, {"role": "assistant", "content": "12"}]]
    assert_same_samples(renderer, hub, write_canonical(folder, "chartqa_c", canonical), fmt="qa", cache=tmp_path)
    answer = {"answer": datasets.Value("string"), "answer_confidence": datasets.Value("string")}
    vqa = datasets.Features(
        {"image": datasets.Image(), "question": datasets.Value("string"), "answers": datasets.List(answer)}
    )
    columns = {
        "image": [png(folder, "red")],
        "question": ["Colour?"],
        "answers": [
            [{"answer": "red", "answer_confidence": "yes"}, {"answer": "crimson", "answer_confidence": "maybe"}]
        ],
    }
    source = load_conversations(write_parquet(folder, "vqav2", columns, vqa), cache_dir=str(tmp_path))
    assert source[0].references == ("red", "crimson")
    assert source[0].messages[-1] == {"role": "assistant", "content": "red"}


# ----------------------------------------------------------------------------------- ShareGPT and messages


def test_llava_onevision_sharegpt_with_a_single_image_column(renderer, folder, tmp_path):
    """lmms-lab/LLaVA-OneVision-Data: ``image`` (one Image, null for text rows) + ``conversations`` from / value."""
    features = datasets.Features(
        {
            "id": datasets.Value("string"),
            "image": datasets.Image(),
            "conversations": datasets.List({"from": datasets.Value("string"), "value": datasets.Value("string")}),
            "data_source": datasets.Value("string"),
        }
    )
    columns = {
        "id": ["a", "b"],
        "image": [png(folder, "red"), None],
        "conversations": [
            [{"from": "human", "value": "<image>\nColour?"}, {"from": "gpt", "value": "Red."}],
            [{"from": "human", "value": "2+2?"}, {"from": "gpt", "value": "4"}],
        ],
        "data_source": ["x", "y"],
    }
    canonical = [
        [{"role": "user", "content": [img("red"), text("\nColour?")]}, {"role": "assistant", "content": "Red."}],
        [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}],
    ]
    hub = write_parquet(folder, "ov", columns, features)
    assert_same_samples(renderer, hub, write_canonical(folder, "ov_c", canonical), fmt="sharegpt", cache=tmp_path)


def test_merged_turn_structs_with_null_keys_and_the_marker_after_the_question(renderer, folder, tmp_path):
    """LLaVA-OneVision-1.5: turns ``{content, from, role, value}`` with two of them null, ``<image>`` after the
    question, and ``bot`` / ``user`` role names."""
    turn = {k: datasets.Value("string") for k in ("content", "from", "role", "value")}
    features = datasets.Features({"images": IMAGES, "conversations": datasets.List(turn)})
    columns = {
        "images": [[png(folder, "blue")]],
        "conversations": [
            [
                {"content": None, "from": "human", "role": None, "value": "Colour?\n<image>"},
                {"content": "Blue.", "from": None, "role": "bot", "value": None},
            ]
        ],
    }
    canonical = [
        [{"role": "user", "content": [text("Colour?\n"), img("blue")]}, {"role": "assistant", "content": "Blue."}]
    ]
    hub = write_parquet(folder, "ov15", columns, features)
    assert_same_samples(renderer, hub, write_canonical(folder, "ov15_c", canonical), fmt="sharegpt", cache=tmp_path)


def test_messages_with_indexed_image_blocks(renderer, folder, tmp_path):
    """HuggingFaceH4/llava-instruct-mix-vsft: ``{index, text, type}`` blocks whose ``index`` names the image."""
    block = {"index": datasets.Value("int64"), "text": datasets.Value("string"), "type": datasets.Value("string")}
    features = datasets.Features(
        {
            "messages": datasets.List({"content": datasets.List(block), "role": datasets.Value("string")}),
            "images": IMAGES,
        }
    )
    columns = {
        "messages": [
            [
                {
                    "content": [
                        {"index": 1, "text": None, "type": "image"},
                        {"index": 0, "text": None, "type": "image"},
                        {"index": None, "text": "Which is which?", "type": "text"},
                    ],
                    "role": "user",
                },
                {"content": [{"index": None, "text": "Blue, red.", "type": "text"}], "role": "assistant"},
            ]
        ],
        "images": [[png(folder, "red"), png(folder, "blue")]],
    }
    canonical = [
        [
            {"role": "user", "content": [img("blue"), img("red"), text("Which is which?")]},
            {"role": "assistant", "content": [text("Blue, red.")]},
        ]
    ]
    hub = write_parquet(folder, "vsft", columns, features)
    assert_same_samples(renderer, hub, write_canonical(folder, "vsft_c", canonical), fmt="messages", cache=tmp_path)


# -------------------------------------------------------------------------------------------- the mapping


def test_the_readme_mapping_example_renders_its_made_up_schema_as_the_canonical_form(renderer, folder, tmp_path):
    """The documented ``[data]`` mapping block (docs/data.md), read as the config loader reads it, over rows of the
    schema its comment shows."""
    import re
    import tomllib

    from vlm_sft.config import REPO_ROOT, DataConfig

    blocks = re.findall(r"^```toml\n(.*?)^```", (REPO_ROOT / "docs" / "data.md").read_text(), re.M | re.S)
    settings = DataConfig(**tomllib.loads(next(b for b in blocks if "conversation_column" in b))["data"])
    rows = [
        {
            "dialog": [
                {"speaker": "customer", "utterance": "<image> What is broken?"},
                {"speaker": "agent", "utterance": "The red part."},
            ],
            "screenshots": ["img/red.png"],
            "persona": "You repair phones.",
        }
    ]
    data = tmp_path / settings.source
    data.parent.mkdir(parents=True)
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (data.parent / "img").mkdir()
    (data.parent / "img" / "red.png").write_bytes((folder / "img" / "red.png").read_bytes())
    canonical = [
        [
            {"role": "system", "content": "You repair phones."},
            {"role": "user", "content": [img("red"), text(" What is broken?")]},
            {"role": "assistant", "content": "The red part."},
        ]
    ]
    source = assert_same_samples(
        renderer, data, write_canonical(data.parent, "support_c", canonical), fmt="sharegpt", cache=tmp_path,
        mapping=RowMapping.from_settings(settings.model_dump()),
    )  # fmt: skip
    assert "format = 'sharegpt'" in source.schema.reason
    with pytest.raises(SchemaError, match="no schema fits"):  # unmapped, the same file fits no schema
        load_conversations(data, cache_dir=str(tmp_path))


def test_a_mapped_column_that_does_not_exist_names_the_columns_there(folder, tmp_path):
    data = tmp_path / "rows.jsonl"
    data.write_text(json.dumps({"dialog": [], "pics": []}) + "\n")
    with pytest.raises(SchemaError) as info:
        load_conversations(data, cache_dir=str(tmp_path), mapping=RowMapping(conversation_column="dialogue"))
    assert "conversation_column = 'dialogue' is not a column" in str(info.value)
    assert "its columns: dialog, pics" in str(info.value)


# ----------------------------------------------------------------------------- images vs placeholders


PLACEMENT_ROWS = [
    ({"conversations": [{"from": "human", "value": "<image> hi"}, {"from": "gpt", "value": "x"}], "images": []},
     "more_placeholders_than_images"),
    ({"conversations": [{"from": "human", "value": "<image> <image>"}, {"from": "gpt", "value": "x"}],
      "images": ["img/red.png"]}, "more_placeholders_than_images"),
    ({"conversations": [{"from": "human", "value": "<image> hi"}, {"from": "gpt", "value": "x"}],
      "images": ["img/red.png", "img/blue.png"]}, "images_without_placeholders"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "index": 2}, {"type": "text", "text": "hi"}]},
                   {"role": "assistant", "content": "x"}], "images": ["img/red.png"]}, "image_index_out_of_range"),
    ({"messages": [{"role": "assistant", "content": "x"}], "images": ["img/red.png"]}, "images_without_user_turn"),
    ({"question": "Colour?", "answers": [], "image": "img/red.png"}, "no_answer"),
]  # fmt: skip
"""One row per mismatch, with the skip reason it must get."""


@pytest.mark.parametrize(("row", "reason"), PLACEMENT_ROWS, ids=[r for _, r in PLACEMENT_ROWS])
def test_each_mismatch_is_its_own_reason_naming_the_row(row, reason, folder):
    from vlm_sft.data.image_roots import ImageRoots
    from vlm_sft.data.schemas import RowConverter

    with pytest.raises(RenderError) as info:
        RowConverter(None, ImageRoots(folder))(row, 7)
    assert info.value.reason == reason and info.value.sample_index == 7


def test_a_file_of_good_and_bad_rows_packs_the_good_and_counts_the_bad(folder, tmp_path):
    """The data report over one file: every row packed or skipped with its reason, and the totals balance."""
    from vlm_sft.config import load_config
    from vlm_sft.report import build_report

    def row(content: list, images: list) -> dict:
        return {
            "messages": [{"role": "user", "content": content}, {"role": "assistant", "content": "x"}],
            "images": images,
        }

    ask = {"type": "text", "text": "Colour?"}
    good = row([{"type": "image"}, ask], ["img/red.png"])
    rows = [
        good,
        row([{"type": "image"}, {"type": "image"}, ask], ["img/red.png"]),  # more placeholders than images
        row([ask], []),  # text only
        row([{"type": "image"}, ask], ["img/red.png", "img/blue.png"]),  # some images marked, not all
        good,
        row([{"type": "image", "index": 3}, ask], ["img/red.png"]),  # an index the row does not have
    ]
    data = folder / "mixed.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = load_config(None, ["--data.source", str(data), "--train.output_dir", str(tmp_path)])
    report = build_report(cfg, progress=False)
    skipped = {reason: info["count"] for reason, info in report["skipped"].items()}
    assert skipped == {
        "more_placeholders_than_images": 1,
        "images_without_placeholders": 1,
        "image_index_out_of_range": 1,
    }
    assert report["samples_packed"] == 3 and report["samples_seen"] == 6 == report["samples_packed"] + sum(
        skipped.values()
    )
    assert [e["row"] for e in report["skipped"]["image_index_out_of_range"]["examples"]] == [5]
    assert report["schemas"] == {"train": "messages (column 'messages' holds the chat messages)"}


def test_report_show_prints_the_collapsed_placeholders_the_trained_spans_and_the_schema(folder, tmp_path, capsys):
    from vlm_sft.report import main

    rows = [{"texts": [{"user": "Colour?", "assistant": "Red."}], "images": ["img/red.png"]}]
    data = folder / "show.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["--data.source", str(data), "--show", "1"]) == 0
    out = capsys.readouterr().out
    assert "read as pairs (column 'texts'" in out
    assert "<|image_pad|> x 4<|vision_end|>Colour?" in out  # 64 x 64 pixels: 4 merged image tokens
    assert "[TRAIN]" in out and "Red.<|im_end|>[/TRAIN]" in out
    assert out.count("[TRAIN]") == 1 and "[TRAIN]Colour" not in out


def test_weight_must_be_0_or_1(renderer):
    bad = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "x", "weight": 0.5}]
    with pytest.raises(RenderError) as info:
        renderer.render(bad)
    assert info.value.reason == "bad_weight"


def test_the_mapping_settings_are_checked_at_load_and_a_missing_column_stops_the_start(folder, tmp_path, caplog):
    from vlm_sft.config import ConfigError, load_config
    from vlm_sft.data.build import load_sources

    with pytest.raises(ConfigError, match="must map to one of system, user, assistant, tool"):
        load_config(None, ["--data.roles.customer", "customer"])
    mixture = ["--data.sources", '[{source = "a.jsonl"}]', "--data.format", "qa"]
    with pytest.raises(ConfigError, match=r"data\.format is set beside"):
        load_config(None, mixture)
    data = folder / "pairs.jsonl"
    data.write_text(json.dumps({"texts": [{"user": "q", "assistant": "a"}], "images": []}) + "\n")
    base = ["--data.source", str(data), "--train.output_dir", str(tmp_path)]
    with caplog.at_level("INFO", logger="vlm_sft.data.build"):
        load_sources(load_config(None, base))
    assert (
        f"data.source ({data}) read as pairs (column 'texts' holds the [{{user, assistant}}] pairs); file"
        in caplog.text
    )
    with pytest.raises(ConfigError) as info:
        load_sources(load_config(None, [*base, "--data.images_column", "pictures"]))
    assert str(info.value).startswith(f"data.source ({data}): ")
    assert "images_column = 'pictures' is not a column of this source (its columns: images, texts)" in str(info.value)


# ------------------------------------------------------------------------------------------- multiple choice


def mc_canonical(question: str, options: list[str], letter: str, image: str) -> list[dict]:
    lines = "\n".join(f"{'ABCDE'[i]}. {o}" for i, o in enumerate(options))
    return [
        {"role": "user", "content": [img(image), text(f"{question}\n{lines}")]},
        {"role": "assistant", "content": letter},
    ]


MC_OPTIONS = ["a circle", "a square", "a triangle"]


@pytest.mark.parametrize(
    ("name", "features", "row"),
    [
        (  # lmms-lab/ai2d: options list, the answer's index as text
            "ai2d",
            {"question": datasets.Value("string"), "options": datasets.List(datasets.Value("string")),
             "answer": datasets.Value("string"), "image": datasets.Image()},
            {"question": "Which shape?", "options": MC_OPTIONS, "answer": "1"},
        ),
        (  # ScienceQA: choices list, the answer's index as an int
            "scienceqa",
            {"image": datasets.Image(), "question": datasets.Value("string"),
             "choices": datasets.List(datasets.Value("string")), "answer": datasets.Value("int64")},
            {"question": "Which shape?", "choices": MC_OPTIONS, "answer": 1},
        ),
        (  # MMMU: options as a Python list's text, the answer as a letter
            "mmmu",
            {"question": datasets.Value("string"), "options": datasets.Value("string"),
             "answer": datasets.Value("string"), "image": datasets.Image()},
            {"question": "Which shape?", "options": str(MC_OPTIONS), "answer": "B"},
        ),
        (  # MMBench: one column per letter (null past the last), the answer as a letter
            "mmbench",
            {"question": datasets.Value("string"), "A": datasets.Value("string"), "B": datasets.Value("string"),
             "C": datasets.Value("string"), "D": datasets.Value("string"), "answer": datasets.Value("string"),
             "image": datasets.Image()},
            {"question": "Which shape?", "A": MC_OPTIONS[0], "B": MC_OPTIONS[1], "C": MC_OPTIONS[2], "D": None,
             "answer": "B"},
        ),
    ],
)  # fmt: skip
def test_multiple_choice_benchmarks_ask_with_lettered_options_and_answer_the_letter(
    renderer, folder, tmp_path, name, features, row
):
    columns = {k: [v] for k, v in {**row, "image": png(folder, "red")}.items()}
    hub = write_parquet(folder, name, columns, datasets.Features(features))
    canonical = write_canonical(folder, f"{name}_c", [mc_canonical("Which shape?", MC_OPTIONS, "B", "red")])
    source = assert_same_samples(renderer, hub, canonical, fmt="qa", cache=tmp_path)
    assert source[0].references == ("B",) and source[0].options == tuple(MC_OPTIONS)


def test_an_instruction_suffix_goes_after_the_last_question(renderer, folder, tmp_path):
    features = datasets.Features(
        {"image": datasets.Image(), "query": datasets.Value("string"), "label": datasets.List(datasets.Value("string"))}
    )
    hub = write_parquet(
        folder, "chartqa_instr", {"image": [png(folder, "red")], "query": ["Peak?"], "label": [["12"]]}, features
    )
    suffix = "Answer the question using a single word or phrase."
    canonical = [
        [{"role": "user", "content": [img("red"), text(f"Peak?\n{suffix}")]}, {"role": "assistant", "content": "12"}]
    ]
    assert_same_samples(
        renderer, hub, write_canonical(folder, "chartqa_instr_c", canonical), fmt="qa", cache=tmp_path,
        mapping=RowMapping(instruction=suffix),
    )  # fmt: skip


def test_an_answer_that_names_no_option_is_a_counted_skip(folder):
    from vlm_sft.data.image_roots import ImageRoots
    from vlm_sft.data.schemas import RowConverter

    for answer in ("7", "E", None):
        with pytest.raises(RenderError) as info:
            RowConverter(None, ImageRoots(folder))({"question": "q", "options": MC_OPTIONS, "answer": answer}, 3)
        assert info.value.reason == "bad_options" and info.value.sample_index == 3
