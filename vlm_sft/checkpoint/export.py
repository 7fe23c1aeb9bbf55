"""The Hugging Face export of a model, streamed tensor by tensor so that no host ever holds the whole model.

Every rank walks the model's state (parameters and persistent buffers) in the same order. A sharded tensor is
gathered alone (``DTensor.full_tensor``, a collective every rank joins); only rank 0 keeps it, cuts it into the
tensors the files hold, casts them to the checkpoint's dtype on the way to the host and adds them to the current
safetensors shard, which is written as soon as its last tensor arrives. Rank 0's extra host memory is therefore
about one shard plus one gathered tensor (``max_shard_size`` bounds it), where gathering the full state dict took
the whole model in fp32: 140 GB for the 35B-A3B model.

What a save writes (``export_hf``), the layout transformers' ``save_pretrained`` writes::

    config.json                          architectures and dtype set, for transformers' Auto classes
    model.safetensors                    every tensor, when they fit in one shard; otherwise
    model-0000k-of-0000n.safetensors     shards of at most max_shard_size (a bigger tensor gets one of its own)
    model.safetensors.index.json         total_size and weight_map, written last

The plan (``plan_export``: which tensors, under which keys, in which dtype and file) is made from shapes and dtypes
alone before any data moves, so every rank knows the file names and when each shard is complete.

The tensors on disk:

* **dtype**: each tensor in the dtype the base checkpoint (``source``) stored it in, so a bf16 checkpoint exports at
  its own size and a run at learning rate 0 exports it bit for bit; ``dtype`` (default float32) for tensors the
  source does not name, and for every tensor without a source (random-init models).
* **MoE**: fused experts (``experts.gate_up_proj`` ``[E, 2I, D]``, ``experts.down_proj`` ``[E, D, I]``) are written
  per expert (``experts.{e}.gate_proj.weight`` ...), the form transformers writes, cut from the gathered tensor as
  it streams (see ``hf_dir``).
* **Tied embeddings**: ``lm_head.weight`` is not written (transformers ties it on load).
* **LoRA** (peft's ``X.base_layer.weight``, ``X.lora_A.default.weight``, ``X.lora_B.default.weight``): merged into
  ``X.weight = base + alpha / r * B @ A`` in float32 and cast to the base's dtype (as ``merged_state_dict``),
  gathering that module's three tensors only. ``export_adapter`` writes the PEFT folder from the trainable tensors.
* **mtp.***: the base checkpoint's multi-token-prediction head, which the model drops on load, is copied unchanged
  from ``source``, so the export still serves with MTP speculative decoding (vLLM).
"""

from __future__ import annotations

import copy
import json
import logging
import math
import os
import shutil
from collections.abc import Callable, Iterator, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
from huggingface_hub import split_torch_state_dict_into_shards
from safetensors.torch import save_file
from torch import nn

from processors import save_processor
from vlm_sft.checkpoint import integrity
from vlm_sft.checkpoint.hf_dir import (
    FUSED_DOWN,
    FUSED_GATE_UP,
    INDEX_FILE,
    SINGLE_FILE,
    CheckpointIndex,
    SliceReader,
    default_architecture,
)
from vlm_sft.checkpoint.lora_export import BASE_LAYER, LORA_A, LORA_B, lora_modules, save_adapter
from vlm_sft.checkpoint.state import CheckpointSaveError
from vlm_sft.config import LoraSettings, RunConfig
from vlm_sft.parallel.collectives import PeerFailure, all_ranks_or_none, full_tensor
from vlm_sft.parallel.env import DistEnv

logger = logging.getLogger(__name__)

MTP_PREFIX = "mtp."
"""Keys of the base checkpoint's multi-token-prediction head: not in the model, copied from the source."""
SHARD_PATTERN = "model{suffix}.safetensors"
"""transformers' shard names: ``model.safetensors``, or ``model-00001-of-00003.safetensors`` ..."""
SINGLE_PROCESS = DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
"""The env of a save outside a distributed job (``save_pretrained``): no collectives, rank 0 writes."""

