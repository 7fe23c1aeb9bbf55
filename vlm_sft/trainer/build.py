"""From a ``RunConfig`` to the objects a run needs: processor, renderer, data sources, pipeline, model.

The trainer, the data report (``python -m vlm_sft.report``) and the packing self-check
(``python -m vlm_sft.check_packing``) all build through here, so they see exactly the same data and model.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import Qwen3_5Config, Qwen3_5MoeConfig

from processors import load_processor, load_tiny_processor
from renderers import (
    RenderedSample,
    RenderError,
    check_served_prompt,
    check_template_parity,
    get_renderer,
    served_probes,
)
from renderers.served import default_thinking_mode, last_reply_reasons, with_thinking_default
from vlm_sft.config import SHAPES_DATASET, TINY_MODELS, TINY_MOE_MODEL, ConfigError, RunConfig
from vlm_sft.data.image_roots import ImageRoots
from vlm_sft.data.pipeline import PackingPipeline
from vlm_sft.data.shapes import materialize_shapes
from vlm_sft.data.sources import (
    ConversationSource,
    RowConverter,
    RowRenderFn,
    hub_cache_roots,
    load_conversations,
    render_fn,
)
from vlm_sft.data.streaming import StreamingRows, local_files
from vlm_sft.trainer.distributed import DistEnv, all_reduce, shard_model

logger = logging.getLogger(__name__)


def build_processor(cfg: RunConfig) -> Any:
    """The tiny offline processor for the tiny presets, else the checkpoint's own (no torchvision needed), with its
    chat template's ``enable_thinking`` default set to ``data.enable_thinking`` where it differs: the run's processor
    is the one its checkpoints save, so a server calling their template with no arguments prompts the way the run
    trained (``renderers.served``)."""
    processor = (
        load_tiny_processor() if cfg.model.name_or_path in TINY_MODELS else load_processor(cfg.model.name_or_path)
    )
    served = default_thinking_mode(processor.chat_template, processor.tokenizer.special_tokens_map)
    if served is not None and served != cfg.data.enable_thinking:
        logger.info(
            "chat template: enable_thinking defaults to %s in this run's checkpoints (data.enable_thinking; the base "
            "template's default is %s)",
            str(cfg.data.enable_thinking).lower(),
            str(served).lower(),
        )
        template = with_thinking_default(processor.chat_template, cfg.data.enable_thinking)
        processor.chat_template = processor.tokenizer.chat_template = template
    return processor


def tiny_model_config(cfg: RunConfig) -> Qwen3_5Config | Qwen3_5MoeConfig:
    """The random-init preset ``model.name_or_path`` names (``tiny`` or ``tiny-moe``) at the config's widths."""
    from vlm_sft.model.presets import tiny_qwen3_5_config, tiny_qwen3_5_moe_config

    kwargs = {"hidden_size": cfg.model.hidden_size, "vision_hidden_size": cfg.model.hidden_size}
    if cfg.model.initializer_range is not None:
        kwargs["initializer_range"] = cfg.model.initializer_range
    if cfg.model.name_or_path == TINY_MOE_MODEL:
        return tiny_qwen3_5_moe_config(**kwargs)
    return tiny_qwen3_5_config(**kwargs)


def build_renderer(cfg: RunConfig, processor: Any):
    return get_renderer(
        processor,
        loss_on=cfg.data.loss_on,
        special_text=cfg.data.special_text,
        enable_thinking=cfg.data.enable_thinking,
    )


THINKING_PROBE_ROWS = 256
"""Training rows ``check_served_template`` reads to compare the data's replies with ``data.enable_thinking``."""


