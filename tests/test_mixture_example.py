"""The mixture example (``python -m vlm_sft.data.mixture_example``) and ``configs/debug_mixture.toml``: the three
sources load in their three row formats with the rows asked for, every training row renders, the parquet rows read
their images from embedded bytes only, the config points at what the CLI writes, and the ``[[data.sources]]``
validators refuse a clash of names, a zero weight and ``data.source`` beside the tables, naming the fix."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
from PIL import Image

import renderers.images
from vlm_sft.config import REPO_ROOT, ConfigError, RunConfig, SourceConfig, load_config
from vlm_sft.data.build import build_renderer
from vlm_sft.data.mixture_example import (
    DEFAULT_OUT,
    SPECS,
    WrittenSource,
    _parser,
    main,
    share_out,
    write_mixture_example,
)
from vlm_sft.data.shapes import TASK_WEIGHTS, make_sample
from vlm_sft.data.sources import ConversationSource, load_conversations, render_fn

MIXTURE_CONFIG = REPO_ROOT / "configs" / "debug_mixture.toml"
NUM_TRAIN, NUM_EVAL, SEED = 40, 9, 3
"""Small sizes for the tests (the defaults are 600 / 60): 24 / 12 / 4 training rows, 3 held-out rows each."""


@pytest.fixture(scope="module")
def config() -> RunConfig:
    return load_config(MIXTURE_CONFIG)


@pytest.fixture(scope="module")
def renderer(config, processor):
    """The renderer the mixture run builds (its ``data`` settings over the tiny processor)."""
    return build_renderer(config, processor)


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> tuple[Path, list[WrittenSource]]:
    """The CLI's output folder, and what it wrote (the second call finds it: same settings)."""
    out = tmp_path_factory.mktemp("mixture")
    argv = ["--out", str(out), "--num-train", str(NUM_TRAIN), "--num-eval", str(NUM_EVAL), "--seed", str(SEED)]
    assert main(argv) == 0
    return out, write_mixture_example(out, num_train=NUM_TRAIN, num_eval=NUM_EVAL, seed=SEED, progress=False)


def _load(path: Path, table: SourceConfig, config: RunConfig, cache: Path) -> ConversationSource:
    """``path`` with the image roots ``table`` gives it in ``config`` (the loader's own defaults otherwise)."""
    allowed = [*config.data.allowed_image_roots, *table.allowed_image_roots]
    image_root = table.image_root if table.image_root is not None else config.data.image_root
    return load_conversations(path, image_root=image_root, allowed_image_roots=allowed, cache_dir=str(cache))


def _tables(config: RunConfig) -> dict[tuple[str, str], SourceConfig]:
    return {
        **{(s.label, "train"): s for s in config.data.sources},
        **{(s.label, "eval"): s for s in config.data.eval_sources},
    }


def test_sources_partition_the_shapes_tasks():
    tasks = [t for spec in SPECS for t in spec.tasks]
    assert sorted(tasks) == sorted(TASK_WEIGHTS)  # each sample goes to exactly one source
    assert share_out(NUM_TRAIN, [s.weight for s in SPECS]) == [24, 12, 4]
    assert share_out(7, [6, 3, 1]) == [4, 2, 1] and sum(share_out(601, [6, 3, 1])) == 601


def test_six_files_load_with_their_rows_and_tasks(written, config, tmp_path):
    out, sources = written
    expected = {"messages": (24, 3, "messages"), "llava": (12, 3, "sharegpt"), "parquet": (4, 3, "messages")}
    suffixes = {"messages": ".jsonl", "llava": ".json", "parquet": ".parquet"}
    tables = _tables(config)
    assert [w.name for w in sources] == list(expected)
    for w, spec in zip(sources, SPECS, strict=True):
        for split, rows in zip(("train", "eval"), expected[w.name][:2], strict=True):
            path = w.files[split]
            assert path == out / w.name / f"{split}{suffixes[w.name]}" and w.rows[split] == rows
            source = _load(path, tables[w.name, split], config, tmp_path / "cache")
            assert (len(source), source.schema.format) == (rows, expected[w.name][2]), path
            assert set(source.column("task")) <= set(spec.tasks), path
            assert all(isinstance(a, str) and a for a in source.column("answer")), path
            assert all(i.startswith(f"{split}-") for i in source.column("id")), path


def test_every_training_row_renders(written, config, renderer, tmp_path):
    _, sources = written
    tables = _tables(config)
    for w in sources:
        source = _load(w.files["train"], tables[w.name, "train"], config, tmp_path / "cache")
        fn = render_fn(source, renderer)
        for i in range(len(source)):
            sample = fn(i)  # a SampleError here names the row
            sample.check()
            shapes_index = int(source.row(i)["id"].split("-")[1])
            assert sample.num_images == len(make_sample(SEED, "train", shapes_index).images), (w.name, i)


