"""The embedded shapes dataset: deterministic for a seed, the tasks it promises, images that match the answers."""

from __future__ import annotations

import hashlib
import json

import numpy as np
from PIL import Image

from vlm_sft.data.shapes import COLOURS, TASK_WEIGHTS, make_sample, materialize_shapes


def _digest(folder):
    h = hashlib.sha256()
    for path in sorted(folder.rglob("*")):
        if path.is_file() and path.name != "manifest.json":
            h.update(path.relative_to(folder).as_posix().encode())
            h.update(path.read_bytes())
    return h.hexdigest()


def test_same_seed_gives_identical_files(tmp_path):
    a = materialize_shapes(tmp_path / "a", num_train=40, num_eval=8, seed=3, progress=False)
    b = materialize_shapes(tmp_path / "b", num_train=40, num_eval=8, seed=3, progress=False)
    assert _digest(a["train"].parent) == _digest(b["train"].parent)
    c = materialize_shapes(tmp_path / "c", num_train=40, num_eval=8, seed=4, progress=False)
    assert _digest(a["train"].parent) != _digest(c["train"].parent)


def test_train_and_eval_are_disjoint_streams():
    train = [make_sample(0, "train", i).messages for i in range(20)]
    held = [make_sample(0, "eval", i).messages for i in range(20)]
    assert train != held


def test_tasks_mix_and_sample_shapes(tmp_path):
    paths = materialize_shapes(tmp_path, num_train=300, num_eval=0, progress=False)
    rows = [json.loads(line) for line in paths["train"].read_text().splitlines()]
    assert len(rows) == 300
    assert {r["task"] for r in rows} == set(TASK_WEIGHTS)
    n_images = [sum(b["type"] == "image" for m in r["messages"] for b in m["content"]) for r in rows]
    assert {0, 1, 2} <= set(n_images)  # text-only, one image, two images
    assert all(r["messages"][-1]["role"] == "assistant" for r in rows)
    for r in rows:
        for m in r["messages"]:
            for b in m["content"]:
                if b["type"] == "image":
                    assert (paths["train"].parent / b["image"]).is_file()


def test_colour_answer_is_in_the_picture():
    """The colour answer must be recoverable from the pixels alone, or the task could not be learned."""
    hits = 0
    for i in range(60):
        s = make_sample(1, "train", i)
        if s.task != "colour":
            continue
        (img,) = s.images.values()
        px = np.asarray(img.convert("RGB"), dtype=np.int32).reshape(-1, 3)
        target = np.array(COLOURS[s.answer])
        hits += int((np.abs(px - target).sum(-1) < 10).sum() > 20)
        assert img.size == (64, 64) and isinstance(img, Image.Image)
    assert hits >= 15


def test_existing_dataset_is_reused(tmp_path):
    paths = materialize_shapes(tmp_path, num_train=10, num_eval=2, progress=False)
    stamp = paths["train"].stat().st_mtime_ns
    again = materialize_shapes(tmp_path, num_train=10, num_eval=2, progress=False)
    assert again == paths and paths["train"].stat().st_mtime_ns == stamp
