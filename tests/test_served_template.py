"""Served as trained: the saved checkpoint's template, called as a server calls it, prompts exactly the tokens the run
trained before each reply (``renderers.served``, ``renderers.parity.check_served_prompt``).

The measured failure this guards against (docs/serving.md, "Served as trained"): the default run trained replies as
``<think>``, ``\\n\\n``, ``</think>``, ... while the template's default (thinking) prompt ends ``<think>``, ``\\n``;
served the default way it answered 30 of 70 colour questions instead of 70.
"""

from __future__ import annotations

import pytest
import torch
from chat_fixtures import conversations

from processors import load_processor, save_processor
from renderers import TemplateParityError, check_served_prompt, check_template_parity, served_probes
from renderers.qwen3_5 import Qwen3_5Renderer
from renderers.served import (
    ServedPrompt,
    default_thinking_mode,
    has_thinking_switch,
    last_reply_reasons,
    with_thinking_default,
)
from vlm_sft.config import RunConfig
from vlm_sft.data import build as data_build
from vlm_sft.data.served_video import VIDEO_PROBE_FPS, check_served_video, video_probe

CASES = list(conversations(["p0", "p1", "p2", "p3", "p4"]))


def run_config(enable_thinking: bool, loss_on: str = "all_assistant") -> RunConfig:
    return RunConfig.model_validate(
        {"data": {"enable_thinking": enable_thinking, "loss_on": loss_on}, "model": {"vlm": {}}}
    )


@pytest.fixture(scope="module", params=[False, True], ids=["non_thinking", "thinking"])
def served(request, tmp_path_factory):
    """(mode, the run's renderer, the processor reloaded from a checkpoint directory the run saved)."""
    cfg = run_config(request.param)
    processor = data_build.build_processor(cfg)
    renderer = data_build.build_renderer(cfg, processor)
    folder = save_processor(tmp_path_factory.mktemp("final"), processor, processor.tokenizer)
    return request.param, renderer, load_processor(folder)


@pytest.mark.parametrize("case", CASES)
def test_last_reply_trains_on_the_saved_templates_generation_prompt(served, image_files, case):
    """Training tokens of the last reply == ``apply_chat_template(messages[:-1], add_generation_prompt=True)`` +
    the reply's tokens, under the saved checkpoint's template, called with no arguments (the server's default) and
    with the run's ``enable_thinking``. Single- and multi-turn, system prompts, images first and last, tool calls,
    reasoning. A non-thinking run cannot serve a reasoning reply by default (its prompt closes the think block): that
    is refused, and ``data_build.check_served_template`` warns when the data is mostly such replies."""
    enable_thinking, renderer, saved = served
    messages, tools = conversations(image_files)[case]
    if not enable_thinking and last_reply_reasons(messages):
        with pytest.raises(TemplateParityError, match="served_prompt"):
            check_served_prompt(renderer, saved, messages, tools=tools)
        return
    check_served_prompt(renderer, saved, messages, tools=tools)
    check_served_prompt(renderer, saved, messages, tools=tools, enable_thinking=enable_thinking)


def test_cases_cover_reasoning_tools_images_and_several_turns(image_files):
    cases = conversations(image_files)
    assert sum(last_reply_reasons(m) for m, _ in cases.values()) >= 2
    assert sum(t is not None for _, t in cases.values()) >= 2
    assert sum(sum(m["role"] == "assistant" for m in msgs) > 1 for msgs, _ in cases.values()) >= 3


def test_the_other_thinking_mode_is_not_what_the_run_trained(served):
    """Guards the check itself: served in the mode the run did not train, the prompt stops elsewhere."""
    enable_thinking, renderer, saved = served
    with pytest.raises(TemplateParityError, match="served_prompt"):
        check_served_prompt(renderer, saved, served_probes(False)[0], enable_thinking=not enable_thinking)


def test_a_served_prompt_without_its_think_block_fails(served):
    """A saved template whose generation prompt drops the think block prompts ``<|im_start|>assistant\\n``, still a
    prefix of the trained text: the model would have to write the template's think block itself. Refused."""
    enable_thinking, renderer, saved = served
    for prompt in ("'<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n'", "'<|im_start|>assistant\\n<think>\\n'"):
        assert prompt in saved.chat_template
    dropped = saved.chat_template.replace("<think>\\n\\n</think>\\n\\n'", "'").replace("<think>\\n'", "'")
    broken = load_processor(saved.tokenizer.name_or_path)
    broken.chat_template = broken.tokenizer.chat_template = dropped
    with pytest.raises(TemplateParityError, match="served_prompt"):
        check_served_prompt(renderer, broken, served_probes(enable_thinking)[0])