# How a step of the stream turns its gathered model tensors into the files' tensors.
PLAIN = "plain"  # one model tensor -> one file tensor (``X.base_layer.bias`` -> ``X.bias``)
GATE_UP = "gate_up"  # fused ``experts.gate_up_proj`` -> per expert ``gate_proj`` then ``up_proj``
DOWN = "down"  # fused ``experts.down_proj`` -> per expert ``down_proj``
LORA = "lora"  # ``X.base_layer.weight``, ``X.lora_A``, ``X.lora_B`` -> merged ``X.weight``
SOURCE = "source"  # a tensor of the base checkpoint (``mtp.*``), read by rank 0, as stored


class LoraScale(Protocol):
    """What the merge needs of the LoRA settings (``config.LoraSettings``): the update is ``alpha / r * B @ A``."""

    r: int
    alpha: float


@dataclass(frozen=True)
class ExportedTensor:
    """One tensor of the export, known before any data is read."""

    key: str
    """Its key in the files (transformers' name)."""
    shape: tuple[int, ...]
    dtype: torch.dtype
    """The dtype it is written in."""

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    def meta(self) -> torch.Tensor:
        """A data-less stand-in, for planning the shards with huggingface_hub's splitter."""
        return torch.empty(self.shape, dtype=self.dtype, device="meta")


@dataclass(frozen=True)
class ExportStep:
    """One step of the stream: model tensors gathered together (on every rank, in this order) and what they become.

    A step gathers one tensor, except a LoRA module's merge (its base, A and B): rank 0 never holds more than one
    step's gathered tensors besides the shard being filled."""

    kind: str
    """``PLAIN``, ``GATE_UP``, ``DOWN``, ``LORA`` or ``SOURCE``."""
    inputs: tuple[str, ...]
    """Model state keys to gather (``SOURCE``: the checkpoint key rank 0 reads)."""
    outputs: tuple[ExportedTensor, ...]
    """The file tensors, in the order the step yields them."""


@dataclass(frozen=True)
class ShardLayout:
    """Which file each exported tensor goes to, planned from shapes and dtypes alone."""

    files: dict[str, tuple[str, ...]]
    """File name -> keys (one file: ``model.safetensors``)."""
    total_size: int
    """Bytes of all tensors (the index's ``metadata.total_size``)."""

    @property
    def sharded(self) -> bool:
        return len(self.files) > 1

    def weight_map(self) -> dict[str, str]:
        return dict(sorted((key, name) for name, keys in self.files.items() for key in keys))


# -------------------------------------------------------------------------------------------------- planning


