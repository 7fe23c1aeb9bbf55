"""Typed run configuration: TOML files in ``configs/`` plus dotted command-line overrides.

Config is data. Every field has a docstring; validators raise with the current values and the fix instead of
rewriting a user's setting. ``load_config("configs/debug.toml", ["--train.max_steps", "20"])`` is the one entry point
the trainer, the data report and the packing check share.
"""

from __future__ import annotations

import sys
import tomllib
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CONFIG = REPO_ROOT / "configs" / "debug.toml"
TINY_MODEL = "tiny"
"""``model.name_or_path`` value that builds the offline tiny Qwen3.5 preset instead of loading a checkpoint."""
SHAPES_DATASET = "shapes"
"""``data.source`` value that selects the embedded, generated shapes dataset."""


class ConfigError(ValueError):
    """A config that cannot run, with the fix in the message."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_assignment=True, frozen=False)


class VLMConfig(_Section):
    """Vision-language settings; present (``[model.vlm]``) whenever the data has images."""

    freeze_vision: bool = True
    """Keep the vision tower's weights fixed. The usual SFT choice; its unused parameters would otherwise decay."""


class ModelConfig(_Section):
    name_or_path: str = TINY_MODEL
    """``tiny`` (offline preset), a local HF checkpoint directory, or a hub id such as ``Qwen/Qwen3.5-0.8B``."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Parameter and compute dtype. bfloat16 means bf16 autocast on CUDA with fp32 master weights."""
    attn_impl: Literal["auto", "flash_attn", "torch_varlen", "sdpa"] = "auto"
    """Full-attention backend; ``auto`` picks the fastest boundary-exact one available on the device."""
    linear_attn_impl: Literal["auto", "fla", "torch"] = "auto"
    """GatedDeltaNet and short-conv backend; ``fla`` needs flash-linear-attention on CUDA."""
    loss_impl: Literal["auto", "fla_fused", "chunked"] = "auto"
    """Cross-entropy backend; both avoid materializing full fp32 logits."""
    activation_checkpointing: bool = False
    """Recompute each decoder layer in backward to save activation memory."""
    initializer_range: float | None = None
    """Only for ``tiny``: std of the random init (0.08 learns fastest on the shapes task; see measured facts)."""
    hidden_size: int = 64
    """Only for ``tiny``: text and vision hidden size."""
    vlm: VLMConfig | None = None
    """Vision settings; required when the dataset has images (``[model.vlm]`` in TOML)."""


class ShapesConfig(_Section):
    """The embedded shapes dataset: generated deterministically, materialized once as jsonl + png files."""

    num_train: int = Field(4000, ge=1)
    """Training conversations to generate."""
    num_eval: int = Field(200, ge=0)
    """Held-out conversations (a disjoint seed stream), used for eval loss and colour accuracy."""
    seed: int = 0
    """Generator seed; the same seed gives byte-identical files."""
    image_size: int = Field(64, ge=32)
    """Side of the square images in pixels (64 gives a 4x4 patch grid = 4 image tokens)."""
    root: str = "data/shapes"
    """Folder under which the dataset is materialized (a subfolder per seed and size)."""


class DataConfig(_Section):
    source: str = SHAPES_DATASET
    """``shapes``, a local jsonl / json / parquet file, or a hub dataset id."""
    split: str = "train"
    """Split to read for hub datasets and files loaded through ``datasets``."""
    eval_source: str | None = None
    """Held-out data for eval; for ``shapes`` the generator's eval split is used when this is unset."""
    shapes: ShapesConfig = ShapesConfig()
    """Settings of the embedded shapes dataset."""
    seq_len: int = Field(1024, ge=8)
    """Longest sample kept, in tokens; longer ones are truncated image-safely (or skipped, see ``truncation``)."""
    pack_len: int = Field(2048, ge=8)
    """Tokens per packed row; every row is padded to exactly this length."""
    packing: Literal["bfd", "cat", "stack"] = "bfd"
    """``bfd`` best-fit-decreasing packing, ``cat`` sequential packing, ``stack`` padded batches (baseline)."""
    stack_batch_size: int = Field(32, ge=1)
    """Rows per micro-batch with ``packing = "stack"`` (packed modes put one row per micro-batch)."""
    shuffle: bool = True
    """Visit the training rows in a seeded random order each epoch (False: file order)."""
    bfd_buffer: int = Field(512, ge=1)
    """Look-ahead buffer (samples) of the ``bfd`` packer."""
    max_image_patches_per_pack: int | None = None
    """Cap on vision patches per pack, bounding the vision tower's memory per step; None: no cap."""
    truncation: Literal["drop", "truncate"] = "drop"
    """When truncation cuts the final trainable turn's closing token: ``drop`` the sample or ``truncate`` it."""
    loss_on: Literal["all_assistant", "last_assistant"] = "all_assistant"
    """Which assistant turns are trained."""
    special_text: Literal["escape", "drop", "error"] = "escape"
    """What to do with special-token strings (e.g. ``<|image_pad|>``) typed in user text."""
    num_workers: int = Field(0, ge=0, le=1)
    """0: render and pack in the training process; 1: one worker process prefetches packed batches (the pipeline is
    one deterministic stream, so one worker at most)."""