def test_reply_tokens_starting_inside_a_prompt_token_fail(served, monkeypatch):
    """Without the cut after the served prompt, a thinking run's empty think block tokenizes as ``<think>``, ``\\n\\n``
    while its prompt ends ``<think>``, ``\\n``: the token check catches it (a non-thinking run's cut merges nothing)."""
    enable_thinking, renderer, saved = served
    probe = served_probes(enable_thinking)[0]
    monkeypatch.setattr(renderer, "_tokenize", lambda text, cuts=(): Qwen3_5Renderer._tokenize(renderer, text))
    if not enable_thinking:
        check_served_prompt(renderer, saved, probe)
        return
    with pytest.raises(TemplateParityError, match="straddles the prompt"):
        check_served_prompt(renderer, saved, probe)


@pytest.mark.parametrize("case", CASES)
def test_renderer_still_equals_the_processor_in_both_modes(served, image_files, case):
    """Template parity holds with the cuts: the processor tokenizes its own text in pieces cut where its own served
    prompts end (``parity.served_cuts``), ids, modality types, images and the trained text all equal."""
    _, renderer, saved = served
    messages, tools = conversations(image_files)[case]
    check_template_parity(renderer, saved, messages, tools=tools)


def test_saved_template_serves_the_runs_mode_by_default(served):
    enable_thinking, _, saved = served
    assert default_thinking_mode(saved.chat_template, saved.tokenizer.special_tokens_map) is enable_thinking


def test_thinking_default_is_idempotent_and_an_explicit_value_wins(processor):
    base = processor.chat_template
    assert default_thinking_mode(base) is True  # the tiny template follows Qwen3.5-9B: thinking unless told not to
    off = with_thinking_default(base, False)
    assert with_thinking_default(off, False) == off
    assert with_thinking_default(off, True) == with_thinking_default(base, True)
    assert default_thinking_mode(off) is False and default_thinking_mode(with_thinking_default(off, True)) is True
    prompt = processor.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True)
    processor.chat_template = off
    try:
        explicit = processor.apply_chat_template(
            [{"role": "user", "content": "Hi"}], add_generation_prompt=True, enable_thinking=True
        )
    finally:
        processor.chat_template = base
    assert explicit == prompt


def test_a_template_without_the_switch_is_left_alone():
    template = "{% for m in messages %}{{ m.content }}{% endfor %}"
    assert not has_thinking_switch(template)
    assert with_thinking_default(template, False) == template
    assert default_thinking_mode(template) is None


def test_build_processor_writes_the_default_only_where_it_differs():
    assert default_thinking_mode(data_build.build_processor(run_config(False)).chat_template) is False
    thinking = data_build.build_processor(run_config(True))
    assert (
        thinking.chat_template == data_build.load_tiny_processor().chat_template
    )  # already the tiny template's default


def test_served_prompt_continuations_follow_the_template(processor):
    served = ServedPrompt.from_template(processor.chat_template, processor.tokenizer.special_tokens_map, False)
    assert served.header == "<|im_start|>assistant\n"
    assert served.continuations == ("<think>\n\n</think>\n\n", "<think>\n")
    text = "x<think>\n\n</think>\n\nRed."
    assert served.cut_after_prompt(text, 1, len(text)) == len("x<think>\n\n</think>\n\n")
    assert served.cut_after_prompt("xRed.", 1, 5) is None  # a history turn: no think block


def _trained_text(renderer, processor, messages, tools=None) -> str:
    sample = renderer.render(messages, tools=tools)
    return processor.tokenizer.decode(sample.token_ids[sample.loss_mask].tolist())


