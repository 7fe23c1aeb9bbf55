"""Video through the renderer and the data path: the tokens and pixels transformers' processor makes for the same
conversation, a trained sample that never trains a video token, rows with a videos column, packing and truncation.

The processor references come from ``tools/make_video_references.py`` (``tests/test_video_processor.py`` holds the
preprocessing to them step by step); here the whole renderer is held to them.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from test_video_processor import FIXTURES, REFERENCES, TENSORS, case_settings, case_source

from renderers import Qwen3_5Renderer, RenderError
from renderers.types import VIDEO_TOKEN_TYPE
from renderers.video import VideoSettings
from renderers.vision_items import transformers_inputs
from vlm_sft.data.collate import collate
from vlm_sft.data.image_roots import ImageRoots
from vlm_sft.data.pack import Pack
from vlm_sft.data.schemas import RowConverter, detect_schema
from vlm_sft.data.shift import shift_sample

SMALL = VideoSettings(min_pixels=1024, max_pixels=16384)
CLIP = str(FIXTURES / "a_64x48_24fps.mp4")


def video_block(case: dict) -> dict:
    block = {"type": "video", "video": case_source(case)}
    return block | ({"fps": case["frame_fps"]} if "frame_fps" in case else {})


@pytest.mark.parametrize("name", sorted(REFERENCES))
def test_rendered_prompt_equals_the_processor(name, processor):
    """ids, slot types, pixels and grid exactly as ``Qwen3VLProcessor`` (template + videos) returns them."""
    case = REFERENCES[name]
    renderer = Qwen3_5Renderer(processor, video_settings=case_settings(case))
    messages = [{"role": "user", "content": [video_block(case), {"type": "text", "text": "What moves?"}]}]
    sample = renderer.render_prompt(messages, thinking=case["prompt"].endswith("<think>\n"))
    sample.check()
    assert sample.metadata["text"].startswith(case["prompt"].split("<|vision_start|>")[0])
    np.testing.assert_array_equal(sample.token_ids.numpy(), TENSORS[f"{name}.input_ids"])
    np.testing.assert_array_equal(sample.mm_token_type_ids.numpy(), TENSORS[f"{name}.mm_token_type_ids"])
    theirs = transformers_inputs(sample.multi_modal_data)
    assert theirs["video_grid_thw"].tolist() == [case["video_grid_thw"]]
    assert torch.equal(theirs["pixel_values_videos"], torch.from_numpy(TENSORS[f"{name}.pixel_values_videos"]))
    assert "pixel_values" not in theirs


@pytest.fixture(scope="module")
def small_renderer(processor):
    return Qwen3_5Renderer(processor, video_settings=SMALL)


def mixed_conversation(image_path: str) -> list[dict]:
    return [
        {"role": "user", "content": [{"type": "image", "image": image_path}, {"type": "text", "text": "and"}]},
        {"role": "assistant", "content": "a square"},
        {"role": "user", "content": [{"type": "video", "video": CLIP}, {"type": "text", "text": "What moves?"}]},
        {"role": "assistant", "content": "the red square"},
    ]


def test_a_trained_sample_keeps_every_video_token_out_of_the_loss(small_renderer, image_files):
    sample = small_renderer.render(mixed_conversation(image_files[0]))
    sample.check()
    mm = sample.multi_modal_data
    assert mm.num_images == 1 and mm.num_videos == 1 and mm.videos[0].first_item == 1
    assert mm.item_types() == [1] + [VIDEO_TOKEN_TYPE] * mm.videos[0].num_groups
    text = small_renderer.tokenizer.decode(sample.token_ids)
    assert "<0.3 seconds><|vision_start|><|video_pad|>" in text and "<|vision_start|><0.3" not in text
    trained = small_renderer.tokenizer.decode(sample.token_ids[sample.loss_mask])
    assert trained == "a square<|im_end|><think>\n\n</think>\n\nthe red square<|im_end|>"  # the template's last turn


def test_a_packed_batch_of_video_samples_keeps_the_contract(small_renderer, image_files):
    """Two video samples and an image sample in one row: positions per segment equal each sample's own."""
    samples = [small_renderer.render(mixed_conversation(image_files[k]), sample_index=k) for k in range(2)]
    samples.append(
        small_renderer.render([mixed_conversation(image_files[2])[0], {"role": "assistant", "content": "x"}])
    )
    shifted = [shift_sample(s) for s in samples]
    batch = collate([Pack(rows=(tuple(shifted),), row_len=sum(len(s) for s in shifted) + 5)])
    batch.check(positions=True)
    assert batch.num_images == sum(s.multi_modal_data.num_items for s in samples)
    assert sum(s.num_videos for s in shifted) == 2 and shifted[0].num_video_tokens > 0


