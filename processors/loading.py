"""Load, compose and save Qwen3.5 processors without torchvision, and verify what was saved.

Two facts about transformers 5.23 shape this module (measured in shared/reference/measured-facts.md):

- ``AutoProcessor.from_pretrained`` on a Qwen3.5 checkpoint needs torchvision, because the processor always
  carries a ``Qwen3VLVideoProcessor``. So ``load_processor`` builds the parts itself (``AutoTokenizer``, the PIL
  image processor, the video processor class directly, the chat template) and composes them with
  ``compose_processor``, which holds the one workaround that lets ``Qwen3VLProcessor`` be built at all.
- ``processor.save_pretrained`` rewrites the tokenizer files and ``chat_template.jinja`` from the processor's own
  tokenizer and template, clobbering a custom template or pad token that was set on a separate tokenizer object.
  So ``save_processor`` writes the processor first and the tokenizer last, then reloads the directory and checks
  that it gives exactly the processor it was asked to save, raising ``ProcessorMismatchError`` otherwise.
"""

from __future__ import annotations

import difflib
import logging
import os
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image
from transformers import AutoTokenizer
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

logger = logging.getLogger(__name__)

TINY_PROCESSOR_DIR = Path(__file__).resolve().parent / "assets" / "tiny-qwen3_5"
"""The committed tiny Qwen3.5 processor (regenerate with ``python -m processors.build_tiny``)."""


class ProcessorMismatchError(ValueError):
    """A saved processor directory does not reload to the processor and tokenizer that were saved."""


def _let_processor_accept_video_processors() -> None:
    """Make ``Qwen3VLProcessor(...)`` constructible on a machine without torchvision.

    ``ProcessorMixin.__init__`` checks every sub-processor's class by looking up the name of its modality's base
    class (``"VideoProcessorMixin"`` for video) on ``transformers.processing_utils.transformers_module``. Without
    torchvision that lazy module does not expose ``VideoProcessorMixin``, the lookup falls back to the auto
    mappings and fails with ``AttributeError: ... VIDEO_PROCESSOR_MAPPING ... _extra_content``. Putting the real
    class from ``transformers.video_processing_utils`` on that module handle makes the check pass; a real
    ``Qwen3VLVideoProcessor`` instance (which needs no torchvision to construct) must still be passed. Idempotent.
    """
    import transformers.processing_utils as processing_utils
    from transformers.video_processing_utils import VideoProcessorMixin

    module = processing_utils.transformers_module
    if module.__dict__.get("VideoProcessorMixin") is not VideoProcessorMixin:
        module.VideoProcessorMixin = VideoProcessorMixin


def compose_processor(
    tokenizer: Any,
    image_processor: Qwen2VLImageProcessorPil,
    chat_template: str | None,
    video_processor: Qwen3VLVideoProcessor | None = None,
) -> Qwen3VLProcessor:
    """A ``Qwen3VLProcessor`` (what ``AutoProcessor`` gives for qwen3_5) from its parts, without torchvision.

    ``video_processor`` defaults to a stock ``Qwen3VLVideoProcessor``: the processor requires one, and this
    pipeline never feeds it videos.
    """
    _let_processor_accept_video_processors()
    return Qwen3VLProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        video_processor=video_processor if video_processor is not None else Qwen3VLVideoProcessor(),
        chat_template=chat_template,
    )


def load_processor(path_or_hub_id: str | os.PathLike, **from_pretrained_kwargs: Any) -> Qwen3VLProcessor:
    """Load a Qwen3.5 processor from a checkpoint directory or hub id, without torchvision.

    Reads the tokenizer (with its chat template) through ``AutoTokenizer``, the image processor with the PIL
    backend whatever class the checkpoint names (``Qwen2VLImageProcessorFast`` on the hub needs torchvision), and
    the video processor's settings when the checkpoint has them. ``from_pretrained_kwargs`` (``revision``,
    ``cache_dir``, ``local_files_only`` ...) go to every ``from_pretrained`` call.
    """
    source = str(path_or_hub_id)
    tokenizer = AutoTokenizer.from_pretrained(source, **from_pretrained_kwargs)
    image_processor = Qwen2VLImageProcessorPil.from_pretrained(source, **from_pretrained_kwargs)
    try:
        video_processor = Qwen3VLVideoProcessor.from_pretrained(source, **from_pretrained_kwargs)
    except OSError:
        logger.info("%s has no video processor config; using Qwen3VLVideoProcessor defaults", source)
        video_processor = Qwen3VLVideoProcessor()
    if tokenizer.chat_template is None:
        raise ValueError(
            f"{source} has no chat template (no chat_template.jinja and none in tokenizer_config.json); "
            "a Qwen3.5 processor needs one: save it with processors.save_processor"
        )
    return compose_processor(tokenizer, image_processor, tokenizer.chat_template, video_processor)


def load_tiny_processor() -> Qwen3VLProcessor:
    """The committed tiny Qwen3.5 processor (2048 BPE tokens + the Qwen3.5 added tokens, small-image bounds)."""
    return load_processor(TINY_PROCESSOR_DIR)


def save_processor(directory: str | os.PathLike, processor: Qwen3VLProcessor, tokenizer: Any) -> Path:
    """Save ``processor`` with ``tokenizer`` as its tokenizer to ``directory``, then verify the reload.

    The processor is written first and the tokenizer last, so the tokenizer's files, pad token and chat template
    (when it has one; the processor's otherwise) are what the directory ends up with, even when ``tokenizer`` is a
    different object from ``processor.tokenizer``. The image processor is also written on its own as
    ``preprocessor_config.json``, the file hub checkpoints and older tools read. Raises
    ``ProcessorMismatchError`` naming every difference if the reloaded processor is not the one intended.
    """
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    processor.save_pretrained(out)
    processor.image_processor.save_pretrained(out)
    tokenizer.save_pretrained(out)
    verify_saved_processor(out, processor, tokenizer)
    return out


