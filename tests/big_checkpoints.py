"""Random bf16 Hugging Face checkpoints of a chosen size S (tens of MiB), for the memory tests of load, save and resume.

Why so big: a rank's peak host memory moves by tens of MiB with nothing but import order and allocator state, so a
figure like "peak RSS - baseline <= 2 x S" means something only when S stands well above that noise (64-128 MiB).
Why random and bf16: the released Qwen3.5 checkpoints are bf16, and what is measured is where bytes go, not what
they say.

The checkpoints are what a user points ``model.name_or_path`` at: ``config.json`` (Qwen3.5 or Qwen3.5-MoE, dtype
bf16), the weights as transformers writes them (HF names; MoE experts per expert on disk,
``...mlp.experts.{e}.gate_proj.weight`` etc.; a few ``mtp.*`` tensors of a multi-token-prediction head, which the
model does not hold but an export must keep), split into several ``model-0000N-of-0000M.safetensors`` files with
``model.safetensors.index.json``, and the tiny offline processor. The size comes from the number of decoder layers
(widths fixed at hidden 512), so the bytes sit in many similar tensors, as in a real model, not in one embedding.

Use: ``cached_checkpoint(tmp_path_factory, "dense", 96 * MIB)`` inside a test module's own session-scoped fixture
(conftest-free: the module imports this file); it is written once per session under pytest's base temp directory and
reused by every module that asks for the same kind and size. Writing 100 MiB takes about 2 s.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from transformers import Qwen3_5Config, Qwen3_5MoeConfig

MIB = 2**20
DEFAULT_SIZE = 96 * MIB
"""S of the memory tests: well above the RSS noise, small enough for 2 CPU cores."""
HIDDEN = 512
"""Text hidden size of the big checkpoints (the vision tower stays tiny: hidden 64)."""
INDEX_FILE = "model.safetensors.index.json"
COMPLETE = "COMPLETE"
"""Marker written last: a cached directory without it was interrupted and is written again."""


@dataclass(frozen=True)
class BigCheckpoint:
    """A written checkpoint directory and what the tests compare against."""

    path: Path
    """The directory (``model.name_or_path``)."""
    size: int
    """S: bytes of tensor data in its safetensors files (the index's ``total_size``)."""
    kind: str
    """``dense`` or ``moe``."""
    layers: int
    """Decoder layers (a multiple of 4: 3 GatedDeltaNet : 1 full attention)."""
    files: int
    """Safetensors files the weights are split into."""


def dense_config(layers: int, hidden: int = HIDDEN) -> Qwen3_5Config:
    """The tiny preset's structure (tokenizer, heads, vision tower) at text width ``hidden`` with an MLP of
    ``3 * hidden``, so that the MLP holds most of each layer, as in the real models."""
    from vlm_sft.model.presets import tiny_qwen3_5_config

    config = tiny_qwen3_5_config(hidden_size=hidden, num_hidden_layers=layers)
    config.text_config.intermediate_size = 3 * hidden
    return config


def moe_config(layers: int, hidden: int = HIDDEN) -> Qwen3_5MoeConfig:
    """The tiny MoE preset at text width ``hidden``: 16 experts of width ``hidden / 2``, top-2, a shared expert of the
    same width; the experts hold most of each layer, as in the 35B-A3B."""
    from vlm_sft.model.presets import tiny_qwen3_5_moe_config

    width = hidden // 2
    return tiny_qwen3_5_moe_config(
        hidden_size=hidden, num_hidden_layers=layers, num_experts=16, moe_intermediate_size=width,
        shared_expert_intermediate_size=width,
    )  # fmt: skip


CONFIGS = {"dense": dense_config, "moe": moe_config}


def on_disk_shapes(config: Qwen3_5Config | Qwen3_5MoeConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of the checkpoint as transformers writes it: the model's keys, fused experts split per expert,
    plus a few ``mtp.*`` tensors (a multi-token-prediction head: fc, norms and one MLP layer)."""
    from vlm_sft.model.backends import resolve_backends
    from vlm_sft.model.vlm import Qwen3_5VLM

    with torch.device("meta"):
        model = Qwen3_5VLM(config, resolve_backends("cpu"))
    shapes: dict[str, tuple[int, ...]] = {}
    for key, t in model.state_dict().items():
        prefix, _, name = key.rpartition(".")
        if name == "gate_up_proj":  # [E, 2I, D] -> E x (gate [I, D], up [I, D])
            e, two_i, d = t.shape
            for i in range(e):
                shapes[f"{prefix}.{i}.gate_proj.weight"] = (two_i // 2, d)
                shapes[f"{prefix}.{i}.up_proj.weight"] = (two_i // 2, d)
        elif name == "down_proj" and prefix.endswith(".experts"):  # [E, D, I] -> E x [D, I]
            for i in range(t.shape[0]):
                shapes[f"{prefix}.{i}.down_proj.weight"] = tuple(t.shape[1:])
        else:
            shapes[key] = tuple(t.shape)
    d = config.text_config.hidden_size
    mtp = {"mtp.fc.weight": (d, 2 * d), "mtp.norm.weight": (d,), "mtp.pre_fc_norm_embedding.weight": (d,)}
    mtp |= {"mtp.pre_fc_norm_hidden.weight": (d,), "mtp.layers.0.input_layernorm.weight": (d,)}
    mtp |= {f"mtp.layers.0.mlp.{p}.weight": (d, d) for p in ("gate_proj", "up_proj", "down_proj")}
    return shapes | mtp


def _bytes(shapes: dict[str, tuple[int, ...]]) -> int:
    return sum(2 * torch.Size(s).numel() for s in shapes.values())


def layers_for(kind: str, size: int) -> int:
    """The multiple of 4 of decoder layers whose bf16 checkpoint comes closest to ``size`` bytes (at least 4)."""
    four, eight = (_bytes(on_disk_shapes(CONFIGS[kind](n))) for n in (4, 8))
    per_four = eight - four
    return 4 * max(1, round((size - four) / per_four) + 1)


def write_checkpoint(
    directory: Path, kind: str, layers: int, *, hidden: int = HIDDEN, files: int = 2, seed: int = 0
) -> BigCheckpoint:
    """Writes a random bf16 checkpoint of ``kind`` with ``layers`` decoder layers of width ``hidden`` into
    ``directory``.

    Values are ``N(0, 0.02)`` (norm weights too: nothing is trained on them, and they stay finite through a forward).
    Tensors are generated and written one file at a time, in key order, so the writer holds about ``S / files``.
    """
    from processors import load_tiny_processor, save_processor

    config = CONFIGS[kind](layers, hidden)
    shapes = on_disk_shapes(config)
    directory.mkdir(parents=True, exist_ok=True)
    config.architectures = [
        "Qwen3_5MoeForConditionalGeneration" if kind == "moe" else "Qwen3_5ForConditionalGeneration"
    ]
    config.dtype = torch.bfloat16
    config.save_pretrained(directory)
    processor = load_tiny_processor()
    save_processor(directory, processor, processor.tokenizer)

    total, target = _bytes(shapes), -(-_bytes(shapes) // files)
    groups: list[list[str]] = [[]]
    filled = 0
    for key in sorted(shapes):
        if filled >= target and len(groups) < files:
            groups.append([])
            filled = 0
        groups[-1].append(key)
        filled += 2 * torch.Size(shapes[key]).numel()
    gen = torch.Generator().manual_seed(seed)
    weight_map = {}
    for i, keys in enumerate(groups):
        name = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        tensors = {k: torch.empty(shapes[k], dtype=torch.bfloat16).normal_(0.0, 0.02, generator=gen) for k in keys}
        save_file(tensors, str(directory / name), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(keys, name)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    (directory / COMPLETE).write_text("")
    return BigCheckpoint(directory, total, kind, layers, len(groups))


def read_checkpoint(directory: Path, kind: str) -> BigCheckpoint:
    """The description of a checkpoint ``write_checkpoint`` wrote earlier."""
    index = json.loads((directory / INDEX_FILE).read_text())
    layers = json.loads((directory / "config.json").read_text())["text_config"]["num_hidden_layers"]
    files = len(set(index["weight_map"].values()))
    return BigCheckpoint(directory, index["metadata"]["total_size"], kind, layers, files)


def cached_checkpoint(
    factory: pytest.TempPathFactory, kind: str, size: int = DEFAULT_SIZE, *, layers: int | None = None
) -> BigCheckpoint:
    """A checkpoint of ``kind`` near ``size`` bytes (or with exactly ``layers`` layers), written once per pytest
    session under its base temp directory and shared by every test module that asks for the same one."""
    layers = layers_for(kind, size) if layers is None else layers
    directory = factory.getbasetemp() / f"big_checkpoint_{kind}_{layers}_layers"
    if (directory / COMPLETE).is_file():
        return read_checkpoint(directory, kind)
    return write_checkpoint(directory, kind, layers)


BASELINE_LAYERS, BASELINE_HIDDEN = 4, 64
"""The baseline of a memory measurement: the same kind at hidden 64 and 4 layers (about 1 MiB), written the same way,
so that "peak - baseline" leaves the model's own bytes."""


def tiny_baseline(factory: pytest.TempPathFactory, kind: str) -> BigCheckpoint:
    """The baseline of a memory test (``BASELINE_LAYERS``, ``BASELINE_HIDDEN``), written once per pytest session."""
    directory = factory.getbasetemp() / f"big_checkpoint_{kind}_baseline"
    if (directory / COMPLETE).is_file():
        return read_checkpoint(directory, kind)
    return write_checkpoint(directory, kind, BASELINE_LAYERS, hidden=BASELINE_HIDDEN)


def write_with_baselines(work: Path, kinds: list[str], size: int) -> dict[str, BigCheckpoint]:
    """For each of ``kinds``: a checkpoint near ``size`` bytes under ``kind`` and its baseline under
    ``<kind>_baseline`` (the memory benches' "peak - baseline"), written into ``work``."""
    checkpoints = {}
    for kind in kinds:
        checkpoints[kind] = write_checkpoint(work / f"ck-{kind}", kind, layers_for(kind, size))
        baseline = write_checkpoint(work / f"ck-{kind}-baseline", kind, BASELINE_LAYERS, hidden=BASELINE_HIDDEN)
        checkpoints[f"{kind}_baseline"] = baseline
    return checkpoints
