"""Hugging Face checkpoint directories: find them (local or hub), read their safetensors, write new ones.

Kept free of model classes so the trainer can save a gathered (e.g. FSDP full) state dict with the same writer.
A directory written here holds ``config.json`` and either ``model.safetensors`` or shards
``model-0000k-of-0000n.safetensors`` with ``model.safetensors.index.json``: the layout transformers reads.

MoE experts: in memory they are fused (``experts.gate_up_proj`` ``[E, 2I, D]``, gate rows then up rows;
``experts.down_proj`` ``[E, D, I]``); on disk transformers' conversion mapping (``qwen2_moe``, applied to
``qwen3_5_moe_text``) writes per-expert ``experts.{e}.gate_proj.weight`` ``[I, D]``, ``up_proj`` ``[I, D]``,
``down_proj`` ``[D, I]``. ``split_experts`` writes that form, ``fuse_experts`` reads it back.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import re
from collections import defaultdict
from pathlib import Path

import torch
from huggingface_hub import snapshot_download, split_torch_state_dict_into_shards
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import PretrainedConfig

logger = logging.getLogger(__name__)

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_SHARD_PATTERN = "model{suffix}.safetensors"


def resolve_checkpoint_dir(dir_or_hub_id: str | os.PathLike, *, revision: str | None = None) -> Path:
    """A local checkpoint directory: the path itself when it exists, else a hub snapshot (config + safetensors).

    Offline (``HF_HUB_OFFLINE=1``) the hub lookup only finds what is already in the local cache.
    """
    path = Path(dir_or_hub_id).expanduser()
    if path.is_dir():
        return path
    if path.exists() or str(dir_or_hub_id).count("/") != 1:
        raise FileNotFoundError(f"{dir_or_hub_id}: not a checkpoint directory, nor a hub id of the form 'owner/name'")
    logger.info("downloading %s (config and safetensors) from the hub", dir_or_hub_id)
    local = snapshot_download(str(dir_or_hub_id), revision=revision, allow_patterns=["*.json", "*.safetensors"])
    return Path(local)


def checkpoint_files(path: Path) -> list[Path]:
    """The safetensors files of a checkpoint directory, from its index when sharded."""
    index = path / INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [path / name for name in sorted(set(weight_map.values()))]
    single = path / SINGLE_FILE
    if single.is_file():
        return [single]
    found = sorted(p.name for p in path.iterdir())
    raise FileNotFoundError(
        f"{path}: no {SINGLE_FILE} or {INDEX_FILE} (found {found[:12]}); only safetensors checkpoints are supported"
    )


def load_hf_state_dict(
    path: str | os.PathLike, *, device: torch.device | str = "cpu", dtype: torch.dtype | None = None
) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint directory, on ``device``, floating ones cast to ``dtype`` (None: as stored)."""
    state: dict[str, torch.Tensor] = {}
    for file in checkpoint_files(Path(path)):
        with safe_open(str(file), framework="pt", device=str(device)) as f:
            for key in f.keys():  # noqa: SIM118 (safe_open handles are not iterable)
                t = f.get_tensor(key)
                if dtype is not None and t.is_floating_point():
                    t = t.to(dtype)
                state[key] = t
    return state


