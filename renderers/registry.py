"""``get_renderer``: the renderer for a loaded processor, chosen in one place.

A renderer encodes a model family's chat format (placeholders, turn markers, template variables), so the choice
follows the processor. Only the Qwen3.5 family (Qwen2-VL-style image placeholders and ChatML turns) exists today;
an unknown processor fails here, at start-up, with the list of known renderers, rather than rendering wrong tokens.
"""

from __future__ import annotations

import logging
from typing import Any

from renderers.qwen3_5 import Qwen3_5Renderer

logger = logging.getLogger(__name__)

RENDERERS: dict[str, type] = {"qwen3_5": Qwen3_5Renderer}
"""Renderer name -> class; every class takes ``(processor, **options)``."""

_QWEN_VL_TOKENS = ("<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|image_pad|>", "<|vision_end|>")


def detect_renderer(processor: Any) -> str:
    """The renderer name for a processor, from its tokens and image processor; ``ValueError`` if none fits."""
    tokenizer = getattr(processor, "tokenizer", None)
    image_processor = getattr(processor, "image_processor", None)
    if tokenizer is None or image_processor is None:
        raise ValueError(
            f"{type(processor).__name__} is not a vision-language processor (no tokenizer / image processor)"
        )
    vocab = tokenizer.get_vocab()
    if all(t in vocab for t in _QWEN_VL_TOKENS) and hasattr(image_processor, "merge_size"):
        return "qwen3_5"
    raise ValueError(
        f"no renderer for {type(processor).__name__} with {type(tokenizer).__name__}; known: {', '.join(RENDERERS)}"
    )


def get_renderer(processor: Any, *, name: str | None = None, **options: Any) -> Qwen3_5Renderer:
    """Build the renderer for ``processor`` (or the one called ``name``) with renderer ``options``.

    Options of ``Qwen3_5Renderer``: ``loss_on`` ("all_assistant" | "last_assistant"), ``special_text``
    ("escape" | "drop" | "error"), ``image_cache_size``, ``image_cache_bytes``, ``max_image_pixels``,
    ``chat_template``, ``template_kwargs``.
    """
    if name is None:
        name = detect_renderer(processor)
    if name not in RENDERERS:
        raise ValueError(f"unknown renderer {name!r}; known: {', '.join(RENDERERS)}")
    renderer = RENDERERS[name](processor, **options)
    logger.info("renderer: %s (%s)", name, ", ".join(f"{k}={v}" for k, v in options.items()) or "defaults")
    return renderer
