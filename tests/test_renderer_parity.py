"""The renderer against the processor's own ``apply_chat_template``: token ids, images, modality types, loss mask."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest
import torch
from chat_fixtures import conversations, img, txt
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

from renderers import (
    IMAGE_TOKEN_TYPE,
    RenderedSample,
    TemplateParityError,
    check_template_parity,
    get_renderer,
)
from renderers.qwen3_5 import Qwen3_5Renderer

REFERENCE = Path(__file__).resolve().parent / "fixtures" / "qwen3_5_renderings.json"


def assert_parity(renderer, processor, messages, tools=None, reference_messages=None) -> RenderedSample:
    """Ours on ``messages`` equals the processor on ``reference_messages`` (default: the same messages)."""
    sample = renderer.render(messages, tools=tools)
    sample.check()
    ref = processor.apply_chat_template(
        reference_messages or messages,
        tools=tools,
        tokenize=True,
        return_dict=True,
        return_tensors="pt",
        return_assistant_tokens_mask=True,
    )
    ref_ids = ref["input_ids"][0]
    assert sample.token_ids.tolist() == ref_ids.tolist()
    assert torch.equal(sample.mm_token_type_ids, ref["mm_token_type_ids"][0].long())
    vision = torch.isin(ref_ids, torch.as_tensor(renderer.vision_ids)) | (ref_ids == renderer.image_token_id)
    if renderer.loss_on == "all_assistant":
        assert torch.equal(sample.loss_mask, ref["assistant_masks"][0].bool() & ~vision)
    if sample.multi_modal_data is None:
        assert "pixel_values" not in ref
    else:
        mm = sample.multi_modal_data
        assert torch.equal(mm.image_grid_thw, ref["image_grid_thw"])
        assert torch.equal(mm.pixel_values, ref["pixel_values"])
        for r in mm.placeholders:
            assert sample.token_ids[r.offset - 1] == renderer.vision_ids[0]
            assert sample.token_ids[r.end] == renderer.vision_ids[1]
    assert len(sample.token_ids) == len(sample.loss_mask) == len(sample.mm_token_type_ids)
    return sample


CASES = list(conversations(["p0", "p1", "p2", "p3", "p4"]))


@pytest.mark.parametrize("case", CASES)
def test_parity_with_apply_chat_template(renderer, processor, image_files, case):
    messages, tools = conversations(image_files)[case]
    sample = assert_parity(renderer, processor, messages, tools)
    n_images = sum(
        isinstance(b, dict) and b.get("type") in ("image", "image_url")
        for m in messages
        for b in m["content"]
        if isinstance(m["content"], list)
    )
    assert sample.num_images == n_images
    assert sample.num_trainable_tokens > 0


def test_at_least_twenty_cases():
    assert len(CASES) >= 20


def test_image_source_spellings_give_identical_samples(renderer, processor, image_files):
    """Path, file://, bytes, data URI, base64 key, PIL, image_url and {bytes, path} all render like the path."""
    path = image_files[1]
    data = Path(path).read_bytes()
    b64 = base64.b64encode(data).decode()
    sources = [
        {"type": "image", "image": path},
        {"type": "image", "path": path},
        {"type": "image", "url": "file://" + path},
        {"type": "image", "image": data},
        {"type": "image", "image": {"bytes": data, "path": None}},
        {"type": "image", "image": "data:image/png;base64," + b64},
        {"type": "image", "base64": b64},
        {"type": "image", "image": Image.open(path)},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64," + b64}},
        {"type": "image_url", "image_url": path},
    ]
    reference = [{"role": "user", "content": [img(path), txt("?")]}, {"role": "assistant", "content": "Green."}]
    for block in sources:
        messages = [{"role": "user", "content": [block, txt("?")]}, {"role": "assistant", "content": "Green."}]
        assert_parity(renderer, processor, messages, reference_messages=reference)


def test_matches_real_qwen3_5_rendering(renderer):
    """Our rendering of the published Qwen3.5 case A (tools, system, reasoning) equals the real template's text."""
    ref = json.loads(REFERENCE.read_text())
    messages = [
        {"role": "system", "content": "You are concise."},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "reasoning_content": "Two plus two equals four.", "content": "Four."},
    ]
    assert renderer.render_text(messages, tools=[ref["tool"]]) == ref["A_completed_turn_with_tools"]


def test_loss_mask_covers_assistant_content_and_im_end(renderer, processor):
    messages = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "Q1"},
        {"role": "assistant", "content": "A1"},
        {"role": "user", "content": "Q2"},
        {"role": "assistant", "reasoning_content": "R", "content": "A2"},
    ]
    tok = processor.tokenizer
    every = renderer.render(messages)
    assert tok.decode(every.token_ids[every.loss_mask]) == "A1<|im_end|><think>\nR\n</think>\n\nA2<|im_end|>"
    last = get_renderer(processor, loss_on="last_assistant").render(messages)
    assert tok.decode(last.token_ids[last.loss_mask]) == "<think>\nR\n</think>\n\nA2<|im_end|>"
    assert torch.equal(last.token_ids, every.token_ids)
    assert not (last.loss_mask & ~every.loss_mask).any()
    # never the role header, the newline after <|im_end|>, system or user text
    assert tok.decode(every.token_ids[~every.loss_mask]).count("assistant\n") == 2


