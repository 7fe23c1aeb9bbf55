"""A run's set-up: everything the loop needs between steps, built in order, each part agreed on by every rank.

``setup`` prepares the output folder, the processor and renderer (``data.build``), the data, the checkpoint to resume
from (its data position checked before the model is built), the mesh (``parallel.mesh``), the model (built and
parallelized, ``checkpoint.build``), the optimizer and schedule, the resumed state, the packing self-check
(``checks.self_check``), the data pipelines and the metrics, and returns them as one ``Run``. The loop
(``trainer.loop``) and the dry run (``trainer.dry_run``) both start from it.
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from vlm_sft.checkpoint import build
from vlm_sft.checkpoint.hf_dir import CheckpointIndex
from vlm_sft.checkpoint.state import TrainerState, load_checkpoint, read_trainer_state, resolve_resume, restore_rng
from vlm_sft.config import ConfigError, RunConfig
from vlm_sft.cpu_threads import set_cpu_threads
from vlm_sft.data import build as data_build
from vlm_sft.data.batch import PackedBatch
from vlm_sft.parallel.collectives import all_ranks_or_none
from vlm_sft.parallel.context_parallel import NO_CP, ContextParallel
from vlm_sft.parallel.env import DistEnv, cleanup, elastic_restart, init_distributed
from vlm_sft.parallel.failure import FailureBoard, stop_peers
from vlm_sft.parallel.mesh import build_mesh
from vlm_sft.parallel.parallelize import vision_tower
from vlm_sft.trainer.batches import (
    DataLayout,
    TrainBatches,
    check_data_settings,
    check_position,
    count_steps,
    dealt_workers,
    resolve_num_workers,
    warn_small_streams,
)
from vlm_sft.trainer.data_accounting import RunAccounting
from vlm_sft.trainer.evaluate import build_eval_batches
from vlm_sft.trainer.generation import GenerationPrompt, generation_prompts
from vlm_sft.trainer.metrics import MetricsLogger, ModuleTimer, StepTimer
from vlm_sft.trainer.nonfinite import NonFiniteGuard
from vlm_sft.trainer.optim import build_optimizer, build_scheduler, follow_configured_lr
from vlm_sft.trainer.router_balance import RouterBalance
from vlm_sft.trainer.scored_eval import ScoredPrompt, scored_eval_prompts

logger = logging.getLogger(__name__)


@dataclass(kw_only=True)
class Run:
    """Everything one training run holds between steps (built by ``setup``, by keyword)."""

    cfg: RunConfig
    env: DistEnv
    out_dir: Path
    processor: Any
    sources: data_build.DataSources
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any
    train_batches: TrainBatches
    accounting: RunAccounting
    eval_batches: list[PackedBatch]
    metrics: MetricsLogger
    total_steps: int
    step: int = 0
    compute_dtype: torch.dtype | None = None
    """bf16 for bf16 runs (FSDP's param dtype), None for fp32."""
    balance: RouterBalance | None = None
    """MoE runs: the step-global load-balancing loss and routing metrics (None: dense)."""
    cp: ContextParallel = NO_CP
    """This rank's context-parallel group (``train.cp_size``; ``NO_CP`` without)."""
    weights_source: CheckpointIndex | None = None
    """The HF checkpoint the run started from (None: a random-init preset): the export writes each tensor in its
    dtype and copies its ``mtp.*`` head back."""
    generation: list[GenerationPrompt] = field(default_factory=list)
    """Held-out prompts every eval answers by generation (``train.eval_generate``; the same on every rank)."""
    scored: dict[str, list[ScoredPrompt]] = field(default_factory=dict)
    """Per scored held-out source (``metric``), the prompts every eval asks and scores (``trainer.scored_eval``)."""
    resumed_from: Path | None = None
    """The checkpoint the run resumed from (None: a fresh start)."""
    guard: NonFiniteGuard = field(default_factory=lambda: NonFiniteGuard(3))
    """Non-finite steps skipped and the run of them (``trainer.nonfinite``; ``train.max_nonfinite_steps``)."""
    timer: StepTimer = field(init=False)
    vision_timer: ModuleTimer = field(init=False)

    def __post_init__(self) -> None:
        self.timer = StepTimer(self.env.device)
        # The vision tower's share of each forward (it runs once per forward, on a dummy image when there is none).
        self.vision_timer = ModuleTimer(vision_tower(self.model), self.env.device)


CPU_COLLECTIVE_TIMEOUT_S = 600.0
GPU_COLLECTIVE_TIMEOUT_S = 1800.0


def collective_timeout_s(train: Any) -> float:
    """``train.collective_timeout_s``, or its default for the device the run will use."""
    if train.collective_timeout_s is not None:
        return float(train.collective_timeout_s)
    gpu = train.device == "cuda" or (train.device == "auto" and torch.cuda.is_available())
    return GPU_COLLECTIVE_TIMEOUT_S if gpu else CPU_COLLECTIVE_TIMEOUT_S


@contextmanager
def running(cfg: RunConfig) -> Iterator[Run]:
    """The set-up run of this process (every rank enters this), joined to the job's process group; on the way out,
    also after a failure (in the set-up too), the data workers end, the run's tracker runs end and the process leaves
    the group (after a barrier only when the block finished: a failed rank's peers may never reach it)."""
    env = init_distributed(cfg.train.device, timeout_s=collective_timeout_s(cfg.train))
    board = FailureBoard.for_process_group(env.rank, env.world_size, attempt=elastic_restart() or 0)
    if board is not None:
        board.start()
    finished = False
    try:
        with ExitStack() as opened:  # what the set-up started (data workers, metrics), ended in reverse order
            try:
                yield setup(cfg, env, opened)
            except BaseException as err:  # tell the peers first (unless they know): none waits for the timeout
                stop_peers(board, err)
                raise
        finished = True
    finally:
        if board is not None:
            board.stop()
        cleanup(env, finished=finished)


def setup(cfg: RunConfig, env: DistEnv, opened: ExitStack) -> Run:
    """Data, model (self-checked, then sharded), optimizer and schedule, resumed state, batches and metrics; what
    must end with the run (the data workers, the metrics' trackers) is pushed on ``opened`` as soon as it starts, so
    an error later in the set-up ends it too (a data worker left running kept a failed run from exiting)."""
    out_dir = Path(cfg.train.output_dir)
    torch.manual_seed(cfg.train.seed)
    with all_ranks_or_none(env, "preparing the run (config, processor, data)"):
        processor, renderer = _prepare(cfg, env, out_dir)
    with all_ranks_or_none(env, "loading the data"):
        sources = data_build.load_sources(cfg)
        # Refuse to train on tokens the checkpoint's template would not give, or that its server would not prompt.
        data_build.check_served_template(cfg, processor, renderer, sources.train, warn=env.is_main)
    # Checked against its manifest before anything of it is read: a collective (every rank hashes its share of the
    # files), with its own agreements inside; `latest` falls back to the newest intact checkpoint.
    resume_from = resolve_resume(cfg.train.resume, out_dir, env=env)
    # A collective: every rank, outside the agreements.
    mesh = build_mesh(env, cp_size=cfg.train.cp_size, ep_size=cfg.train.ep_size)
    # The data's global streams, and which this rank reads (a CP group shares its rows: its data-parallel rank's).
    layout = DataLayout(
        mesh.dp_rank, mesh.dp_size, cfg.train.micro_batches, cfg.data.streams_per_micro_batch, mesh.dims.cp
    )
    num_workers = resolve_num_workers(cfg.data.num_workers, log=env.is_main)
    if env.device.type == "cpu":  # one thread count whatever the launcher; each data worker holds a core
        workers = dealt_workers(num_workers, len(layout.cycle()))
        set_cpu_threads(cfg.train.cpu_threads, data_workers=workers, log=env.is_main)
    saved = None if resume_from is None else read_trainer_state(resume_from, env=env)  # read once, used throughout
    pipelines = data_build.TrainPipelines(cfg, sources.train, renderer)
    if saved is not None:  # a resume that cannot continue exactly is refused before the model is built
        with all_ranks_or_none(env, f"checking {resume_from} against this run"):
            check_position(saved.data, layout)
            check_data_settings(saved.data, pipelines, layout)
    resuming = resume_from is not None
    with all_ranks_or_none(env, "building the model"):
        # Parallelized as it is built (LoRA, checkpointing, CP, FSDP): a checkpoint is read slice by slice into each
        # rank's shards (build.build_model).
        model = build.build_model(cfg, env.device, env=env, mesh=mesh, resuming=resuming)
        balance = RouterBalance.for_model(model, cfg.model.router_aux_loss_coef, log=env.is_main)
    pad_id = int(processor.tokenizer.pad_token_id)
    compute_dtype = torch.bfloat16 if cfg.model.dtype == "bfloat16" else None
    model.train()
    if env.is_main and sources.train_rows is not None:
        warn_small_streams(sources.train_rows, layout, cfg.data.bfd_buffer, cfg.data.packing)
    total_steps = cfg.train.max_steps or count_steps(pipelines, layout, env, cfg.train.epochs)
    optimizer = build_optimizer(model, cfg.train)
    scheduler = build_scheduler(optimizer, cfg.train, total_steps)
    step, data_state = _resume(cfg, env, resume_from, saved, model, optimizer, scheduler)
    if cfg.train.check_packing:  # on the weights the run trains from (resumed ones included)
        _self_check(cfg, env, out_dir, model, renderer, sources, pad_id)
    with all_ranks_or_none(env, "starting the data pipelines and the metrics"):
        train_batches = TrainBatches(
            pipelines, layout, pad_id=pad_id, spatial_merge_size=model.config.vision_config.spatial_merge_size,
            num_workers=num_workers, prefetch=cfg.data.prefetch_packs, state=data_state,
            pin_memory=env.device.type == "cuda", log=env.is_main,
        )  # fmt: skip
        opened.callback(train_batches.close)  # its workers start now
        eval_batches = build_eval_batches(cfg, sources, renderer, env, pad_id)
        generation = generation_prompts(cfg, sources, renderer)
        scored = scored_eval_prompts(cfg, sources, renderer)
        metrics = MetricsLogger(
            out_dir,
            enabled=env.is_main,
            total_steps=total_steps,
            start_step=step,
            report_to=list(cfg.train.report_to),
            run_config=cfg.to_dict(),
            run_name=cfg.train.run_name,
            project=cfg.train.project,
            tracker_state=saved.trackers if saved is not None else None,  # continue the tracker runs
        )
        opened.callback(metrics.close)
    weights = {e.label: e.weight for e in cfg.data.sources}
    accounting = RunAccounting(out_dir, env, train_batches, replica=mesh.cp.rank > 0, weights=weights)
    return Run(
        cfg=cfg, env=env, out_dir=out_dir, processor=processor, sources=sources, model=model, optimizer=optimizer,
        scheduler=scheduler, train_batches=train_batches, accounting=accounting, eval_batches=eval_batches,
        metrics=metrics, total_steps=total_steps, step=step, compute_dtype=compute_dtype, balance=balance, cp=mesh.cp,
        weights_source=build.weights_source(cfg), generation=generation, scored=scored, resumed_from=resume_from,
        guard=_guard(cfg, sources, saved),
    )  # fmt: skip


def _guard(cfg: RunConfig, sources: data_build.DataSources, saved: TrainerState | None) -> NonFiniteGuard:
    """The non-finite guard, continuing a resumed run's count; it names a mixture's sources in its reports."""
    mixture = [p.name for p in sources.train.parts] if isinstance(sources.train, data_build.MixedSources) else []
    skipped = saved.nonfinite_steps if saved is not None else 0
    return NonFiniteGuard(cfg.train.max_nonfinite_steps, skipped, sources=tuple(mixture))


def _prepare(cfg: RunConfig, env: DistEnv, out_dir: Path) -> tuple[Any, Any]:
    """The rank-local start: settings checked against this machine, processor and renderer, shapes data written."""
    if cfg.model.dtype == "bfloat16" and env.device.type != "cuda":
        raise ConfigError(
            f"model.dtype = 'bfloat16' but this run is on {env.device} (no CUDA device): bf16 is only used on "
            "CUDA; set model.dtype = 'float32' for CPU runs"
        )
    if env.is_main:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "config.json").write_text(cfg.model_dump_json(indent=2))
    processor = data_build.build_processor(cfg)
    renderer = data_build.build_renderer(cfg, processor)
    if env.is_main:  # a progress bar only where someone watches it, not in a job's log file
        data_build.materialize_data(cfg, progress=sys.stderr.isatty())
    return processor, renderer


