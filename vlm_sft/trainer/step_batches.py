"""The micro-batches of one optimizer step and the counts every rank needs before its first forward.

One all-reduce per step carries, from every rank: whether loading failed, whether the data ended, the token counts
(trainable tokens first: the loss normalizer must be known before any backward), the images and FLOPs, whether the
rank was asked to stop (``trainer.preemption``), and the data accounting. Under context parallelism the ranks of a CP
group hold the same rows but train on disjoint token shards, so each counts the tokens of its own shard (every token
is counted once over the world) and a 1/cp share of the images and FLOPs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from vlm_sft.data.batch import PackedBatch
from vlm_sft.flops import batch_flops
from vlm_sft.parallel.collectives import check_peers
from vlm_sft.parallel.context_parallel import NO_CP, ContextParallel
from vlm_sft.parallel.env import DistEnv
from vlm_sft.trainer.batches import TrainBatches
from vlm_sft.trainer.data_accounting import RunAccounting


@dataclass(frozen=True)
class StepBatches:
    """The micro-batches of one optimizer step and the counts over every rank (from the step's one all-reduce)."""

    batches: list[PackedBatch]
    trainable: int
    real: int
    capacity: int
    images: int
    flops: float
    data: list[float] = field(default_factory=list)
    """The data accounting's values summed over ranks (``RunAccounting.local_values``), when one was passed."""
    stop_requests: int = 0
    """Ranks that had been asked to stop (a stop signal, ``trainer.preemption``) when the step's all-reduce ran: more
    than 0 on one rank means more than 0 on every rank."""


def next_step_batches(
    batches: TrainBatches,
    n: int,
    env: DistEnv,
    model: torch.nn.Module,
    accounting: RunAccounting | None = None,
    cp: ContextParallel = NO_CP,
    stop: bool = False,
) -> StepBatches | None:
    """``n`` micro-batches and the global counts (module docstring), or None on every rank as soon as one rank ran
    out of data. ``stop``: this rank was asked to stop (summed into ``StepBatches.stop_requests``)."""
    out: list[PackedBatch] = []
    error = None
    # As many values on a rank that fails as on its peers, so that the all-reduce matches.
    local = torch.zeros(_COUNTS + (accounting.width if accounting is not None else 0), dtype=torch.float64)
    try:  # the counts too: a rank that fails anywhere here still joins the all-reduce, or its peers wait in it
        out = _draw(batches, n)
        local = _local_counts(out, n, model, accounting, cp, stop)
    except Exception as exc:  # reported to every rank by check_peers, then re-raised here
        error = exc
    totals = check_peers(env, "loading the next batches", error, local)
    if float(totals[0]) > 0:
        return None
    trainable, real, capacity, images = (round(v) for v in totals[1:5].tolist())
    stop_requests = round(float(totals[6]))
    return StepBatches(out, trainable, real, capacity, images, float(totals[5]), totals[7:].tolist(), stop_requests)


def _draw(batches: TrainBatches, n: int) -> list[PackedBatch]:
    """Up to ``n`` micro-batches: fewer when this rank's data ends."""
    out = []
    for batch in batches:
        out.append(batch)
        if len(out) == n:
            break
    return out


_COUNTS = 7
"""Values of ``_local_counts`` before the data accounting's: end of data, 3 token counts, images, FLOPs, stop."""


def _local_counts(
    out: list[PackedBatch], n: int, model: torch.nn.Module, accounting: RunAccounting | None, cp: ContextParallel,
    stop: bool,
) -> torch.Tensor:  # fmt: skip
    """This rank's part of the step's all-reduce (module docstring), ``_COUNTS`` values then the accounting's."""
    flops = sum(batch_flops(b, model.config, vision_trainable=model.vision_trainable).train for b in out)
    data = accounting.local_values() if accounting is not None else []
    counts = [shard_counts(b, cp) for b in out]
    local = [
        0 if len(out) == n else 1,
        *(sum(c[i] for c in counts) for i in range(3)),
        sum(b.num_images for b in out) / cp.size,
        flops / cp.size,
        float(stop),
        *data,
    ]
    return torch.tensor(local, dtype=torch.float64)


def shard_counts(batch: PackedBatch, cp: ContextParallel) -> tuple[int, int, int]:
    """(trainable, real, all) tokens of this rank's shard of ``batch`` (the whole batch without CP), from the CPU
    copy the loader returns: no device read."""
    if not cp.active:
        return batch.num_trainable_tokens, batch.num_real_tokens, batch.input_ids.numel()
    trainable = int(cp.shard(batch.loss_mask.reshape(-1)).sum())
    real = int(cp.shard(batch.real_mask().reshape(-1)).sum())
    return trainable, real, batch.input_ids.numel() // cp.size
