"""``--dry-run``: a run set up exactly as training sets it up, its first step's batches drawn, then the memory table.

Everything up to the first optimizer step happens as in ``trainer.loop.train`` (``trainer.setup``: checkpoint load,
LoRA / context-parallel / MoE wrapping, sharding, the self-check, the data pipelines); then every rank measures its
memory and plans its steady state (``checks.memory_report``), rank 0 prints the table and writes
``<train.output_dir>/dry_run.json``. No optimizer step, no checkpoint.
"""

from __future__ import annotations

import time

from vlm_sft.checks.memory_report import FirstStep, report
from vlm_sft.config import RunConfig
from vlm_sft.trainer.loop import RunResult
from vlm_sft.trainer.setup import running
from vlm_sft.trainer.step_batches import next_step_batches


def dry_run(cfg: RunConfig) -> RunResult:
    """Set up, draw step 1's batches, report the memory per rank (every rank calls this); a result of 0 steps whose
    ``data`` is the sample accounting of those batches. The process group is left at exit."""
    t_start = time.perf_counter()
    with running(cfg) as run:
        step = next_step_batches(run.train_batches, cfg.train.micro_batches, run.env, run.model, run.accounting, run.cp)
        first = None if step is None else FirstStep(len(step.batches), step.capacity, step.real, step.trainable)
        table = report(
            cfg, run.env, run.model, run.out_dir, first_step=first, compute_dtype=run.compute_dtype,
            weights_source=run.weights_source,
        )  # fmt: skip
        if run.env.is_main:
            print(table.format(), flush=True)
        data = run.accounting.report(0, "dry run")
    return RunResult(0, None, {}, time.perf_counter() - t_start, 0.0, data.to_dict())
