"""From a ``RunConfig`` to the run's model: a random-init preset or a checkpoint, parallelized for the run's mesh.

The data side of a run (processor, renderer, sources, pipelines) is ``vlm_sft.data.build``'s; how the model is
spread over ranks is ``vlm_sft.parallel.parallelize``'s.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from typing import Any

import torch
from transformers import Qwen3_5Config, Qwen3_5MoeConfig

from vlm_sft.config import TINY_MODELS, RunConfig
from vlm_sft.parallel.collectives import all_reduce
from vlm_sft.parallel.env import DistEnv
from vlm_sft.parallel.fsdp import local_rows
from vlm_sft.parallel.mesh import ParallelMesh, build_mesh
from vlm_sft.parallel.parallelize import parallelize

logger = logging.getLogger(__name__)


def tiny_model_config(cfg: RunConfig) -> Qwen3_5Config | Qwen3_5MoeConfig:
    """The random-init preset ``model.name_or_path`` names (``tiny`` or ``tiny-moe``) at the config's widths."""
    from vlm_sft.model.presets import tiny_preset

    return tiny_preset(
        cfg.model.name_or_path, hidden_size=cfg.model.hidden_size, initializer_range=cfg.model.initializer_range
    )


def checkpoint_path(cfg: RunConfig) -> Path | None:
    """The local directory of ``model.name_or_path`` (a hub id is fetched into the cache), None for a tiny preset."""
    from vlm_sft.checkpoint.hf_dir import resolve_checkpoint_dir

    return None if cfg.model.name_or_path in TINY_MODELS else resolve_checkpoint_dir(cfg.model.name_or_path)


def weights_source(cfg: RunConfig):
    """The index (headers only) of the checkpoint the run loads its weights from, for the export (each tensor's
    dtype, the ``mtp.*`` head to copy back); None for a random-init preset."""
    from vlm_sft.checkpoint.hf_dir import CheckpointIndex

    path = checkpoint_path(cfg)
    return None if path is None else CheckpointIndex.open(path)


def build_model(
    cfg: RunConfig,
    device: torch.device,
    *,
    env: DistEnv | None = None,
    mesh: ParallelMesh | None = None,
    resuming: bool = False,
) -> torch.nn.Module:
    """The run's model: a random-init tiny preset, or a checkpoint (hub id or directory), LoRA-wrapped when asked.

    With ``env`` the model comes back parallelized for the job (``parallelize``: LoRA, activation checkpointing,
    context parallelism, FSDP2) over ``mesh`` (built from ``env`` and ``train.cp_size`` when not given); a checkpoint
    is then loaded the sharded way (``vlm_sft.checkpoint.load``): built on meta, wrapped, sharded, materialized, and
    each rank reads only the rows of its shards. ``resuming``: the weights that the resumed checkpoint restores are
    not read from the HF checkpoint at all (all of them in a full fine-tuning run; a LoRA run still reads its frozen
    base).

    Without a ``[model.vlm]`` section the vision tower is frozen, with one warning: its parameters would otherwise
    receive no gradient and still decay under AdamW. bf16 runs keep fp32 master weights (FSDP2 mixed precision
    computes in bf16); a bf16 LoRA run stores its frozen base in bf16 beside fp32 adapters.
    """
    m = cfg.model
    if m.vlm is None:
        logger.warning("no [model.vlm] section: the vision tower is frozen (add [model.vlm] to configure it)")
    freeze = True if m.vlm is None else m.vlm.freeze_vision
    if env is not None and mesh is None:
        mesh = build_mesh(env, cp_size=cfg.train.cp_size, ep_size=cfg.train.ep_size)
    frozen_dtype = torch.bfloat16 if m.lora is not None and m.dtype == "bfloat16" else torch.float32
    spread = functools.partial(
        parallelize, mesh=mesh, activation_checkpointing=m.activation_checkpointing,
        attach_lora=None if m.lora is None else functools.partial(_attach_lora, cfg, frozen_dtype=frozen_dtype),
        param_dtype=torch.bfloat16 if m.dtype == "bfloat16" else None,
    )  # fmt: skip
    reduce = (lambda t: all_reduce(t, env)) if env is not None else None
    if m.name_or_path not in TINY_MODELS:
        return _load_checkpoint_model(cfg, device, spread, reduce, freeze=freeze, resuming=resuming)
    from vlm_sft.model import build_model as build_random

    torch.manual_seed(cfg.train.seed)
    model = spread(
        build_random(tiny_model_config(cfg), dtype=torch.float32, freeze_vision=freeze, device=device, **_backends(cfg))
    )
    if m.lora is not None:
        _init_lora(cfg, model, reduce)
    return model