def probe_image() -> Image.Image:
    """A deterministic 96x64 RGB image (gradient with a filled disc) for round-trip checks: 6 image tokens."""
    ys, xs = np.mgrid[0:64, 0:96]
    disc = (xs - 30) ** 2 + (ys - 32) ** 2 < 20**2
    pixels = np.stack([xs * 2, ys * 4, np.where(disc, 255, 40)], axis=-1).astype(np.uint8)
    return Image.fromarray(pixels)


def probe_conversation() -> list[dict[str, Any]]:
    """A short conversation touching every path of the template that a round trip could change."""
    return [
        {"role": "system", "content": "You are a helpful assistant."},
        {
            "role": "user",
            "content": [
                {"type": "image", "image": probe_image()},
                {"type": "text", "text": "What colour is the disc? Café, 🙂, 12 shapes."},
            ],
        },
        {"role": "assistant", "reasoning_content": "It looks blue.", "content": "The disc is blue."},
        {"role": "user", "content": "And the background?"},
    ]


def _render_probe(processor: Qwen3VLProcessor) -> tuple[str, dict[str, Any]]:
    conversation = probe_conversation()
    text = processor.apply_chat_template(conversation, add_generation_prompt=True)
    encoded = processor.apply_chat_template(
        conversation, add_generation_prompt=True, tokenize=True, return_dict=True, return_tensors="np"
    )
    return text, dict(encoded)


def _describe_text_difference(name: str, saved: str | None, expected: str | None) -> str:
    if saved is None or expected is None:
        return f"{name}: saved {'none' if saved is None else f'{len(saved)} chars'}, expected " + (
            "none" if expected is None else f"{len(expected)} chars"
        )
    diff = difflib.unified_diff(expected.splitlines(), saved.splitlines(), "expected", "saved", n=0, lineterm="")
    return f"{name} differs:\n" + "\n".join(list(diff)[:12])


def _tokenizer_facts(tokenizer: Any) -> dict[str, Any]:
    return {
        "vocabulary size": len(tokenizer),
        "added tokens": {i: (t.content, t.special) for i, t in tokenizer.added_tokens_decoder.items()},
        "special tokens map": dict(tokenizer.special_tokens_map),
        "pad token": (tokenizer.pad_token, tokenizer.pad_token_id),
        "eos token": (tokenizer.eos_token, tokenizer.eos_token_id),
        "tokenizer class": type(tokenizer).__name__,
    }


def _image_processor_facts(image_processor: Any) -> dict[str, Any]:
    facts = image_processor.to_dict()
    facts.pop("image_processor_type", None)  # saved names are normalized; the class is compared instead
    facts["class"] = type(image_processor).__name__
    return facts


def verify_saved_processor(directory: str | os.PathLike, processor: Qwen3VLProcessor, tokenizer: Any) -> None:
    """Reload ``directory`` and raise ``ProcessorMismatchError`` unless it matches ``processor`` + ``tokenizer``.

    Compared: the chat template (the tokenizer's, or the processor's when the tokenizer has none), the vocabulary
    and added tokens, pad and eos, the image-processor settings, and one probe conversation (text plus a generated
    image) rendered, tokenized and pixel-processed by both, which must agree exactly.
    """
    saved = load_processor(directory)
    expected_template = tokenizer.chat_template if tokenizer.chat_template is not None else processor.chat_template
    expected = compose_processor(tokenizer, processor.image_processor, expected_template, processor.video_processor)
    problems: list[str] = []

    if saved.chat_template != expected_template:
        problems.append(_describe_text_difference("chat template", saved.chat_template, expected_template))
    saved_facts, expected_facts = _tokenizer_facts(saved.tokenizer), _tokenizer_facts(tokenizer)
    for key, value in expected_facts.items():
        if saved_facts[key] != value:
            problems.append(f"{key}: saved {saved_facts[key]!r}, expected {value!r}")
    saved_image, expected_image = (
        _image_processor_facts(saved.image_processor),
        _image_processor_facts(processor.image_processor),
    )
    for key in sorted(set(saved_image) | set(expected_image)):
        if saved_image.get(key) != expected_image.get(key):
            problems.append(
                f"image processor {key}: saved {saved_image.get(key)!r}, expected {expected_image.get(key)!r}"
            )

    if not problems:  # a differing template or vocabulary would make every probe comparison below noise
        saved_text, saved_out = _render_probe(saved)
        expected_text, expected_out = _render_probe(expected)
        if saved_text != expected_text:
            problems.append(_describe_text_difference("probe conversation text", saved_text, expected_text))
        for key in sorted(set(saved_out) | set(expected_out)):
            a, b = saved_out.get(key), expected_out.get(key)
            if a is None or b is None or a.shape != b.shape or not np.array_equal(a, b):
                where = "" if a is None or b is None or a.shape != b.shape else f" (first at {np.argwhere(a != b)[0]})"
                problems.append(
                    f"probe {key}: saved {None if a is None else a.shape}, expected {None if b is None else b.shape}"
                    f"{where}"
                )

    if problems:
        raise ProcessorMismatchError(
            f"the processor saved in {directory} does not reload as the one given to save_processor:\n- "
            + "\n- ".join(problems)
        )
    logger.info("verified the processor saved in %s", directory)
