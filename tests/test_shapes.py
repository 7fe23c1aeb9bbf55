"""The embedded shapes dataset: deterministic for a seed, the tasks it promises, images that match the answers."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import torch
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


def test_the_video_task_leaves_every_other_sample_as_it_was():
    with_video = [make_sample(0, "train", i, video_share=0.2) for i in range(200)]
    videos = [s for s in with_video if s.task == "video"]
    assert 20 <= len(videos) <= 60 and all(s.videos and not s.images for s in videos)
    for i, sample in enumerate(with_video):
        if sample.task != "video":
            assert sample == make_sample(0, "train", i)


def test_a_clip_shows_the_asked_colour_at_the_asked_end(tmp_path, processor):
    """The materialized clip, decoded and sampled as the video run does (``configs/debug_video.toml``: 4 frames of
    64 x 64, two groups at 0.25 s and 1.25 s), shows the answer's colour in the group the question names."""
    from renderers.video import VideoSettings, load_video

    paths = materialize_shapes(tmp_path, num_train=60, num_eval=0, video_share=0.2, progress=False)
    rows = [json.loads(line) for line in paths["train"].read_text().splitlines()]
    rows = [r for r in rows if r["task"] == "video"]
    assert rows and {"start", "end"} == {r["messages"][-1]["content"][0]["text"].split()[2] for r in rows}
    settings = VideoSettings(min_pixels=16384)
    for row in rows:
        block, _ = row["messages"][0]["content"]
        video = load_video(str(paths["train"].parent / block["video"]), settings)
        assert video.grid_thw == (2, 4, 4) and video.timestamps == (0.25, 1.25)
        group = 0 if row["messages"][-1]["content"][0]["text"].startswith("At the start") else 1
        frames = video.pixel_values.reshape(2, 16, 3, 2, 16, 16)[group, :, :, 0]  # its first frame's patches
        rgb = ((frames * 0.5 + 0.5) * 255).permute(1, 0, 2, 3).reshape(3, -1)
        wanted = torch.tensor(COLOURS[row["answer"]], dtype=torch.float32)[:, None]
        assert int(((rgb - wanted).abs().max(0).values < 30).sum()) >= 64, row  # a shape's worth of pixels
