"""AdamW (fused or foreach) with decay only where it belongs, and a warmup + cosine, constant or warmup-stable-decay
schedule."""

from __future__ import annotations

import logging
import math

import torch
from torch import nn
from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

from vlm_sft.config import DEFAULT_WARMUP_STEPS, ConfigError, TrainConfig
from vlm_sft.trainer.optim_offload import offload_optimizer_state

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


IMPLEMENTATION_KEYS = ("fused", "foreach")
"""AdamW group options that pick how the step runs (``train.optimizer_impl``), not what it computes."""


def build_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW over ``param_groups`` run the ``cfg.optimizer_impl`` way: ``fused`` (one in-place kernel per device, no
    step temporaries) or ``foreach`` (multi-tensor ops; ``torch._foreach_sqrt`` of exp_avg_sq allocates one fp32
    copy of a group's shard each step). Both work on FSDP2's DTensors and on the fp32 trainables of a bf16 LoRA model
    (whose frozen base never reaches the optimizer); ``tests/test_optim.py`` holds them to the same update.

    A fused optimizer is refused, with the fix, for trainable tensors torch has no fused kernel for (non-float, or
    on a device outside its list), here at set-up rather than at the first step. The choice also survives a resume
    (``keep_implementation``)."""
    groups = param_groups(model, cfg.weight_decay)
    if cfg.optimizer_impl == "fused":
        check_fused_supported(groups)
    optimizer = torch.optim.AdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas), **{cfg.optimizer_impl: True})
    optimizer.register_load_state_dict_pre_hook(keep_implementation)
    if cfg.optimizer_offload:
        offload_optimizer_state(optimizer, _device_of(groups))
    return optimizer


def _device_of(groups: list[dict]) -> torch.device:
    """The trainable parameters' device (the host when there are none)."""
    params = [p for g in groups for p in g["params"]]
    return params[0].device if params else torch.device("cpu")


def check_fused_supported(groups: list[dict]) -> None:
    """Raise ``ConfigError`` naming the fix when torch's fused AdamW cannot take every trainable tensor (torch's
    own check says so only as a RuntimeError without the setting to change)."""
    devices = _get_fused_kernels_supported_devices()
    params = (p for g in groups for p in g["params"])
    bad = {f"{p.dtype} on {p.device.type}" for p in params if p.device.type not in devices or not p.is_floating_point()}
    if bad:
        raise ConfigError(
            f"train.optimizer_impl = 'fused': torch {torch.__version__} has no fused AdamW for trainable tensors of "
            f"{', '.join(sorted(bad))} (its fused devices: {', '.join(devices)}; floating-point dtypes only); set "
            "train.optimizer_impl = 'foreach'"
        )


def keep_implementation(optimizer: torch.optim.Optimizer, state_dict: dict) -> dict | None:
    """``load_state_dict`` pre-hook: the loaded groups take this optimizer's ``fused`` / ``foreach``.

    torch's ``load_state_dict`` copies every option of the saved groups, and a checkpoint's groups carry the
    implementation they were saved with, so without this a run resumed from a checkpoint of the other kind (or of a
    version before ``train.optimizer_impl``, whose groups say neither, i.e. torch's default foreach) would run that
    one, not the configured one, and the memory plan would describe another step. Rewritten before torch casts the
    state, so the step counters land where this implementation keeps them (a fused step's on the parameter's
    device)."""
    saved = state_dict["param_groups"]
    if len(saved) != len(optimizer.param_groups):
        return None  # torch refuses it next, with its own message
    pairs = zip(optimizer.param_groups, saved, strict=True)
    groups = [{**old, **{k: now[k] for k in IMPLEMENTATION_KEYS}} for now, old in pairs]
    return {**state_dict, "param_groups": groups}


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


def follow_configured_lr(lr: float, optimizer: torch.optim.Optimizer, scheduler, *, log: bool = False) -> None:
    """After a resume: the schedule's peak is ``train.lr`` as configured now, not the checkpoint's.

    Loading a checkpoint restores the optimizer's groups and the schedule's ``base_lrs`` with the peak the run was
    started with, so a resume with a lowered ``train.lr`` (the fix for a run that diverged) trained on at the old one,
    silently. The schedule keeps its position and shape (built from this run's config); only its peak is replaced,
    with a warning naming both."""
    saved = list(scheduler.base_lrs)
    if all(base == lr for base in saved):
        return
    scheduler.base_lrs = [lr] * len(saved)
    for group, factor in zip(optimizer.param_groups, scheduler.lr_lambdas, strict=True):
        group["initial_lr"] = lr
        group["lr"] = lr * factor(scheduler.last_epoch)
    scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]
    if log:
        logger.warning(
            "train.lr = %g, the checkpoint's was %g: the schedule goes on from step %d with the new peak (lr now %g)",
            lr, saved[0], scheduler.last_epoch, optimizer.param_groups[0]["lr"],
        )  # fmt: skip


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