def check_served_template(cfg: RunConfig, processor: Any, renderer: Any, source: Any, *, warn: bool = True) -> None:
    """Refuse to train on tokens the checkpoint would not serve, and say when the data disagrees with the mode.

    The renderer must equal the processor (``check_template_parity``), and a server calling the template the run
    saves with no arguments must prompt exactly the tokens the run trains before each probe's last reply
    (``check_served_prompt``). Then (``warn``) the last replies of the first ``THINKING_PROBE_ROWS`` rows: mostly
    reasoning in a non-thinking run, or none in a thinking one, is a warning naming the setting (streamed sources
    are not read)."""
    check_template_parity(renderer, processor)
    for probe in served_probes(cfg.data.enable_thinking):
        check_served_prompt(renderer, processor, probe)
    if not warn or isinstance(source, StreamedSource) or not len(source):
        return
    rows = range(min(len(source), THINKING_PROBE_ROWS))
    reasoning = sum(_reasons(source, i) for i in rows)
    if not cfg.data.enable_thinking and reasoning > len(rows) / 2:
        logger.warning(
            "%d of the first %d training rows end in a reply with reasoning, but data.enable_thinking = false: the "
            "saved template's default prompt closes the think block, so served the default way the model is never "
            "asked to reason; set data.enable_thinking = true for reasoning data",
            reasoning,
            len(rows),
        )
    elif cfg.data.enable_thinking and reasoning == 0:
        logger.warning(
            "none of the first %d training rows ends in a reply with reasoning, but data.enable_thinking = true: the "
            "saved template's default prompt opens a think block the data never fills; set data.enable_thinking = "
            "false for data without reasoning",
            len(rows),
        )


def _reasons(source: ConversationSource, index: int) -> bool:
    """Whether row ``index``'s last reply reasons; a row that does not load says no (the data pipeline skips and
    reports it with its reason)."""
    try:
        return last_reply_reasons(source[index].messages)
    except RenderError:
        return False


@dataclass(frozen=True)
class StreamedSource:
    """A ``data.streaming`` source: rows are read while training (``StreamingRows``), never prepared on local disk."""

    path: str
    """Local parquet / jsonl file or folder of shards, or a hub dataset id."""
    split: str
    """Split of a hub dataset."""
    images: ImageRoots
    """Where its images may be read from (by default the data folder; for a hub dataset its caches)."""

    @classmethod
    def open(cls, cfg: RunConfig) -> StreamedSource:
        """Checks the local files now (a missing one is an error at start-up, not in a data worker)."""
        d = cfg.data
        files = local_files(d.source)
        allowed = tuple(d.allowed_image_roots)
        if files is None:
            root, allowed = d.image_root, allowed + hub_cache_roots(None)
        else:
            folder = Path(d.source).expanduser()
            root = d.image_root or str(folder if folder.is_dir() else folder.parent)
        return cls(d.source, d.split, ImageRoots(root, allowed))


@dataclass(frozen=True)
class DataSources:
    """Training and held-out conversations, with the eval task of each held-out row when the data has one."""

    train: ConversationSource | StreamedSource
    """Training rows (read while training with ``data.streaming``)."""
    eval: ConversationSource | None
    """Held-out rows, or None when the config names none."""
    eval_tasks: dict[int, str]
    """Held-out row index -> task name (``task`` column), for per-task accuracy; empty when absent."""


def materialize_data(cfg: RunConfig, *, progress: bool = True) -> dict[str, Path] | None:
    """Write the generated shapes dataset when the config uses it (idempotent; one process at a time: in a
    distributed run rank 0 does it before the others load). Returns its jsonl paths, or None for other sources."""
    d = cfg.data
    if d.source != SHAPES_DATASET:
        return None
    s = d.shapes
    return materialize_shapes(
        s.root, num_train=s.num_train, num_eval=s.num_eval, seed=s.seed, image_size=s.image_size, progress=progress
    )


def load_sources(cfg: RunConfig) -> DataSources:
    """Load the configured data (for ``shapes``, written first if it is not there yet)."""
    d = cfg.data
    shapes = materialize_data(cfg, progress=False)
    if shapes is not None:
        train_path, eval_path = shapes["train"], (shapes["eval"] if d.shapes.num_eval else None)
    else:
        train_path, eval_path = d.source, d.eval_source
    roots = {"image_root": d.image_root, "allowed_image_roots": tuple(d.allowed_image_roots)}
    if d.streaming and shapes is None:
        train = StreamedSource.open(cfg)
    else:
        train = load_conversations(train_path, split=d.split, **roots)
    held = load_conversations(eval_path, split=d.split, **roots) if eval_path is not None else None
    task_column = held.column("task") if held is not None else None
    tasks = {i: str(t) for i, t in enumerate(task_column or []) if t is not None}
    rows = "streamed" if isinstance(train, StreamedSource) else str(len(train))
    logger.info("data: %s training rows from %s, %d held-out", rows, train_path, len(held) if held else 0)
    return DataSources(train=train, eval=held, eval_tasks=tasks)


