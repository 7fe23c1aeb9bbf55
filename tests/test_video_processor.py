"""``renderers.video`` against transformers 5.25's own Qwen3-VL video processor and processor, and its errors.

The references in ``tests/fixtures/video/`` are transformers' outputs for the clips there, written by
``tools/make_video_references.py`` in an environment with torchvision (this one has none). Grid, sampled frames,
timestamps, token ids and modality types must match exactly, and so must the pixels (``PIXEL_BOUND`` = 0, the max
abs difference measured): torchvision resizes uint8 frames with the very torch kernel ``resize_frames`` calls, whose
AVX2 and default builds agree here (``ATEN_CPU_CAPABILITY=default``). A float round trip through the resize instead
is off by one uint8 level in places, which this bound catches. Both sides decode with PyAV: one with another FFmpeg
may convert YUV to RGB differently; the references record the versions that wrote them.
"""

from __future__ import annotations

import dataclasses
import json
import os
from fractions import Fraction
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import av
import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.numpy import load_file
from transformers import AutoTokenizer
from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

from processors import TINY_PROCESSOR_DIR
from renderers.errors import RenderError
from renderers.video import (
    VideoSettings,
    group_timestamps,
    load_video,
    resized_size,
    sample_frame_indices,
    video_placeholder_text,
)

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "video"
_DOCUMENT = json.loads((FIXTURES / "references.json").read_text())
REFERENCES = {case["name"]: case for case in _DOCUMENT["cases"]}
VERSIONS = _DOCUMENT["versions"]
TENSORS = load_file(str(FIXTURES / "references.safetensors"))
PIXEL_BOUND = 0.0
"""Largest |ours - transformers'| pixel value allowed (measured: 0; one uint8 level would be 1 / 127.5)."""
WRAPPER = "<|vision_start|><|video_pad|><|vision_end|>"
TINY_VIDEO_CONFIG = json.loads((TINY_PROCESSOR_DIR / "processor_config.json").read_text())["video_processor"]


def case_settings(case: dict) -> VideoSettings:
    """The tiny checkpoint's settings with the case's videos_kwargs, as the processor was called with them."""
    changes = {k: case[k] for k in ("fps", "min_frames", "max_frames", "min_pixels", "max_pixels") if k in case}
    changes["cap_pixels_per_frame"] = case.get("cap_pixels_per_frame", False)
    changes["max_video_tokens"] = case.get("max_video_tokens", 768)
    return dataclasses.replace(VideoSettings.from_processor(TINY_VIDEO_CONFIG), **changes)


def case_source(case: dict) -> str | list[str]:
    source = FIXTURES / case["source"]
    return sorted(str(p) for p in source.iterdir()) if source.is_dir() else str(source)


def load_case(case: dict, source=None):
    return load_video(case_source(case) if source is None else source, case_settings(case), fps=case.get("frame_fps"))


@pytest.fixture(scope="module")
def processed() -> dict:
    return {name: load_case(case) for name, case in REFERENCES.items()}


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(TINY_PROCESSOR_DIR)


@pytest.mark.parametrize("name", sorted(REFERENCES))
def test_grid_frames_and_prompt_text_match_transformers(name, processed):
    case, video = REFERENCES[name], processed[name]
    assert list(video.grid_thw) == case["video_grid_thw"] == TENSORS[f"{name}.video_grid_thw"].tolist()
    assert list(video.frame_indices) == case["frame_indices"]
    assert video.source_fps == case["source_fps"]
    assert video_placeholder_text(video, merge_size=2) == case["video_text"]


@pytest.mark.parametrize("name", sorted(REFERENCES))
def test_tokens_match_transformers(name, processed, tokenizer):
    """The template's whole wrapper is replaced (5.25 collapses it first): no outer start / end pair is left."""
    case = REFERENCES[name]
    assert case["prompt"].count(WRAPPER) == 1
    text = case["prompt"].replace(WRAPPER, video_placeholder_text(processed[name], merge_size=2))
    input_ids = np.asarray(tokenizer(text)["input_ids"])
    mm_token_type_ids = np.where(input_ids == tokenizer.convert_tokens_to_ids("<|video_pad|>"), 2, 0)
    np.testing.assert_array_equal(input_ids, TENSORS[f"{name}.input_ids"])
    np.testing.assert_array_equal(mm_token_type_ids, TENSORS[f"{name}.mm_token_type_ids"])


