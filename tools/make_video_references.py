"""Write the synthetic test videos and transformers' own Qwen3-VL outputs for them, the references that
``tests/test_video_processor.py`` holds ``renderers.video`` to.

Runs only where torchvision is installed (transformers' video processor needs it; the project's environment has
none), so it gets an environment of its own. Check ``df -h /tmp`` first (about 6 GB), then:

    python3 -m venv /tmp/venv-tv && /tmp/venv-tv/bin/pip install torch==2.14.1 torchvision==0.29.1 \\
        transformers==5.25.0 av==18.1.0 safetensors pillow numpy jinja2
    /tmp/venv-tv/bin/python tools/make_video_references.py

``av`` must be the version of the project's environment (``.venv/bin/pip show av``; 18.1.0 is the newest for
Python 3.11): both sides decode to RGB with its FFmpeg.

Writes ``tests/fixtures/video/``: the clips (H.264 in MP4, with B-frames, so decode order matters), a frame list as
PNG files, ``references.safetensors`` (per case ``input_ids``, ``mm_token_type_ids``, ``pixel_values_videos``,
``video_grid_thw``) and ``references.json`` (per case the source, settings, the chat-template prompt, the video's
prompt text, the sampled frame indices and the source fps). The output is deterministic (x264 on one thread).

Frames are decoded with transformers' own PyAV reader (``read_video_pyav``, every frame) and sampled by the
processor (``do_sample_frames``): the processor's default decoder, torchcodec, is not installed here.
"""

from __future__ import annotations

import json
import sys
from fractions import Fraction
from pathlib import Path

import av
import numpy as np
import torch
import torchvision
import transformers
from PIL import Image
from safetensors.numpy import save_file
from transformers import AutoProcessor
from transformers.video_utils import read_video_pyav

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "tests" / "fixtures" / "video"
TINY_PROCESSOR_DIR = REPO / "processors" / "assets" / "tiny-qwen3_5"
WRAPPER = "<|vision_start|><|video_pad|><|vision_end|>"

CLIPS = {
    # name: (width, height, frames, frame rate)
    "a_64x48_24fps.mp4": (64, 48, 40, Fraction(24)),
    "b_40x72_30fps.mp4": (40, 72, 33, Fraction(30)),
    "c_64x48_ntsc.mp4": (64, 48, 25, Fraction(30000, 1001)),
    "d_128x96_24fps.mp4": (128, 96, 12, Fraction(24)),
}
FRAME_LIST = ("frames", 64, 32, 5)
"""Directory, width, height and count of the PNG frame list."""

CASES = [
    # upscaled height (48 -> 64); 40 frames at 24 fps sample 3, clamped up to min_frames
    {"name": "upscale_min_frames", "source": "a_64x48_24fps.mp4", "fps": 2, "size": (4096, 16384)},
    # odd sampled count (5): the last frame repeats; downscaled both ways
    {"name": "odd_frames", "source": "b_40x72_30fps.mp4", "fps": 5, "size": (4096, 65536)},
    # NTSC rate, odd count, and the per-frame cap binding (64x64 without it)
    {
        "name": "ntsc_cap_per_frame",
        "source": "c_64x48_ntsc.mp4",
        "fps": 7,
        "size": (1024, 65536),
        "cap_pixels_per_frame": True,
        "max_video_tokens": 1,
    },
    # the pixel budget scales 96x128 down to 32x64
    {"name": "pixel_budget", "source": "d_128x96_24fps.mp4", "fps": 2, "size": (1024, 16384)},
    # max_frames clamps 40 sampled frames to 6 (an instance setting: sample_frames ignores a call-time max_frames)
    {"name": "max_frames", "source": "a_64x48_24fps.mp4", "fps": 24, "size": (1024, 12288), "max_frames": 6},
    # a frame list is taken as given (transformers refuses to sample one); 64x32 needs no resize
    {"name": "frame_list", "source": "frames", "frame_fps": 2.0, "size": (1024, 16384)},
]


