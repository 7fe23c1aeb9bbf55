"""The training loop: steps, evals and checkpoints of a set-up run (``trainer.setup``), with exact loss normalization.

One optimizer step equals one big batch: every rank draws ``micro_batches`` packs, the trainable-token count of all
of them on all ranks is all-reduced *before* any backward, and each micro-batch's loss sum is scaled by
``world_size / global_count``. FSDP averages gradients over ranks (a division by ``world_size``), so the update is
exactly ``d(sum of token losses) / d(params) / global_count``, however the tokens were split across ranks and
micro-batches. Gradients are reduce-scattered once per step, after the last micro-batch's backward.

Context parallelism (``train.cp_size``) keeps this exact: the ranks of a CP group hold the same rows, each trains on
its own shard of their tokens and counts only that shard (``step_batches.shard_counts``), so the global count
counts every token once; the group's gradients are then summed, not averaged, by the same ``world_size / count``
scale under FSDP2's average over every rank (the model needs no extra reduction over the CP group).

Collectives follow the rules in ``parallel.collectives``: the step's one control-plane all-reduce (failure flag, end of
data, token counts) runs on host tensors before the first forward, and every rank-local section (loading data,
files written on rank 0, the packing self-check) is followed by an agreement, so one rank's failure stops all ranks.

A stop signal (SIGTERM, SIGUSR1; ``trainer.preemption``) on any rank rides on that same all-reduce: every rank trains
the step it was agreed at, saves it as a periodic checkpoint and returns ``RunResult.stopped`` (the CLI exits with
``PREEMPTED_EXIT_CODE``). A resumed run writes where it resumed into ``metrics.jsonl`` (``{"event": "resumed"}``, with
the elastic agent's restart count under torchrun / accelerate), after the records it kept.

A step whose loss or gradient norm is not finite on any rank is not applied (``trainer.nonfinite``: every rank reads
the same verdict from the gradient norm, before the optimizer runs; no collective is added). After
``train.max_nonfinite_steps`` of them in a row the run stops with ``DivergedError``; nothing is saved while the last
step was skipped.
"""

from __future__ import annotations

import logging
import math
import os
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from vlm_sft.checkpoint.export import export_final
from vlm_sft.checkpoint.state import TrainerState, capture_rng, save_checkpoint
from vlm_sft.config import RunConfig
from vlm_sft.flops import mfu, peak_flops
from vlm_sft.parallel.collectives import all_ranks_or_none, all_reduce_sum, gather_objects
from vlm_sft.parallel.env import elastic_restart
from vlm_sft.parallel.failure import doing, set_phase
from vlm_sft.parallel.fsdp import clip_grad_norm_, set_gradient_sync
from vlm_sft.parallel.parallelize import context_parallel_off
from vlm_sft.trainer.evaluate import evaluate, format_eval
from vlm_sft.trainer.generation import evaluate_generation
from vlm_sft.trainer.metrics import peak_memory_mb, step_breakdown
from vlm_sft.trainer.nonfinite import (
    DivergedError,
    check_finite_state,
    describe_batches,
    log_skip,
    poison_nonfinite,
    suspects,
)
from vlm_sft.trainer.preemption import PREEMPTED_EXIT_CODE, Stopped, StopRequest, stop_signals
from vlm_sft.trainer.router_balance import StepRouting, routing_metrics
from vlm_sft.trainer.scored_eval import evaluate_scores
from vlm_sft.trainer.setup import Run, running
from vlm_sft.trainer.step_batches import StepBatches, next_step_batches

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RunResult:
    """What a finished run reports (on every rank)."""

    steps: int
    """Optimizer steps completed."""
    final_dir: Path | None
    """The HF checkpoint directory written at the end (None when the run was stopped early)."""
    last_eval: dict
    """The last eval metrics (empty when the run had no eval data)."""
    wall_time_s: float
    """Seconds from start-up to the end of the final save."""
    real_tokens_per_s: float
    """Non-padding tokens processed per second of training steps (all ranks)."""
    data: dict
    """Sample accounting at the end (all ranks): seen, packed, skipped by reason, buffered, passes."""
    stopped: Stopped | None = None
    """Set when a stop signal ended the run (``trainer.preemption``): it saved a checkpoint and skipped the final eval
    and export; None: it ran to its end."""