def _self_check(cfg: RunConfig, env: DistEnv, out_dir: Path, model, renderer, sources, pad_id: int) -> None:
    """The packing self-check on a slice of the sharded model (``checks.slice``): every rank joins the slice's
    gathers (so the call is outside ``all_ranks_or_none``: it holds collectives and agreements of its own), rank 0
    checks; all ranks stop on failure."""
    from vlm_sft.checks.self_check import run_packing_check

    report = run_packing_check(cfg, model=model, renderer=renderer, source=sources.train, pad_id=pad_id, env=env)
    with all_ranks_or_none(env, "writing the packing self-check's report"):
        if env.is_main:
            (out_dir / "packing_check.json").write_text(json.dumps(report.to_dict(), indent=2) + "\n")
            logger.info("packing self-check:\n%s", report.format())
            if not report.ok:  # the table was just logged and is in packing_check.json: do not print it twice
                raise RuntimeError(f"packing self-check failed (table above; {out_dir / 'packing_check.json'})")


def _resume(
    cfg: RunConfig, env: DistEnv, resume_from: Path | None, saved: TrainerState | None, model, optimizer, scheduler
) -> tuple[int, dict | None]:
    """Restore model, optimizer, schedule and RNG from ``resume_from`` (its trainer state ``saved`` was read and its
    data position checked in ``setup``, before the model was built); (step, global data position). A LoRA run's
    frozen base is checked before the DCP load, so a refused resume reads no weights. Any number of processes
    resumes: DCP reshards, the position is global."""
    if resume_from is None:
        return 0, None
    lora = cfg.model.lora is not None
    with all_ranks_or_none(env, f"checking {resume_from}'s frozen base against this run"):
        base = getattr(model, "base_fingerprint", None)
        if lora and saved.base_fingerprint != base:
            raise ConfigError(
                f"{resume_from} holds adapters trained on another frozen base (fingerprint {saved.base_fingerprint}, "
                f"this run built {base}): resume with the model.name_or_path, revision and model.dtype it was "
                "trained with"
            )
    state = load_checkpoint(resume_from, model=model, optimizer=optimizer, env=env, trainable_only=lora, state=saved)
    scheduler.load_state_dict(state.scheduler)
    follow_configured_lr(cfg.train.lr, optimizer, scheduler, log=env.is_main)
    restore_rng(state.rng)
    return state.step, state.data
