"""Hugging Face checkpoint directories: find them (local or hub), index their tensors from the safetensors headers,
read row slices, and the on-disk naming of MoE experts. Kept free of model classes.

A checkpoint directory holds ``config.json`` and either ``model.safetensors`` or shards
``model-0000k-of-0000n.safetensors`` with ``model.safetensors.index.json``: the layout transformers reads and
``vlm_sft.checkpoint.export`` writes.

MoE experts: in memory they are fused (``experts.gate_up_proj`` ``[E, 2I, D]``, gate rows then up rows;
``experts.down_proj`` ``[E, D, I]``); on disk transformers' conversion mapping (``qwen2_moe``, applied to
``qwen3_5_moe_text``) writes per-expert ``experts.{e}.gate_proj.weight`` ``[I, D]``, ``up_proj`` ``[I, D]``,
``down_proj`` ``[D, I]``. ``split_experts`` / ``fuse_experts`` convert whole state dicts between the two forms (tests
and tools); the export splits expert by expert as it streams, with the same key patterns.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import struct
from collections import defaultdict
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from huggingface_hub import snapshot_download
from transformers import PretrainedConfig

logger = logging.getLogger(__name__)

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


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


_DTYPES = {
    "BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}  # fmt: skip
"""safetensors' dtype names -> torch dtypes."""


@dataclass(frozen=True)
class TensorEntry:
    """Where one checkpoint tensor lives, read from the file's header alone (no tensor data is touched)."""

    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    """Byte offset of the tensor's data in the file (after the header)."""

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def _read_header(file: Path) -> dict[str, TensorEntry]:
    """The tensors of one safetensors file from its JSON header (8-byte little-endian length, then the JSON)."""
    with open(file, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    out = {}
    for key, info in header.items():
        if info["dtype"] not in _DTYPES:
            raise ValueError(f"{file}: tensor {key!r} has dtype {info['dtype']}, which is not supported here")
        out[key] = TensorEntry(file, _DTYPES[info["dtype"]], tuple(info["shape"]), 8 + n + info["data_offsets"][0])
    return out


@dataclass(frozen=True)
class CheckpointIndex:
    """Every tensor of a checkpoint directory by name, with its file, dtype and shape: built from the headers only,
    so a rank learns the layout of a 70 GB checkpoint without reading any weight. ``SliceReader`` reads the rows."""

    path: Path
    entries: dict[str, TensorEntry]

    @classmethod
    def open(cls, path: str | os.PathLike) -> CheckpointIndex:
        path = Path(path)
        entries: dict[str, TensorEntry] = {}
        for file in checkpoint_files(path):
            entries.update(_read_header(file))
        return cls(path, entries)

    def __contains__(self, key: str) -> bool:
        return key in self.entries

    @property
    def dtype(self) -> torch.dtype:
        """The most common floating dtype of the checkpoint (what it was saved in)."""
        floating = [e.dtype for e in self.entries.values() if e.dtype.is_floating_point]
        return max(set(floating), key=floating.count) if floating else torch.float32

    @property
    def total_bytes(self) -> int:
        return sum(e.nbytes for e in self.entries.values())

    def reader(self) -> SliceReader:
        return SliceReader(self)


class SliceReader:
    """Reads row ranges (dim 0) of checkpoint tensors, touching only their bytes.

    A positional read of exactly the rows' byte range (a safetensors tensor is one C-contiguous block, so rows
    ``a:b`` are one range) into a fresh buffer: nothing is memory-mapped, so no page of another rank's rows ever
    counts in this process's memory, and the only buffer alive is the slice being copied. A context manager: the
    files stay open until it exits.
    """

    def __init__(self, index: CheckpointIndex) -> None:
        self.index = index
        self._files: dict[Path, Any] = {}
        self._stack = ExitStack()

    def __enter__(self) -> SliceReader:
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()
        self._files.clear()

    def _handle(self, file: Path):
        if file not in self._files:
            self._files[file] = self._stack.enter_context(open(file, "rb", buffering=0))  # noqa: SIM115 (the stack closes it)
        return self._files[file]

    def rows(self, key: str, start: int | None = None, stop: int | None = None) -> torch.Tensor:
        """Rows ``start:stop`` of tensor ``key`` (the whole tensor without bounds), as stored, on the CPU."""
        entry = self.index.entries[key]
        n = entry.shape[0] if entry.shape else 1
        start, stop = (0 if start is None else start), (n if stop is None else stop)
        if not 0 <= start <= stop <= n:
            raise IndexError(f"{key}: rows {start}:{stop} outside its {n} rows")
        row_bytes = entry.nbytes // n if n else 0
        shape = (stop - start, *entry.shape[1:]) if entry.shape else ()
        buffer = bytearray((stop - start) * row_bytes)
        f = self._handle(entry.file)
        f.seek(entry.offset + start * row_bytes)
        if buffer and f.readinto(buffer) != len(buffer):
            raise OSError(f"{entry.file}: truncated while reading {key} (the file is shorter than its header says)")
        if not buffer:
            return torch.empty(shape, dtype=entry.dtype)
        return torch.frombuffer(buffer, dtype=entry.dtype).reshape(shape)


def load_hf_state_dict(path: str | os.PathLike, *, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint directory on the CPU, floating ones cast to ``dtype`` (None: as stored).

    For tests and tools on small checkpoints: it holds the whole checkpoint. Models load through
    ``vlm_sft.checkpoint.load``, which reads only each rank's slices.
    """
    index = CheckpointIndex.open(path)
    state: dict[str, torch.Tensor] = {}
    with index.reader() as reader:
        for key in index.entries:
            t = reader.rows(key)
            state[key] = t.to(dtype) if dtype is not None and t.is_floating_point() else t
    return state


FUSED_GATE_UP = re.compile(r"^(.*\.experts)\.gate_up_proj$")
FUSED_DOWN = re.compile(r"^(.*\.experts)\.down_proj$")
"""The fused in-memory expert tensors (group 1: the ``...experts`` prefix)."""
_PER_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def split_experts(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The state dict with fused expert tensors replaced by transformers' per-expert on-disk keys (others as is).

    The per-expert tensors are copies (safetensors refuses tensors that share storage).
    """
    out: dict[str, torch.Tensor] = {}
    for key, t in state_dict.items():
        if m := FUSED_GATE_UP.match(key):
            for e, (gate_ID, up_ID) in enumerate(zip(*t.chunk(2, dim=1), strict=True)):
                out[f"{m[1]}.{e}.gate_proj.weight"] = gate_ID.clone()
                out[f"{m[1]}.{e}.up_proj.weight"] = up_ID.clone()
        elif m := FUSED_DOWN.match(key):
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
