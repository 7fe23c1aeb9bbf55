"""The offline tiny Qwen3.5 processor: tokenizer, chat template, image processor, load / save / verify, build."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from chat_fixtures import WEATHER_TOOL
from jinja2.exceptions import TemplateError
from PIL import Image
from transformers import AutoTokenizer

from processors import (
    TINY_PROCESSOR_DIR,
    ProcessorMismatchError,
    load_processor,
    save_processor,
    verify_saved_processor,
)
from processors.build_tiny import CHAT_TEMPLATE_PATH
from processors.build_tiny import main as build_main
from processors.special_tokens import (
    EOS_TOKEN,
    IMAGE_TOKEN,
    NOT_SPECIAL,
    PAD_TOKEN,
    QWEN3_5_SPECIAL_TOKENS,
    TINY_VOCAB_SIZE,
    VISION_END_TOKEN,
    VISION_START_TOKEN,
    tiny_token_id,
)

SYSTEM_AND_USER = [{"role": "system", "content": "You are concise."}, {"role": "user", "content": "What is 2+2?"}]
ASSISTANT = {"role": "assistant", "reasoning_content": "Two plus two equals four.", "content": "Four."}
# The three renderings of the real Qwen3.5-9B template (revision c202236), from the public goldens recorded in
# shared/reference/qwen3_5_renderings.json; copied here so the tests run on a checkout without the shared folder.
TOOLS_SYSTEM_TURN = '<|im_start|>system\n# Tools\n\nYou have access to the following functions:\n\n<tools>\n{"type": "function", "function": {"name": "get_weather", "description": "Return the weather for a city.", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}\n</tools>\n\nIf you choose to call a function ONLY reply in the following format with NO suffix:\n\n<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>\nvalue_1\n</parameter>\n<parameter=example_parameter_2>\nThis is the value for the second parameter\nthat can span\nmultiple lines\n</parameter>\n</function>\n</tool_call>\n\n<IMPORTANT>\nReminder:\n- Function calls MUST follow the specified format: an inner <function=...></function> block must be nested within <tool_call></tool_call> XML tags\n- Required parameters MUST be specified\n- You may provide optional reasoning for your function call in natural language BEFORE the function call, but NOT after\n- If there is no function call available, answer the question like normal with your current knowledge and do not tell the user about function calls\n</IMPORTANT>\n\nYou are concise.<|im_end|>\n'
REFERENCE_A = (
    TOOLS_SYSTEM_TURN + "<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
    "<|im_start|>assistant\n<think>\nTwo plus two equals four.\n</think>\n\nFour.<|im_end|>\n"
)
REFERENCE_B = TOOLS_SYSTEM_TURN + "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n<think>\n"
REFERENCE_C = (
    "<|im_start|>system\nYou are concise.<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
    "<|im_start|>assistant\n<think>\n</think>\n\nPrior answer.<|im_end|>\n<|im_start|>user\nAnd 3+3?<|im_end|>\n"
    "<|im_start|>assistant\n<think>\n"
)
SHARED_REFERENCE = Path(__file__).resolve().parents[2] / "shared" / "reference" / "qwen3_5_renderings.json"


@pytest.fixture(scope="module")
def tokenizer(processor):
    return processor.tokenizer


def square(size: tuple[int, int], colour: tuple[int, int, int]) -> Image.Image:
    image = Image.new("RGB", size, (20, 20, 20))
    image.paste(colour, (size[0] // 4, size[1] // 4, 3 * size[0] // 4, 3 * size[1] // 4))
    return image


def two_image_conversation() -> list[dict]:
    return [
        {"role": "system", "content": "You are a helpful assistant."},
        {
            "role": "user",
            "content": [
                {"type": "image", "image": square((64, 64), (255, 0, 0))},
                {"type": "text", "text": "and"},
                {"type": "image", "image": square((96, 64), (0, 0, 255))},
                {"type": "text", "text": "What colours are the squares?"},
            ],
        },
        {"role": "assistant", "reasoning_content": "Left red, right blue.", "content": "Red and blue."},
    ]


def render(tokenizer, messages, **kwargs) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)


# --- tokenizer ---------------------------------------------------------------------------------------------------


def test_tokenizer_has_qwen3_5_added_tokens_at_the_shared_ids(tokenizer):
    assert type(tokenizer).__name__ == "Qwen3_5Tokenizer"
    assert len(tokenizer) == TINY_VOCAB_SIZE
    assert (len(QWEN3_5_SPECIAL_TOKENS), len(NOT_SPECIAL)) == (33, 12)  # the real added tokens: ids 248044-248076
    decoder = tokenizer.added_tokens_decoder
    for token in QWEN3_5_SPECIAL_TOKENS:
        token_id = tiny_token_id(token)
        assert tokenizer.convert_tokens_to_ids(token) == token_id
        assert decoder[token_id].content == token
        assert decoder[token_id].special == (token not in NOT_SPECIAL), token
    assert (tokenizer.eos_token, tokenizer.pad_token) == (EOS_TOKEN, PAD_TOKEN)
    assert tokenizer.bos_token is None
    assert tokenizer.encode("<|im_start|>user\n<think>x</think>", add_special_tokens=False)[0] == tiny_token_id(
        "<|im_start|>"
    )


def test_tokenizer_round_trips_text_and_keeps_non_special_added_tokens(tokenizer):
    text = 'The red circle is at the top left. Café 🙂 红色的圆形 12,345 {"a": [1, 2]}\n\n  x'
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text
    assert max(ids) < 2048  # plain text never produces an added token
    # NFC: a decomposed e + combining acute encodes like the composed letter.
    assert tokenizer.encode("cafe\u0301", add_special_tokens=False) == tokenizer.encode(
        "café", add_special_tokens=False
    )
    ids = tokenizer.encode("<|im_start|><think>hi</think><|im_end|>", add_special_tokens=False)
    assert tokenizer.decode(ids, skip_special_tokens=True) == "<think>hi</think>"


# --- chat template -----------------------------------------------------------------------------------------------


def test_template_source_is_the_shipped_template(processor):
    assert processor.chat_template == CHAT_TEMPLATE_PATH.read_text(encoding="utf-8")
    assert processor.tokenizer.chat_template == processor.chat_template


@pytest.mark.skipif(not SHARED_REFERENCE.exists(), reason="shared/reference is not next to this checkout")
def test_reference_copies_match_the_shared_reference():
    shared = json.loads(SHARED_REFERENCE.read_text(encoding="utf-8"))
    assert shared["tool"] == WEATHER_TOOL
    assert shared["A_completed_turn_with_tools"] == REFERENCE_A
    assert shared["B_generation_prompt_with_tools"] == REFERENCE_B
    assert shared["C_multi_turn_generation_prompt"] == REFERENCE_C


def test_reference_a_completed_turn_with_tools(tokenizer):
    assert render(tokenizer, [*SYSTEM_AND_USER, ASSISTANT], tools=[WEATHER_TOOL]) == REFERENCE_A


def test_reference_b_generation_prompt_with_tools(tokenizer):
    text = render(tokenizer, SYSTEM_AND_USER, tools=[WEATHER_TOOL], add_generation_prompt=True)
    assert text == REFERENCE_B
    assert (
        render(tokenizer, SYSTEM_AND_USER, tools=[WEATHER_TOOL], add_generation_prompt=True, enable_thinking=True)
        == text
    )


def test_reference_c_is_a_prefix_extension_of_the_template_output(tokenizer):
    """C comes from the goldens' prefix-extension case, built the way the goldens built it.

    The goldens took the generation-prompt ids, appended the ids of a rendered "Prior answer." turn beyond the
    prompt's length, and rendered the next user turn after it. The prompt ends in ``<think>`` ``\\n`` while the
    turn has ``<think>`` ``\\n\\n`` (one token), so that slice drops a newline: hence ``<think>\\n</think>``. A full
    re-render of the same messages, as the real template does it, drops the earlier turn's think block instead.
    """
    prompt = tokenizer.apply_chat_template(
        SYSTEM_AND_USER, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    turn = tokenizer.apply_chat_template(
        [*SYSTEM_AND_USER, {"role": "assistant", "content": "Prior answer."}], tokenize=True, return_dict=False
    )
    assert (
        tokenizer.decode(prompt[-2:]) + "|" + tokenizer.decode(turn[len(prompt) - 2 : len(prompt)])
        == "<think>\n|<think>\n\n"
    )
    completion = turn[len(prompt) :]
    completion = completion[: completion.index(tokenizer.convert_tokens_to_ids(EOS_TOKEN)) + 1]
    next_turn = render(tokenizer, [{"role": "user", "content": "And 3+3?"}], add_generation_prompt=True)
    assert tokenizer.decode(prompt + completion) + "\n" + next_turn == REFERENCE_C

    full = render(
        tokenizer,
        [*SYSTEM_AND_USER, {"role": "assistant", "content": "Prior answer."}, {"role": "user", "content": "And 3+3?"}],
        add_generation_prompt=True,
    )
    assert full == REFERENCE_C.replace("<think>\n</think>\n\nPrior answer.", "Prior answer.")


def test_generation_prompt_without_thinking_is_a_closed_empty_block(tokenizer):
    text = render(tokenizer, SYSTEM_AND_USER, add_generation_prompt=True, enable_thinking=False)
    assert text.endswith("<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert render(tokenizer, SYSTEM_AND_USER).endswith("What is 2+2?<|im_end|>\n")  # no prompt unless asked


def test_reasoning_is_dropped_before_the_last_query_and_kept_after(tokenizer):
    messages = [
        {"role": "user", "content": "q1"},
        {"role": "assistant", "reasoning_content": "r1", "content": "a1"},
        {"role": "user", "content": "q2"},
        {"role": "assistant", "reasoning_content": "r2", "content": "a2"},
        {"role": "assistant", "content": "<think>\nr3\n</think>\n\na3"},
        {"role": "assistant", "content": "a4"},
    ]
    assert render(tokenizer, messages) == (
        "<|im_start|>user\nq1<|im_end|>\n<|im_start|>assistant\na1<|im_end|>\n"
        "<|im_start|>user\nq2<|im_end|>\n<|im_start|>assistant\n<think>\nr2\n</think>\n\na2<|im_end|>\n"
        "<|im_start|>assistant\n<think>\nr3\n</think>\n\na3<|im_end|>\n"
        "<|im_start|>assistant\n<think>\n\n</think>\n\na4<|im_end|>\n"
    )


def test_tool_calls_and_merged_tool_results(tokenizer):
    call = {"name": "get_weather", "arguments": {"city": "Paris", "days": 2, "flag": True, "opts": {"unit": "C"}}}
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "reasoning_content": "Call the tool.",
            "tool_calls": [{"type": "function", "function": call}],
        },
        {"role": "tool", "content": "Sunny"},
        {"role": "tool", "content": "Warm"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [call, {"name": "noop", "arguments": {}}]},
        {"role": "user", "content": "<tool_response>\nok\n</tool_response>"},
        {"role": "assistant", "content": "It is sunny."},
    ]
    params = "<parameter=city>\nParis\n</parameter>\n<parameter=days>\n2\n</parameter>\n"
    params += '<parameter=flag>\nTrue\n</parameter>\n<parameter=opts>\n{"unit": "C"}\n</parameter>\n'
    weather_call = "<tool_call>\n<function=get_weather>\n" + params + "</function>\n</tool_call>"
    assert render(tokenizer, messages) == (
        "<|im_start|>user\nWeather in Paris?<|im_end|>\n"
        "<|im_start|>assistant\n<think>\nCall the tool.\n</think>\n\n" + weather_call + "<|im_end|>\n"
        "<|im_start|>user\n<tool_response>\nSunny\n</tool_response>\n<tool_response>\nWarm\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n<think>\n\n</think>\n\nChecking.\n\n" + weather_call + "\n"
        "<tool_call>\n<function=noop>\n</function>\n</tool_call><|im_end|>\n"
        "<|im_start|>user\n<tool_response>\nok\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n<think>\n\n</think>\n\nIt is sunny.<|im_end|>\n"
    )


def test_image_and_video_blocks_render_in_place(tokenizer):
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "Look: "},
                {"type": "image"},
                {"type": "video"},
                {"type": "image_url", "image_url": {"url": "x.png"}},
                {"type": "text", "text": " done "},
            ],
        }
    ]
    one = "<|vision_start|><|image_pad|><|vision_end|>"
    video = "<|vision_start|><|video_pad|><|vision_end|>"
    assert render(tokenizer, messages) == f"<|im_start|>user\nLook: {one}{video}{one} done<|im_end|>\n"
    numbered = render(tokenizer, messages, add_vision_id=True)
    assert f"Look: Picture 1: {one}Video 1: {video}Picture 2: {one} done" in numbered


@pytest.mark.parametrize(
    ("messages", "message"),
    [
        ([], "empty conversation|No messages provided"),
        ([{"role": "user", "content": "q"}, {"role": "system", "content": "s"}], "must be the first message"),
        ([{"role": "system", "content": "s"}], "No user query"),
        ([{"role": "user", "content": "q"}, {"role": "robot", "content": "x"}], "Unexpected message role robot"),
        (
            [
                {"role": "user", "content": "q"},
                {"role": "assistant", "tool_calls": [{"name": "f", "arguments": '{"a": 1}'}]},
            ],
            "not a JSON string",
        ),
        (
            [{"role": "system", "content": [{"type": "image"}]}, {"role": "user", "content": "q"}],
            "cannot contain images",
        ),
    ],
)
def test_template_rejects_malformed_conversations(tokenizer, messages, message):
    with pytest.raises((ValueError, TemplateError), match=message):
        render(tokenizer, messages)


def test_assistant_mask_covers_content_through_im_end(processor, tokenizer):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "q1"},
        {"role": "assistant", "reasoning_content": "r1", "content": "a1"},
        {"role": "user", "content": "q2"},
        {"role": "assistant", "reasoning_content": "r2", "content": "The square is red."},
    ]
    for apply in (tokenizer.apply_chat_template, processor.apply_chat_template):
        out = apply(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True, return_tensors="np")
        ids, mask = out["input_ids"][0], out["assistant_masks"][0]
        spans, start = [], None
        for i, m in enumerate([*mask.tolist(), 0]):
            if m and start is None:
                start = i
            elif not m and start is not None:
                spans.append(tokenizer.decode(ids[start:i]))
                start = None
        assert spans == ["a1<|im_end|>", "<think>\nr2\n</think>\n\nThe square is red.<|im_end|>"]


# --- processor ---------------------------------------------------------------------------------------------------


def test_two_image_conversation_expands_placeholders_per_image(processor, tokenizer):
    out = processor.apply_chat_template(
        two_image_conversation(), tokenize=True, return_dict=True, return_mm_token_type_ids=True, return_tensors="np"
    )
    ids, mm_types = out["input_ids"][0], out["mm_token_type_ids"][0]
    grids = out["image_grid_thw"]
    assert grids.tolist() == [[1, 4, 4], [1, 4, 6]]  # 64x64 -> 4 tokens, 96x64 -> 6 tokens
    image_id = tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
    starts = np.flatnonzero(ids == tokenizer.convert_tokens_to_ids(VISION_START_TOKEN))
    ends = np.flatnonzero(ids == tokenizer.convert_tokens_to_ids(VISION_END_TOKEN))
    assert len(starts) == len(ends) == len(grids)
    for start, end, grid in zip(starts, ends, grids, strict=True):
        assert (ids[start + 1 : end] == image_id).all()
        assert end - start - 1 == int(np.prod(grid)) // 4
    assert np.array_equal(mm_types == 1, ids == image_id)
    assert set(np.unique(mm_types).tolist()) == {0, 1}
    assert out["pixel_values"].shape == (int(np.prod(grids, axis=1).sum()), 3 * 2 * 16 * 16)


def test_image_processor_has_qwen3_5_settings(processor):
    image_processor = processor.image_processor
    assert type(image_processor).__name__ == "Qwen2VLImageProcessorPil"
    assert (image_processor.patch_size, image_processor.temporal_patch_size, image_processor.merge_size) == (16, 2, 2)
    assert list(image_processor.image_mean) == list(image_processor.image_std) == [0.5, 0.5, 0.5]
    assert (image_processor.size.shortest_edge, image_processor.size.longest_edge) == (32 * 32, 256 * 256)
    big = image_processor(images=[Image.new("RGB", (1024, 768))], return_tensors="np")
    assert np.prod(big["image_grid_thw"][0]) // 4 <= 64  # bounded by max_pixels


def _probe_outputs(processor) -> dict:
    return dict(
        processor.apply_chat_template(two_image_conversation(), tokenize=True, return_dict=True, return_tensors="np")
    )


def assert_same_outputs(a, b) -> None:
    out_a, out_b = _probe_outputs(a), _probe_outputs(b)
    assert out_a.keys() == out_b.keys()
    for key in out_a:
        assert np.array_equal(out_a[key], out_b[key]), key


def test_save_processor_keeps_a_separate_tokenizer_template_and_pad(processor, tmp_path):
    """The clobber case: processor.save_pretrained would restore the processor's own template and pad token."""
    tokenizer = AutoTokenizer.from_pretrained(TINY_PROCESSOR_DIR)
    tokenizer.chat_template = processor.chat_template + "{#- fine-tuned variant -#}"
    tokenizer.pad_token = "<|vision_pad|>"
    save_processor(tmp_path, processor, tokenizer)
    reloaded = load_processor(tmp_path)
    assert reloaded.chat_template == tokenizer.chat_template
    assert reloaded.tokenizer.pad_token == "<|vision_pad|>"
    assert reloaded.tokenizer.pad_token_id == tiny_token_id("<|vision_pad|>")
    assert_same_outputs(reloaded, processor)