@dataclass(frozen=True)
class StepStats:
    """What one optimizer step reports."""

    loss_sum: torch.Tensor
    """This rank's summed token loss (CPU float64 scalar; all-reduce it for the global loss)."""
    grad_norm: float
    """The global gradient norm, the same on every rank (NaN when any rank's loss was not finite)."""
    sections: dict[str, float]
    routing: torch.Tensor
    """MoE runs: this rank's router sums of the step (``StepRouting.flat``, CPU); empty for a dense model."""
    micro_losses: list[float] = field(default_factory=list)
    """This rank's loss sum of each micro-batch (to name a non-finite one)."""

    @property
    def applied(self) -> bool:
        """The update was applied: the gradient norm was finite (on every rank alike; ``trainer.nonfinite``)."""
        return math.isfinite(self.grad_norm)


# ------------------------------------------------------------------------------------------------------- a run


def train(cfg: RunConfig) -> RunResult:
    """Run the configured job to its end, or until a stop signal (``RunResult.stopped``); every rank calls this. The
    process group is left at exit. (The dry run, which stops before the first step, is ``trainer.dry_run.dry_run``.)

    The stop signals' handlers are installed before the set-up: a signal during the set-up stops the run at the first
    step boundary, with nothing to save."""
    t_start = time.perf_counter()
    with stop_signals(rank=int(os.environ.get("RANK", "0"))) as stop, running(cfg) as run:
        last_eval, train_time, real_tokens, stopped = run_steps(run, stop)
        final_dir, data = None, {}
        if stopped is None or stopped.checkpoint is not None:
            data = run.accounting.report(run.step, "end of the run" if stopped is None else "stopped").to_dict()
        run.train_batches.close()  # the data workers' cores and memory are free for the export
        if stopped is None:
            check_finite_state(run.model, run.optimizer, run.env, run.step)
            with doing("exporting the final checkpoint"):
                final_dir = export_final(
                    run.out_dir / "final", run.model, run.processor, run.env, cfg, source=run.weights_source
                )
    env = run.env
    wall = time.perf_counter() - t_start
    tok_s = real_tokens / max(train_time, 1e-9)
    if env.is_main and stopped is None:
        logger.info(
            "done: %d steps in %.1f s (%.0f real tokens/s); final checkpoint %s", run.step, wall, tok_s, final_dir
        )
    return RunResult(run.step, final_dir, last_eval, wall, tok_s, data, stopped)


# ------------------------------------------------------------------------------------------------ the steps


def run_steps(run: Run, stop: StopRequest | None = None) -> tuple[dict, float, int, Stopped | None]:
    """Steps until ``total_steps`` (or the data ends, or a rank is asked to ``stop``), with logging, evals and
    checkpoints; (last eval, train seconds, real tokens, how the run stopped early or None)."""
    cfg, env = run.cfg, run.env
    has_eval = run.sources.eval is not None  # the same on every rank, even one whose share of eval packs is empty
    last_eval: dict = {}
    train_time, real_total = 0.0, 0
    window = _new_window()
    peak = peak_flops(env.device, run.compute_dtype)
    if run.resumed_from is not None:
        _log_resume(run)
    start_step, stopped, save_due = run.step, None, False
    while run.step < run.total_steps:
        set_phase(f"training step {run.step + 1}")  # named to the peers if this rank fails (parallel.failure)
        run.timer.reset()
        run.vision_timer.take()  # drop anything an eval forward left behind
        step_batches = next_step_batches(
            run.train_batches, cfg.train.micro_batches, env, run.model, run.accounting, run.cp,
            stop=stop is not None and stop.requested,
        )  # fmt: skip
        if step_batches is None:
            break
        if step_batches.stop_requests and run.step == start_step:  # no step trained yet: nothing new to save
            stopped = _stopped(run, step_batches.stop_requests, None)
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
        if stats.applied:
            run.guard.applied()
        else:
            _skipped(run, step_batches, stats)
        if run.step % cfg.train.log_every == 0 or run.step == run.total_steps:
            _log_step(run, step_batches, stats, window, peak, data_counts)
            window = _new_window()
        else:
            run.metrics.advance(1)
        if run.guard.exhausted:  # every rank alike: the verdicts are the same
            raise _diverged(run)
        last = run.step == run.total_steps
        stopping = step_batches.stop_requests > 0  # the same on every rank: the sum of the step's all-reduce
        if has_eval and cfg.train.eval_every and run.step % cfg.train.eval_every == 0 and not last and not stopping:
            last_eval = _evaluate(run)
        if stopping:  # one save, also at a periodic save's step or the last step (a resume then evals and exports)
            stopped = _stopped(run, step_batches.stop_requests, None if run.guard.diverging else _save(run))
            break
        # A save due while the run skips non-finite steps waits for the next applied step (trainer.nonfinite).
        save_due = save_due or bool(cfg.train.save_every and run.step % cfg.train.save_every == 0)
        if save_due and not last and not run.guard.diverging:
            _save(run)
            save_due = False
    if has_eval and stopped is None:
        last_eval = _evaluate(run)
    run.metrics.close()
    return last_eval, train_time, real_total, stopped


