"""Resumable checkpoints (torch distributed checkpoint) and the final Hugging Face export.

Layout under ``<output_dir>/checkpoints``::

    step-000100/            complete checkpoint (has COMPLETE)
        model + optimizer   DCP shards, written by every rank (LoRA runs: adapters and their optimizer state only)
        rank00000.pt        per-rank trainer state: step, scheduler, data pipeline, RNG
        hf/                 the same weights as an HF directory with processor and tokenizer (when the trainer asks;
                            LoRA runs: hf/adapter/ only, the merged copy is written to final/)
        COMPLETE
    step-000200.tmp/        a save in progress, or one killed mid-write: never loaded, removed by the next save

A save writes into ``step-N.tmp`` and is renamed into place by rank 0 only after every rank finished, so a run
killed mid-save resumes from the previous complete checkpoint. Only the last ``keep_last`` complete ones are kept.
Multi-node runs need ``output_dir`` on a filesystem every node sees.
"""

from __future__ import annotations

import logging
import random
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)

from vlm_sft.trainer.distributed import DistEnv, all_ranks_or_none

logger = logging.getLogger(__name__)

_STEP_DIR = re.compile(r"^step-(\d+)$")
COMPLETE_MARKER = "COMPLETE"


@dataclass
class TrainerState:
    """Everything besides model and optimizer that an exact resume needs, for one rank."""

    step: int
    """Optimizer steps completed."""
    scheduler: dict
    """LR scheduler state dict."""
    data: dict
    """Data pipeline state (sample indices and positions, never tensors)."""
    rng: dict
    """torch / numpy / python RNG states."""
    extra: dict
    """Free-form counters (tokens seen, ...)."""


def capture_rng() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def checkpoints_dir(output_dir: str | Path) -> Path:
    return Path(output_dir) / "checkpoints"


def complete_checkpoints(output_dir: str | Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    root = checkpoints_dir(output_dir)
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        m = _STEP_DIR.match(p.name)
        if m and (p / COMPLETE_MARKER).is_file():
            found.append((int(m.group(1)), p))
    return [p for _, p in sorted(found)]


def resolve_resume(resume: str | None, output_dir: str | Path) -> Path | None:
    """``latest`` -> the newest complete checkpoint (None when there is none yet); a path must be complete."""
    if resume is None:
        return None
    if resume == "latest":
        found = complete_checkpoints(output_dir)
        return found[-1] if found else None
    path = Path(resume)
    if not (path / COMPLETE_MARKER).is_file():
        raise FileNotFoundError(
            f"train.resume = {resume!r} is not a complete checkpoint (no {COMPLETE_MARKER} marker); "
            f"use 'latest' or one of {[str(p) for p in complete_checkpoints(output_dir)]}"
        )
    return path


def save_checkpoint(
    output_dir: str | Path,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    state: TrainerState,
    env: DistEnv,
    keep_last: int,
    write_extra: Callable[[Path], None] | None = None,
    trainable_only: bool = False,
) -> Path:
    """Write a resumable checkpoint for ``state.step`` atomically; every rank must call this.

    ``trainable_only`` (LoRA runs): only the parameters that train, with their optimizer state; the frozen base is
    not written, since the run rebuilds it from ``model.name_or_path`` (a 9B base would be 18 GB per checkpoint).

    ``write_extra(tmp_dir)`` runs on every rank before the checkpoint is marked complete (the trainer writes the HF
    export there), so the extra files appear and disappear together with the checkpoint.
    """
    root = checkpoints_dir(output_dir)
    final = root / f"step-{state.step:06d}"
    tmp = root / f"step-{state.step:06d}.tmp"
    with all_ranks_or_none(env, f"preparing {tmp}"):
        if env.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
    model_sd, optim_sd = get_state_dict(model, optimizer, options=_options(trainable_only))
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp))
    with all_ranks_or_none(env, f"writing the trainer state into {tmp}"):
        torch.save(state.__dict__, tmp / f"rank{env.rank:05d}.pt")
    if write_extra is not None:
        write_extra(tmp)
    with all_ranks_or_none(env, f"completing the checkpoint {final}"):
        if env.is_main:
            (tmp / COMPLETE_MARKER).write_text(f"step {state.step}, world size {env.world_size}\n")
            if final.exists():
                shutil.rmtree(final)
            tmp.rename(final)
            for old in complete_checkpoints(output_dir)[:-keep_last]:
                shutil.rmtree(old, ignore_errors=True)
            for stale in root.glob("step-*.tmp"):
                shutil.rmtree(stale, ignore_errors=True)
            logger.info("saved checkpoint %s", final)
    return final


def _options(trainable_only: bool) -> StateDictOptions:
    """What a checkpoint holds: every parameter, or (``trainable_only``) the ones that train; the loader asks for
    the same keys, so a strict load would only flag the frozen ones it was told to leave alone."""
    return StateDictOptions(ignore_frozen_params=trainable_only, strict=not trainable_only)


def load_checkpoint(
    path: str | Path, *, model: nn.Module, optimizer: torch.optim.Optimizer, env: DistEnv, trainable_only: bool = False
) -> TrainerState:
    """Restore model and optimizer in place and return this rank's trainer state; every rank must call this.
    ``trainable_only`` must match the save's: a LoRA run restores its adapters onto the rebuilt frozen base."""
    path = Path(path)
    rank_file = path / f"rank{env.rank:05d}.pt"
    with all_ranks_or_none(env, f"opening the checkpoint {path}"):
        if not rank_file.is_file():
            raise FileNotFoundError(
                f"{rank_file} is missing: the checkpoint was written by a job with a different world size "
                f"({(path / COMPLETE_MARKER).read_text().strip()}); resume with the same number of processes"
            )
    options = _options(trainable_only)
    model_sd, optim_sd = get_state_dict(model, optimizer, options=options)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"], options=options)
    with all_ranks_or_none(env, f"reading {rank_file}"):
        raw = torch.load(rank_file, weights_only=False)
    logger.info("resumed from %s at step %d", path, raw["step"])
    return TrainerState(**raw)


def full_state_dict(model: nn.Module, *, trainable_only: bool = False) -> dict[str, torch.Tensor]:
    """The whole (unsharded) state dict on CPU, on rank 0 (empty elsewhere); every rank must call this.
    ``trainable_only``: only parameters that require gradients (a LoRA run's adapters)."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=trainable_only)
    return get_model_state_dict(model, options=options)