class TrainConfig(_Section):
    seed: int = 0
    """Seed for init, data order and dropout."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """``auto``: CUDA when available, else CPU."""
    max_steps: int | None = Field(300, ge=1)
    """Optimizer steps to run; None to run ``epochs`` instead."""
    epochs: float | None = None
    """Passes over the data when ``max_steps`` is None."""
    micro_batches: int = Field(1, ge=1)
    """Micro-batches per optimizer step on each rank (gradient accumulation)."""
    grad_sync: Literal["step", "micro_batch"] = "step"
    """When sharded gradients are reduce-scattered: once per ``step`` (after the last micro-batch: 1/micro_batches
    of the traffic, but each rank holds the whole model's unsharded fp32 gradient during the step, 4 bytes per
    parameter) or after every ``micro_batch`` (sharded gradients only: for models whose full gradient does not fit
    one GPU). The update is the same either way."""
    lr: float = Field(1e-3, gt=0)
    """Peak learning rate."""
    min_lr_ratio: float = Field(0.1, ge=0, le=1)
    """Cosine floor as a fraction of ``lr``."""
    schedule: Literal["cosine", "constant"] = "cosine"
    """Learning-rate shape after warmup."""
    warmup_steps: int = Field(50, ge=0)
    """Linear warmup steps."""
    weight_decay: float = Field(0.01, ge=0)
    """AdamW decay, never applied to norms, biases and embeddings."""
    betas: tuple[float, float] = (0.9, 0.98)
    """AdamW betas."""
    grad_clip: float | None = Field(1.0, gt=0)
    """Max global gradient norm; None disables clipping."""
    output_dir: str = "outputs/debug"
    """Run folder: metrics.jsonl, checkpoints, final/."""
    save_every: int | None = Field(None, ge=1)
    """Steps between resumable checkpoints; None: only the final one."""
    keep_last: int = Field(2, ge=1)
    """Resumable checkpoints kept."""
    resume: str | None = None
    """``latest`` or a checkpoint path to continue from."""
    log_every: int = Field(10, ge=1)
    """Steps between metrics lines."""
    eval_every: int | None = Field(None, ge=1)
    """Steps between evals; None: eval at the end only."""
    report_to: list[Literal["tensorboard", "wandb"]] = []
    """Extra metric sinks beside metrics.jsonl."""
    check_packing: bool = False
    """Run the packing self-check (packed vs per-sample logits and gradients) before training."""


class RunConfig(_Section):
    """The whole run: ``[model]``, ``[data]``, ``[train]``."""

    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    train: TrainConfig = TrainConfig()

    @model_validator(mode="after")
    def _check_compatible(self) -> RunConfig:
        d, m, t = self.data, self.model, self.train
        if d.seq_len > d.pack_len:
            raise ConfigError(
                f"data.seq_len ({d.seq_len}) > data.pack_len ({d.pack_len}): a kept sample could never fit a pack; "
                f"set data.pack_len >= {d.seq_len} or lower data.seq_len"
            )
        if d.source == SHAPES_DATASET and m.vlm is None:
            raise ConfigError(
                "the shapes dataset has images but [model.vlm] is missing; add a [model.vlm] section "
                "(or --model.vlm.freeze_vision true)"
            )
        if m.dtype == "bfloat16" and t.device == "cpu":
            raise ConfigError(
                "model.dtype = 'bfloat16' with train.device = 'cpu': bf16 on CPU is slow and inexact here; "
                "set model.dtype = 'float32' for CPU runs"
            )
        if t.max_steps is None and t.epochs is None:
            raise ConfigError("set train.max_steps or train.epochs (both are unset)")
        if t.max_steps is not None and t.epochs is not None:
            raise ConfigError(
                f"train.max_steps ({t.max_steps}) and train.epochs ({t.epochs}) are both set; unset one of them"
            )
        if t.warmup_steps and t.max_steps is not None and t.warmup_steps >= t.max_steps:
            raise ConfigError(
                f"train.warmup_steps ({t.warmup_steps}) >= train.max_steps ({t.max_steps}); lower warmup_steps"
            )
        if m.name_or_path != TINY_MODEL and m.initializer_range is not None:
            raise ConfigError(
                f"model.initializer_range only applies to the tiny preset, not to {m.name_or_path!r}; remove it"
            )
        if d.packing == "stack" and d.max_image_patches_per_pack is not None:
            raise ConfigError(
                "data.max_image_patches_per_pack applies to packed rows; with data.packing = 'stack' every "
                "multimodal sample has its own row. Unset it or choose packing 'bfd' / 'cat'"
            )
        return self

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")


def parse_overrides(argv: list[str]) -> dict[str, Any]:
    """``["--train.max_steps", "20", "--model.vlm.freeze_vision=false"]`` -> nested dict.

    Values are parsed as TOML literals (numbers, booleans, arrays, quoted strings); anything else stays a string,
    so ``--data.source my.jsonl`` needs no quotes.
    """
    out: dict[str, Any] = {}
    i = 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--"):
            raise ConfigError(f"unexpected argument {arg!r}: overrides look like --section.field value")
        key, eq, value = arg[2:].partition("=")
        if not eq:
            if i + 1 >= len(argv):
                raise ConfigError(f"override {arg!r} has no value")
            value = argv[i + 1]
            i += 1
        i += 1
        node = out
        parts = key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override --{key} conflicts with another override of {part}")
        node[parts[-1]] = _parse_value(value)
    return out


def _parse_value(text: str) -> Any:
    if text.lower() in ("none", "null"):
        return None
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> RunConfig:
    """Load a TOML config (default ``configs/debug.toml``) and apply dotted overrides; raise ConfigError on problems."""
    path = Path(path) if path is not None else DEFAULT_CONFIG
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} not found; pass --config configs/debug.toml or another file")
    with path.open("rb") as f:
        data = tomllib.load(f)
    data = _merge(data, parse_overrides(overrides or []))
    try:
        return RunConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(f"invalid config {path}:\n{_explain(err)}") from None


def split_config_arg(argv: list[str]) -> tuple[str | None, list[str]]:
    """Pull ``--config X`` / ``--config=X`` out of argv; return (path or None, remaining overrides)."""
    rest: list[str] = []
    config = None
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--config":
            if i + 1 >= len(argv):
                raise ConfigError("--config needs a path")
            config = argv[i + 1]
            i += 2
            continue
        if arg.startswith("--config="):
            config = arg.split("=", 1)[1]
        else:
            rest.append(arg)
        i += 1
    return config, rest


def config_from_cli(argv: list[str]) -> RunConfig | None:
    """``--config X`` plus dotted overrides -> config; prints the error and returns None when it is invalid.

    The shared front of every command-line entry point (train, data report, packing check): each exits with
    status 2 on None.
    """
    try:
        config_path, overrides = split_config_arg(argv)
        return load_config(config_path, overrides)
    except ConfigError as err:
        print(f"config error: {err}", file=sys.stderr)
        return None


def _explain(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"])
        ctx_err = (e.get("ctx") or {}).get("error")
        if isinstance(ctx_err, ConfigError):
            lines.append(f"  {ctx_err}")
        elif e["type"] == "extra_forbidden":
            lines.append(f"  {loc}: unknown setting (check the spelling; see vlm_sft/config.py for the fields)")
        else:
            lines.append(f"  {loc}: {e['msg']} (got {e.get('input')!r})")
    return "\n".join(lines)