def _new_window() -> dict[str, float]:
    """Sums over the steps since the last metrics line (so a logged value covers every step, not just the last)."""
    return {"real": 0, "time": 0.0, "data": 0.0, "flops": 0.0, "start": time.perf_counter()}


def train_step(run: Run, step: StepBatches) -> StepStats:
    """Forward and backward of every micro-batch (gradients reduced after the last), clip; AdamW and the schedule only
    when the gradient norm is finite (``trainer.nonfinite``: the same verdict on every rank)."""
    model, env, timer = run.model, run.env, run.timer
    timer.mark("data_s")
    scale = env.world_size / max(step.trainable, 1)
    loss_sum = torch.zeros((), dtype=torch.float64, device=env.device)
    micro_losses: list[torch.Tensor] = []
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
        poison_nonfinite(loss).backward()  # a non-finite loss turns every rank's gradient norm NaN (trainer.nonfinite)
        timer.mark("backward_s")
        micro_losses.append(out.loss_sum.detach().double())
        loss_sum += micro_losses[-1]
    grad_norm = _clip(model, run.cfg.train.grad_clip)
    m = len(micro_losses)
    flat = torch.cat([torch.stack([loss_sum, grad_norm.double(), *micro_losses]), routing.flat().to(env.device)])
    flat = flat.cpu()  # the step's one read of the device, before the update: the same verdict on every rank
    stats = StepStats(flat[0], float(flat[1]), {}, flat[2 + m :], flat[2 : 2 + m].tolist())
    if stats.applied:
        run.optimizer.step()
        run.scheduler.step()
    run.optimizer.zero_grad(set_to_none=True)
    timer.mark("optimizer_s")
    return replace(stats, sections=step_breakdown(timer.reset()))


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
        "nonfinite_steps": run.guard.total,
    }
    with all_ranks_or_none(run.env, "writing the metrics"):
        run.metrics.advance(1, loss=loss, lr=lr, tok_s=step.real / max(stats.sections["step_time_s"], 1e-9))
        run.metrics.log(record)


def _clip(model: torch.nn.Module, max_norm: float | None) -> torch.Tensor:
    """Clip to ``max_norm`` and return the total gradient norm as a device scalar (read later, with the loss)."""
    params = [p for p in model.parameters() if p.grad is not None]
    if not params:
        return torch.zeros((), device=next(model.parameters()).device)
    return clip_grad_norm_(params, max_norm)


def _skipped(run: Run, step: StepBatches, stats: StepStats) -> None:
    """Count a step that was not applied; what every rank's micro-batches held goes to ``metrics.jsonl`` and rank 0's
    log (one gather: every rank skipped the same step)."""
    run.guard.skipped(run.step)
    mine = describe_batches(step.batches, stats.micro_losses, run.env.rank, run.guard.sources)
    suspect = suspects([b for part in gather_objects(mine, run.env) for b in part])
    record = {
        "step": run.step, "event": "nonfinite_step", "grad_norm": stats.grad_norm, "consecutive": len(run.guard.streak),
        "nonfinite_steps": run.guard.total, "batches": suspect,
    }  # fmt: skip
    with all_ranks_or_none(run.env, "writing the skipped step to the metrics"):
        run.metrics.log(record)
        if run.env.is_main:
            log_skip(run.step, run.guard, stats.grad_norm, suspect)


def _diverged(run: Run) -> DivergedError:
    """The stop after ``train.max_nonfinite_steps`` skips in a row, recorded in ``metrics.jsonl``."""
    error = run.guard.error(run.cfg.train.lr)
    record = {"step": run.step, "event": "diverged", "first_nonfinite_step": error.first_step}
    with all_ranks_or_none(run.env, "writing the divergence to the metrics"):
        run.metrics.log(record | {"nonfinite_steps": run.guard.total})
    return error