def test_rows_with_a_videos_column_and_markers(tmp_path):
    """LLaVA-Video's ShareGPT rows: ``<video>`` in the text, the files in a ``videos`` column, paths confined."""
    (tmp_path / "clip.mp4").write_bytes((FIXTURES / "a_64x48_24fps.mp4").read_bytes())
    rows = [
        {"conversations": [{"from": "human", "value": "<video>\nWhat moves?"}, {"from": "gpt", "value": "red"}],
         "videos": ["clip.mp4"]},
        {"conversations": [{"from": "human", "value": "What moves?"}, {"from": "gpt", "value": "red"}],
         "video": "clip.mp4"},
        {"conversations": [{"from": "human", "value": "<video><video>"}, {"from": "gpt", "value": "red"}],
         "videos": ["clip.mp4"]},
        {"conversations": [{"from": "human", "value": "<video>"}, {"from": "gpt", "value": "red"}],
         "videos": ["../outside.mp4"]},
    ]  # fmt: skip
    convert = RowConverter(detect_schema(["conversations", "videos"]), ImageRoots(str(tmp_path)))
    marked, unmarked = convert(rows[0], 0), convert(rows[1], 1)
    expected = [{"type": "video", "video": str(tmp_path / "clip.mp4")}]
    assert marked.messages[0]["content"][:1] == expected and unmarked.messages[0]["content"][:1] == expected
    with pytest.raises(RenderError) as err:
        convert(rows[2], 2)
    assert err.value.reason == "more_placeholders_than_videos"
    with pytest.raises(RenderError) as err:
        convert(rows[3], 3)
    assert err.value.reason == "image_outside_root"
    json.dumps(marked.messages)  # plain data, as every row of the pipeline


def test_a_video_path_outside_the_root_is_refused_before_it_is_opened(tmp_path):
    roots = ImageRoots(str(tmp_path))
    block = {"type": "video", "video": "/etc/hostname"}
    with pytest.raises(RenderError) as err:
        roots.resolve_block(block)
    assert err.value.reason == "image_outside_root"
    frames = {"type": "video", "video": [str(tmp_path / "ok.png"), "/etc/hostname"], "fps": 2}
    with pytest.raises(RenderError):
        roots.resolve_block(frames)


@torch.no_grad()
def assert_transformers_logits(sample) -> None:
    """Our tiny model on a rendered sample's items == transformers' on ``transformers_inputs`` (same weights)."""
    from transformers import Qwen3_5ForConditionalGeneration

    from vlm_sft.data.mrope import sample_position_ids
    from vlm_sft.model import build_model, tiny_qwen3_5_config

    cfg = tiny_qwen3_5_config()
    torch.manual_seed(0)
    ref = Qwen3_5ForConditionalGeneration(cfg).eval()
    ours = build_model(cfg)
    ours.load_state_dict(ref.state_dict())
    mm = sample.multi_modal_data
    ids, types = sample.token_ids[None], sample.mm_token_type_ids[None]
    with torch.no_grad():
        theirs = ref(input_ids=ids, mm_token_type_ids=types, **transformers_inputs(mm)).logits
        positions = sample_position_ids(sample.mm_token_type_ids, mm.image_grid_thw)[:, None]
        mine = ours(ids, position_ids=positions, mm_token_type_ids=types, pixel_values=mm.pixel_values,
                    image_grid_thw=mm.image_grid_thw)  # fmt: skip
    assert float((mine - theirs).abs().max()) <= 1e-5 and float(theirs.abs().max()) > 0.1


def test_a_rendered_video_conversation_gives_transformers_logits(small_renderer, image_files):
    """Renderer to model end to end: our model on our items == transformers' on ``transformers_inputs``."""
    assert_transformers_logits(small_renderer.render(mixed_conversation(image_files[1])))


