"""The training loop: set-up, one training step, eval and checkpoints, with exact loss normalization.

One optimizer step equals one big batch: every rank draws ``micro_batches`` packs, the trainable-token count of all
of them on all ranks is all-reduced *before* any backward, and each micro-batch's loss sum is scaled by
``world_size / global_count``. FSDP averages gradients over ranks (a division by ``world_size``), so the update is
exactly ``d(sum of token losses) / d(params) / global_count``, however the tokens were split across ranks and
micro-batches. Gradients are reduce-scattered once per step, after the last micro-batch's backward.

Context parallelism (``train.cp_size``) keeps this exact: the ranks of a CP group hold the same rows, each trains on
its own shard of their tokens and counts only that shard (``step_batches.shard_counts``), so the global count
counts every token once; the group's gradients are then summed, not averaged, by the same ``world_size / count``
scale under FSDP2's average over every rank (the model needs no extra reduction over the CP group).

Collectives follow the rules in ``distributed.py``: the step's one control-plane all-reduce (failure flag, end of
data, token counts) runs on host tensors before the first forward, and every rank-local section (loading data,
files written on rank 0, the packing self-check) is followed by an agreement, so one rank's failure stops all ranks.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from vlm_sft.checkpoint.export import export_final
from vlm_sft.checkpoint.hf_dir import CheckpointIndex
from vlm_sft.checkpoint.state import (
    TrainerState,
    capture_rng,
    load_checkpoint,
    read_trainer_state,
    resolve_resume,
    restore_rng,
    save_checkpoint,
)
from vlm_sft.config import ConfigError, RunConfig
from vlm_sft.cpu_threads import set_cpu_threads
from vlm_sft.data.batch import PackedBatch
from vlm_sft.flops import mfu, peak_flops
from vlm_sft.model.context_parallel import NO_CP, ContextParallel
from vlm_sft.trainer import build
from vlm_sft.trainer.batches import (
    DataLayout,
    TrainBatches,
    check_position,
    count_steps,
    dealt_workers,
    resolve_num_workers,
    warn_small_streams,
)
from vlm_sft.trainer.data_accounting import RunAccounting
from vlm_sft.trainer.distributed import (
    DistEnv,
    all_ranks_or_none,
    all_reduce_sum,
    cleanup,
    context_parallel_groups,
    init_distributed,
    set_gradient_sync,
)
from vlm_sft.trainer.dry_run import run_dry
from vlm_sft.trainer.evaluate import build_eval_batches, evaluate, format_eval
from vlm_sft.trainer.generation import GenerationPrompt, evaluate_generation, generation_prompts
from vlm_sft.trainer.metrics import MetricsLogger, ModuleTimer, StepTimer, peak_memory_mb, step_breakdown
from vlm_sft.trainer.optim import build_optimizer, build_scheduler
from vlm_sft.trainer.router_balance import RouterBalance, StepRouting, routing_metrics
from vlm_sft.trainer.step_batches import StepBatches, next_step_batches

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RunResult:
    """What a finished run reports (on every rank)."""

    steps: int
    """Optimizer steps completed."""
    final_dir: Path | None
    """The HF checkpoint directory written at the end."""
    last_eval: dict
    """The last eval metrics (empty when the run had no eval data)."""
    wall_time_s: float
    """Seconds from start-up to the end of the final save."""
    real_tokens_per_s: float
    """Non-padding tokens processed per second of training steps (all ranks)."""
    data: dict
    """Sample accounting at the end (all ranks): seen, packed, skipped by reason, buffered, passes."""


@dataclass
class Run:
    """Everything one training run holds between steps (built by ``setup``)."""

    cfg: RunConfig
    env: DistEnv
    out_dir: Path
    processor: Any
    sources: build.DataSources
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
    timer: StepTimer = field(init=False)
    vision_timer: ModuleTimer = field(init=False)

    def __post_init__(self) -> None:
        self.timer = StepTimer(self.env.device)
        # The vision tower's share of each forward (it runs once per forward, on a dummy image when there is none).
        self.vision_timer = ModuleTimer(self.model.model.visual, self.env.device)


@dataclass(frozen=True)
class StepStats:
    """What one optimizer step reports."""

    loss_sum: torch.Tensor
    """This rank's summed token loss (CPU float64 scalar; all-reduce it for the global loss)."""
    grad_norm: float
    sections: dict[str, float]
    routing: torch.Tensor
    """MoE runs: this rank's router sums of the step (``StepRouting.flat``, CPU); empty for a dense model."""