class _RequireVLM:
    """Wraps a render function: an image sample with no ``[model.vlm]`` section is a config error, not a skip."""

    def __init__(self, fn: Any, has_vlm: bool, progress: Any = None) -> None:
        self.fn = fn
        self.has_vlm = has_vlm
        self.progress = progress

    def __call__(self, index: int) -> RenderedSample:
        if self.progress is not None:
            self.progress.update(1)
        sample = self.fn(index)
        if sample.num_images and not self.has_vlm:
            raise ConfigError(
                f"sample {index} has {sample.num_images} image(s) but the config has no [model.vlm] section; "
                "add [model.vlm] (freeze_vision = true keeps the tower fixed)"
            )
        return sample


def build_pipeline(
    cfg: RunConfig,
    source: ConversationSource | StreamedSource,
    renderer: Any,
    *,
    shard: int = 0,
    num_shards: int = 1,
    epochs: int | None,
    shuffle: bool | None = None,
    packing: str | None = None,
    progress: Any = None,
    check_skips: bool = False,
) -> PackingPipeline:
    """The packing pipeline of shard ``shard`` of ``num_shards`` of ``source`` (positions ``shard, shard + n, ...`` of
    each epoch's order). ``progress`` (a tqdm bar) is advanced once per rendered sample. ``check_skips`` (training)
    stops the pipeline when more than ``data.max_skip_fraction`` of its samples are skipped; the data report, which
    exists to list the skips, leaves it off."""
    d = cfg.data
    limit = d.max_skip_fraction if check_skips and d.max_skip_fraction < 1 else None
    shuffle = d.shuffle if shuffle is None else shuffle
    order = None
    if isinstance(source, StreamedSource):
        convert = RowRenderFn(RowConverter(None, source.images), renderer)
        order = StreamingRows(
            source.path, row_to_sample=convert, shard=shard, num_shards=num_shards, split=source.split,
            shuffle_files=shuffle, seed=cfg.train.seed,
        )  # fmt: skip
        render = order
    else:
        render = render_fn(source, renderer)
    return PackingPipeline(
        0 if order is not None else len(source),
        _RequireVLM(render, cfg.model.vlm is not None, progress),
        seq_len=d.seq_len,
        pack_len=d.pack_len,
        packing=packing or d.packing,
        batch_size=d.stack_batch_size,
        buffer_size=d.bfd_buffer,
        max_image_patches_per_pack=d.max_image_patches_per_pack,
        truncation=d.truncation,
        shuffle=shuffle,
        seed=cfg.train.seed,
        epochs=epochs,
        rank=shard,
        world_size=num_shards,
        order=order,
        max_skip_fraction=limit,
        skip_check_after=d.skip_check_after,
    )


