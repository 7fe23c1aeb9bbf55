"""The shapes video task (``configs/debug_video.toml``): a run on it trains, evaluates and answers by task; the whole
run learns the order of the colours, and transformers alone, serving its ``final/``, answers as it was trained.

The learning checks take minutes: they run with ``VLM_SFT_LEARNING_CHECKS=1`` (as the default run's colour check
does); the served one also needs a Python with torchvision (``VLM_SFT_TORCHVISION_PYTHON``, the environment of
``tools/make_video_references.py``), which the project's environment cannot hold.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from train_helpers import LEARNING_CHECK, Background, read_metrics

from vlm_sft.config import REPO_ROOT
from vlm_sft.data.shapes import shapes_dir

CONFIG = "configs/debug_video.toml"
TORCHVISION_PYTHON = "VLM_SFT_TORCHVISION_PYTHON"


def _held_out(run: Path) -> Path:
    """The run's materialized shapes folder (``shapes_dir``, as the run's own config names it)."""
    s = json.loads((run / "config.json").read_text())["data"]["shapes"]
    return shapes_dir(s["root"], s["seed"], s["image_size"], s["video_share"])


def test_the_video_config_trains_and_scores_the_video_task(tmp_path):
    """Two steps of the video run on a small shapes set: the eval reports the video task's teacher-forced and
    generated accuracy, and the held-out replies name each prompt's video."""
    from vlm_sft.train import main

    run = tmp_path / "run"
    argv = ["--config", CONFIG, "--train.output_dir", str(run), "--data.shapes.root", str(tmp_path / "shapes")]
    argv += ["--data.shapes.num_train", "60", "--data.shapes.num_eval", "30", "--train.max_steps", "2"]
    argv += ["--train.eval_every", "2", "--train.eval_generate", "30", "--train.plot", "false"]
    assert main([*argv, "--data.num_workers", "0"]) == 0
    (last,) = [r for r in read_metrics(run) if "eval_loss" in r]
    assert {"eval_acc_video", "eval_gen_acc_video", "eval_acc_colour"} <= set(last)
    rows = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    videos = [r for r in rows if r["task"] == "video"]
    assert videos and all("<|video_pad|>" in r["prompt"] and "seconds>" in r["prompt"] for r in videos)
    from vlm_sft.generate import main as generate  # the docs' command on the held-out file, its clips included

    held_out = _held_out(run) / "eval.jsonl"
    out = tmp_path / "replies.jsonl"
    argv = ["--max-new-tokens", "8", "--out", str(out)]
    assert generate([str(run / "final"), "--data", str(held_out), *argv]) == 0
    tasks = [json.loads(line)["task"] for line in held_out.read_text().splitlines()]
    assert "video" in tasks and len(out.read_text().splitlines()) == len(tasks) == 30


@pytest.fixture(scope="module")
def learned(tmp_path_factory) -> Path:
    if os.environ.get(LEARNING_CHECK) != "1":
        pytest.skip(f"learning check: set {LEARNING_CHECK}=1 (~7 min)")
    out = tmp_path_factory.mktemp("video") / "run"
    shapes = tmp_path_factory.mktemp("shapes")
    Background(["--config", CONFIG, "--train.output_dir", str(out), "--data.shapes.root", str(shapes)]).wait(1800)
    return out


def test_the_video_run_learns_which_colour_comes_first(learned):
    """Held-out video questions (the colour at the start or at the end of the clip) answered by generation at the
    last eval: >= 90% exactly right, where chance is 1 in 6."""
    last = [r for r in read_metrics(learned) if "eval_gen_acc_video" in r][-1]
    assert last["eval_gen_acc_video"] >= 0.9, last


def test_transformers_alone_answers_the_video_questions(learned):
    """transformers' processor (decoding and sampling each clip by the settings saved in ``final/``) and its
    ``generate``: >= 90% of the held-out video questions answered exactly as trained."""
    python = os.environ.get(TORCHVISION_PYTHON)
    if not python:
        pytest.skip(f"needs a Python with torchvision and transformers: set {TORCHVISION_PYTHON}")
    data = _held_out(learned) / "eval.jsonl"
    script = str(REPO_ROOT / "tools" / "check_served_video.py")
    done = subprocess.run([python, script, str(learned / "final"), str(data)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["asked"] >= 20 and result["accuracy"] >= 0.9, result
