"""The Qwen3.5 vision-language model for packed SFT, its ops and checkpoint I/O.

The model exports load lazily (PEP 562), so importing a light submodule such as ``vlm_sft.model.presets`` does not
pull in the whole model stack.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vlm_sft.model.presets import tiny_qwen3_5_config, tiny_qwen3_5_moe_config

if TYPE_CHECKING:
    from vlm_sft.model.vlm import LossOutput, Qwen3_5VLM, build_model

__all__ = ["LossOutput", "Qwen3_5VLM", "build_model", "tiny_qwen3_5_config", "tiny_qwen3_5_moe_config"]

_LAZY = {"LossOutput", "Qwen3_5VLM", "build_model"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        from vlm_sft.model import vlm

        return getattr(vlm, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