def _save_in_reverse_order(directory: Path, processor, tokenizer) -> None:
    """Test-only: the wrong order (tokenizer first, processor last) that save_processor must not use."""
    tokenizer.save_pretrained(directory)
    processor.save_pretrained(directory)


def test_reversed_save_order_is_caught_by_verification(processor, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(TINY_PROCESSOR_DIR)
    tokenizer.chat_template = processor.chat_template + "{#- fine-tuned variant -#}"
    tokenizer.pad_token = "<|vision_pad|>"
    _save_in_reverse_order(tmp_path, processor, tokenizer)
    with pytest.raises(ProcessorMismatchError) as error:
        verify_saved_processor(tmp_path, processor, tokenizer)
    assert "chat template differs" in str(error.value)
    assert "pad token: saved ('<|endoftext|>'" in str(error.value)


def test_verification_catches_changed_image_settings(processor, tmp_path):
    save_processor(tmp_path, processor, processor.tokenizer)
    config = json.loads((tmp_path / "processor_config.json").read_text())
    config["image_processor"]["size"]["longest_edge"] = 128 * 128
    (tmp_path / "processor_config.json").write_text(json.dumps(config))
    with pytest.raises(ProcessorMismatchError, match="image processor size"):
        verify_saved_processor(tmp_path, processor, processor.tokenizer)


def test_load_processor_from_a_hub_style_directory(processor, tmp_path):
    """Hub checkpoints name the torchvision image processor and keep the video settings in their own file."""
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(TINY_PROCESSOR_DIR / name, tmp_path / name)
    image_config = json.loads((TINY_PROCESSOR_DIR / "preprocessor_config.json").read_text())
    image_config["image_processor_type"] = "Qwen2VLImageProcessorFast"
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(image_config))
    video_config = processor.video_processor.to_dict()
    (tmp_path / "video_preprocessor_config.json").write_text(json.dumps(video_config))
    loaded = load_processor(tmp_path)
    assert type(loaded.image_processor).__name__ == "Qwen2VLImageProcessorPil"
    assert_same_outputs(loaded, processor)


