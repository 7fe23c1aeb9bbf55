"""Qwen3.5 processors: the offline tiny processor, loading without torchvision, and verified saving."""

from processors.loading import (
    TINY_PROCESSOR_DIR,
    ProcessorMismatchError,
    compose_processor,
    load_processor,
    load_tiny_processor,
    save_processor,
    verify_saved_processor,
)

__all__ = [
    "TINY_PROCESSOR_DIR",
    "ProcessorMismatchError",
    "compose_processor",
    "load_processor",
    "load_tiny_processor",
    "save_processor",
    "verify_saved_processor",
]