def plan_export(
    state: dict[str, torch.Tensor],
    *,
    tied_embeddings: bool,
    source: CheckpointIndex | None = None,
    dtype: torch.dtype | None = None,
    lora: LoraScale | None = None,
) -> list[ExportStep]:
    """The steps of the stream for a model state (shapes and dtypes are read, never data; DTensors stay sharded).

    ``dtype``: for floating tensors the source does not name (None: the source's dtype, float32 without a source).
    Raises when the model has LoRA adapters and ``lora`` is None (a plain checkpoint cannot hold them), or
    ``lora.r`` disagrees with the adapters' shapes (a wrong ``r`` would silently rescale the update).
    """
    fallback = dtype or (source.dtype if source is not None else torch.float32)

    def exported(key: str, shape: Sequence[int], t: torch.Tensor, fused_key: str | None = None) -> ExportedTensor:
        stored = [source.entries[k].dtype for k in (key, fused_key) if source is not None and k in source.entries]
        out = t.dtype if not t.is_floating_point() else (stored[0] if stored else fallback)
        return ExportedTensor(key, tuple(shape), out)

    merged = _lora_steps(state, lora, exported)
    steps: list[ExportStep] = []
    for key, t in state.items():
        if tied_embeddings and key == "lm_head.weight":
            continue
        if key in merged:
            steps.append(merged[key])
        elif m := FUSED_GATE_UP.match(key):
            E, I2, D = t.shape  # gate rows then up rows, I2 = 2I
            outs = [
                exported(f"{m[1]}.{e}.{proj}.weight", (I2 // 2, D), t, key)
                for e in range(E)
                for proj in ("gate_proj", "up_proj")
            ]
            steps.append(ExportStep(GATE_UP, (key,), tuple(outs)))
        elif m := FUSED_DOWN.match(key):
            outs = [exported(f"{m[1]}.{e}.down_proj.weight", t.shape[1:], t, key) for e in range(t.shape[0])]
            steps.append(ExportStep(DOWN, (key,), tuple(outs)))
        elif ".lora_" not in key:
            steps.append(ExportStep(PLAIN, (key,), (exported(key.replace(BASE_LAYER, "."), t.shape, t),)))
    for key, entry in (source.entries if source is not None else {}).items():
        if key.startswith(MTP_PREFIX):
            steps.append(ExportStep(SOURCE, (key,), (ExportedTensor(key, entry.shape, entry.dtype),)))
    return steps


def _lora_steps(
    state: dict[str, torch.Tensor], lora: LoraScale | None, exported: Callable[..., ExportedTensor]
) -> dict[str, ExportStep]:
    """Each adapted module's merge step, under its base weight's key (where the stream meets the module first)."""
    modules = lora_modules(state)
    if modules and lora is None:
        raise ValueError(
            f"the model has LoRA adapters ({modules[0]} ...) but no LoRA settings were given: pass lora= (r, alpha) "
            "to merge them, or export the adapter alone with export_adapter"
        )
    out: dict[str, ExportStep] = {}
    for m in modules:
        base_key, a, b = m + BASE_LAYER + "weight", state[m + LORA_A], state[m + LORA_B]
        if base_key not in state:
            raise ValueError(f"{m}: LoRA weights without a base weight ({base_key})")
        if a.shape[0] != lora.r or b.shape[1] != lora.r:
            raise ValueError(f"{m}: A {tuple(a.shape)} and B {tuple(b.shape)} have rank {a.shape[0]}, not r={lora.r}")
        base = state[base_key]
        out[base_key] = ExportStep(
            LORA, (base_key, m + LORA_A, m + LORA_B), (exported(m + ".weight", base.shape, base),)
        )
    return out


def plan_shards(tensors: Sequence[ExportedTensor], max_shard_size: int | str = "5GB") -> ShardLayout:
    """The files of the export, by huggingface_hub's splitter (the one transformers' ``save_pretrained`` uses), run
    on data-less meta tensors: greedy in stream order, a tensor above ``max_shard_size`` alone in its own file."""
    split = split_torch_state_dict_into_shards(
        {t.key: t.meta() for t in tensors}, filename_pattern=SHARD_PATTERN, max_shard_size=max_shard_size
    )
    files = {name: tuple(keys) for name, keys in split.filename_to_tensors.items()}
    assert split.is_sharded or list(files) == [SINGLE_FILE], files
    return ShardLayout(files, sum(t.nbytes for t in tensors))


# ------------------------------------------------------------------------------------------------- streaming


def _gather(t: torch.Tensor, env: DistEnv) -> torch.Tensor | None:
    """The whole tensor on rank 0 (on its device), None elsewhere. A DTensor's ``full_tensor`` is a collective that
    every rank joins, in the same order; the other ranks drop their copy at once."""
    t = full_tensor(t)
    return t.detach() if env.is_main else None


def _host(t: torch.Tensor, out: ExportedTensor, *, own: bool = False) -> torch.Tensor:
    """``t`` on the CPU in the export dtype, contiguous; ``own`` copies a view that must not share its storage
    (safetensors refuses a file whose tensors overlap; an expert is a view of its layer's gathered tensor)."""
    if tuple(t.shape) != out.shape:  # raised, not asserted: under python -O the wrong tensor would be written
        raise ExportPlanError(f"{out.key}: the model holds shape {tuple(t.shape)}, the export planned {out.shape}")
    return t.to(device="cpu", dtype=out.dtype, copy=own).contiguous()


class ExportPlanError(RuntimeError):
    """The streamed export found a tensor or a file other than it planned: a bug in the plan, never written."""


def _step_tensors(
    step: ExportStep, state: dict[str, torch.Tensor], env: DistEnv, reader: SliceReader | None, scale: float
) -> Iterator[torch.Tensor | None]:
    """The step's file tensors in ``step.outputs`` order, one at a time (None on ranks other than 0)."""
    if step.kind == SOURCE:
        assert reader is not None
        with all_ranks_or_none(env, f"reading {step.inputs[0]} from {reader.index.path}"):
            t = reader.rows(step.inputs[0]) if env.is_main else None
        yield t
        return
    full = [_gather(state[k], env) for k in step.inputs]
    if not env.is_main:
        yield from (None for _ in step.outputs)
        return
    if step.kind == PLAIN:
        yield _host(full[0], step.outputs[0])
    elif step.kind == LORA:
        base, a, b = full
        yield _host(base.float() + scale * (b.float() @ a.float()), step.outputs[0])
    elif step.kind == GATE_UP:
        half = full[0].shape[1] // 2
        pieces = (p for expert in full[0] for p in (expert[:half], expert[half:]))
        yield from (_host(p, out, own=True) for p, out in zip(pieces, step.outputs, strict=True))
    else:
        assert step.kind == DOWN, step.kind
        yield from (_host(p, out, own=True) for p, out in zip(full[0], step.outputs, strict=True))


class _ShardWriter:
    """Collects the streamed tensors per file and writes a file the moment its last tensor arrives.

    Every rank runs one (rank 0 alone holds tensors), so every rank knows when a file is complete and joins the
    failure agreement around its write: a full disk on rank 0 stops every rank instead of leaving the others
    waiting in the next gather."""

    def __init__(self, directory: Path, layout: ShardLayout, env: DistEnv) -> None:
        self.directory, self.layout, self.env = directory, layout, env
        self._file_of = {key: name for name, keys in layout.files.items() for key in keys}
        self._pending: dict[str, dict[str, torch.Tensor | None]] = {name: {} for name in layout.files}

    def add(self, key: str, tensor: torch.Tensor | None) -> None:
        name = self._file_of[key]
        pending = self._pending[name]
        assert key not in pending, key
        pending[key] = tensor
        if len(pending) == len(self.layout.files[name]):
            path = self.directory / name
            with all_ranks_or_none(self.env, f"writing {path}"):
                if self.env.is_main:
                    save_file(pending, str(path), metadata={"format": "pt"})
                    logger.info("wrote %s (%d tensors)", path, len(pending))
            del self._pending[name]

    def finish(self) -> None:
        """Writes the index (sharded exports), after every shard: a reader never finds an index without its files."""
        if self._pending:  # an export missing files is never sealed (python -O keeps this check)
            raise ExportPlanError(f"files never completed: {sorted(self._pending)}")
        with all_ranks_or_none(self.env, f"writing {self.directory / INDEX_FILE}"):
            if self.env.is_main and self.layout.sharded:
                index = {"metadata": {"total_size": self.layout.total_size}, "weight_map": self.layout.weight_map()}
                (self.directory / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")


# --------------------------------------------------------------------------------------------------- exports


def export_hf(
    model: nn.Module,
    directory: str | os.PathLike,
    *,
    env: DistEnv,
    source: CheckpointIndex | None = None,
    dtype: torch.dtype | None = None,
    max_shard_size: int | str = "5GB",
    lora: LoraScale | None = None,
) -> Path:
    """Writes the model as an HF checkpoint directory (config + safetensors), streamed; every rank must call this.

    ``model`` is a ``Qwen3_5VLM`` (``config``, ``tied_embeddings``), sharded by FSDP2 or not. ``source``: the index
    of the checkpoint the run loaded; its dtypes are kept and its ``mtp.*`` tensors copied. ``dtype``: for tensors
    the source does not name (no source: all; default float32). ``lora``: the settings of a LoRA-injected model,
    whose adapters are merged into the weights (a plain checkpoint has no place for them). Weight files of an
    earlier save in ``directory`` are removed first, so no stale shard is read with the new ones.
    """
    directory = Path(directory)
    if source is not None and directory.resolve() == source.path.resolve():
        raise ValueError(
            f"cannot export into {directory}: it is the source checkpoint, whose files the export replaces while it "
            "still reads them (mtp.*); export into another directory"
        )
    state = model.state_dict(keep_vars=True)  # params + persistent buffers, one order on every rank
    steps = plan_export(state, tied_embeddings=model.tied_embeddings, source=source, dtype=dtype, lora=lora)
    tensors = [out for step in steps for out in step.outputs]
    layout = plan_shards(tensors, max_shard_size)
    with all_ranks_or_none(env, f"preparing {directory}"):
        if env.is_main:
            directory.mkdir(parents=True, exist_ok=True)
            _write_config(model.config, directory, tensors)
            _remove_stale_weights(directory)
    writer = _ShardWriter(directory, layout, env)
    scale = lora.alpha / lora.r if lora is not None else 0.0
    with source.reader() if source is not None else nullcontext() as reader:
        for step in steps:
            for out, t in zip(step.outputs, _step_tensors(step, state, env, reader, scale), strict=True):
                writer.add(out.key, t)
    writer.finish()
    if env.is_main:
        logger.info("exported %d tensors to %s (%d file(s))", len(tensors), directory, len(layout.files))
    return directory


def _write_config(config, directory: Path, tensors: Sequence[ExportedTensor]) -> None:
    """``config.json`` with ``architectures`` (for transformers' Auto classes) and ``dtype``: the files' most common
    floating dtype, so ``from_pretrained(dtype="auto")`` loads them as written. Set on a copy of the config."""
    out = copy.deepcopy(config)
    out.architectures = [default_architecture(config)]
    floating = [t.dtype for t in tensors if t.dtype.is_floating_point]
    if floating:
        out.dtype = max(set(floating), key=floating.count)
    out.save_pretrained(directory)


def _remove_stale_weights(directory: Path) -> None:
    """Deletes weight files of an earlier save in the same directory, so no old shard is read with the new."""
    stale = [*directory.glob("model*.safetensors"), *[p for p in [directory / INDEX_FILE] if p.exists()]]
    for p in stale:
        p.unlink()
    if stale:
        logger.info("%s: replaced %d weight files of an earlier save", directory, len(stale))


def save_pretrained(
    model: nn.Module,
    save_dir: str | os.PathLike,
    *,
    source: CheckpointIndex | None = None,
    dtype: torch.dtype | None = None,
    max_shard_size: int | str = "5GB",
    lora: LoraScale | None = None,
) -> Path:
    """``export_hf`` for a model outside a distributed job (not sharded): tests, notebooks and tools."""
    return export_hf(
        model, save_dir, env=SINGLE_PROCESS, source=source, dtype=dtype, max_shard_size=max_shard_size, lora=lora
    )


def export_adapter(
    model: nn.Module, directory: str | os.PathLike, *, env: DistEnv, lora: LoraSettings, base_model_name_or_path: str
) -> Path:
    """The PEFT adapter folder of a LoRA run (``lora_export.save_adapter``); every rank must call this.

    Only the tensors that train are gathered (adapters, and ``modules_to_save``), one at a time, and kept on rank 0:
    the frozen base is never read.
    """
    names = [n for n, _ in model.named_parameters()]
    trainable: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        if p.requires_grad:
            full = _gather(p, env)
            if full is not None:
                trainable[name] = full.to("cpu")
    with all_ranks_or_none(env, f"writing the adapter {directory}"):
        if env.is_main:
            save_adapter(
                directory, trainable, r=lora.r, alpha=lora.alpha, dropout=lora.dropout,
                target_modules=list(lora.target_modules), base_model_name_or_path=base_model_name_or_path,
                modules_to_save=list(lora.modules_to_save), parameter_names=names,
            )  # fmt: skip
    return Path(directory)


def export_final(
    directory: Path,
    model: nn.Module,
    processor,
    env: DistEnv,
    cfg: RunConfig,
    *,
    source: CheckpointIndex | None = None,
    merge: bool | None = None,
) -> Path:
    """A run's HF checkpoint (``final/``, ``checkpoints/step-N/hf``): weights + config, then processor and tokenizer
    (tokenizer last, verified on reload); every rank must call this.

    LoRA runs write the adapter in PEFT's format to ``<directory>/adapter`` and, when ``merge`` (default:
    ``train.merge_lora``), the merged full weights as the HF checkpoint itself; without the merged copy only the
    trainable tensors are gathered. ``source``: the index of the checkpoint the run loaded (dtypes, ``mtp.*``).

    Written into ``<directory>.tmp``, sealed with a ``MANIFEST.json`` of its files (``integrity.write_manifest``;
    ``python -m vlm_sft.checkpoint.integrity DIR`` checks it), then renamed into place, replacing an earlier export
    only then: a half-written export never looks complete. A failure removes the ``.tmp`` folder and raises
    ``CheckpointSaveError`` naming the export (``PeerFailure`` on the ranks that did not fail).
    """
    directory = Path(directory)
    if source is not None and directory.resolve() == source.path.resolve():
        raise ValueError(
            f"cannot export into {directory}: it is the source checkpoint, which the export would replace; export "
            "into another directory"
        )
    tmp = directory.with_name(directory.name + ".tmp")
    try:
        with all_ranks_or_none(env, f"preparing {tmp}"):
            if env.is_main:
                shutil.rmtree(tmp, ignore_errors=True)
        _write_final(tmp, model, processor, env, cfg, source=source, merge=merge)
        integrity.write_manifest(tmp, env)
        with all_ranks_or_none(env, f"moving {tmp} to {directory}"):
            if env.is_main:
                integrity.replace_folder(tmp, directory)
    except BaseException as err:  # any failure, an interrupt too: the partial folder goes first
        if env.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
        if not isinstance(err, Exception) or isinstance(err, PeerFailure | CheckpointSaveError):
            raise
        raise CheckpointSaveError(
            f"could not write the HF export {directory} (into {tmp}, now removed): {type(err).__name__}: {err}"
        ) from err
    return directory


def _write_final(
    directory: Path, model: nn.Module, processor, env: DistEnv, cfg: RunConfig, *, source, merge: bool | None
) -> None:
    """``export_final``'s files, written into ``directory`` (its ``.tmp`` folder)."""
    lora = cfg.model.lora
    merge = cfg.train.merge_lora if merge is None else merge
    if lora is not None:
        export_adapter(model, directory / "adapter", env=env, lora=lora, base_model_name_or_path=cfg.model.name_or_path)
        with all_ranks_or_none(env, f"writing the processor into {directory / 'adapter'}"):
            if env.is_main:  # the run's chat template (its thinking default) travels with the adapter too
                save_processor(directory / "adapter", processor, processor.tokenizer)
        if not merge:
            return
    export_hf(model, directory, env=env, source=source, lora=lora)
    with all_ranks_or_none(env, f"writing the processor into {directory}"):
        if env.is_main:
            save_processor(directory, processor, processor.tokenizer)
            _copy_generation_config(source, directory)


def _copy_generation_config(source: CheckpointIndex | None, directory: Path) -> None:
    """The base checkpoint's ``generation_config.json`` (its stop tokens and sampling defaults, which servers such as
    vLLM read) copied unchanged; a random-init preset has none, and transformers then stops at the config's eos."""
    found = None if source is None else source.path / "generation_config.json"
    if found is not None and found.is_file():
        shutil.copyfile(found, directory / "generation_config.json")