def test_a_run_trains_on_video_rows_and_reports_them(tmp_path):
    """``train.py`` on LLaVA-Video-style rows (``<video>`` markers and a videos column) beside an image row, with
    the ``data.video_*`` settings: it trains 2 steps, counts every video, and skips a broken clip with its reason."""
    from train_helpers import read_metrics

    from vlm_sft.report import main as report
    from vlm_sft.train import main

    (tmp_path / "clips").mkdir()
    for name in ("a_64x48_24fps.mp4", "b_40x72_30fps.mp4"):
        (tmp_path / "clips" / name).write_bytes((FIXTURES / name).read_bytes())
    (tmp_path / "clips" / "broken.mp4").write_bytes((FIXTURES / "a_64x48_24fps.mp4").read_bytes()[:900])
    row = lambda clip, answer: {  # noqa: E731
        "conversations": [{"from": "human", "value": "<video>\nWhat moves?"}, {"from": "gpt", "value": answer}],
        "videos": [f"clips/{clip}"],
    }
    rows = [row("a_64x48_24fps.mp4", "red"), row("b_40x72_30fps.mp4", "blue")] * 4 + [row("broken.mp4", "x")]
    data = tmp_path / "videos.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    settings = ["--data.video_max_pixels", "16384", "--data.video_min_pixels", "1024", "--data.video_fps", "4"]
    common = ["--data.source", str(data), "--data.seq_len", "256", "--data.pack_len", "320", *settings]
    run = tmp_path / "run"
    train = ["--train.max_steps", "2", "--train.eval_every", "none", "--train.plot", "false", "--train.log_every", "1"]
    train += ["--data.num_workers", "0"]
    assert main([*common, *train, "--train.output_dir", str(run), "--data.max_skip_fraction", "0.5"]) == 0
    assert [r["step"] for r in read_metrics(run) if "loss" in r] == [1, 2]
    saved = json.loads((run / "final" / "processor_config.json").read_text())["video_processor"]
    assert saved["fps"] == 4 and saved["size"] == {"shortest_edge": 1024, "longest_edge": 16384}  # served as trained
    out = tmp_path / "report.json"
    assert report([*common, "--out", str(out)]) == 0
    summary = json.loads(out.read_text())
    assert summary["videos"] == 8 and summary["video_tokens"] > 0 and summary["images"] == 0
    from processors import load_tiny_processor

    renderer = Qwen3_5Renderer(
        load_tiny_processor(), video_settings=VideoSettings(4, min_pixels=1024, max_pixels=16384)
    )
    groups = 0
    for clip in ("a_64x48_24fps.mp4", "b_40x72_30fps.mp4"):
        video = {"type": "video", "video": str(tmp_path / "clips" / clip)}
        sample = renderer.render([{"role": "user", "content": [video]}, {"role": "assistant", "content": "x"}])
        groups += sample.multi_modal_data.videos[0].num_groups
    assert summary["video_frames"] == 4 * 2 * groups  # two frames per group, 4 rows of each clip
    assert [e["row"] for e in summary["skipped"]["corrupt_video"]["examples"]] == [8]


def test_video_settings_that_contradict_the_checkpoint_are_a_config_error(tmp_path, capsys):
    from vlm_sft.report import main as report

    data = tmp_path / "rows.jsonl"
    data.write_text(
        json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "a"}]})
    )
    # The tiny checkpoint's smallest video is 131072 pixels: a budget below it cannot be met.
    assert report(["--data.source", str(data), "--data.video_max_pixels", "4096"]) == 2
    err = capsys.readouterr().err
    assert "data.video_*" in err and "min_pixels=131072" in err and "Traceback" not in err


def test_generate_answers_about_a_video(tmp_path, capsys):
    """``python -m vlm_sft.generate CHECKPOINT --video CLIP --prompt ...``: transformers' ``generate`` on the prompt
    our renderer builds with the checkpoint's own video settings."""
    from transformers import Qwen3_5ForConditionalGeneration

    from processors import load_tiny_processor
    from vlm_sft.generate import main
    from vlm_sft.model import tiny_qwen3_5_config

    torch.manual_seed(0)
    Qwen3_5ForConditionalGeneration(tiny_qwen3_5_config()).save_pretrained(tmp_path / "ckpt")
    processor = load_tiny_processor()
    SMALL.apply_to(processor.video_processor)
    processor.save_pretrained(tmp_path / "ckpt")
    argv = [str(tmp_path / "ckpt"), "--video", CLIP, "--prompt", "What moves?", "--max-new-tokens", "3"]
    assert main([*argv, "--out", str(tmp_path / "out.jsonl")]) == 0
    row = json.loads((tmp_path / "out.jsonl").read_text())
    assert row["index"] == 0 and isinstance(row["reply"], str)


