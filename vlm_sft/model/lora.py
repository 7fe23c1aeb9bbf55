"""LoRA adapters on the text model of ``Qwen3_5VLM``, through peft (a well-kept library, not hand-written adapters).

peft's ``inject_adapter_in_model`` replaces each targeted ``nn.Linear`` in place by a LoRA layer (the base weight
under ``base_layer``, the adapter under ``lora_A`` / ``lora_B``), so every module path stays what it was: FSDP2
still finds the decoder layers, and the checkpoint names stay transformers' with the adapter's keys beside them.

The targets are passed as full module names under ``model.language_model``: peft matches a short name by suffix
anywhere in the model, and the vision tower has its own ``qkv`` / ``proj`` / ``linear_fc*``, so short names could
adapt the tower by accident. After injection only the adapters require gradients: the base weights are frozen (and
stay bitwise unchanged), the vision tower was frozen already (a LoRA run never trains it).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from torch import nn

logger = logging.getLogger(__name__)

TEXT_MODEL_PREFIX = "model.language_model."
"""Where the text model's modules live in ``Qwen3_5VLM`` (and in transformers' ``Qwen3_5ForConditionalGeneration``)."""


def _text_linears(model: nn.Module) -> list[str]:
    """Full names of the text model's ``nn.Linear`` modules."""
    return [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and n.startswith(TEXT_MODEL_PREFIX)]


def lora_target_names(model: nn.Module, targets: Sequence[str]) -> list[str]:
    """Full names of the text model's ``nn.Linear`` modules whose last name part is in ``targets``."""
    wanted = set(targets)
    return [name for name in _text_linears(model) if name.rsplit(".", 1)[-1] in wanted]


def attach_lora(model: nn.Module, *, r: int, alpha: float, dropout: float, targets: Sequence[str]) -> list[str]:
    """Inject LoRA adapters (peft, adapter ``default``) into the text model's ``targets``; freeze everything else.

    Returns the full names of the adapted modules. Raises when a target matches no module of this model.
    """
    from peft import LoraConfig, inject_adapter_in_model

    names = lora_target_names(model, targets)
    found = {n.rsplit(".", 1)[-1] for n in names}
    missing = [t for t in targets if t not in found]
    if missing:
        available = sorted({n.rsplit(".", 1)[-1] for n in _text_linears(model)})
        raise ValueError(f"LoRA targets {missing} match no module of this model's text model; available: {available}")
    inject_adapter_in_model(LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=names), model)
    for name, p in model.named_parameters():  # the adapters train; the base and the vision tower stay frozen
        p.requires_grad_(".lora_A." in name or ".lora_B." in name)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    logger.info(
        "LoRA r=%d alpha=%g on %d modules: %d trainable of %d parameters (%.2f%%)",
        r, alpha, len(names), trainable, total, 100 * trainable / max(total, 1),
    )  # fmt: skip
    return names
