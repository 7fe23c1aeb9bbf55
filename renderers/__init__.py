"""Renderers: conversations to training tokens plus ``MultiModalData``."""

from renderers.errors import RenderError, SampleError, SkipSample
from renderers.types import (
    IMAGE_TOKEN_TYPE,
    TEXT_TOKEN_TYPE,
    VIDEO_TOKEN_TYPE,
    MultiModalData,
    PlaceholderRange,
    RenderedSample,
)

__all__ = [
    "IMAGE_TOKEN_TYPE",
    "TEXT_TOKEN_TYPE",
    "VIDEO_TOKEN_TYPE",
    "MultiModalData",
    "PlaceholderRange",
    "RenderError",
    "RenderedSample",
    "SampleError",
    "SkipSample",
]