# ------------------------------------------------------------------------------------------------------- set-up


def train(cfg: RunConfig, *, dry_run: bool = False) -> RunResult:
    """Run the configured job to its end; every rank calls this. The process group is left at exit.

    ``dry_run``: everything up to the first optimizer step exactly as training does it (checkpoint load, wrapping,
    sharding, the self-check, the data pipeline's first step of batches), then the memory report
    (``trainer.dry_run``) and no step, no checkpoint."""
    t_start = time.perf_counter()
    env = init_distributed(cfg.train.device)
    finished = False
    run = None
    try:
        run = setup(cfg, env)
        if dry_run:
            data = run_dry(run)
            finished = True
            return RunResult(0, None, {}, time.perf_counter() - t_start, 0.0, data)
        last_eval, train_time, real_tokens = run_steps(run)
        data = run.accounting.report(run.step, "end of the run")
        final_dir = export_final(run.out_dir / "final", run.model, run.processor, env, cfg, source=run.weights_source)
        finished = True
    finally:
        if run is not None:  # the tracker runs end with the run, also after a dry run or a failure
            run.metrics.close()
        cleanup(env, finished=finished)
    wall = time.perf_counter() - t_start
    tok_s = real_tokens / max(train_time, 1e-9)
    if env.is_main:
        logger.info(
            "done: %d steps in %.1f s (%.0f real tokens/s); final checkpoint %s", run.step, wall, tok_s, final_dir
        )
    return RunResult(run.step, final_dir, last_eval, wall, tok_s, data.to_dict())


