"""The training loop: exact loss normalization, clipping, schedule, eval, checkpoints, metrics.

One optimizer step equals one big batch: every rank draws ``micro_batches`` packs, the trainable-token count of all
of them on all ranks is all-reduced *before* any backward, and each micro-batch's loss sum is scaled by
``world_size / global_count``. FSDP averages gradients over ranks (a division by ``world_size``), so the update is
exactly ``d(sum of token losses) / d(params) / global_count``, however the tokens were split across ranks and
micro-batches.
"""

from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from processors import save_processor
from renderers import check_template_parity
from vlm_sft.config import ConfigError, RunConfig
from vlm_sft.data.batch import PackedBatch
from vlm_sft.data.collate import collate
from vlm_sft.flops import batch_flops, mfu, peak_flops
from vlm_sft.model.checkpoint_io import save_hf_checkpoint
from vlm_sft.trainer import build
from vlm_sft.trainer.batches import TrainBatches
from vlm_sft.trainer.checkpoint import (
    TrainerState,
    capture_rng,
    full_state_dict,
    load_checkpoint,
    resolve_resume,
    restore_rng,
    save_checkpoint,
)
from vlm_sft.trainer.distributed import DistEnv, all_reduce, all_reduce_sum, barrier, init_distributed, shard_model
from vlm_sft.trainer.evaluate import evaluate
from vlm_sft.trainer.metrics import MetricsLogger, ModuleTimer, StepTimer, peak_memory_mb
from vlm_sft.trainer.optim import build_optimizer, build_scheduler

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


def _eval_batches(cfg: RunConfig, sources: build.DataSources, renderer, env: DistEnv, pad_id: int) -> list[PackedBatch]:
    if sources.eval is None:
        return []
    pipeline = build.build_pipeline(
        cfg,
        sources.eval,
        renderer,
        rank=env.rank,
        world_size=env.world_size,
        epochs=1,
        shuffle=False,
        packing="stack" if cfg.data.packing == "stack" else "cat",
    )
    return [collate([p], pad_id=pad_id) for p in pipeline]


def _next_batches(batches: TrainBatches, n: int, env: DistEnv) -> list[PackedBatch] | None:
    """``n`` micro-batches, or None on every rank as soon as one rank has run out (end of the last epoch)."""
    out = []
    for _ in range(n):
        try:
            out.append(next(batches))
        except StopIteration:
            break
    short = all_reduce_sum(torch.tensor([0 if len(out) == n else 1]), env)
    return None if int(short) > 0 else out


def _count_steps(cfg: RunConfig, sources: build.DataSources, renderer, env: DistEnv) -> int:
    """Optimizer steps in ``train.epochs`` passes, counted by running the pipeline once without a model."""
    epochs = cfg.train.epochs
    whole = int(epochs) if float(epochs).is_integer() else int(epochs) + 1
    pipeline = build.build_pipeline(
        cfg, sources.train, renderer, rank=env.rank, world_size=env.world_size, epochs=whole
    )
    packs = sum(1 for _ in pipeline)
    per_epoch = packs / whole
    steps = int(per_epoch * epochs) // cfg.train.micro_batches
    steps = int(all_reduce(torch.tensor([steps]), env, "min"))  # every rank must run the same number of steps
    if steps < 1:
        raise ValueError(f"train.epochs = {epochs} gives no full optimizer step ({packs} packs); raise epochs")
    return steps