def test_load_processor_works_without_torchvision(tmp_path):
    """In a fresh interpreter where torchvision is absent, the tiny processor loads, saves and renders."""
    script = f"""
import sys
sys.modules["torchvision"] = None  # import fails and find_spec says absent, as on a machine without it
from transformers.utils import is_torchvision_available
assert not is_torchvision_available()
from PIL import Image
from processors import load_tiny_processor, save_processor
p = load_tiny_processor()
save_processor({str(tmp_path)!r}, p, p.tokenizer)
out = p.apply_chat_template([{{"role": "user", "content": [{{"type": "image", "image": Image.new("RGB", (64, 64))}}]}}],
                            tokenize=True, return_dict=True)
print(out["image_grid_thw"].tolist())
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-1] == "[[1, 4, 4]]"


def test_build_is_deterministic_and_matches_the_committed_assets(tmp_path):
    build_main(["--out", str(tmp_path)])
    built = sorted(p.name for p in tmp_path.iterdir())
    assert built == sorted(p.name for p in TINY_PROCESSOR_DIR.iterdir())
    for name in built:
        assert (tmp_path / name).read_bytes() == (TINY_PROCESSOR_DIR / name).read_bytes(), (
            f"{name} differs from the committed asset: rerun `python -m processors.build_tiny` and commit"
        )