@pytest.mark.parametrize("enable_thinking", [False, True])
def test_stable_prefix_trains_only_turns_a_server_prompt_leads_into(image_files, enable_thinking):
    """History turns render without their think block, so no served prompt leads into them: ``stable_prefix``
    leaves them out, ``all_assistant`` trains them as rendered. Turns after the last user query (a tool call, then
    the answer) are stable and train in both."""
    cases = conversations(image_files)
    processor = data_build.build_processor(run_config(enable_thinking))
    stable = data_build.build_renderer(run_config(enable_thinking, "stable_prefix"), processor)
    every = data_build.build_renderer(run_config(enable_thinking, "all_assistant"), processor)
    messages, _ = cases["multi_turn_text"]
    history, last = (m["content"] for m in messages if m["role"] == "assistant")
    assert history in _trained_text(every, processor, messages)
    assert history not in _trained_text(stable, processor, messages)
    assert last in _trained_text(stable, processor, messages)
    messages, tools = cases["tool_call_and_result"]
    call = next(m for m in messages if m["role"] == "assistant")["tool_calls"][0]["function"]["name"]
    answer = messages[-1]["content"]
    trained = _trained_text(stable, processor, messages, tools)
    assert call in trained and answer in trained
    assert trained == _trained_text(every, processor, messages, tools)


# ------------------------------------------------------------------------------------------------ video


def test_the_video_probe_is_served_as_trained(served):
    """The saved template's text of the video probe, its wrapper expanded by transformers' own
    ``Qwen3VLProcessor.replace_video_token`` / ``get_text_with_replacements`` (text only: its video processor needs
    torchvision), tokenizes to the run's tokens; and ``check_served_video``, which expands with ours, passes."""
    from transformers.video_utils import VideoMetadata

    _, renderer, saved = served
    check_served_video(renderer, saved)
    probe = video_probe()
    sample = renderer.render(probe)
    (video,) = sample.multi_modal_data.videos
    grid = sample.multi_modal_data.image_grid_thw[video.first_item]
    metadata = VideoMetadata(total_num_frames=4, fps=VIDEO_PROBE_FPS, frames_indices=[0, 1, 2, 3])
    inputs = {"video_grid_thw": torch.tensor([[video.num_groups, *grid[1:].tolist()]]), "video_metadata": [metadata]}
    prompt = saved.apply_chat_template(probe[:-1], tokenize=False, add_generation_prompt=True)
    (theirs,), _ = saved.get_text_with_replacements(
        [prompt], videos_replacements=[saved.replace_video_token(inputs, 0)]
    )
    assert "<0.5 seconds><|vision_start|><|video_pad|>" in theirs and "<2.5 seconds>" in theirs
    ids = saved.tokenizer(theirs, add_special_tokens=False)["input_ids"]
    assert sample.token_ids[: len(ids)].tolist() == ids and len(sample.token_ids) > len(ids)


@pytest.mark.parametrize(
    ("written", "error"),
    [
        ("<|video_pad|>", "writes the probe's video as '<|video_pad|>'"),  # no wrapper for the processor to expand
        ("<|vision_start|><0.0 seconds><|video_pad|><|vision_end|>", "not as '<|vision_start|><|video_pad|>"),
        ("<0.0 seconds><|vision_start|><|video_pad|><|vision_end|>", "token_ids: the run trains"),  # its own time
    ],
    ids=["no_wrapper", "timestamp_inside", "timestamp_before"],
)
def test_a_template_that_writes_videos_otherwise_fails_the_served_check(served, written, error):
    """A saved template that writes a video block otherwise than the run's renderer (which keeps the base template)
    is refused by ``check_served_template``, naming what it wrote or the tokens that differ."""
    enable_thinking, renderer, saved = served
    wrapper = "'<|vision_start|><|video_pad|><|vision_end|>'"
    assert saved.chat_template.count(wrapper) == 1
    broken = load_processor(saved.tokenizer.name_or_path)
    broken.chat_template = broken.tokenizer.chat_template = saved.chat_template.replace(wrapper, repr(written))
    with pytest.raises(TemplateParityError, match="served_video") as err:
        data_build.check_served_template(run_config(enable_thinking), broken, renderer, [], warn=False)
    assert error in str(err.value)


def test_a_template_without_video_passes_the_check_with_a_warning(served, caplog):
    """A template that writes nothing for a video (an image-only template) serves no video: the run may train on
    images with it (a video row is then a counted skip), and the check says so instead of refusing the run."""
    enable_thinking, renderer, saved = served
    broken = load_processor(saved.tokenizer.name_or_path)
    wrapper = "'<|vision_start|><|video_pad|><|vision_end|>'"
    broken.chat_template = broken.tokenizer.chat_template = saved.chat_template.replace(wrapper, "''")
    with caplog.at_level("WARNING"):
        data_build.check_served_template(run_config(enable_thinking), broken, renderer, [], warn=False)
    assert "writes no video" in caplog.text
