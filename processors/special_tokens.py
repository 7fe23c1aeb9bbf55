"""The Qwen3.5 special tokens, in the order (and so with the relative ids) the real tokenizer has them.

The real Qwen3.5 vocabulary puts these after its regular BPE tokens, starting with ``<|endoftext|>`` at 248044
(``<|vision_start|>`` = 248053, ``<|image_pad|>`` = 248056, ``<|video_pad|>`` = 248057) and ending with
``<|audio_pad|>`` at 248076. The tiny offline tokenizer keeps the same order right after its
``TINY_REGULAR_VOCAB_SIZE`` regular tokens, so every id relation the real model has (and every test that relies on
one) holds for the tiny one too. This module is the single source of those ids: the processor build script and the
tiny model preset both read it.
"""

from __future__ import annotations

QWEN3_5_SPECIAL_TOKENS: tuple[str, ...] = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "<tool_call>",
    "</tool_call>",
    "<|fim_prefix|>",
    "<|fim_middle|>",
    "<|fim_suffix|>",
    "<|fim_pad|>",
    "<|repo_name|>",
    "<|file_sep|>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
    "<|audio_start|>",
    "<|audio_end|>",
    "<tts_pad>",
    "<tts_text_bos>",
    "<tts_text_eod>",
    "<tts_text_bos_single>",
    "<|audio_pad|>",
)
"""All added tokens, in id order (the real tokenizer has these 33, ids 248044-248076; the last seven, for audio and
speech, are unused by a vision-language model but kept so the vocabulary and ids match the real one)."""

NOT_SPECIAL: frozenset[str] = frozenset(
    {"<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"}
    | {"<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>"}
)
"""Added tokens that the real tokenizer marks ``special=False`` (kept when decoding with skip_special_tokens)."""

TINY_REGULAR_VOCAB_SIZE = 2048
"""Regular (byte-level BPE) tokens of the tiny tokenizer; the special tokens follow from this id on."""

EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"
IMAGE_TOKEN = "<|image_pad|>"
VIDEO_TOKEN = "<|video_pad|>"
VISION_START_TOKEN = "<|vision_start|>"
VISION_END_TOKEN = "<|vision_end|>"


def tiny_token_id(token: str) -> int:
    """Id of a special token in the tiny tokenizer."""
    return TINY_REGULAR_VOCAB_SIZE + QWEN3_5_SPECIAL_TOKENS.index(token)


TINY_VOCAB_SIZE = TINY_REGULAR_VOCAB_SIZE + len(QWEN3_5_SPECIAL_TOKENS)
"""Size of the tiny tokenizer's vocabulary, and so of the tiny model's embedding."""
