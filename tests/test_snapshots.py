"""Local snapshots of hub datasets and their subsets, as a cluster without internet holds them: a ``README.md`` with
YAML ``configs:`` and one subfolder of parquet shards per subset (``hf download ... --local-dir``), or subfolders
alone. Each subset loads alone by name, prepared and streamed; a missing or unknown subset or split names what
exists; the documented mixture example (docs/data.md) trains as written against such a snapshot; every CLI answers a config or data
error with one line and exit code 2."""

from __future__ import annotations

import io
import json
import shlex
from pathlib import Path

import datasets
import pytest
from PIL import Image

from vlm_sft.config import REPO_ROOT, load_config
from vlm_sft.data.snapshots import SnapshotError, snapshot_files, subsets
from vlm_sft.data.sources import load_conversations

PAIRS = datasets.Features(
    {
        "images": datasets.List(datasets.Image()),
        "texts": datasets.List(
            {
                "user": datasets.Value("string"),
                "assistant": datasets.Value("string"),
                "source": datasets.Value("string"),
            }
        ),
    }
)
"""the_cauldron's features, as its parquet files store them."""

CARD = """---
dataset_info:
- config_name: ai2d
  features:
  - name: images
    sequence: image
  - name: texts
    list:
    - name: user
      dtype: string
    - name: assistant
      dtype: string
    - name: source
      dtype: string
configs:
- config_name: ai2d
  data_files:
  - split: train
    path: ai2d/train-*
- config_name: chartqa
  data_files:
  - split: train
    path: chartqa/train-*
  - split: test
    path: chartqa/test-*
---
# Dataset Card for The Cauldron (a test snapshot)
"""


def png(colour: str) -> dict:
    buf = io.BytesIO()
    Image.new("RGB", (64, 64), colour).save(buf, format="PNG")
    return {"bytes": buf.getvalue(), "path": None}


COLOURS = ("red", "green", "blue", "yellow")


def pairs_shard(path: Path, subset: str, rows: int) -> None:
    """``rows`` the_cauldron-style rows whose question names the subset and the row."""
    path.parent.mkdir(parents=True, exist_ok=True)
    colours = [COLOURS[i % len(COLOURS)] for i in range(rows)]
    columns = {
        "images": [[png(c)] for c in colours],
        "texts": [
            [{"user": f"{subset} {i}: colour?", "assistant": c, "source": subset}] for i, c in enumerate(colours)
        ],
    }
    datasets.Dataset.from_dict(columns, features=PAIRS).to_parquet(path)


def write_cauldron(root: Path, *, card: bool = True) -> Path:
    """A snapshot with subsets ai2d (3 rows) and chartqa (2 train rows, 1 test row)."""
    pairs_shard(root / "ai2d" / "train-00000-of-00001-0a1b.parquet", "ai2d", 3)
    pairs_shard(root / "chartqa" / "train-00000-of-00001-2c3d.parquet", "chartqa", 2)
    pairs_shard(root / "chartqa" / "test-00000-of-00001-4e5f.parquet", "chartqa-test", 1)
    if card:
        (root / "README.md").write_text(CARD)
    return root


@pytest.fixture(scope="module")
def cauldron(tmp_path_factory) -> Path:
    return write_cauldron(tmp_path_factory.mktemp("snap") / "the_cauldron")


def questions(source) -> list[str]:
    return [source[i].messages[0]["content"][-1]["text"] for i in range(len(source))]


def test_each_subset_of_a_readme_snapshot_loads_alone_by_name(cauldron, tmp_path):
    assert subsets(cauldron) == ["ai2d", "chartqa"]
    ai2d = load_conversations(cauldron, subset="ai2d", cache_dir=str(tmp_path))
    assert questions(ai2d) == ["ai2d 0: colour?", "ai2d 1: colour?", "ai2d 2: colour?"]
    assert ai2d.schema.format == "pairs" and ai2d.files == "README.md configs, subset 'ai2d', 1 file(s)"
    chartqa = load_conversations(cauldron, subset="chartqa", cache_dir=str(tmp_path))
    assert questions(chartqa) == ["chartqa 0: colour?", "chartqa 1: colour?"]
    test = load_conversations(cauldron, subset="chartqa", split="test", cache_dir=str(tmp_path))
    assert questions(test) == ["chartqa-test 0: colour?"]