def frame_pixels(i: int, width: int, height: int) -> np.ndarray:
    """Frame ``i``: a gradient whose blue level steps each frame, a red square moving right, a green one down."""
    ys, xs = np.mgrid[0:height, 0:width]
    rgb = np.stack([xs * 255 // (width - 1), ys * 255 // (height - 1), np.full_like(xs, (i * 23) % 256)], -1)
    side = max(6, min(width, height) // 4)
    x, y = (i * 3) % (width - side), (i * 2) % (height - side)
    rgb[height // 4 : height // 4 + side, x : x + side] = (230, 30, 30)
    rgb[y : y + side, width // 2 : width // 2 + side] = (30, 210, 60)
    return rgb.astype(np.uint8)


def write_clip(path: Path, width: int, height: int, frames: int, rate: Fraction) -> None:
    with av.open(str(path), mode="w") as container:
        stream = container.add_stream("libx264", rate=rate)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.options = {"crf": "20", "preset": "medium", "threads": "1"}
        for i in range(frames):
            frame = av.VideoFrame.from_ndarray(frame_pixels(i, width, height), format="rgb24")
            container.mux(stream.encode(frame))
        container.mux(stream.encode())


def write_fixtures() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    for name, (width, height, frames, rate) in CLIPS.items():
        write_clip(OUT / name, width, height, frames, rate)
    folder, width, height, count = FRAME_LIST
    (OUT / folder).mkdir(exist_ok=True)
    for i in range(count):
        Image.fromarray(frame_pixels(i, width, height)).save(OUT / folder / f"{i:03d}.png")


def frame_paths() -> list[str]:
    folder, _, _, count = FRAME_LIST
    return [str(OUT / folder / f"{i:03d}.png") for i in range(count)]


def run_case(processor, case: dict) -> tuple[dict, dict]:
    """transformers' outputs for one case: arrays for the safetensors file and facts for the JSON file."""
    video_processor = processor.video_processor
    video_processor.min_frames, video_processor.max_frames = case.get("min_frames", 4), case.get("max_frames", 768)
    conversation = [
        {
            "role": "user",
            "content": [{"type": "video", "video": case["source"]}, {"type": "text", "text": "What moves?"}],
        }
    ]
    prompt = processor.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
    shortest, longest = case["size"]
    kwargs = {
        "size": {"shortest_edge": shortest, "longest_edge": longest},
        "cap_pixels_per_frame": case.get("cap_pixels_per_frame", False),
        "max_video_tokens": case.get("max_video_tokens", 768),
        "return_metadata": True,
        "return_text_replacement_offsets": True,
        "return_tensors": "np",
    }
    if "frame_fps" in case:
        paths = frame_paths()
        videos = [[paths]]  # a list of frame files, nested as transformers reads one video of image paths
        metadata = {"total_num_frames": len(paths), "fps": case["frame_fps"], "frames_indices": list(range(len(paths)))}
        kwargs |= {"do_sample_frames": False, "video_metadata": [metadata]}
        sampled = len(paths)  # _calculate_timestamps pads this list of indices in place: keep the frames given
    else:
        video, metadata = read_video_pyav(
            str(OUT / case["source"]), lambda metadata, **_: np.arange(metadata.total_num_frames)
        )
        metadata.frames_indices = None
        videos = [video]
        kwargs |= {"do_sample_frames": True, "fps": case["fps"], "video_metadata": [dict(metadata)]}
        sampled = None
    out = processor(text=[prompt], videos=videos, **kwargs)
    (offset,) = out["text_replacement_offsets"][0]
    assert offset["text"] == WRAPPER, offset  # 5.25 replaces the template's whole wrapper, not just the pad
    meta = out["video_metadata"][0]
    arrays = {
        "input_ids": np.asarray(out["input_ids"][0], dtype=np.int64),
        "mm_token_type_ids": np.asarray(out["mm_token_type_ids"][0], dtype=np.int64),
        "pixel_values_videos": np.asarray(out["pixel_values_videos"], dtype=np.float32),
        "video_grid_thw": np.asarray(out["video_grid_thw"][0], dtype=np.int64),
    }
    facts = {
        **{k: v for k, v in case.items() if k != "size"},
        "min_pixels": shortest,
        "max_pixels": longest,
        "min_frames": video_processor.min_frames,
        "max_frames": video_processor.max_frames,
        "prompt": prompt,
        "video_text": offset["replacement"],
        "frame_indices": [int(i) for i in meta.frames_indices][:sampled],
        "source_fps": float(meta.fps),
        "video_grid_thw": arrays["video_grid_thw"].tolist(),
    }
    return arrays, facts


def main() -> None:
    write_fixtures()
    processor = AutoProcessor.from_pretrained(TINY_PROCESSOR_DIR)
    tensors, cases = {}, []
    for case in CASES:
        arrays, facts = run_case(processor, case)
        tensors |= {f"{case['name']}.{key}": value for key, value in arrays.items()}
        cases.append(facts)
        print(f"{case['name']}: frames {facts['frame_indices']} grid {facts['video_grid_thw']}", file=sys.stderr)
    save_file(tensors, str(OUT / "references.safetensors"))
    versions = {m.__name__: m.__version__ for m in (transformers, torch, torchvision, av)}
    document = {"versions": versions, "cpu": torch.backends.cpu.get_cpu_capability(), "cases": cases}
    (OUT / "references.json").write_text(json.dumps(document, indent=1) + "\n")


if __name__ == "__main__":
    main()