@pytest.mark.parametrize("name", sorted(REFERENCES))
def test_pixels_match_transformers(name, processed):
    ours, theirs = processed[name].pixel_values, torch.from_numpy(TENSORS[f"{name}.pixel_values_videos"])
    assert ours.dtype == torch.float32 and ours.shape == theirs.shape
    diff = (ours - theirs).abs().max().item()
    assert diff <= PIXEL_BOUND, f"max |diff| {diff} ({diff * 127.5:.2f} uint8 levels); references from {VERSIONS}"


def test_the_references_hold_the_cases_that_catch_bugs():
    """An odd sampled count (the last frame repeats), the per-frame cap, a budget scale-down and a frame list."""
    odd = [c for c in REFERENCES.values() if len(c["frame_indices"]) % 2]
    assert len(odd) >= 2 and any("frame_fps" in c for c in REFERENCES.values())
    assert any(c.get("cap_pixels_per_frame") for c in REFERENCES.values())
    budget = REFERENCES["pixel_budget"]
    assert resized_size(4, 96, 128, case_settings(budget)) == (32, 64)
    capped = case_settings(REFERENCES["ntsc_cap_per_frame"])
    assert resized_size(5, 48, 64, capped) != resized_size(
        5, 48, 64, dataclasses.replace(capped, cap_pixels_per_frame=False)
    )


def test_frame_order_matters():
    """The frame list reversed gives other pixels and the same grid: the pixel check sees the order."""
    case = REFERENCES["frame_list"]
    reversed_frames = load_case(case, list(reversed(case_source(case))))
    theirs = torch.from_numpy(TENSORS["frame_list.pixel_values_videos"])
    assert list(reversed_frames.grid_thw) == case["video_grid_thw"]
    assert (reversed_frames.pixel_values - theirs).abs().max().item() > 0.5


def test_sampling_and_timestamps_rules():
    settings = VideoSettings(fps=2, min_frames=4, max_frames=6)
    assert sample_frame_indices(40, 24.0, settings).tolist() == [0, 13, 26, 39]  # 3 -> min_frames
    assert sample_frame_indices(3, 24.0, settings).tolist() == [0, 1, 2]  # never more than there are
    assert sample_frame_indices(240, 24.0, settings).tolist() == [0, 48, 96, 143, 191, 239]  # 20 -> max_frames
    # an odd count repeats the last index before the pairs are averaged: (0, 1), (2, 3), (4, 4) at 2 fps
    assert group_timestamps([0, 1, 2, 3, 4], 2.0, 2) == (0.25, 1.25, 2.0)


def test_settings_from_the_checkpoint_config():
    settings = VideoSettings.from_processor(TINY_VIDEO_CONFIG)
    assert (settings.fps, settings.min_frames, settings.max_frames) == (2, 4, 768)
    assert (settings.min_pixels, settings.max_pixels) == (131072, 786432)
    assert (settings.cap_pixels_per_frame, settings.max_video_tokens, settings.factor) == (False, 768, 32)
    assert settings.image_mean == (0.5, 0.5, 0.5) and settings.rescale_factor == pytest.approx(1 / 255)
    assert VideoSettings.from_processor(Qwen3VLVideoProcessor().to_dict()) == VideoSettings()  # the same defaults
    for key, value in (("resample", 2), ("do_sample_frames", False), ("do_normalize", False)):
        with pytest.raises(ValueError, match=key):
            VideoSettings.from_processor({**TINY_VIDEO_CONFIG, key: value})


def _write_clip(path: Path, frames: int, container_format: str = "mp4", size: tuple[int, int] = (48, 32)) -> Path:
    """A small H.264 clip at 24 fps whose frames differ (the grey level steps)."""
    width, height = size
    with av.open(str(path), mode="w", format=container_format) as container:
        stream = container.add_stream("libx264", rate=Fraction(24))
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.options = {"threads": "1"}
        for i in range(frames):
            pixels = np.full((height, width, 3), (i * 29) % 256, np.uint8)
            container.mux(stream.encode(av.VideoFrame.from_ndarray(pixels, format="rgb24")))
        container.mux(stream.encode())
    return path


def _write_audio(path: Path) -> Path:
    """A WAV file: a container without a video stream."""
    with av.open(str(path), mode="w", format="wav") as container:
        stream = container.add_stream("pcm_s16le", rate=8000)
        frame = av.AudioFrame.from_ndarray(np.zeros((1, 800), np.int16), format="s16", layout="mono")
        frame.sample_rate = 8000
        container.mux(stream.encode(frame))
        container.mux(stream.encode(None))
    return path


SMALL = VideoSettings(min_pixels=1024, max_pixels=16384)


