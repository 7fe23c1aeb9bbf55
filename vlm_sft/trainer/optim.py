"""AdamW with decay only where it belongs, and a warmup + cosine, constant or warmup-stable-decay schedule."""

from __future__ import annotations

import logging
import math

import torch
from torch import nn

from vlm_sft.config import DEFAULT_WARMUP_STEPS, TrainConfig

logger = logging.getLogger(__name__)

NO_DECAY_NAME_PARTS = ("embed_tokens", "pos_embed", "norm", "bias", "A_log", "dt_bias")
"""Parameters whose names contain one of these never decay: norms, biases, embeddings and the GDN decay terms."""


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Two AdamW groups: decayed matrices, and the rest (1-D tensors and embeddings) without decay."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if p.ndim < 2 or any(part in name for part in NO_DECAY_NAME_PARTS):
            no_decay.append(p)
        else:
            decay.append(p)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def build_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    return torch.optim.AdamW(param_groups(model, cfg.weight_decay), lr=cfg.lr, betas=tuple(cfg.betas))


def lr_factor(
    step: int, *, warmup_steps: int, total_steps: int, schedule: str, min_lr_ratio: float, decay_fraction: float = 0.2
) -> float:
    """Multiplier of the peak lr at optimizer step ``step`` (0-based): linear warmup, then ``cosine`` to the floor,
    ``constant``, or ``wsd`` (warmup-stable-decay): the peak until the last ``decay_fraction`` of the run, then a
    cosine to the floor over those steps."""
    if warmup_steps and step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    start = warmup_steps
    if schedule == "wsd":
        start = max(warmup_steps, total_steps - round(decay_fraction * total_steps))
        if step < start:
            return 1.0
    span = max(1, total_steps - start)
    progress = min(1.0, (step - start) / span)
    return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def resolve_warmup_steps(cfg: TrainConfig, total_steps: int) -> int:
    """The run's warmup length: ``warmup_fraction`` of ``total_steps`` (rounded), or ``warmup_steps`` (default 50).

    Decided here because only the schedule knows the run's length (``train.epochs`` runs count their steps first).
    A ``warmup_steps`` that is not shorter than the run would spend the whole run warming up (no decay; the peak lr
    reached at the last step or never); it is cut to a tenth of the run, with one warning naming the values and the
    fix.
    """
    if cfg.warmup_fraction is not None:
        return round(cfg.warmup_fraction * total_steps)
    steps = cfg.warmup_steps if cfg.warmup_steps is not None else DEFAULT_WARMUP_STEPS
    if steps and steps >= total_steps:
        clipped = total_steps // 10
        origin = "" if cfg.warmup_steps is not None else ", the default"
        logger.warning(
            "train.warmup_steps (%d%s) >= the run's %d steps: warming up for %d steps (a tenth of the run) instead; "
            "set train.warmup_fraction (e.g. 0.08) to scale warmup with the run's length",
            steps,
            origin,
            total_steps,
            clipped,
        )
        return clipped
    return steps


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: TrainConfig, total_steps: int):
    """Warmup (``resolve_warmup_steps``) then ``cfg.schedule`` over ``total_steps`` optimizer steps."""
    warmup = resolve_warmup_steps(cfg, total_steps)
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda step: lr_factor(
            step,
            warmup_steps=warmup,
            total_steps=total_steps,
            schedule=cfg.schedule,
            min_lr_ratio=cfg.min_lr_ratio,
            decay_fraction=cfg.decay_fraction,
        ),
    )
