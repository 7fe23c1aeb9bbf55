"""Hugging Face checkpoint directories: find them (local or hub), read their safetensors, write new ones.

Kept free of model classes so the trainer can save a gathered (e.g. FSDP full) state dict with the same writer.
A directory written here holds ``config.json`` and either ``model.safetensors`` or shards
``model-0000k-of-0000n.safetensors`` with ``model.safetensors.index.json``: the layout transformers reads.
"""

from __future__ import annotations

import copy
import json
import logging
import os
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
    architecture: str = "Qwen3_5ForConditionalGeneration",
) -> Path:
    """Writes ``config.json`` and the state dict as (sharded) safetensors; returns the directory.

    Tensors must be full (not sharded DTensors) and must not share storage (drop tied duplicates first).
    ``config.architectures`` and ``config.dtype`` are set on a copy of the config, so transformers' Auto classes
    pick the right class and dtype.
    """
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