def _backends(cfg: RunConfig) -> dict[str, Any]:
    m = cfg.model
    return {
        "attn_impl": m.attn_impl,
        "linear_attn_impl": m.linear_attn_impl,
        "loss_impl": m.loss_impl,
        "experts_impl": m.experts_impl,
    }


def _load_checkpoint_model(cfg, device, spread, reduce, *, freeze, resuming) -> torch.nn.Module:
    """Meta build -> parallelize (``spread``: LoRA wrap, ..., shard) -> materialize -> read this rank's slices
    (``vlm_sft.checkpoint.load``)."""
    from vlm_sft.checkpoint.hf_dir import CheckpointIndex
    from vlm_sft.checkpoint.load import load_model_config, load_weights, materialize, meta_model, plan_reads
    from vlm_sft.model.backends import resolve_backends

    path = checkpoint_path(cfg)
    backends = resolve_backends(device, **_backends(cfg))
    model = meta_model(load_model_config(path), backends, freeze_vision=freeze)
    index = CheckpointIndex.open(path)
    plan_reads(model, index)  # a checkpoint that does not fit the model fails here, before any allocation
    model = spread(model)
    materialize(model, device)
    if not resuming:
        report = load_weights(model, index)
    elif cfg.model.lora is not None:  # the checkpoint holds the adapters only: the frozen base comes from HF
        report = load_weights(model, index, select=lambda _, t: not t.requires_grad)
    else:
        report = None  # every weight comes from the resumed checkpoint
    if cfg.model.lora is not None:
        _init_lora(cfg, model, reduce)
    read = "nothing (resuming)" if report is None else f"{report.bytes_read / 2**20:.0f} MiB of its shards"
    logger.info("loaded %s: this rank read %s (backends %s)", path, read, backends)
    return model


def _attach_lora(cfg: RunConfig, model: torch.nn.Module, *, frozen_dtype: torch.dtype) -> None:
    """LoRA adapters before any sharding (FSDP2 then shards the wrapped layers), also on a meta model; the base stays
    frozen, stored in ``frozen_dtype``, and the trainable parameters in fp32."""
    from vlm_sft.config import LORA_FUSED_GROUPS
    from vlm_sft.model.lora import attach_lora, store_frozen_in

    lora = cfg.model.lora
    split = [g for g, members in LORA_FUSED_GROUPS.items() if 0 < len(set(members) & set(lora.target_modules)) < 2]
    if split:
        logger.warning(
            "model.lora.allow_partial_fused: the adapter covers part of the fused group(s) %s; vLLM and SGLang fuse "
            "these projections and crash on or silently drop such adapters (serve the merged final/ instead)",
            split,
        )
    attach_lora(
        model, r=lora.r, alpha=lora.alpha, dropout=lora.dropout, targets=lora.target_modules,
        modules_to_save=lora.modules_to_save,
    )  # fmt: skip
    store_frozen_in(model, frozen_dtype)


def _init_lora(cfg: RunConfig, model: torch.nn.Module, reduce) -> None:
    """The adapters' values (the same fp32 draw on every rank and for every base dtype, each rank keeping its rows)
    and the frozen base's fingerprint, which each checkpoint saves and a resume checks (the trainer)."""
    from vlm_sft.model.lora import base_fingerprint, init_adapters

    init_adapters(model, cfg.train.seed + 1, rows=local_rows)
    model.base_fingerprint = base_fingerprint(model, reduce)
