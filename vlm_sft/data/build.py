"""From a ``RunConfig`` to the data side of a run: processor, renderer, data sources and packing pipelines.

The trainer, the data report (``python -m vlm_sft.report``), the packing check (``python -m vlm_sft.check_packing``),
the benchmarks and the notebooks all build through here, so they see exactly the same samples and packs. The model
side of a run is ``vlm_sft.checkpoint.build``'s.
"""

from __future__ import annotations

import dataclasses
import logging
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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
from renderers.video import VideoSettings
from vlm_sft.config import SHAPES_DATASET, TINY_MODELS, ConfigError, RowFormat, RunConfig, Scoring, SourceConfig
from vlm_sft.data.image_roots import ImageRoots
from vlm_sft.data.mixture import ConcatSource, Mixture, MixturePart
from vlm_sft.data.pipeline import IndexOrder, PackingPipeline
from vlm_sft.data.schemas import RowConverter, RowMapping, Schema, SchemaError, detect_schema
from vlm_sft.data.served_video import check_served_video
from vlm_sft.data.shapes import materialize_shapes
from vlm_sft.data.snapshots import SnapshotError
from vlm_sft.data.sources import (
    ConversationSource,
    RowRenderFn,
    hub_cache_roots,
    load_conversations,
    local_path,
    render_fn,
)
from vlm_sft.data.streaming import StreamingRows, local_files, open_stream

logger = logging.getLogger(__name__)


def build_processor(cfg: RunConfig) -> Any:
    """The tiny offline processor for the tiny presets, else the checkpoint's own (no torchvision needed), with its
    chat template's ``enable_thinking`` default set to ``data.enable_thinking`` where it differs and its video
    processor set to the ``data.video_*`` settings: the run's processor is the one its checkpoints save, so a server
    calling their template with no arguments prompts, and samples videos, the way the run trained
    (``renderers.served``)."""
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
    settings = video_settings(cfg, processor)
    if settings != VideoSettings.from_processor(processor.video_processor.to_dict()):
        logger.info("video: %s in this run's checkpoints (data.video_*)", settings)
        settings.apply_to(processor.video_processor)
    return processor


def build_renderer(cfg: RunConfig, processor: Any):
    return get_renderer(
        processor,
        loss_on=cfg.data.loss_on,
        special_text=cfg.data.special_text,
        enable_thinking=cfg.data.enable_thinking,
    )


def video_settings(cfg: RunConfig, processor: Any) -> VideoSettings:
    """The checkpoint's video processor settings with the run's ``data.video_*`` overrides (``build_processor``
    writes them into the run's processor, which the renderer reads)."""
    data, base = cfg.data, VideoSettings.from_processor(processor.video_processor.to_dict())
    changes = {"fps": data.video_fps, "min_frames": data.video_min_frames, "max_frames": data.video_max_frames}
    changes |= {"max_pixels": data.video_max_pixels, "min_pixels": data.video_min_pixels}
    if data.video_max_frame_tokens is not None:
        changes |= {"cap_pixels_per_frame": True, "max_video_tokens": data.video_max_frame_tokens}
    try:
        return dataclasses.replace(base, **{k: v for k, v in changes.items() if v is not None})
    except ValueError as e:
        raise ConfigError(f"data.video_*: {e} (the checkpoint's video processor gives {base})") from e


THINKING_PROBE_ROWS = 256
"""Training rows ``check_served_template`` reads to compare the data's replies with ``data.enable_thinking``."""