@dataclass(frozen=True)
class TrainPipelines:
    """``(stream, streams) -> pipeline`` of the training data: stream ``stream`` of ``streams`` is pipeline shard
    ``stream`` of ``streams`` (picklable: data workers build their own). The streams are global, the same for any
    number of ranks and workers; which rank reads which is ``trainer.batches.DataLayout``'s business."""

    cfg: RunConfig
    source: ConversationSource | StreamedSource
    renderer: Any
    epochs: int | None = None
    """Passes before the stream ends (None: forever, as in training; counting the steps of an epochs-run sets it)."""

    def __call__(self, stream: int, streams: int) -> PackingPipeline:
        return build_pipeline(
            self.cfg, self.source, self.renderer, shard=stream, num_shards=streams, epochs=self.epochs,
            check_skips=True,
        )  # fmt: skip


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
    cfg: RunConfig, device: torch.device, *, env: DistEnv | None = None, resuming: bool = False
) -> torch.nn.Module:
    """The run's model: a random-init tiny preset, or a checkpoint (hub id or directory), LoRA-wrapped when asked.

    With ``env`` the model comes back sharded for it (FSDP2, ``shard_model``); a checkpoint is then loaded the
    sharded way (``vlm_sft.checkpoint.load``): built on meta, wrapped, sharded, materialized, and each rank reads only
    the rows of its shards. ``resuming``: the weights that the resumed checkpoint restores are not read from the HF
    checkpoint at all (all of them in a full fine-tuning run; a LoRA run still reads its frozen base).

    Without a ``[model.vlm]`` section the vision tower is frozen, with one warning: its parameters would otherwise
    receive no gradient and still decay under AdamW. bf16 runs keep fp32 master weights (FSDP2 mixed precision
    computes in bf16); a bf16 LoRA run stores its frozen base in bf16 beside fp32 adapters.
    """
    m = cfg.model
    if m.vlm is None:
        logger.warning("no [model.vlm] section: the vision tower is frozen (add [model.vlm] to configure it)")
    freeze = True if m.vlm is None else m.vlm.freeze_vision
    frozen_dtype = torch.bfloat16 if m.lora is not None and m.dtype == "bfloat16" else torch.float32
    compute_dtype = torch.bfloat16 if m.dtype == "bfloat16" else None
    shard = (lambda model: shard_model(model, env, param_dtype=compute_dtype)) if env is not None else (lambda x: x)
    reduce = (lambda t: all_reduce(t, env)) if env is not None else None
    if m.name_or_path in TINY_MODELS:
        from vlm_sft.model import build_model as build_random

        torch.manual_seed(cfg.train.seed)
        model = build_random(
            tiny_model_config(cfg), dtype=torch.float32, freeze_vision=freeze, device=device, **_backend_kwargs(cfg)
        )
        if m.lora is not None:
            _attach_lora(cfg, model, frozen_dtype)
            _init_lora(cfg, model, None)
        return shard(model)
    return _load_checkpoint_model(
        cfg, device, shard, reduce, freeze=freeze, frozen_dtype=frozen_dtype, resuming=resuming
    )


def _backend_kwargs(cfg: RunConfig) -> dict[str, Any]:
    m = cfg.model
    return {
        "attn_impl": m.attn_impl,
        "linear_attn_impl": m.linear_attn_impl,
        "loss_impl": m.loss_impl,
        "experts_impl": m.experts_impl,
        "activation_checkpointing": m.activation_checkpointing,
    }


def _load_checkpoint_model(cfg, device, shard, reduce, *, freeze, frozen_dtype, resuming) -> torch.nn.Module:
    """Meta build -> LoRA wrap -> shard -> materialize -> read this rank's slices (``vlm_sft.checkpoint.load``)."""
    from vlm_sft.checkpoint.hf_dir import CheckpointIndex
    from vlm_sft.checkpoint.load import load_model_config, load_weights, materialize, meta_model, plan_reads
    from vlm_sft.model.backends import resolve_backends

    path = checkpoint_path(cfg)
    kwargs = _backend_kwargs(cfg)
    checkpointing = kwargs.pop("activation_checkpointing")
    backends = resolve_backends(device, **kwargs)
    model = meta_model(load_model_config(path), backends, freeze_vision=freeze, activation_checkpointing=checkpointing)
    index = CheckpointIndex.open(path)
    plan_reads(model, index)  # a checkpoint that does not fit the model fails here, before any allocation
    if cfg.model.lora is not None:
        _attach_lora(cfg, model, frozen_dtype)
    model = shard(model)
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


def _attach_lora(cfg: RunConfig, model: torch.nn.Module, frozen_dtype: torch.dtype) -> None:
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
    """The adapters' values (the same fp32 draw on every rank and for every base dtype) and the frozen base's
    fingerprint, which each checkpoint saves and a resume checks (the trainer)."""
    from vlm_sft.model.lora import base_fingerprint, init_adapters

    init_adapters(model, cfg.train.seed + 1)
    model.base_fingerprint = base_fingerprint(model, reduce)


def resolve_output_dir(cfg: RunConfig) -> Path:
    return Path(cfg.train.output_dir)
