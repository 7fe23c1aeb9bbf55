"""Streaming end to end: a sharded local parquet source trained on by 2 ranks x 2 data workers, every row seen once
per pass, and a run resumed from a mid-run checkpoint that continues exactly as the uninterrupted run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from train_helpers import deterministic, read_metrics, run_training, tiny_run_args

from vlm_sft.data.shapes import materialize_shapes
from vlm_sft.data.sources import rows_to_dataset

ROWS = 32


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> tuple[Path, Path]:
    """4 parquet files of shapes rows (images stay files beside them, referenced relative to ``image_root``)."""
    tmp = tmp_path_factory.mktemp("stream")
    paths = materialize_shapes(tmp / "shapes", num_train=ROWS, num_eval=0, seed=3, image_size=64, progress=False)
    rows = [json.loads(line) for line in paths["train"].read_text().splitlines()]
    folder = tmp / "shards"
    folder.mkdir()
    for k in range(4):
        rows_to_dataset(rows[k::4]).to_parquet(str(folder / f"part-{k:02d}.parquet"))
    return folder, paths["train"].parent


def _args(tmp: Path, shards: tuple[Path, Path], **extra: object) -> list[str]:
    folder, image_root = shards
    return tiny_run_args(
        tmp,
        **{
            "data.source": str(folder),
            "data.image_root": str(image_root),
            "data.streaming": True,
            "data.num_workers": 2,
            "data.streams_per_micro_batch": 2,  # 2 ranks x 1 micro-batch x 2 = 4 streams: one file each
            "data.bfd_buffer": 8,
            "train.max_steps": 8,
            "train.save_every": 4,
            **extra,
        },
    )


def test_two_ranks_two_workers_stream_every_row_once_and_resume_exactly(tmp_path, shards):
    whole = tmp_path / "whole"
    run_training(_args(whole, shards), nproc=2, timeout=240)
    accounting = json.loads((whole / "run" / "data_accounting.json").read_text())
    first_pass = next(h["pass"] for h in accounting["history"] if "pass" in h)
    assert first_pass == {"number": 1, "seen": ROWS, "packed": ROWS, "skipped": 0}  # 4 shards, each row once

    checkpoint = whole / "run" / "checkpoints" / "step-000004"
    resumed = tmp_path / "resumed"
    run_training(_args(resumed, shards, **{"train.resume": str(checkpoint)}), nproc=2, timeout=240)
    expected = [r for r in deterministic(read_metrics(whole / "run")) if r["step"] > 4]
    got = deterministic(read_metrics(resumed / "run"))
    assert [r["step"] for r in got] == list(range(5, 9))
    assert got == expected