def setup(cfg: RunConfig, env: DistEnv) -> Run:
    """Data, model (self-checked, then sharded), optimizer and schedule, resumed state, batches and metrics."""
    out_dir = Path(cfg.train.output_dir)
    torch.manual_seed(cfg.train.seed)
    with all_ranks_or_none(env, "preparing the run (config, processor, data)"):
        processor, renderer = _prepare(cfg, env, out_dir)
    with all_ranks_or_none(env, "loading the data"):
        sources = build.load_sources(cfg)
        # Refuse to train on tokens the checkpoint's template would not give, or that its server would not prompt.
        build.check_served_template(cfg, processor, renderer, sources.train, warn=env.is_main)
    with all_ranks_or_none(env, "finding the checkpoint to resume from"):
        resume_from = resolve_resume(cfg.train.resume, out_dir)
    cp, dp_rank, dp_size = context_parallel_groups(env, cfg.train.cp_size)
    # The data's global streams, and which this rank reads (a CP group shares its rows: its data-parallel rank's).
    layout = DataLayout(dp_rank, dp_size, cfg.train.micro_batches, cfg.data.streams_per_micro_batch, cfg.train.cp_size)
    num_workers = resolve_num_workers(cfg.data.num_workers, log=env.is_main)
    if env.device.type == "cpu":  # one thread count whatever the launcher; each data worker holds a core
        workers = dealt_workers(num_workers, len(layout.cycle()))
        set_cpu_threads(cfg.train.cpu_threads, data_workers=workers, log=env.is_main)
    saved = None if resume_from is None else read_trainer_state(resume_from, env=env)
    if saved is not None:  # a resume that cannot continue exactly is refused before the model is built
        with all_ranks_or_none(env, f"checking {resume_from} against this run"):
            check_position(saved.data, layout)
    resuming = resume_from is not None
    with all_ranks_or_none(env, "building the model"):
        # Sharded as it is built: a checkpoint is read slice by slice into each rank's shards (build.build_model).
        model = build.build_model(cfg, env.device, env=env, resuming=resuming)
        balance = RouterBalance.for_model(model, cfg.model.router_aux_loss_coef, log=env.is_main)
    pad_id = int(processor.tokenizer.pad_token_id)
    with all_ranks_or_none(env, "setting up context parallelism"):
        model.set_context_parallel(cp)
    compute_dtype = torch.bfloat16 if cfg.model.dtype == "bfloat16" else None
    model.train()
    pipelines = build.TrainPipelines(cfg, sources.train, renderer)
    if env.is_main and not isinstance(sources.train, build.StreamedSource):
        warn_small_streams(len(sources.train), layout, cfg.data.bfd_buffer, cfg.data.packing)
    total_steps = cfg.train.max_steps or count_steps(pipelines, layout, env, cfg.train.epochs)
    optimizer = build_optimizer(model, cfg.train)
    scheduler = build_scheduler(optimizer, cfg.train, total_steps)
    step, data_state = _resume(cfg, env, resume_from, saved, model, optimizer, scheduler)
    if cfg.train.check_packing:  # on the weights the run trains from (resumed ones included)
        _self_check(cfg, env, out_dir, model, renderer, sources, pad_id)
    with all_ranks_or_none(env, "starting the data pipelines and the metrics"):
        train_batches = TrainBatches(
            pipelines,
            layout,
            pad_id=pad_id,
            spatial_merge_size=model.config.vision_config.spatial_merge_size,
            num_workers=num_workers,
            prefetch=cfg.data.prefetch_packs,
            state=data_state,
            pin_memory=env.device.type == "cuda",
            log=env.is_main,
        )
        eval_batches = build_eval_batches(cfg, sources, renderer, env, pad_id)
        generation = generation_prompts(cfg, sources, renderer)
        metrics = MetricsLogger(
            out_dir,
            enabled=env.is_main,
            total_steps=total_steps,
            start_step=step,
            report_to=list(cfg.train.report_to),
            run_config=cfg.to_dict(),
            run_name=cfg.train.run_name,
            project=cfg.train.project,
            tracker_state=saved.extra.get("trackers") if saved is not None else None,  # continue the tracker runs
        )
    accounting = RunAccounting(out_dir, env, train_batches, replica=cp.rank > 0)
    return Run(
        cfg, env, out_dir, processor, sources, model, optimizer, scheduler, train_batches, accounting, eval_batches,
        metrics, total_steps, step, compute_dtype, balance, cp, build.weights_source(cfg), generation,
    )  # fmt: skip


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
    processor = build.build_processor(cfg)
    renderer = build.build_renderer(cfg, processor)
    if env.is_main:  # a progress bar only where someone watches it, not in a job's log file
        build.materialize_data(cfg, progress=sys.stderr.isatty())
    return processor, renderer


def _self_check(cfg: RunConfig, env: DistEnv, out_dir: Path, model, renderer, sources, pad_id: int) -> None:
    """The packing self-check on a slice of the sharded model (``trainer.check_slice``): every rank joins the slice's
    gathers (so the call is outside ``all_ranks_or_none``: it holds collectives and agreements of its own), rank 0
    checks; all ranks stop on failure."""
    from vlm_sft.trainer.self_check import run_packing_check

    report = run_packing_check(cfg, model=model, renderer=renderer, source=sources.train, pad_id=pad_id, env=env)
    with all_ranks_or_none(env, "writing the packing self-check's report"):
        if env.is_main:
            (out_dir / "packing_check.json").write_text(json.dumps(report.to_dict(), indent=2) + "\n")
            logger.info("packing self-check:\n%s", report.format())
            if not report.ok:  # the table was just logged and is in packing_check.json: do not print it twice
                raise RuntimeError(f"packing self-check failed (table above; {out_dir / 'packing_check.json'})")