def test_a_wrong_or_missing_subset_or_split_names_what_exists(cauldron):
    with pytest.raises(
        SnapshotError, match=r"has no subset 'docvqa'; its subsets \(README.md configs\): ai2d, chartqa"
    ):
        snapshot_files(cauldron, subset="docvqa")
    with pytest.raises(SnapshotError, match=r"has 2 subsets \(ai2d, chartqa\); name one with subset"):
        snapshot_files(cauldron)
    with pytest.raises(SnapshotError, match="has no split 'validation'; its splits: train, test"):
        snapshot_files(cauldron, subset="chartqa", split="validation")
    with pytest.raises(SnapshotError, match="is one file"):
        snapshot_files(next(cauldron.glob("ai2d/*.parquet")), subset="ai2d")


def test_a_default_config_is_read_without_a_subset(tmp_path):
    root = write_cauldron(tmp_path / "snap")
    (root / "README.md").write_text(
        CARD.replace("- config_name: chartqa\n  data_files", "- config_name: chartqa\n  default: true\n  data_files")
    )
    assert snapshot_files(root).subset == "chartqa"


def test_subfolders_without_a_card_are_subsets_or_read_whole(tmp_path):
    root = write_cauldron(tmp_path / "plain", card=False)
    assert subsets(root) == ["ai2d", "chartqa"]
    whole = snapshot_files(root)
    assert [Path(f).parent.name for f in whole.files] == ["ai2d", "chartqa"]  # the train files of both, not test
    assert len(snapshot_files(root, subset="chartqa", split="test").files) == 1
    with pytest.raises(SnapshotError, match="has no subset 'docvqa'; its subsets: ai2d, chartqa"):
        snapshot_files(root, subset="docvqa")


def test_a_streamed_subset_reads_only_its_rows(cauldron, tmp_path):
    from vlm_sft.report import build_report

    overrides = ["--data.source", str(cauldron), "--data.subset", "chartqa", "--data.streaming", "true"]
    cfg = load_config(None, [*overrides, "--train.output_dir", str(tmp_path)])
    report = build_report(cfg, progress=False)
    assert report["samples_seen"] == 2 == report["samples_packed"]
    assert report["schemas"]["train"].startswith("pairs")


def test_a_hub_id_passes_the_subset_as_the_config_name(monkeypatch):
    asked = {}

    def load_dataset(path, *args, **kwargs):
        asked.update(kwargs, path=path)
        return datasets.Dataset.from_dict({"texts": [[{"user": "q", "assistant": "a"}]]})

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    source = load_conversations("HuggingFaceM4/the_cauldron", subset="ai2d", split="train")
    assert asked["path"] == "HuggingFaceM4/the_cauldron" and asked["name"] == "ai2d" and asked["split"] == "train"
    assert source.schema.format == "pairs"


# ---------------------------------------------------------------------------------------------------------------
# The documented commands (docs/data.md), as written, against such a snapshot.


def readme_block(lang: str, must_hold: str) -> str:
    """The first documented ```lang block (README.md, then docs/*.md) holding ``must_hold``."""
    from doc_pages import block

    return block(lang, must_hold)