def check_served_template(cfg: RunConfig, processor: Any, renderer: Any, source: Any, *, warn: bool = True) -> None:
    """Refuse to train on tokens the checkpoint would not serve, and say when the data disagrees with the mode.

    The renderer must equal the processor (``check_template_parity``), and a server calling the template the run
    saves with no arguments must prompt exactly the tokens the run trains before each probe's last reply
    (``check_served_prompt``; a video's, ``check_served_video``). Then (``warn``) the last replies of the first
    ``THINKING_PROBE_ROWS`` rows: mostly reasoning in a non-thinking run, or none in a thinking one, is a warning
    naming the setting (streamed sources are not read)."""
    check_template_parity(renderer, processor)
    for probe in served_probes(cfg.data.enable_thinking):
        check_served_prompt(renderer, processor, probe)
    check_served_video(renderer, processor)
    prepared = [p.source for p in source.parts] if isinstance(source, MixedSources) else [source]
    prepared = [s for s in prepared if not isinstance(s, StreamedSource) and len(s)]
    if not warn or not prepared:
        return
    probes = [(s, i) for s in prepared for i in range(min(len(s), THINKING_PROBE_ROWS // len(prepared)))]
    reasoning = sum(_reasons(s, i) for s, i in probes)
    if not cfg.data.enable_thinking and reasoning > len(probes) / 2:
        logger.warning(
            "%d of the first %d training rows end in a reply with reasoning, but data.enable_thinking = false: the "
            "saved template's default prompt closes the think block, so served the default way the model is never "
            "asked to reason; set data.enable_thinking = true for reasoning data",
            reasoning,
            len(probes),
        )
    elif cfg.data.enable_thinking and reasoning == 0:
        logger.warning(
            "none of the first %d training rows ends in a reply with reasoning, but data.enable_thinking = true: the "
            "saved template's default prompt opens a think block the data never fills; set data.enable_thinking = "
            "false for data without reasoning",
            len(probes),
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
    """Local parquet / jsonl file, folder of shards or hub snapshot, or a hub dataset id."""
    split: str
    """Split of a hub dataset or snapshot."""
    images: ImageRoots
    """Where its images may be read from (by default the data folder; for a hub dataset its caches)."""
    subset: str | None = None
    """Subset (``datasets`` config name) of a hub dataset or snapshot."""
    schema: Schema | None = None
    """How its rows are read, recognised from the first row (None: per row)."""
    files: str = "streamed"
    """How its files were found, for the start log."""

    @classmethod
    def open(
        cls,
        path: str,
        *,
        split: str,
        subset: str | None,
        mapping: RowMapping,
        image_root: str | None,
        allowed_image_roots: tuple[str, ...],
    ) -> StreamedSource:
        """Checks the local files and reads the first row now (a missing file, subset or column is an error at
        start-up, not in a data worker)."""
        files = local_files(path, subset=subset, split=split)
        allowed = tuple(allowed_image_roots)
        if files is None:
            root, allowed = image_root, allowed + hub_cache_roots(None)
            kwargs = {"name": subset} if subset else {}
        else:
            folder = Path(path).expanduser()
            root = image_root or str(folder if folder.is_dir() else folder.parent)
            kwargs = {}
        stream = open_stream(path, split=split, files=files, load_kwargs=kwargs).decode(False)  # video: no torchcodec
        first = next(iter(stream), None)
        if first is None:
            raise ValueError(f"{path}: no rows")
        schema = detect_schema(first.keys(), mapping, name=path)
        how = "hub dataset" if files is None else f"{len(files[1])} file(s)"
        return cls(path, split, ImageRoots(root, allowed), subset, schema, f"streamed, {how}")


@dataclass(frozen=True)
class MixedSource:
    """One source of a training mixture, loaded."""

    name: str
    weight: float
    source: ConversationSource | StreamedSource


@dataclass(frozen=True)
class MixedSources:
    """The training sources of a mixture (``[[data.sources]]``), in config order; packed by ``Mixture``."""

    parts: tuple[MixedSource, ...]

    @property
    def weights(self) -> dict[str, float]:
        return {p.name: p.weight for p in self.parts}

    @property
    def rows(self) -> int | None:
        """Rows of all sources (one epoch's draws), or None when a source is streamed."""
        if any(isinstance(p.source, StreamedSource) for p in self.parts):
            return None
        return sum(len(p.source) for p in self.parts)


@dataclass(frozen=True)
class DataSources:
    """Training and held-out conversations, with the eval task of each held-out row when the data has one."""

    train: ConversationSource | StreamedSource | MixedSources
    """Training rows (read while training with ``data.streaming``), or a mixture of sources."""
    eval: ConversationSource | ConcatSource | None
    """Held-out rows (of every ``[[data.eval_sources]]`` source, one after the other), or None when the config
    names none."""
    eval_tasks: dict[int, str]
    """Held-out row index -> task name (``task`` column), for per-task accuracy; empty when absent."""
    eval_groups: dict[int, str] = dataclasses.field(default_factory=dict)
    """Held-out row index -> source name with ``[[data.eval_sources]]`` (scored per source); empty otherwise."""
    scored: tuple[tuple[SourceConfig, ConversationSource], ...] = ()
    """The held-out sources that set a ``metric``, each with its table (``trainer.scored_eval``)."""

    @property
    def train_rows(self) -> int | None:
        """Training rows (of all sources of a mixture), or None when streamed."""
        if isinstance(self.train, MixedSources):
            return self.train.rows
        return None if isinstance(self.train, StreamedSource) else len(self.train)


def materialize_data(cfg: RunConfig, *, progress: bool = True) -> dict[str, Path] | None:
    """Write the generated shapes dataset when the config uses it (idempotent; one process at a time: in a
    distributed run rank 0 does it before the others load). Returns its jsonl paths, or None for other sources."""
    d = cfg.data
    if not d.uses_shapes:
        return None
    s = d.shapes
    sizes = {"seed": s.seed, "image_size": s.image_size, "video_share": s.video_share}
    return materialize_shapes(s.root, num_train=s.num_train, num_eval=s.num_eval, **sizes, progress=progress)


def load_sources(cfg: RunConfig) -> DataSources:
    """Load the configured data (for ``shapes``, written first if it is not there yet). A source that cannot be
    opened, or has no rows, is a ``ConfigError`` naming it, raised before any model is built."""
    d = cfg.data
    shapes = materialize_data(cfg, progress=False)
    if d.sources:
        train = MixedSources(tuple(MixedSource(e.label, e.weight, _open(cfg, e, shapes)) for e in d.sources))
        _log_mixture(train)
    else:
        train = _open(cfg, one_source_table(cfg, d.source, "train"), shapes)
    tables = held_out_tables(cfg)
    parts = [(table, _open(cfg, table, shapes, held_out=True)) for table in tables]
    if d.eval_sources:
        held = ConcatSource([(table.label, source) for table, source in parts])
    else:
        held = parts[0][1] if parts else None
    task_column = held.column("task") if held is not None else None
    tasks = {i: str(t) for i, t in enumerate(task_column or []) if t is not None}
    groups = {i: held.source_of(i)[0] for i in range(len(held))} if isinstance(held, ConcatSource) else {}
    scored = tuple((table, source) for table, source in parts if table.metric is not None)
    sources = DataSources(train=train, eval=held, eval_tasks=tasks, eval_groups=groups, scored=scored)
    rows = "streamed" if sources.train_rows is None else str(sources.train_rows)
    where = "a mixture of " + ", ".join(p.name for p in train.parts) if isinstance(train, MixedSources) else d.source
    logger.info("data: %s training rows from %s, %d held-out", rows, where, len(held) if held else 0)
    return sources


def held_out_tables(cfg: RunConfig) -> list[SourceConfig]:
    """The held-out sources of the config as tables (never streamed): each ``[[data.eval_sources]]`` table, or
    ``data.eval_source`` (the shapes dataset's eval split when it trains on shapes) with ``[data]``'s settings."""
    d = cfg.data
    if d.eval_sources:
        return [e.model_copy(update={"streaming": False}) for e in d.eval_sources]
    if d.eval_source is not None or (d.source == SHAPES_DATASET and not d.sources and d.shapes.num_eval):
        return [one_source_table(cfg, d.eval_source or SHAPES_DATASET, "eval", streaming=False)]
    if d.metric is not None:
        raise ConfigError("data.metric is set but the run has no held-out data: set data.eval_source")
    return []


def open_held_out(cfg: RunConfig, table: SourceConfig) -> ConversationSource:
    """One held-out source (``vlm_sft.evaluate`` opens the tables it scores; shapes written first if needed)."""
    shapes = materialize_data(cfg, progress=False) if table.source == SHAPES_DATASET else None
    return _open(cfg, table, shapes, held_out=True)


def _open(
    cfg: RunConfig, entry: SourceConfig, shapes: dict[str, Path] | None, *, held_out: bool = False
) -> ConversationSource | StreamedSource:
    """One source of the config (``data.source`` as a one-table mixture, or a ``[[data.sources]]`` table)."""
    d = cfg.data
    path = entry.source
    if path == SHAPES_DATASET:
        path = str(shapes["eval" if held_out else "train"])
    split = entry.split or d.split
    settings = {
        "split": split,
        "subset": entry.subset,
        "mapping": RowMapping.from_settings(entry.model_dump()),
        "image_root": entry.image_root or d.image_root,
        "allowed_image_roots": (*d.allowed_image_roots, *entry.allowed_image_roots),
    }
    streaming = d.streaming if entry.streaming is None else entry.streaming
    what = f"{_what(cfg, entry, held_out)} ({entry.source})"
    empty = ConfigError(f"{what} has no rows; fill it or remove its table")
    try:
        local = local_path(path)
        if local is not None and local.is_file() and local.stat().st_size == 0:  # ``datasets``: "no data!"
            raise empty
        if streaming and entry.source != SHAPES_DATASET:
            source = StreamedSource.open(path, **settings)
        else:
            source = load_conversations(path, **settings)
    except (SchemaError, SnapshotError) as err:  # our own messages name what exists and the fix
        raise ConfigError(f"{what}: {err}") from err
    except ConfigError:
        raise
    except Exception as err:  # a missing file, an unknown hub id, an unreadable format: name the source
        raise ConfigError(f"{what} cannot be read: {type(err).__name__}: {err}") from err
    if not isinstance(source, StreamedSource) and not len(source):
        raise empty
    logger.info("data: %s read as %s; %s", what, source.schema.describe(), source.files)
    return source


def one_source_table(cfg: RunConfig, source: str, name: str, **update: Any) -> SourceConfig:
    """``data.source`` / ``data.eval_source`` as the one table of a mixture, with ``[data]``'s mapping and scoring,
    and its subset where ``source`` is ``data.source`` itself (held-out rows in another file have no subset of their
    own)."""
    settings = cfg.data.model_dump(include={*RowFormat.model_fields, *Scoring.model_fields})
    if source != cfg.data.source:
        settings["subset"] = None
    return SourceConfig(source=source, name=name, **settings, **update)


def source_schemas(sources: DataSources) -> dict[str, str]:
    """Each training source's name and the schema it was read as (``Schema.describe``), for the data report."""
    if isinstance(sources.train, MixedSources):
        parts = [(p.name, p.source) for p in sources.train.parts]
    else:
        parts = [("train", sources.train)]
    return {name: s.schema.describe() if s.schema else "recognised per row" for name, s in parts}


def _what(cfg: RunConfig, entry: SourceConfig, held_out: bool) -> str:
    """How an error names a source: its table's name in a mixture, else the setting."""
    if cfg.data.sources or cfg.data.eval_sources:
        return f"data source {entry.label!r}"
    return f"data.{'eval_' if held_out else ''}source"


def _log_mixture(mixture: MixedSources) -> None:
    """What one epoch of the mixture reads of each source (``vlm_sft.data.mixture``: epochs)."""
    total_weight = sum(p.weight for p in mixture.parts)
    epoch = mixture.rows
    for p in mixture.parts:
        share = p.weight / total_weight
        if isinstance(p.source, StreamedSource):
            passes = "streamed"
        elif epoch is None:
            passes = f"{len(p.source)} rows (a streamed source in the mix: no epochs)"
        else:
            passes = f"{len(p.source)} rows, {share * epoch / len(p.source):.2f} passes per epoch"
        logger.info("data: source %r: weight %g (%.1f%% of the samples), %s", p.name, p.weight, 100 * share, passes)


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
        if sample.multi_modal_data is not None and not self.has_vlm:
            raise ConfigError(
                f"sample {index} has {sample.num_images} image(s) and {sample.num_videos} video(s) but the config has "
                "no [model.vlm] section; "
                "add [model.vlm] (freeze_vision = true keeps the tower fixed)"
            )
        return sample


def build_pipeline(
    cfg: RunConfig,
    source: ConversationSource | StreamedSource | MixedSources,
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
    order, source_of = None, None
    if isinstance(source, MixedSources):
        order = _mixture(cfg, source, renderer, shard=shard, num_shards=num_shards, shuffle=shuffle)
        render, source_of = order, order.source_of
    elif isinstance(source, StreamedSource):
        order = render = _streamed(
            cfg, source, renderer, shard=shard, num_shards=num_shards, shuffle=shuffle, seed=cfg.train.seed
        )
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
        source_of=source_of,
    )


def _streamed(
    cfg: RunConfig, source: StreamedSource, renderer: Any, *, shard: int, num_shards: int, shuffle: bool, seed: int
) -> StreamingRows:
    convert = RowRenderFn(RowConverter(source.schema, source.images), renderer)
    return StreamingRows(
        source.path, row_to_sample=convert, shard=shard, num_shards=num_shards, split=source.split,
        subset=source.subset, shuffle_files=shuffle, seed=seed,
    )  # fmt: skip


def _mixture(
    cfg: RunConfig, mixture: MixedSources, renderer: Any, *, shard: int, num_shards: int, shuffle: bool
) -> Mixture:
    """Data stream ``shard`` of ``num_shards`` of a mixture: every source's share for this stream, each in its own
    order (seeded by the run's seed and the source's name, so adding a source leaves the others' orders alone)."""
    parts = []
    for p in mixture.parts:
        seed = cfg.train.seed + zlib.crc32(p.name.encode())
        if isinstance(p.source, StreamedSource):
            rows = _streamed(cfg, p.source, renderer, shard=shard, num_shards=num_shards, shuffle=shuffle, seed=seed)
            parts.append(MixturePart(p.name, p.weight, rows, rows, None))
        else:
            order = IndexOrder(len(p.source), shuffle=shuffle, seed=seed, rank=shard, world_size=num_shards)
            parts.append(MixturePart(p.name, p.weight, order, render_fn(p.source, renderer), len(p.source)))
    return Mixture(parts, seed=cfg.train.seed, stream=shard, streams=num_shards)


@dataclass(frozen=True)
class TrainPipelines:
    """``(stream, streams) -> pipeline`` of the training data: stream ``stream`` of ``streams`` is pipeline shard
    ``stream`` of ``streams`` (picklable: data workers build their own). The streams are global, the same for any
    number of ranks and workers; which rank reads which is ``trainer.batches.DataLayout``'s business."""

    cfg: RunConfig
    source: ConversationSource | StreamedSource | MixedSources
    renderer: Any
    epochs: int | None = None
    """Passes before the stream ends (None: forever, as in training; counting the steps of an epochs-run sets it)."""

    def __call__(self, stream: int, streams: int) -> PackingPipeline:
        return build_pipeline(
            self.cfg, self.source, self.renderer, shard=stream, num_shards=streams, epochs=self.epochs,
            check_skips=True,
        )  # fmt: skip
