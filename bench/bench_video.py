"""What a video costs a data worker: decode + sample + resize + patchify time per clip at Qwen3.5's video settings,
its tokens, and the workers one H200 would need if its data were all video.

    python bench/bench_video.py            (about 1-2 minutes on 2 cores)
    python bench/bench_video.py --quick    (one clip size, one repetition, nothing written)

Data: synthetic H.264 clips written with PyAV (a moving gradient with pixel noise, so the encoder cannot skip
content), 30 fps, 10 s and 60 s, 640x360 and 1280x720. Each is read by ``renderers.video.load_video`` with the
tiny processor's video settings, which are Qwen3.5's (2 frames per second, 4-768 frames, 131072-786432 pixels over the
whole sampled video), in one thread, as a data worker reads it; ``--reps`` repetitions (default 3), median seconds.
``decode share``: the part of it spent in PyAV decoding every frame up to the last sampled one (timed alone).
Workers needed: the H200's token rate at 40% MFU on the 0.8B shape (``bench/results/data.json``'s
``gpu_tokens_per_s``, from ``bench_data.py``) over one worker's video tokens/s.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import tempfile
import time
from pathlib import Path

import harness  # first: the CPU environment, before torch is imported
import numpy as np

from processors import load_tiny_processor
from renderers.video import VideoSettings, load_video

RESULTS = harness.results_path("video")
DATA_RESULTS = harness.results_path("data")
CLIPS = [(640, 360, 10), (640, 360, 60), (1280, 720, 10)]
"""(width, height, seconds) of each clip, 30 fps."""


def write_clip(path: Path, width: int, height: int, seconds: int, fps: int = 30) -> Path:
    import av

    rng = np.random.default_rng(0)
    ys, xs = np.mgrid[0:height, 0:width]
    with av.open(str(path), mode="w") as container:
        stream = container.add_stream("libx264", rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for t in range(seconds * fps):
            base = (xs + 4 * t) % 256, (ys + 2 * t) % 256, (xs + ys + t) % 256
            frame = np.stack(base, axis=-1).astype(np.int16) + rng.integers(-12, 12, (height, width, 3))
            image = av.VideoFrame.from_ndarray(np.clip(frame, 0, 255).astype(np.uint8), format="rgb24")
            container.mux(stream.encode(image))
        container.mux(stream.encode())
    return path


def decode_seconds(path: Path, last_frame: int) -> float:
    """Decoding alone: every frame up to ``last_frame`` (``load_video`` converts only the sampled ones to RGB)."""
    import av

    start = time.perf_counter()
    with av.open(str(path)) as container:
        for k, _ in enumerate(container.decode(video=0)):
            if k >= last_frame:
                break
    return time.perf_counter() - start


def measure(path: Path, settings: VideoSettings, reps: int) -> dict:
    seconds, decode = [], []
    for _ in range(reps):
        start = time.perf_counter()
        video = load_video(str(path), settings)
        seconds.append(time.perf_counter() - start)
        decode.append(decode_seconds(path, int(video.frame_indices[-1])))
    t, h, w = video.grid_thw
    tokens = t * h * w // settings.merge_size**2
    s = statistics.median(seconds)
    return {
        "frames_sampled": len(video.frame_indices),
        "grid_thw": [t, h, w],
        "tokens": tokens,
        "seconds": s,
        "decode_share": statistics.median(decode) / s,
        "tokens_per_s": tokens / s,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="the first clip only, one repetition, nothing written")
    ap.add_argument("--reps", type=int, default=None, help="repetitions per clip (default 3; quick 1)")
    args = ap.parse_args()
    harness.set_threads(1)
    reps = args.reps or (1 if args.quick else 3)
    settings = VideoSettings.from_processor(load_tiny_processor().video_processor.to_dict())
    gpu = json.loads(DATA_RESULTS.read_text())["gpu_demand"]["gpu_tokens_per_s"] if DATA_RESULTS.is_file() else None
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for width, height, secs in CLIPS[:1] if args.quick else CLIPS:
            path = write_clip(Path(tmp) / f"{width}x{height}_{secs}s.mp4", width, height, secs)
            row = {"clip": f"{width}x{height}, {secs} s, 30 fps", "mb": path.stat().st_size / 2**20}
            row |= measure(path, settings, reps)
            row["workers_for_h200"] = math.ceil(gpu / row["tokens_per_s"]) if gpu else None
            rows.append(row)
    columns = [("clip", "clip", ""), ("mb", "MB", ".1f"), ("frames_sampled", "frames", ""), ("tokens", "tokens", "")]
    columns += [("seconds", "s / clip", ".3f"), ("decode_share", "decode share", ".0%")]
    columns += [("tokens_per_s", "tokens/s / worker", ",.0f"), ("workers_for_h200", "workers for an H200", "")]
    harness.print_table(f"video per data worker ({settings})", columns, rows)
    if not args.quick:
        payload = {"machine": harness.machine_facts(), "settings": str(settings), "gpu_tokens_per_s": gpu}
        harness.write_results("video", payload | {"reps": reps, "clips": rows})


if __name__ == "__main__":
    main()
