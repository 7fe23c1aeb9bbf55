"""Ask a trained checkpoint about the held-out videos of its data through transformers alone: transformers' PyAV
reader decodes each clip, transformers' own processor samples and resizes it by the settings saved in the checkpoint
and writes the prompt, and ``Qwen3_5ForConditionalGeneration.generate`` answers, greedy. Prints how many replies
equal the reference exactly.

The processor's own decoder is torchcodec, which needs FFmpeg libraries of the system; transformers' ``load_video``
with ``backend="pyav"`` is its other reader, and the processor samples the decoded frames as it samples its own.

transformers' video processor needs torchvision, which does not install beside the project's CPU torch, so this runs
in the environment of ``tools/make_video_references.py`` (its docstring says how to make it). After the video run
(``configs/debug_video.toml``):

    /tmp/venv-tv/bin/python tools/check_served_video.py outputs/debug_video/final \\
        data/shapes/seed0-size64-video0.2/eval.jsonl --task video

It imports nothing of the project: what it checks is what a user serving ``final/`` with transformers gets.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch
from transformers import AutoProcessor, Qwen3_5ForConditionalGeneration
from transformers.video_utils import load_video


def _prompt(messages: list[dict], root: Path) -> tuple[list[dict], list[str], str]:
    """The conversation up to its last reply, the absolute paths of its videos, and that reply's text."""
    *prompt, reply = messages
    videos = [
        str(root / block["video"])
        for message in prompt
        for block in (message["content"] if isinstance(message["content"], list) else [])
        if block.get("type") == "video"
    ]
    text = reply["content"] if isinstance(reply["content"], str) else "".join(b["text"] for b in reply["content"])
    return prompt, videos, text


def _every_frame(metadata, **_) -> np.ndarray:
    return np.arange(metadata.total_num_frames)


def _inputs(processor, prompt: list[dict], paths: list[str]) -> dict:
    """What the processor makes of the prompt: every frame decoded, then sampled by the processor's saved settings."""
    text = processor.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
    videos, metadata = [], []
    for path in paths:
        frames, meta = load_video(path, backend="pyav", sample_indices_fn=_every_frame)
        meta.frames_indices = None
        videos.append(frames)
        metadata.append(dict(meta))
    extra = {"videos": videos, "video_metadata": metadata, "do_sample_frames": True} if videos else {}
    return processor(text=[text], return_tensors="pt", **extra)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", type=Path, help="a final/ (or step) checkpoint folder")
    parser.add_argument("data", type=Path, help="a jsonl of conversations; video paths relative to its folder")
    parser.add_argument("--task", default="video", help="only rows whose 'task' is this (empty: every row)")
    parser.add_argument("--limit", type=int, default=200)
    args = parser.parse_args()
    processor = AutoProcessor.from_pretrained(args.checkpoint)
    model = Qwen3_5ForConditionalGeneration.from_pretrained(args.checkpoint, dtype=torch.float32).eval()
    rows = [json.loads(line) for line in args.data.read_text().splitlines() if line.strip()]
    rows = [r for r in rows if not args.task or r.get("task") == args.task][: args.limit]
    right = 0
    for row in rows:
        prompt, paths, reference = _prompt(row["messages"], args.data.parent)
        inputs = _inputs(processor, prompt, paths)
        with torch.no_grad():
            out = model.generate(**inputs, max_new_tokens=32, do_sample=False)
        reply = processor.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
        reply = reply.rsplit("</think>", 1)[-1].strip()
        right += reply == reference.strip()
    print(json.dumps({"task": args.task, "right": right, "asked": len(rows), "accuracy": right / max(len(rows), 1)}))


if __name__ == "__main__":
    main()