_FUSED_GATE_UP = re.compile(r"^(.*\.experts)\.gate_up_proj$")
_FUSED_DOWN = re.compile(r"^(.*\.experts)\.down_proj$")
_PER_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def split_experts(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The state dict with fused expert tensors replaced by transformers' per-expert on-disk keys (others as is).

    The per-expert tensors are copies (safetensors refuses tensors that share storage).
    """
    out: dict[str, torch.Tensor] = {}
    for key, t in state_dict.items():
        if m := _FUSED_GATE_UP.match(key):
            for e, (gate_ID, up_ID) in enumerate(zip(*t.chunk(2, dim=1), strict=True)):
                out[f"{m[1]}.{e}.gate_proj.weight"] = gate_ID.clone()
                out[f"{m[1]}.{e}.up_proj.weight"] = up_ID.clone()
        elif m := _FUSED_DOWN.match(key):
            for e, down_DI in enumerate(t):
                out[f"{m[1]}.{e}.down_proj.weight"] = down_DI.clone()
        else:
            out[key] = t
    return out


def fuse_experts(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The state dict with per-expert keys stacked into the fused in-memory tensors (fused keys pass through).

    Raises when a layer's experts are incomplete (an expert index or one of its three projections missing).
    """
    groups: dict[str, dict[int, dict[str, torch.Tensor]]] = defaultdict(lambda: defaultdict(dict))
    out: dict[str, torch.Tensor] = {}
    for key, t in state_dict.items():
        if m := _PER_EXPERT.match(key):
            groups[m[1]][int(m[2])][m[3]] = t
        else:
            out[key] = t
    for prefix, experts in groups.items():
        n = max(experts) + 1
        incomplete = [e for e in range(n) if len(experts.get(e, {})) != 3]
        if incomplete:
            raise ValueError(
                f"checkpoint experts under {prefix!r} are incomplete: experts {incomplete[:8]} lack one of "
                f"gate_proj/up_proj/down_proj (expected experts 0..{n - 1}, each with all three)"
            )
        if f"{prefix}.gate_up_proj" in out or f"{prefix}.down_proj" in out:
            raise ValueError(f"checkpoint holds both fused and per-expert weights under {prefix!r}")
        ordered = [experts[e] for e in range(n)]
        out[f"{prefix}.gate_up_proj"] = torch.stack([torch.cat([x["gate_proj"], x["up_proj"]]) for x in ordered])
        out[f"{prefix}.down_proj"] = torch.stack([x["down_proj"] for x in ordered])
    return out


def default_architecture(config: PretrainedConfig) -> str:
    """The transformers class a checkpoint of ``config`` is written for (``config.architectures``)."""
    if config.model_type == "qwen3_5_moe":
        return "Qwen3_5MoeForConditionalGeneration"
    return "Qwen3_5ForConditionalGeneration"


def _remove_stale_weights(save_dir: Path) -> None:
    """Deletes weight files of an earlier save in the same directory, so no old shard is read with the new."""
    stale = [p for p in save_dir.glob("model*.safetensors")] + [p for p in [save_dir / INDEX_FILE] if p.exists()]
    for p in stale:
        p.unlink()
    if stale:
        logger.info("%s: replaced %d weight files of an earlier save", save_dir, len(stale))


def save_hf_checkpoint(
    state_dict: dict[str, torch.Tensor],
    config: PretrainedConfig,
    save_dir: str | os.PathLike,
    *,
    max_shard_size: int | str = "5GB",
    architecture: str | None = None,
) -> Path:
    """Writes ``config.json`` and the state dict as (sharded) safetensors; returns the directory.

    Tensors must be full (not sharded DTensors) and must not share storage (drop tied duplicates first).
    ``config.architectures`` (``architecture``, default ``default_architecture(config)``) and ``config.dtype`` are
    set on a copy of the config, so transformers' Auto classes pick the right class and dtype. Fused MoE experts
    are written per expert (``split_experts``), the form transformers writes.
    """
    architecture = architecture or default_architecture(config)
    state_dict = split_experts(state_dict)
    save_dir = Path(save_dir)
    save_dir.mkdir(parents=True, exist_ok=True)
    floating = [t.dtype for t in state_dict.values() if t.is_floating_point()]
    out_config = copy.deepcopy(config)
    out_config.architectures = [architecture]
    if floating:
        out_config.dtype = max(set(floating), key=floating.count)
    out_config.save_pretrained(save_dir)

    cpu_state = {k: v.detach().to("cpu").contiguous() for k, v in state_dict.items()}
    split = split_torch_state_dict_into_shards(
        cpu_state, filename_pattern=_SHARD_PATTERN, max_shard_size=max_shard_size
    )
    _remove_stale_weights(save_dir)
    for filename, keys in split.filename_to_tensors.items():
        save_file({k: cpu_state[k] for k in keys}, str(save_dir / filename), metadata={"format": "pt"})
    if split.is_sharded:
        index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in cpu_state.values())}}
        index["weight_map"] = dict(sorted(split.tensor_to_filename.items()))
        (save_dir / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    logger.info("saved %d tensors to %s (%d file(s))", len(cpu_state), save_dir, len(split.filename_to_tensors))
    return save_dir