def test_the_readme_video_settings_load_and_reach_the_renderer():
    """The README's ``[data]`` video block, on the default config, reaches the renderer setting by setting."""
    import tomllib

    from test_snapshots import readme_block

    from vlm_sft.config import load_config
    from vlm_sft.data.build import build_processor, build_renderer

    settings = tomllib.loads(readme_block("toml", "video_fps"))["data"]
    cfg = load_config(overrides=[f"--data.{k}={v}" for k, v in settings.items()])
    renderer = build_renderer(cfg, build_processor(cfg))
    settings = renderer.video_settings
    assert (settings.fps, settings.min_frames, settings.max_frames) == (2, 4, 64)
    assert (settings.max_pixels, settings.cap_pixels_per_frame, settings.max_video_tokens) == (1048576, True, 256)


@pytest.mark.parametrize("streaming", [False, True])
def test_a_parquet_with_the_hub_video_feature_loads_prepared_and_streamed(tmp_path, streaming):
    """``datasets.Video`` columns, as the hub stores them: read undecoded (``datasets`` would need torchcodec to
    decode them) and decoded by the renderer, in both loaders."""
    import datasets

    from vlm_sft.report import main as report

    turns = datasets.List({"from": datasets.Value("string"), "value": datasets.Value("string")})
    features = datasets.Features({"videos": datasets.List(datasets.Video()), "conversations": turns})
    clip = {"bytes": (FIXTURES / "a_64x48_24fps.mp4").read_bytes(), "path": "a.mp4"}
    conversation = [{"from": "human", "value": "<video>\nWhat moves?"}, {"from": "gpt", "value": "red"}]
    rows = {"videos": [[clip]] * 3, "conversations": [conversation] * 3}
    datasets.Dataset.from_dict(rows, features=features).to_parquet(tmp_path / "train.parquet")
    out = tmp_path / "report.json"
    settings = ["--data.video_max_pixels", "16384", "--data.video_min_pixels", "1024"]
    argv = ["--data.source", str(tmp_path / "train.parquet"), "--data.streaming", json.dumps(streaming), *settings]
    assert report([*argv, "--out", str(out)]) == 0
    summary = json.loads(out.read_text())
    assert summary["videos"] == 3 and summary["samples_packed"] == 3 and not summary["skipped"]


def test_the_notebook_view_shows_the_frames_the_tower_receives(small_renderer):
    """``viz_video.video_frames`` rebuilds each group's frames from the sample's patch rows: equal to the source's
    sampled frames resized as the processor resizes them (unpatchify is patchify's inverse)."""
    import av

    from renderers.video import resize_frames
    from vlm_sft.viz_video import plot_video, video_frames

    sample = small_renderer.render(
        [
            {"role": "user", "content": [{"type": "video", "video": CLIP}, {"type": "text", "text": "What?"}]},
            {"role": "assistant", "content": "x"},
        ]
    )
    groups = video_frames(sample, SMALL)
    video = sample.multi_modal_data.videos[0]
    assert [t for t, _ in groups] == list(video.timestamps) and all(len(f) == 2 for _, f in groups)
    with av.open(CLIP) as container:
        source = [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]
    indices = [0, 13, 26, 39]  # tests/fixtures/video/references.json, case upscale_min_frames (same clip and budget)
    height, width = groups[0][1][0].shape[:2]
    expected = resize_frames(
        torch.from_numpy(np.stack([source[i] for i in indices])).permute(0, 3, 1, 2), (height, width)
    )
    ours = torch.from_numpy(np.stack([f for _, frames in groups for f in frames])).permute(0, 3, 1, 2)
    assert int((ours.int() - expected.int()).abs().max()) <= 1  # float32 normalize and back: at most one level
    assert not torch.equal(ours[0], ours[-1])  # the clip moves: the guard that frames are not all one
    assert len(plot_video(sample, SMALL).axes) == 2


def test_video_rows_without_a_vision_tower_are_a_config_error(tmp_path, capsys):
    """A video-only row needs ``[model.vlm]`` as an image does (a video has no images to count, and was let through)."""
    from vlm_sft.train import main

    (tmp_path / "a.mp4").write_bytes((FIXTURES / "a_64x48_24fps.mp4").read_bytes())
    row = {"messages": [{"role": "user", "content": [{"type": "video", "video": "a.mp4"}]},
                        {"role": "assistant", "content": "red"}]}  # fmt: skip
    (tmp_path / "v.jsonl").write_text(json.dumps(row) + "\n")
    argv = ["--data.source", str(tmp_path / "v.jsonl"), "--model.vlm", "none", "--data.num_workers", "0"]
    assert main([*argv, "--train.output_dir", str(tmp_path / "run"), "--train.max_steps", "1"]) == 2
    assert "0 image(s) and 1 video(s) but the config has no [model.vlm] section" in capsys.readouterr().err
