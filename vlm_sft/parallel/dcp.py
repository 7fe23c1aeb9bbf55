"""Sharded model and optimizer state in and out of torch distributed checkpoint (DCP), reading no pickle.

``checkpoint.state`` decides which files a checkpoint holds; this module is how the sharded tensors get there and
back: ``get_state_dict`` / ``set_state_dict`` (FSDP2's DTensors, resharded on load for any number of processes) and
DCP's save / load, whose ``.metadata`` (a pickle torch writes) is read by ``SafeReader``, an unpickler that admits
only DCP's metadata classes.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, StorageMeta
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

_DCP_METADATA = (
    "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "TensorProperties", "ChunkStorageMetadata",
    "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING",
)  # fmt: skip
_METADATA_CLASSES = {
    *(("torch.distributed.checkpoint.metadata", name) for name in _DCP_METADATA),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # looks a torch.layout up by its name, nothing else
    *((module, name) for module in ("pathlib", "pathlib._local") for name in ("PosixPath", "PurePosixPath")),
}
"""What the ``.metadata`` of a DCP checkpoint of tensors refers to: plain dataclasses, enums and names. Anything else
in it is refused (``UnknownMetadataClass``), so the file cannot run code."""
LISTED_FOR = "2.13"
"""The torch version ``_METADATA_CLASSES`` was written for (torch 2.14's checkpoints name no other class: a 2.14
checkpoint resumed on 2.13 and on 2.14, issue 44). Named in ``UnknownMetadataClass``'s message."""


class UnknownMetadataClass(pickle.UnpicklingError):
    """A DCP ``.metadata`` names a class outside ``_METADATA_CLASSES``: a checkpoint of another torch whose DCP moved
    or added a class, or a file that is not DCP's. Never unpickled; the message names the class, the torch versions
    and the fix."""


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, stream: Any, path: str) -> None:
        super().__init__(stream)
        self.path = path

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _METADATA_CLASSES or (
            module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        ):
            return super().find_class(module, name)
        raise UnknownMetadataClass(
            f"{self.path} refers to {module}.{name}, which is not one of the DCP metadata classes vlm-sft reads "
            f"(listed for torch {LISTED_FOR}; this is torch {torch.__version__}): refused, since unpickling an unknown "
            "class could run code. A checkpoint written by another torch version, whose DCP moved or added that "
            f"class: resume it with the torch that wrote it, or, if {module}.{name} is DCP's own plain metadata "
            "class, add it to _METADATA_CLASSES in vlm_sft/parallel/dcp.py"
        )


class SafeReader(dcp.FileSystemReader):
    """DCP's file reader, but its ``.metadata`` (a pickle that torch writes) is read with an unpickler that admits
    only DCP's own metadata classes, and a checkpoint with pickled entries (``BytesStorageMetadata``, which DCP
    would read with ``torch.load(weights_only=False)``) is refused."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as stream:
            metadata = _MetadataUnpickler(stream, str(path)).load()
        if not isinstance(metadata, Metadata):
            raise ValueError(f"{path} holds a {type(metadata).__name__}, not DCP metadata")
        pickled = sorted(k for k, v in metadata.state_dict_metadata.items() if isinstance(v, BytesStorageMetadata))
        if pickled:
            raise ValueError(
                f"{path}: the entries {pickled[:5]} are pickled objects, which are never read (a pickle can run code); "
                "this checkpoint was not written by this version of vlm-sft"
            )
        if metadata.storage_meta is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id  # what FileSystemReader.read_metadata does after unpickling
        return metadata


def _options(trainable_only: bool) -> StateDictOptions:
    """What a checkpoint holds: every parameter, or (``trainable_only``) the ones that train; the loader asks for
    the same keys, so a strict load would only flag the frozen ones it was told to leave alone."""
    return StateDictOptions(ignore_frozen_params=trainable_only, strict=not trainable_only)


def sharded_state(model: nn.Module, optimizer: torch.optim.Optimizer, *, trainable_only: bool) -> tuple[dict, dict]:
    """``(model state, optimizer state)`` keyed by parameter name, each tensor this rank's shard (a DTensor)."""
    return get_state_dict(model, optimizer, options=_options(trainable_only))


def set_sharded_state(
    model: nn.Module, optimizer: torch.optim.Optimizer, model_state: dict, optim_state: dict, *, trainable_only: bool
) -> None:
    """Write ``sharded_state``'s kind of dicts back into ``model`` and ``optimizer`` in place."""
    options = _options(trainable_only)
    set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optim_state, options=options)


def save_tensors(tensors: dict, path: Path) -> None:
    """DCP save of a tree of tensors into folder ``path`` (a collective: every rank writes its shards)."""
    dcp.save(tensors, checkpoint_id=str(path))


def check_metadata(path: Path) -> None:
    """Read ``path``'s DCP metadata the safe way (rank-local): a refused file fails here, before any collective."""
    SafeReader(str(path)).read_metadata()


def load_tensors(tensors: dict, path: Path) -> None:
    """DCP load into a tree of tensors shaped like the one saved (a collective; resharded for this world size)."""
    dcp.load(tensors, storage_reader=SafeReader(str(path)))