def write_readme_mixture_data(root: Path) -> None:
    """The files the documented mixture example names: data/ocr/{train,eval}.jsonl (chat rows with image files),
    data/charts.parquet (ChartQA's question / answer schema), data/the_cauldron (a snapshot)."""
    (root / "data" / "ocr" / "img").mkdir(parents=True)
    for split, rows in (("train", 12), ("eval", 3)):
        lines = []
        for i in range(rows):
            colour = COLOURS[i % len(COLOURS)]
            Image.new("RGB", (64, 64), colour).save(root / "data" / "ocr" / "img" / f"{split}-{i}.png")
            user = [{"type": "image", "image": f"img/{split}-{i}.png"}, {"type": "text", "text": "What does it say?"}]
            lines.append(
                json.dumps({"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": colour}]})
            )
        (root / "data" / "ocr" / f"{split}.jsonl").write_text("\n".join(lines) + "\n")
    charts = datasets.Features(
        {"image": datasets.Image(), "query": datasets.Value("string"), "label": datasets.List(datasets.Value("string"))}
    )
    columns = {"image": [png(c) for c in COLOURS * 2], "query": ["Peak?"] * 8, "label": [["12", "12.0"]] * 8}
    datasets.Dataset.from_dict(columns, features=charts).to_parquet(root / "data" / "charts.parquet")
    write_cauldron(root / "data" / "the_cauldron")


def test_the_readme_mixture_example_trains_as_written_on_a_local_snapshot(tmp_path, monkeypatch):
    from train_helpers import mixture_run_args, read_metrics

    from vlm_sft.train import main

    write_readme_mixture_data(tmp_path)
    monkeypatch.chdir(tmp_path)  # the README's paths are relative to where the user runs
    tables = readme_block("toml", "[[data.sources]]")
    base = (REPO_ROOT / "configs" / "debug_mixture.toml").read_text()
    config = tmp_path / "mixture.toml"
    config.write_text(base[: base.index("[[data.sources]]")] + tables + "\n" + base[base.index("[train]") :])
    run = tmp_path / "run"
    assert main(mixture_run_args(config, run)) == 0
    steps = [r for r in read_metrics(run) if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2]
    names = ("ocr", "charts", "ai2d")
    assert all(steps[-1][f"samples/{n}"] > 0 for n in names[:2])
    assert sum(steps[-1][f"samples/{n}"] for n in names) == steps[-1]["samples_seen"]
    assert "eval_loss/ocr" in [r for r in read_metrics(run) if "eval_loss" in r][-1]


def test_the_readme_show_command_runs_on_the_snapshot(tmp_path, monkeypatch, capsys):
    from vlm_sft.report import main

    write_cauldron(tmp_path / "data" / "the_cauldron")
    monkeypatch.chdir(tmp_path)
    command = next(line for line in readme_block("bash", "--show").splitlines() if "--show" in line)
    argv = shlex.split(command)
    assert argv[:3] == ["python", "-m", "vlm_sft.report"]
    assert main(argv[3:]) == 0
    out = capsys.readouterr().out
    assert "=== source 'train': read as pairs" in out and out.count("--- row ") == 2 and "ai2d 1: colour?" in out


# ---------------------------------------------------------------------------------------------------------------
# Every CLI: a config or data error is one line and exit code 2.


def test_every_cli_answers_a_config_or_data_error_with_exit_2_and_no_traceback(cauldron, tmp_path, capsys):
    from vlm_sft import check_packing, generate, plot, report, train
    from vlm_sft.data import mixture_example

    bad_subset = ["--data.source", str(cauldron), "--data.subset", "docvqa", "--train.output_dir", str(tmp_path)]
    calls = {
        "train": (train.main, bad_subset, "has no subset 'docvqa'"),
        "report": (report.main, bad_subset, "has no subset 'docvqa'"),
        "report --show": (report.main, [*bad_subset, "--show", "1"], "has no subset 'docvqa'"),
        "check_packing": (check_packing.main, ["--data.source", str(tmp_path / "none.jsonl")], "no such file"),
        "generate": (generate.main, [str(tmp_path / "no-run" / "final"), "--prompt", "hi"], "no checkpoint folder"),
        "plot": (plot.main, [str(tmp_path / "no-run")], "metrics.jsonl"),
        "mixture_example": (mixture_example.main, ["--out", str(tmp_path / "m"), "--num-train", "2"], "error"),
    }
    for name, (main, argv, message) in calls.items():
        assert main(argv) == 2, name
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err, (name, err)