def _resume(
    cfg: RunConfig, env: DistEnv, resume_from: Path | None, saved, model, optimizer, scheduler
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
        if lora and saved.extra.get("base") != base:
            raise ConfigError(
                f"{resume_from} holds adapters trained on another frozen base (fingerprint {saved.extra.get('base')}, "
                f"this run built {base}): resume with the model.name_or_path, revision and model.dtype it was "
                "trained with"
            )
    state = load_checkpoint(resume_from, model=model, optimizer=optimizer, env=env, trainable_only=lora)
    scheduler.load_state_dict(state.scheduler)
    restore_rng(state.rng)
    return state.step, state.data


# ------------------------------------------------------------------------------------------------ the steps


def run_steps(run: Run) -> tuple[dict, float, int]:
    """Steps until ``total_steps`` (or the data ends), with logging, evals and checkpoints; (last eval, train
    seconds, real tokens)."""
    cfg, env = run.cfg, run.env
    has_eval = run.sources.eval is not None  # the same on every rank, even one whose share of eval packs is empty
    last_eval: dict = {}
    train_time, real_total = 0.0, 0
    window = _new_window()
    peak = peak_flops(env.device, run.compute_dtype)
    while run.step < run.total_steps:
        run.timer.reset()
        run.vision_timer.take()  # drop anything an eval forward left behind
        step_batches = next_step_batches(
            run.train_batches, cfg.train.micro_batches, env, run.model, run.accounting, run.cp
        )
        if step_batches is None:
            break
        stats = train_step(run, step_batches)
        run.step += 1
        data_counts = run.accounting.after_step(step_batches.data, run.step)
        train_time += stats.sections["step_time_s"]
        real_total += step_batches.real
        window["real"] += step_batches.real
        window["time"] += stats.sections["step_time_s"]
        window["data"] += stats.sections["data_s"]
        window["flops"] += step_batches.flops
        if run.step % cfg.train.log_every == 0 or run.step == run.total_steps:
            _log_step(run, step_batches, stats, window, peak, data_counts)
            window = _new_window()
        else:
            run.metrics.advance(1)
        last = run.step == run.total_steps
        if has_eval and cfg.train.eval_every and run.step % cfg.train.eval_every == 0 and not last:
            last_eval = _evaluate(run)
        if cfg.train.save_every and run.step % cfg.train.save_every == 0 and not last:
            _save(run)
    if has_eval:
        last_eval = _evaluate(run)
    run.metrics.close()
    return last_eval, train_time, real_total


def _new_window() -> dict[str, float]:
    """Sums over the steps since the last metrics line (so a logged value covers every step, not just the last)."""
    return {"real": 0, "time": 0.0, "data": 0.0, "flops": 0.0, "start": time.perf_counter()}


def train_step(run: Run, step: StepBatches) -> StepStats:
    """Forward and backward of every micro-batch (gradients reduced after the last), clip, AdamW, schedule."""
    model, env, timer = run.model, run.env, run.timer
    timer.mark("data_s")
    scale = env.world_size / max(step.trainable, 1)
    loss_sum = torch.zeros((), dtype=torch.float64, device=env.device)
    balance, routing = run.balance, StepRouting()
    prepass = balance is not None and balance.trains and len(step.batches) > 1
    batches = [b.to(env.device) for b in step.batches] if prepass else step.batches  # copied once, used twice
    step_counts = balance.prepass_counts(model, batches, env) if prepass else None
    for i, batch in enumerate(batches):
        batch = batch.to(env.device)  # a no-op for batches the pre-pass already holds on the device
        set_gradient_sync(model, run.cfg.train.grad_sync == "micro_batch" or i == len(step.batches) - 1)
        out = model(**batch.model_kwargs(), **(balance.forward_kwargs(batch) if balance else {}))
        timer.mark("forward_s")
        timer.add("vision_s", run.vision_timer.take())
        loss = out.loss_sum * scale
        if balance is not None:
            routing.add(out.router)
            if balance.trains:
                loss = loss + balance.aux_term(out.router, step_counts, step.real, env)
        loss.backward()
        timer.mark("backward_s")
        loss_sum += out.loss_sum.detach()
    grad_norm = _clip(model, run.cfg.train.grad_clip)
    run.optimizer.step()
    run.scheduler.step()
    run.optimizer.zero_grad(set_to_none=True)
    flat = torch.cat([torch.stack([loss_sum, grad_norm.double()]), routing.flat().to(env.device)])
    flat = flat.cpu()  # the step's one read of the device
    timer.mark("optimizer_s")
    return StepStats(flat[0], float(flat[1]), step_breakdown(timer.reset()), flat[2:])


def _log_step(
    run: Run, step: StepBatches, stats: StepStats, window: dict, peak: float | None, data_counts: dict[str, int]
) -> None:
    totals = all_reduce_sum(torch.cat([stats.loss_sum.reshape(1), stats.routing]), run.env)
    loss = float(totals[0]) / max(step.trainable, 1)
    routing = routing_metrics(totals[1:], run.balance, step.real) if run.balance else {}
    lr = run.scheduler.get_last_lr()[0]
    wall = time.perf_counter() - window["start"]  # the window's wall time: steps, evals, saves, logging
    record = {
        "step": run.step,
        "loss": loss,
        "lr": run.optimizer.param_groups[0]["lr"],
        "grad_norm": stats.grad_norm,
        **routing,
        "real_tokens": step.real,
        "trainable_tokens": step.trainable,
        "padding_fraction": 1.0 - step.real / max(step.capacity, 1),
        "images": step.images,
        "tokens_per_s": window["real"] / max(window["time"], 1e-9),
        "peak_memory_mb": peak_memory_mb(run.env.device),
        **stats.sections,
        "data_wait_s": window["data"],
        "window_s": wall,
        "data_wait_fraction": window["data"] / max(wall, 1e-9),
        **data_counts,
        "flops_per_step": step.flops,
        "tflops": window["flops"] / max(window["time"], 1e-9) / 1e12,
        "mfu": mfu(window["flops"], window["time"], peak, run.env.world_size),
    }
    with all_ranks_or_none(run.env, "writing the metrics"):
        run.metrics.advance(1, loss=loss, lr=lr, tok_s=step.real / max(stats.sections["step_time_s"], 1e-9))
        run.metrics.log(record)


def _clip(model: torch.nn.Module, max_norm: float | None) -> torch.Tensor:
    """Clip to ``max_norm`` and return the total gradient norm as a device scalar (read later, with the loss)."""
    params = [p for p in model.parameters() if p.grad is not None]
    if not params:
        return torch.zeros((), device=next(model.parameters()).device)
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm is not None else float("inf"))
    if hasattr(norm, "full_tensor"):
        norm = norm.full_tensor()
    return norm