def test_every_source_form_gives_the_same_video(tmp_path, monkeypatch):
    path = _write_clip(tmp_path / "clip.mp4", 10)
    data = path.read_bytes()
    (tmp_path / "a:b.mp4").write_bytes(data)
    monkeypatch.chdir(tmp_path)  # "a:b.mp4" is opened by Python: FFmpeg would read "a:" as a protocol
    reference = load_video(str(path), SMALL)
    forms = (path, f"file://{path}", "a:b.mp4", data, {"bytes": data, "path": "x"}, {"bytes": None, "path": str(path)})
    for source in forms:
        video = load_video(source, SMALL)
        assert video.content_hash == reference.content_hash and video.grid_thw == reference.grid_thw
        assert torch.equal(video.pixel_values, reference.pixel_values)


def test_a_stream_without_a_frame_count_is_counted(tmp_path):
    """Matroska states no frame count (transformers' PyAV reader fails there); its packets are counted instead."""
    mp4 = load_video(_write_clip(tmp_path / "clip.mp4", 30), SMALL)
    mkv_path = _write_clip(tmp_path / "clip.mkv", 30, "matroska")
    with av.open(str(mkv_path)) as container:
        assert container.streams.video[0].frames == 0
    mkv = load_video(mkv_path, SMALL)
    assert mkv.frame_indices == mp4.frame_indices == (0, 10, 19, 29)
    assert torch.equal(mkv.pixel_values, mp4.pixel_values)


def test_fps_samples_a_file_and_times_a_frame_list(tmp_path):
    path = _write_clip(tmp_path / "clip.mp4", 24)
    assert len(load_video(path, SMALL).frame_indices) == 4  # 2 fps over 1 s: min_frames
    assert len(load_video(path, SMALL, fps=12).frame_indices) == 12
    frames = [Image.new("RGB", (32, 32), (i * 40, 0, 0)) for i in range(4)]
    video = load_video(frames, SMALL, fps=4)
    assert video.frame_indices == (0, 1, 2, 3) and video.timestamps == (0.125, 0.625)
    assert load_video(frames, SMALL, fps=8).content_hash != video.content_hash


def _reason(source, fps=None, settings=SMALL) -> str:
    with pytest.raises(RenderError) as info:
        load_video(source, settings, fps=fps)
    return info.value.reason


def test_bad_videos_are_render_errors(tmp_path):
    data = _write_clip(tmp_path / "clip.mp4", 10).read_bytes()
    (tmp_path / "zero.mp4").write_bytes(b"")
    png = tmp_path / "frame.png"
    Image.new("RGB", (32, 32)).save(png)
    assert _reason(data[: len(data) // 2]) == "corrupt_video"  # truncated (the index is at the end)
    assert _reason(str(tmp_path / "zero.mp4")) == "corrupt_video"
    assert _reason(b"this is not a video, just some text") == "corrupt_video"
    assert b"avc1" in data and _reason(data.replace(b"avc1", b"zzzz")) == "unsupported_codec"  # no decoder has it
    assert _reason(png.read_bytes()) == "short_video"  # FFmpeg reads an image file as a 1-frame video
    assert _reason(str(tmp_path / "missing.mp4")) == "missing_video"
    assert _reason(str(tmp_path)) == "missing_video"
    assert _reason("https://example.com/clip.mp4") == "remote_video"
    assert _reason("http://example.com/clip.mp4") == "remote_video"
    assert _reason(data, fps=0) == _reason(data, fps=float("nan")) == "bad_video_source"
    assert _reason(_write_audio(tmp_path / "audio.wav")) == "empty_video"
    assert _reason(_write_clip(tmp_path / "one.mp4", 1)) == "short_video"
    assert _reason(12) == _reason({"path": None}) == _reason({"bytes": "text"}) == "bad_video_source"


def test_bad_frame_lists_are_render_errors(tmp_path):
    png = tmp_path / "frame.png"
    Image.new("RGB", (32, 32)).save(png)
    assert _reason([], fps=2) == "empty_video"
    assert _reason([str(png)] * 4) == "bad_video_source"  # no fps
    assert _reason([str(png), str(tmp_path / "missing.png")], fps=2) == "missing_video"
    assert _reason([str(png), b"not an image"], fps=2) == "corrupt_video"
    assert _reason([str(png), Image.new("RGB", (16, 32))], fps=2) == "bad_video_source"
    assert _reason([str(png)] * 5, fps=2, settings=dataclasses.replace(SMALL, max_frames=4)) == "bad_video_source"
    assert _reason([str(png)], fps=2) == "short_video"