def test_parquet_rows_carry_their_images_as_bytes(written, config, renderer, tmp_path, monkeypatch):
    out, sources = written
    parquet = next(w for w in sources if w.name == "parquet")
    assert not [p for p in (out / "parquet").rglob("*") if p.suffix != ".parquet"]  # no image files beside it

    def no_files(path: str) -> bytes:
        raise AssertionError(f"an image file was read: {path}")

    monkeypatch.setattr(renderers.images, "_read_file", no_files)
    source = _load(parquet.files["train"], _tables(config)["parquet", "train"], config, tmp_path / "cache")
    images_seen = 0
    for i in range(len(source)):
        row = source.row(i)
        shapes = make_sample(SEED, "train", int(row["id"].split("-")[1]))
        assert len(row["images"]) == len(shapes.images)
        for stored, original in zip(row["images"], shapes.images.values(), strict=True):
            assert stored.get("bytes"), (i, stored)  # embedded, not a path
            decoded = Image.open(io.BytesIO(stored["bytes"]))
            assert decoded.mode == "RGB" and decoded.tobytes() == original.tobytes()  # PNG is lossless
            images_seen += 1
        assert render_fn(source, renderer)(i).num_images == len(shapes.images)
    assert images_seen  # seed 3's first parquet rows include compare questions (two images each)
    messages = next(w for w in sources if w.name == "messages")
    with pytest.raises(AssertionError, match="an image file was read"):  # the control: files are caught
        render_fn(
            _load(messages.files["train"], _tables(config)["messages", "train"], config, tmp_path / "c"), renderer
        )(0)


def test_rewrites_only_when_the_settings_change(tmp_path):
    first = write_mixture_example(tmp_path / "a", num_train=10, num_eval=3, seed=0, progress=False)
    files = [p for w in first for p in w.files.values()]
    stamps = [p.stat().st_mtime_ns for p in files]
    again = write_mixture_example(tmp_path / "a", num_train=10, num_eval=3, seed=0, progress=False)
    assert again == first and [p.stat().st_mtime_ns for p in files] == stamps  # found, not rewritten
    twin = write_mixture_example(tmp_path / "b", num_train=10, num_eval=3, seed=0, progress=False)
    contents = {p.relative_to(tmp_path / "a"): p.read_bytes() for p in (tmp_path / "a").rglob("*") if p.is_file()}
    assert contents == {
        p.relative_to(tmp_path / "b"): p.read_bytes() for p in (tmp_path / "b").rglob("*") if p.is_file()
    }
    assert [w.rows for w in twin] == [w.rows for w in first]
    write_mixture_example(tmp_path / "a", num_train=10, num_eval=3, seed=1, progress=False)
    assert files[0].read_bytes() != contents[files[0].relative_to(tmp_path / "a")]  # another seed: rewritten
    with pytest.raises(ValueError, match="every source needs at least one train row; raise --num-train"):
        write_mixture_example(tmp_path / "c", num_train=5, num_eval=3, progress=False)
    assert not (tmp_path / "c").exists()


def test_config_reads_what_the_cli_writes_by_default(written, config):
    out, sources = written
    assert Path("data/mixture_example") == DEFAULT_OUT == _parser().parse_args([]).out  # from the repo root
    for field, split in (("sources", "train"), ("eval_sources", "eval")):
        tables = getattr(config.data, field)
        assert [t.label for t in tables] == [w.name for w in sources]
        for table, w in zip(tables, sources, strict=True):
            assert Path(table.source) == DEFAULT_OUT / w.files[split].relative_to(out), table
    assert [t.weight for t in config.data.sources] == [s.weight for s in SPECS] == [6, 3, 1]


_DATA = '[data]\n{extra}\n[[data.sources]]\nsource = "x/ocr.jsonl"\n{first}\n[[data.sources]]\nsource = "y/ocr.jsonl"\n{second}\n'


@pytest.mark.parametrize(
    ("first", "second", "extra", "message"),
    [
        ('name = "a"', 'name = "a"', "", r"the name\(s\) \['a'\] are used by more than one source; .* name = "),
        ("", "", "", r"the name\(s\) \['ocr'\] are used by more than one source"),  # both file stems are "ocr"
        ('name = "a"\nweight = 0', 'name = "b"', "", r"weight = 0.0: .* remove its table"),
        ('name = "a"', 'name = "b"', 'source = "z.jsonl"', r"data.source and \[\[data.sources\]\] are both set; keep"),
        ('name = "a"', 'name = "b"', 'eval_source = "e.jsonl"\n[[data.eval_sources]]\nsource = "e2.jsonl"', "keep one"),
    ],
    ids=["same-name", "same-file-stem", "weight-0", "source-and-sources", "eval_source-and-eval_sources"],
)
def test_sources_validators_name_the_fix(tmp_path, first, second, extra, message):
    path = tmp_path / "run.toml"
    path.write_text(_DATA.format(extra="", first='name = "a"\nweight = 2', second='name = "b"'))
    assert [s.weight for s in load_config(path).data.sources] == [2, 1]  # the control loads
    path.write_text(_DATA.format(extra=extra, first=first, second=second))
    with pytest.raises(ConfigError, match=message):
        load_config(path)


def test_the_config_trains_on_the_mixture_and_scores_each_eval_source(written, tmp_path):
    """README's ``accelerate launch vlm_sft/train.py --config configs/debug_mixture.toml``, made tiny: the shipped
    config over the CLI's files trains, counts each source's samples and scores each held-out source."""
    from train_helpers import mixture_run_args, read_metrics, run_training

    out, _ = written
    config = tmp_path / "debug_mixture.toml"
    config.write_text(MIXTURE_CONFIG.read_text().replace('"data/mixture_example/', f'"{out}/'))
    run = tmp_path / "run"
    run_training(mixture_run_args(config, run))
    records = read_metrics(run)
    steps = [r for r in records if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2]
    names = ("messages", "llava", "parquet")
    assert sum(steps[-1][f"samples/{n}"] for n in names) == steps[-1]["samples_seen"]
    evals = [r for r in records if "eval_loss" in r]
    assert evals and all(f"eval_loss/{n}" in evals[-1] for n in names)