# ------------------------------------------------------------------------------------------ eval and saving


def _evaluate(run: Run) -> dict:
    """Eval of every rank's own share of the held-out packs, whole rows per rank (per held-out source too, with
    ``[[data.eval_sources]]``), then the generated replies to the run's held-out prompts (``trainer.generation``)
    and the benchmark scores of the scored sources (``trainer.scored_eval``),
    context parallelism off for both. The whole result goes to ``metrics.jsonl``."""
    samples: list[dict] = []
    with context_parallel_off(run.model), doing(f"evaluating at step {run.step}"):
        tasks, groups = run.sources.eval_tasks, run.sources.eval_groups
        result = evaluate(run.model, run.eval_batches, env=run.env, sample_tasks=tasks, sample_groups=groups)
        if run.generation:
            generated, samples = evaluate_generation(
                run.model, run.generation, run.env, run.processor.tokenizer, step=run.step,
                max_new_tokens=run.cfg.train.eval_generate_max_tokens, token_budget=run.cfg.data.pack_len,
                task_names=sorted(set(run.sources.eval_tasks.values())),
            )  # fmt: skip
            result.update(generated)
        if run.scored:
            scores, scored_rows = evaluate_scores(
                run.model, run.scored, run.env, run.processor.tokenizer, token_budget=run.cfg.data.pack_len
            )
            result.update(scores)
            samples += scored_rows
    with all_ranks_or_none(run.env, "writing the eval metrics"):
        run.metrics.log({"step": run.step, **result})
        run.metrics.log_samples(run.step, samples)
        run.metrics.write(format_eval(run.step, result))
    return result


def _save(run: Run) -> Path:
    """A resumable checkpoint with an HF export of the same weights inside it (``checkpoints/step-N/hf``; for LoRA
    runs the adapter only: the merged full weights are written once, to ``final/``)."""
    set_phase(f"saving the checkpoint of step {run.step}")
    check_finite_state(run.model, run.optimizer, run.env, run.step)  # a non-finite tensor is never written
    state = TrainerState(
        step=run.step,
        scheduler=run.scheduler.state_dict(),
        data=run.train_batches.state_dict(),
        rng=capture_rng(),
        base_fingerprint=getattr(run.model, "base_fingerprint", None),  # LoRA: the frozen base the adapters sit on
        trackers=run.metrics.tracker_state(),  # rank 0's (the rank that writes this): what a resume continues
        nonfinite_steps=run.guard.total,
    )
    return save_checkpoint(
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


# ------------------------------------------------------------------------------------------- stop and resume


def _stopped(run: Run, requests: int, checkpoint: Path | None) -> Stopped:
    """Log the stop (``metrics.jsonl`` and rank 0's log); every rank calls this at the same step. No ``checkpoint``:
    no step trained since the start, or the last step was skipped as non-finite (nothing is saved then)."""
    record = {"step": run.step, "event": "preempted", "signalled_ranks": requests}
    record["checkpoint"] = None if checkpoint is None else str(checkpoint)
    with all_ranks_or_none(run.env, "writing the stop to the metrics"):
        run.metrics.log(record)
    if run.env.is_main:
        saved = f"saved {checkpoint}" if checkpoint else "no step trained since the start, nothing new to save"
        if checkpoint is None and run.guard.diverging:
            saved = f"nothing saved: step {run.step} was skipped as non-finite (no checkpoint while diverging)"
        logger.warning(
            "stopped at step %d on a stop signal (%d of %d rank(s) got one): %s; exiting with code %d; "
            "--train.resume latest continues the run",
            run.step, requests, run.env.world_size, saved, PREEMPTED_EXIT_CODE,
        )  # fmt: skip
    return Stopped(run.step, requests, checkpoint)


def _log_resume(run: Run) -> None:
    """Where this run resumed, as a ``metrics.jsonl`` record (with the elastic agent's restart count when there is
    one), so that a restarted job's file says where each attempt took over."""
    record: dict = {"step": run.step, "event": "resumed", "from": str(run.resumed_from)}
    restart = elastic_restart()
    if restart is not None:
        record["restart"] = restart
    with all_ranks_or_none(run.env, "writing the resume to the metrics"):
        run.metrics.log(record)
    if run.env.is_main and restart:
        logger.info("elastic restart %d: continuing from %s at step %d", restart, run.resumed_from, run.step)