def train(cfg: RunConfig) -> RunResult:
    """Run the configured job to its end; every rank calls this."""
    t_start = time.perf_counter()
    env = init_distributed(cfg.train.device)
    out_dir = Path(cfg.train.output_dir)
    if env.is_main:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "config.json").write_text(cfg.model_dump_json(indent=2))
    torch.manual_seed(cfg.train.seed)

    processor = build.build_processor(cfg)
    renderer = build.build_renderer(cfg, processor)
    check_template_parity(renderer, processor)  # refuse to train on tokens the checkpoint's template would not give
    pad_id = int(processor.tokenizer.pad_token_id)
    sources = build.load_sources(cfg, is_main=env.is_main, wait=lambda: barrier(env))

    if cfg.model.dtype == "bfloat16" and env.device.type != "cuda":
        raise ConfigError(
            f"model.dtype = 'bfloat16' but this run is on {env.device} (no CUDA device): bf16 autocast is only used on "
            "CUDA; set model.dtype = 'float32' for CPU runs"
        )
    autocast_dtype = torch.bfloat16 if cfg.model.dtype == "bfloat16" else None
    model = build.build_model(cfg, env.device)
    if cfg.train.check_packing:
        from vlm_sft.check_packing import run_packing_check

        report = run_packing_check(cfg, model=model, renderer=renderer, source=sources.train, pad_id=pad_id)
        if env.is_main:
            logger.info("packing self-check:\n%s", report.format())
        if not report.ok:
            raise RuntimeError(f"packing self-check failed: {report.format()}")
    model = shard_model(model, env)
    model.train()

    total_steps = cfg.train.max_steps or _count_steps(cfg, sources, renderer, env)
    optimizer = build_optimizer(model, cfg.train)
    scheduler = build_scheduler(optimizer, cfg.train, total_steps)
    step = 0
    data_state = None
    resume_from = resolve_resume(cfg.train.resume, out_dir)
    if resume_from is not None:
        state = load_checkpoint(resume_from, model=model, optimizer=optimizer, env=env)
        scheduler.load_state_dict(state.scheduler)
        data_state = state.data
        restore_rng(state.rng)
        step = state.step
    # Steps-based runs stream forever; epoch-based ones stop after the counted steps.
    train_batches = TrainBatches(
        functools.partial(
            build.build_pipeline, cfg, sources.train, renderer, rank=env.rank, world_size=env.world_size, epochs=None
        ),
        pad_id=pad_id,
        spatial_merge_size=model.config.vision_config.spatial_merge_size,
        num_workers=cfg.data.num_workers,
        state=data_state,
        pin_memory=env.device.type == "cuda",
    )
    eval_batches = _eval_batches(cfg, sources, renderer, env, pad_id)
    metrics = MetricsLogger(
        out_dir,
        enabled=env.is_main,
        total_steps=total_steps,
        start_step=step,
        report_to=list(cfg.train.report_to),
        run_config=cfg.to_dict(),
    )
    timer = StepTimer(env.device)
    # The vision tower's share of each forward (it runs once per forward, on a dummy image when there is none).
    vision_timer = ModuleTimer(model.model.visual, env.device)
    peak = peak_flops(env.device, autocast_dtype)
    last_eval: dict = {}
    train_time = 0.0
    real_tokens_total = 0
    window = {"real": 0, "time": 0.0, "flops": 0.0}
    while step < total_steps:
        timer.reset()
        vision_timer.take()  # drop anything an eval forward left behind
        batches = _next_batches(train_batches, cfg.train.micro_batches, env)
        if batches is None:
            break
        local = torch.tensor(
            [
                sum(b.num_trainable_tokens for b in batches),
                sum(b.num_real_tokens for b in batches),
                sum(b.input_ids.numel() for b in batches),
                sum(b.num_images for b in batches),
                sum(batch_flops(b, model.config, vision_trainable=model.vision_trainable).train for b in batches),
            ],
            dtype=torch.float64,
        )
        global_counts = all_reduce_sum(local, env)
        n_trainable = float(global_counts[0])
        timer.mark("data_s")
        loss_sum = torch.zeros((), dtype=torch.float64)
        for batch in batches:
            batch = batch.to(env.device)
            with torch.autocast(env.device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
                out = model(**batch.model_kwargs())
            timer.mark("forward_s")
            timer.add("vision_s", vision_timer.take())
            (out.loss_sum * (env.world_size / max(n_trainable, 1.0))).backward()
            timer.mark("backward_s")
            loss_sum += out.loss_sum.detach().double().cpu()
        grad_norm = _clip(model, cfg.train.grad_clip)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        timer.mark("optimizer_s")
        step += 1
        sections = step_breakdown(timer.reset())
        step_time = sections["step_time_s"]
        train_time += step_time
        real = int(global_counts[1])
        flops = float(global_counts[4])
        real_tokens_total += real
        window["real"] += real
        window["time"] += step_time
        window["flops"] += flops
        loss = float(all_reduce_sum(loss_sum, env)) / max(n_trainable, 1.0)
        metrics.advance(1, loss=loss, lr=scheduler.get_last_lr()[0], tok_s=real / max(step_time, 1e-9))
        if step % cfg.train.log_every == 0 or step == total_steps:
            metrics.log(
                {
                    "step": step,
                    "loss": loss,
                    "lr": optimizer.param_groups[0]["lr"],
                    "grad_norm": grad_norm,
                    "real_tokens": real,
                    "trainable_tokens": int(n_trainable),
                    "padding_fraction": 1.0 - real / max(float(global_counts[2]), 1.0),
                    "images": int(global_counts[3]),
                    "tokens_per_s": window["real"] / max(window["time"], 1e-9),
                    "peak_memory_mb": peak_memory_mb(env.device),
                    **sections,
                    "flops_per_step": flops,
                    "tflops": window["flops"] / max(window["time"], 1e-9) / 1e12,
                    "mfu": mfu(window["flops"], window["time"], peak, env.world_size),
                }
            )
            window = {"real": 0, "time": 0.0, "flops": 0.0}
        if eval_batches and cfg.train.eval_every and step % cfg.train.eval_every == 0 and step != total_steps:
            last_eval = evaluate(
                model, eval_batches, env=env, sample_tasks=sources.eval_tasks, autocast_dtype=autocast_dtype
            )
            metrics.log({"step": step, **last_eval})
            metrics.write(_format_eval(step, last_eval))
        if cfg.train.save_every and step % cfg.train.save_every == 0 and step != total_steps:
            _save(out_dir, model, optimizer, scheduler, train_batches, step, env, cfg, processor)
    if eval_batches:
        last_eval = evaluate(
            model, eval_batches, env=env, sample_tasks=sources.eval_tasks, autocast_dtype=autocast_dtype
        )
        metrics.log({"step": step, **last_eval})
        metrics.write(_format_eval(step, last_eval))
    metrics.close()
    final_dir = export_final(out_dir / "final", model, processor, env)
    wall = time.perf_counter() - t_start
    tok_s = real_tokens_total / max(train_time, 1e-9)
    if env.is_main:
        logger.info("done: %d steps in %.1f s (%.0f real tokens/s); final checkpoint %s", step, wall, tok_s, final_dir)
    return RunResult(steps=step, final_dir=final_dir, last_eval=last_eval, wall_time_s=wall, real_tokens_per_s=tok_s)


STEP_SECTIONS = ("data_s", "forward_s", "backward_s", "optimizer_s")
"""The disjoint wall-clock sections of a step; they sum to ``step_time_s``."""


def step_breakdown(sections: dict[str, float]) -> dict[str, float]:
    """Where one step's time went, as logged in ``metrics.jsonl`` (seconds, this rank).

    ``data_s`` (waiting for packs, collating, the token-count all-reduce), ``forward_s`` = ``vision_s`` (the vision
    tower) + ``text_forward_s`` (embedding, text decoder and the chunked loss, which also computes the LM head's
    gradients), ``backward_s``, ``optimizer_s`` (clipping, AdamW, schedule); ``step_time_s`` is the sum of the four
    disjoint sections. Synchronized on CUDA, so each section holds its own kernels.
    """
    out = {name: float(sections.get(name, 0.0)) for name in STEP_SECTIONS}
    vision = float(sections.get("vision_s", 0.0))
    out["vision_s"] = vision
    out["text_forward_s"] = out["forward_s"] - vision
    out["step_time_s"] = sum(out[name] for name in STEP_SECTIONS)
    return out


def _format_eval(step: int, ev: dict) -> str:
    accs = " ".join(
        f"{k.removeprefix('eval_acc_')}={v:.3f}" for k, v in sorted(ev.items()) if k.startswith("eval_acc_")
    )
    return f"step {step}: eval loss {ev['eval_loss']:.4f}; accuracy {accs}"


def _clip(model: torch.nn.Module, max_norm: float | None) -> float:
    params = [p for p in model.parameters() if p.grad is not None]
    if not params:
        return 0.0
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm is not None else float("inf"))
    if hasattr(norm, "full_tensor"):
        norm = norm.full_tensor()
    return float(norm)


def _save(out_dir, model, optimizer, scheduler, train_batches, step, env, cfg, processor) -> None:
    """A resumable checkpoint with an HF export of the same weights inside it (``checkpoints/step-N/hf``)."""
    state = TrainerState(
        step=step, scheduler=scheduler.state_dict(), data=train_batches.state_dict(), rng=capture_rng(), extra={}
    )
    save_checkpoint(
        out_dir,
        model=model,
        optimizer=optimizer,
        state=state,
        env=env,
        keep_last=cfg.train.keep_last,
        write_extra=lambda folder: export_final(folder / "hf", model, processor, env),
    )


def export_final(directory: Path, model: torch.nn.Module, processor, env: DistEnv) -> Path:
    """Write the HF checkpoint: weights + config, then processor and tokenizer (tokenizer last, verified on reload)."""
    state = full_state_dict(model)
    if env.is_main:
        vlm = model
        if vlm.tied_embeddings:
            state.pop("lm_head.weight", None)
        save_hf_checkpoint(state, vlm.config, directory)
        save_processor(directory, processor, processor.tokenizer)
    barrier(env)
    return directory