def test_image_tokens_never_trained_even_in_assistant_turns(renderer, image_files):
    messages = conversations(image_files)["image_in_assistant_turn"][0]
    sample = renderer.render(messages)
    assert (sample.mm_token_type_ids == IMAGE_TOKEN_TYPE).sum() > 0
    vision = torch.isin(sample.token_ids, torch.as_tensor(renderer.vision_ids))
    assert not sample.loss_mask[(sample.mm_token_type_ids == IMAGE_TOKEN_TYPE) | vision].any()
    assert sample.loss_mask.any()


def test_placeholders_and_token_counts(renderer, image_files):
    messages = conversations(image_files)["three_images_one_turn"][0]
    sample = renderer.render(messages, sample_index=5)
    mm = sample.multi_modal_data
    assert sample.sample_index == 5
    assert mm.image_grid_thw.tolist() == [[1, 4, 4], [1, 8, 4], [1, 4, 6]]
    assert [r.length for r in mm.placeholders] == [4, 8, 6]
    offsets = [r.offset for r in mm.placeholders]
    assert offsets == sorted(offsets)
    assert int((sample.mm_token_type_ids == IMAGE_TOKEN_TYPE).sum()) == 18
    assert mm.pixel_values.shape == (16 + 32 + 24, 3 * 2 * 16 * 16)


def test_check_template_parity_passes_and_detects_a_changed_template(processor):
    check_template_parity(get_renderer(processor), processor)
    check_template_parity(get_renderer(processor, loss_on="last_assistant"), processor)
    drifted = processor.chat_template.replace("'<|im_start|>user\\n'", "'<|im_start|>user\\n\\n'")
    assert drifted != processor.chat_template
    with pytest.raises(TemplateParityError) as info:
        check_template_parity(Qwen3_5Renderer(processor, chat_template=drifted), processor)
    assert info.value.field == "token_ids" and info.value.position > 0
    assert "vs the processor's" in str(info.value)


def test_check_template_parity_detects_changed_generation_span(processor):
    """A template whose generation block also covers the header renders the same ids but a different mask."""
    template = processor.chat_template.replace(
        "{{- '<|im_start|>assistant\\n' }}\n        {%- generation %}",
        "{%- generation %}\n{{- '<|im_start|>assistant\\n' }}",
    )
    assert template != processor.chat_template
    with pytest.raises(TemplateParityError) as info:
        check_template_parity(Qwen3_5Renderer(processor, chat_template=template), processor)
    assert info.value.field == "loss_mask"


def test_template_without_generation_block_is_refused(processor):
    template = processor.chat_template.replace("{%- generation %}", "").replace("{%- endgeneration %}", "")
    with pytest.raises(ValueError, match="generation"):
        Qwen3_5Renderer(processor, chat_template=template)


def test_get_renderer_rejects_unknown_processor():
    class NotAProcessor:
        tokenizer = None

    with pytest.raises(ValueError, match="not a vision-language processor"):
        get_renderer(NotAProcessor())


def test_image_cache_processes_identical_images_once(processor, image_files):
    renderer = get_renderer(processor, image_cache_size=2)
    messages = conversations(image_files)["same_image_twice"][0]
    sample = renderer.render(messages)
    cache = renderer.images.cache
    assert (cache.misses, cache.hits, len(cache)) == (1, 1, 1)
    hashes = sample.multi_modal_data.image_hashes
    assert len(hashes) == 2 and hashes[0] == hashes[1]
    # the sample owns its pixels: editing them leaves the cache (and the next sample) untouched
    sample.multi_modal_data.pixel_values.zero_()
    again = renderer.render(messages)
    assert again.multi_modal_data.pixel_values.abs().sum() > 0
    # bounded: three distinct images through a 2-entry cache keep only the two most recent
    for path in image_files[1:4]:
        renderer.render([{"role": "user", "content": [img(path)]}, {"role": "assistant", "content": "x"}])
    assert len(cache) == 2


def test_image_cache_byte_bound(processor, image_files):
    renderer = get_renderer(processor, image_cache_bytes=16 * 1536 * 4)  # room for exactly one 64x64 image
    for path in (image_files[0], image_files[4]):
        renderer.render([{"role": "user", "content": [img(path)]}, {"role": "assistant", "content": "x"}])
    assert len(renderer.images.cache) == 1
    assert renderer.images.cache.nbytes <= 16 * 1536 * 4


# --------------------------------------------------------------------------------------------- generated cases

_words = st.text(alphabet=st.sampled_from(list("abcdefghij XYZ,.?!\nü你😀")), min_size=1, max_size=30).filter(str.strip)


@st.composite
def generated_conversation(draw, n_images: int):
    messages: list[dict] = []
    if draw(st.booleans()):
        messages.append({"role": "system", "content": draw(_words)})
    for _ in range(draw(st.integers(1, 3))):
        blocks = [txt(draw(_words))]
        for _ in range(draw(st.integers(0, 3))):
            blocks.insert(
                draw(st.integers(0, len(blocks))), {"type": "image", "image": draw(st.integers(0, n_images - 1))}
            )
        messages.append(
            {"role": "user", "content": blocks if draw(st.booleans()) or len(blocks) > 1 else blocks[0]["text"]}
        )
        reply: dict = {"role": "assistant", "content": draw(_words)}
        if draw(st.booleans()):
            reply["reasoning_content"] = draw(_words)
        messages.append(reply)
    return messages


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_parity_generated(renderer, processor, image_files, data):
    messages = data.draw(generated_conversation(len(image_files)))
    for m in messages:
        if isinstance(m["content"], list):
            m["content"] = [img(image_files[b["image"]]) if b["type"] == "image" else b for b in m["content"]]
    assert_parity(renderer, processor, messages)
