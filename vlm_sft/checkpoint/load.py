"""Loading a Hugging Face checkpoint into ``Qwen3_5VLM``, sharded: no rank ever holds the whole model.

The order (torchtitan's and prime-rl's): build the model on the meta device -> wrap it (LoRA adapters, the frozen
dtype) -> ``fully_shard`` -> ``to_empty`` on the rank's device -> ``load_weights``: every rank reads, from the
safetensors files, only the rows of each tensor that its FSDP2 shard owns (``SliceReader.rows``: safetensors'
``get_slice``, so only those bytes are touched) and copies them, cast, into its local shard. A rank's peak is its
final shards plus one slice's read buffer; on CUDA, nothing of the full model passes through GPU memory. An
unsharded model (one CPU process, tests) is the same path with every tensor owned whole.

FSDP2 shards every parameter on dim 0 in ``torch.chunk`` pieces (``ceil(n / W)`` rows per rank, the last ranks
possibly short or empty). MoE experts are fused in memory (``[E, 2I, D]`` / ``[E, D, I]``, dim 0 = experts) and
stored per expert on disk: a rank reads only the experts it owns and writes them into its fused shard in place.

What is not read: ``mtp.*`` (the multi-token-prediction head, unused in training; the export copies it back
unchanged from the source checkpoint), ``lm_head.weight`` of a checkpoint with tied embeddings, LoRA adapters (drawn
by ``lora.init_adapters``) and non-persistent buffers (rotary frequencies, recomputed by ``init_buffers``). Any other
missing, unexpected or misshapen tensor is an error that names it, raised before anything is read.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from transformers import Qwen3_5Config, Qwen3_5MoeConfig

from vlm_sft.checkpoint.hf_dir import CheckpointIndex, SliceReader, resolve_checkpoint_dir
from vlm_sft.model.backends import Backends, resolve_backends
from vlm_sft.model.vlm import Qwen3_5VLM
from vlm_sft.parallel.fsdp import local_rows
from vlm_sft.parallel.parallelize import input_embeddings

logger = logging.getLogger(__name__)

IGNORED_PREFIXES = ("mtp.",)
"""Checkpoint keys the model does not hold: the multi-token-prediction head of the hub checkpoints."""
_FUSED = re.compile(r"^(.*\.experts)\.(gate_up_proj|down_proj)$")
_LORA = (".lora_A.", ".lora_B.")


def load_model_config(path: str | os.PathLike) -> Qwen3_5Config | Qwen3_5MoeConfig:
    """The checkpoint's config: ``Qwen3_5MoeConfig`` when ``config.json`` says ``qwen3_5_moe``, else ``Qwen3_5Config``."""
    path = Path(path)
    config_file = path / "config.json"
    model_type = json.loads(config_file.read_text()).get("model_type") if config_file.is_file() else None
    if model_type == Qwen3_5MoeConfig.model_type:
        return Qwen3_5MoeConfig.from_pretrained(path)
    return Qwen3_5Config.from_pretrained(path)


def meta_model(
    config: Qwen3_5Config | Qwen3_5MoeConfig,
    backends: Backends,
    *,
    freeze_vision: bool = True,
    activation_checkpointing: bool = False,
) -> Qwen3_5VLM:
    """The model's skeleton on the meta device: shapes and dtypes, no memory, nothing initialized."""
    with torch.device("meta"):
        return Qwen3_5VLM(
            config, backends, freeze_vision=freeze_vision, activation_checkpointing=activation_checkpointing
        )


def materialize(model: nn.Module, device: torch.device | str) -> None:
    """Allocate the (sharded) parameters on ``device`` uninitialized, re-tie tied embeddings, recompute the
    non-persistent buffers."""
    device = torch.device(device)
    model.to_empty(device=device)
    vlm = next(m for m in model.modules() if isinstance(m, Qwen3_5VLM))
    if vlm.tied_embeddings and vlm.lm_head.weight is not input_embeddings(vlm).weight:
        vlm.tie_weights()  # to_empty gives each module its own tensor; FSDP2 keeps its shared parameter tied itself
    vlm.init_buffers(device)