# ------------------------------------------------------------------------------------------ eval and saving


def _evaluate(run: Run) -> dict:
    """Eval of every rank's own share of the held-out packs, whole rows per rank, then the generated replies to the
    run's held-out prompts (``trainer.generation``), context parallelism off for both."""
    run.model.set_context_parallel(NO_CP)
    samples: list[dict] = []
    try:
        result = evaluate(run.model, run.eval_batches, env=run.env, sample_tasks=run.sources.eval_tasks)
        if run.generation:
            generated, samples = evaluate_generation(
                run.model, run.generation, run.env, run.processor.tokenizer, step=run.step,
                max_new_tokens=run.cfg.train.eval_generate_max_tokens, token_budget=run.cfg.data.pack_len,
                task_names=sorted(set(run.sources.eval_tasks.values())),
            )  # fmt: skip
            result.update(generated)
    finally:
        run.model.set_context_parallel(run.cp)
    with all_ranks_or_none(run.env, "writing the eval metrics"):
        run.metrics.log({"step": run.step, **result})
        run.metrics.log_samples(run.step, samples)
        run.metrics.write(format_eval(run.step, result))
    return result


def _save(run: Run) -> None:
    """A resumable checkpoint with an HF export of the same weights inside it (``checkpoints/step-N/hf``; for LoRA
    runs the adapter only: the merged full weights are written once, to ``final/``)."""
    state = TrainerState(
        step=run.step,
        scheduler=run.scheduler.state_dict(),
        data=run.train_batches.state_dict(),
        rng=capture_rng(),
        extra={
            "base": getattr(run.model, "base_fingerprint", None),  # LoRA: the frozen base the adapters sit on
            "trackers": run.metrics.tracker_state(),  # rank 0's (the rank that writes this): what a resume continues
        },
    )
    save_checkpoint(
        run.out_dir,
        model=run.model,
        optimizer=run.optimizer,
        state=state,
        env=run.env,
        keep_last=run.cfg.train.keep_last,
        write_extra=lambda folder: export_final(
            folder / "hf", run.model, run.processor, run.env, run.cfg, source=run.weights_source, merge=False
        ),
        trainable_only=run.cfg.model.lora is not None,
    )
