"""Renderers: conversations to training tokens plus ``MultiModalData``."""

from renderers.content import ImageBlock, Message, TextBlock, normalize_messages
from renderers.errors import RenderError, SampleError, SkipSample
from renderers.image_cache import CachedImageProcessor, ImageCache, ProcessedImage
from renderers.images import load_image
from renderers.parity import (
    TemplateParityError,
    check_served_prompt,
    check_template_parity,
    default_probe,
    served_probes,
)
from renderers.qwen3_5 import Qwen3_5Renderer
from renderers.registry import RENDERERS, get_renderer
from renderers.types import (
    IMAGE_TOKEN_TYPE,
    TEXT_TOKEN_TYPE,
    VIDEO_TOKEN_TYPE,
    VISION_TOKEN_TYPES,
    MultiModalData,
    PlaceholderRange,
    RenderedSample,
    VideoSpan,
    vision_slots,
)

__all__ = [
    "IMAGE_TOKEN_TYPE",
    "RENDERERS",
    "TEXT_TOKEN_TYPE",
    "VIDEO_TOKEN_TYPE",
    "VISION_TOKEN_TYPES",
    "CachedImageProcessor",
    "ImageBlock",
    "ImageCache",
    "Message",
    "MultiModalData",
    "PlaceholderRange",
    "ProcessedImage",
    "Qwen3_5Renderer",
    "RenderError",
    "RenderedSample",
    "SampleError",
    "SkipSample",
    "TemplateParityError",
    "TextBlock",
    "VideoSpan",
    "check_served_prompt",
    "check_template_parity",
    "default_probe",
    "get_renderer",
    "load_image",
    "normalize_messages",
    "served_probes",
    "vision_slots",
]