def checkpoint_key(name: str) -> str:
    """The checkpoint key of a model parameter: peft's ``base_layer`` segment removed."""
    return name.replace(".base_layer.", ".")


@dataclass(frozen=True)
class _Read:
    """How one model tensor is filled: from one checkpoint key, or (fused MoE experts) from per-expert keys."""

    name: str
    """The model's parameter or buffer name."""
    keys: tuple[str, ...]
    """The checkpoint keys it consumes."""
    experts: str | None = None
    """``gate_up_proj`` / ``down_proj`` when read from per-expert keys under ``keys``' common prefix."""
    prefix: str = ""


def _expected_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """The tensors a checkpoint fills: parameters (tied ones once) and persistent buffers, LoRA adapters left out."""
    named = dict(model.named_parameters())
    for name, t in model.state_dict(keep_vars=True).items():
        if name not in named and t is not None and not _is_tied_duplicate(model, name):
            named[name] = t
    return {n: t for n, t in named.items() if not any(s in n for s in _LORA)}


def _is_tied_duplicate(model: nn.Module, name: str) -> bool:
    return name == "lm_head.weight" and bool(getattr(model, "tied_embeddings", False))


def plan_reads(model: nn.Module, index: CheckpointIndex) -> list[_Read]:
    """Which checkpoint keys fill which tensor, checked against the checkpoint's names and shapes (no data read).

    Raises with the first missing, unexpected and misshapen names when the checkpoint does not fit the model."""
    reads, missing, bad_shape = [], [], []
    for name, t in _expected_tensors(model).items():
        key = checkpoint_key(name)
        if key in index:
            reads.append(_Read(name, (key,)))
            if index.entries[key].shape != tuple(t.shape):
                bad_shape.append(f"{key}: checkpoint {index.entries[key].shape} vs model {tuple(t.shape)}")
        elif m := _FUSED.match(key):
            read, absent = _per_expert_read(name, m[1], m[2], t, index)
            reads += [read] if read else []
            missing += absent
        else:
            missing.append(key)
    used = {k for r in reads for k in r.keys}
    unexpected = [
        k for k in index.entries
        if k not in used and not k.startswith(IGNORED_PREFIXES) and not _is_tied_duplicate(model, k)
    ]  # fmt: skip
    if missing or unexpected or bad_shape:
        raise ValueError(
            f"checkpoint {index.path} does not match Qwen3_5VLM: missing {_few(missing)}, unexpected "
            f"{_few(unexpected)}, shape mismatches {_few(bad_shape)}"
        )
    return reads


def _few(items: list[str], n: int = 8) -> str:
    return f"{items[:n]}{'...' if len(items) > n else ''}"


def _per_expert_read(name: str, prefix: str, kind: str, t: torch.Tensor, index: CheckpointIndex):
    """A fused expert tensor read from transformers' per-expert keys; (read or None, missing keys). A layer whose
    experts are only partly there raises, naming them."""
    n_experts, rows, cols = t.shape
    parts = ("gate_proj", "up_proj") if kind == "gate_up_proj" else ("down_proj",)
    keys = tuple(f"{prefix}.{e}.{p}.weight" for e in range(n_experts) for p in parts)
    missing = [k for k in keys if k not in index]
    if len(missing) == len(keys):
        return None, [checkpoint_key(name)]  # neither fused nor per-expert: the fused name is what is missing
    if missing:
        incomplete = sorted({int(k.removeprefix(prefix + ".").split(".")[0]) for k in missing})
        raise ValueError(
            f"checkpoint {index.path}: experts under {prefix!r} are incomplete: experts {incomplete[:8]} lack one of "
            f"{'/'.join(parts)} (expected experts 0..{n_experts - 1}, each with all of them)"
        )
    want = (rows // len(parts), cols)
    wrong = [k for k in keys if index.entries[k].shape != want]
    if wrong:
        raise ValueError(
            f"checkpoint {index.path}: {wrong[:4]} are not {want} (the experts of {name} {tuple(t.shape)})"
        )
    return _Read(name, keys, experts=kind, prefix=prefix), []


@dataclass(frozen=True)
class LoadReport:
    """What ``load_weights`` did on this rank."""

    tensors: int
    """Model tensors filled."""
    bytes_read: int
    """Checkpoint bytes this rank read (its slices only)."""
    ignored: tuple[str, ...]
    """Checkpoint keys deliberately not read (``mtp.*``)."""


@torch.no_grad()
def load_weights(
    model: nn.Module, index: CheckpointIndex, *, select: Callable[[str, torch.Tensor], bool] | None = None
) -> LoadReport:
    """Fill this rank's shard of every tensor ``plan_reads`` maps (``select(name, tensor)``: only those) from the
    checkpoint, slice by slice, cast to the tensor's own dtype (the model's dtype rules: fp32 master weights, a bf16
    frozen LoRA base); every rank calls it on a materialized model, independently (no collective)."""
    reads = plan_reads(model, index)
    tensors = _expected_tensors(model)
    done = read = 0
    with index.reader() as reader:
        for r in reads:
            if select is not None and not select(r.name, tensors[r.name]):
                continue
            local, start, stop = local_rows(tensors[r.name])
            read += _fill(local, start, stop, r, reader)
            done += 1
    ignored = tuple(k for k in index.entries if k.startswith(IGNORED_PREFIXES))
    if ignored:
        logger.info(
            "%s: %d tensors of the multi-token-prediction head (mtp.*) are not loaded", index.path, len(ignored)
        )
    return LoadReport(done, read, ignored)


def _fill(local: torch.Tensor, start: int, stop: int, r: _Read, reader: SliceReader) -> int:
    """Copies rows ``start:stop`` of ``r`` into ``local``; returns the bytes read."""
    if r.experts is None:
        data = reader.rows(r.keys[0], start, stop) if local.dim() else reader.rows(r.keys[0])
        local.copy_(data)
        return data.numel() * data.element_size()
    read = 0
    for e in range(start, stop):
        if r.experts == "down_proj":
            parts = [reader.rows(f"{r.prefix}.{e}.down_proj.weight")]
        else:
            parts = [reader.rows(f"{r.prefix}.{e}.{p}.weight") for p in ("gate_proj", "up_proj")]
        row = 0
        for part in parts:  # gate rows then up rows: the fused layout (hf_dir's module docstring)
            local[e - start, row : row + part.shape[0]].copy_(part)
            row += part.shape[0]
            read += part.numel() * part.element_size()
    return read


def from_pretrained(
    dir_or_hub_id: str | os.PathLike,
    *,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
    attn_impl: str = "auto",
    linear_attn_impl: str = "auto",
    loss_impl: str = "auto",
    experts_impl: str = "auto",
    freeze_vision: bool = True,
    activation_checkpointing: bool = False,
    revision: str | None = None,
) -> Qwen3_5VLM:
    """An unsharded ``Qwen3_5VLM`` from a Hugging Face Qwen3.5 / Qwen3.5-MoE checkpoint (local dir or hub id).

    The family follows ``config.json``'s ``model_type``. ``dtype`` None means float32 (master weights for training).
    Built on meta and filled tensor by tensor, so nothing is initialized twice and the peak is the model plus one
    tensor. The trainer shards before it fills (``vlm_sft.checkpoint.build``); this is for one process (tests, tools).
    """
    path = resolve_checkpoint_dir(dir_or_hub_id, revision=revision)
    device = torch.device(device if device is not None else "cpu")
    backends = resolve_backends(
        device, attn_impl=attn_impl, linear_attn_impl=linear_attn_impl, loss_impl=loss_impl, experts_impl=experts_impl
    )
    model = meta_model(
        load_model_config(path),
        backends,
        freeze_vision=freeze_vision,
        activation_checkpointing=activation_checkpointing,
    )
    index = CheckpointIndex.open(path)
    plan_reads(model, index)  # a checkpoint that does not fit fails before any allocation
    if dtype is not None and dtype != torch.float32:
        model.to(dtype)
    materialize(model, device)
    load_weights(model, index)
    model.set_vision_trainable(not freeze_vision)
    logger.info("loaded %s (%s on %s; backends %s)", path, dtype or torch.float32, device, backends)
    return model
