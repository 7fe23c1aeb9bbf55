"""The non-finite guard: a step whose loss or gradient norm is not finite is never applied, and a run that keeps
diverging stops before it saves.

**Agreement without a collective of its own.** Each micro-batch's loss is multiplied by 1 when it is finite and by NaN
when it is not (``poison_nonfinite``: no host read), so a rank's non-finite loss makes every gradient it computes NaN
(also where the loss was ``x + inf``, whose gradient alone would be finite). The step's gradient reduction
(FSDP2's reduce-scatter) sums that NaN into every rank's shard, and the gradient norm, reduced over every rank
already, is then NaN on every rank. So the one read of the step (loss, gradient norm) gives every rank the same
verdict, before the optimizer runs: a non-finite norm skips ``optimizer.step`` and ``scheduler.step`` (weights,
AdamW's moments and step count, the schedule: all unchanged) and drops the gradients. The batches' data is consumed:
the step counts, and a resumed run continues after it.

**Counting and stopping.** Each skip is logged with what the step's non-finite micro-batches held (rank, rows, source,
token counts; every rank's micro-batches when no loss was non-finite, i.e. the gradient overflowed), written to
``metrics.jsonl`` (``{"event": "nonfinite_step", ...}``; every step record carries ``nonfinite_steps``, the skips so
far), and after ``train.max_nonfinite_steps`` skips in a row every rank raises ``DivergedError`` naming the first of
them (the CLI exits with ``DIVERGED_EXIT_CODE``).

**Nothing written while diverging.** No checkpoint is saved while the last step was skipped (a periodic save waits for
the next applied step; a stop signal saves nothing), so ``--train.resume latest`` finds the last checkpoint of a
healthy run; and before every save and the final export the weights and optimizer state are checked
(``check_finite_state``): a non-finite tensor stops the run instead of being written.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from vlm_sft.data.batch import PackedBatch
from vlm_sft.parallel.collectives import all_reduce
from vlm_sft.parallel.env import DistEnv
from vlm_sft.parallel.failure import mark_agreed

logger = logging.getLogger(__name__)

DIVERGED_EXIT_CODE = 3
"""Exit code of every process of a run stopped by the guard: not 1 (a crash, worth a restart) nor 143 (preempted,
resume me): resuming repeats the same steps, so a restart loop would only diverge again."""


class DivergedError(RuntimeError):
    """The run stopped because it diverged; raised on every rank at the same step (an agreed error)."""

    def __init__(self, message: str, first_step: int) -> None:
        super().__init__(message)
        self.first_step = first_step
        """The first step of the run of non-finite steps (or the step whose update made the state non-finite)."""
        mark_agreed(self)  # every rank raises it at the same step: the failure board need not tell anyone


def poison_nonfinite(loss: torch.Tensor) -> torch.Tensor:
    """``loss`` times exactly 1 when finite (gradients bit for bit unchanged), times NaN when not, so that every
    gradient of this rank carries it into the step's reduction (module docstring); no host read."""
    return loss * torch.where(torch.isfinite(loss.detach()), 1.0, math.nan)


@dataclass
class NonFiniteGuard:
    """The run's count of skipped steps and the current run of them (every rank holds the same)."""

    limit: int
    """``train.max_nonfinite_steps``: skips in a row that stop the run."""
    total: int = 0
    """Steps skipped since the run started (a resume continues the checkpoint's count)."""
    streak: list[int] = field(default_factory=list)
    """The steps of the current run of skips (empty after an applied step)."""
    sources: tuple[str, ...] = ()
    """A mixture's source names in config order, to name a bad sample's source (``describe_batches``)."""

    @property
    def diverging(self) -> bool:
        """The last step was skipped: no checkpoint is written now."""
        return bool(self.streak)

    @property
    def exhausted(self) -> bool:
        """``limit`` skips in a row: the run stops (``error``)."""
        return len(self.streak) >= self.limit

    def applied(self) -> None:
        self.streak.clear()

    def skipped(self, step: int) -> None:
        self.total += 1
        self.streak.append(step)

    def error(self, lr: float) -> DivergedError:
        """The stop, naming the first bad step and what to change."""
        steps = ", ".join(map(str, self.streak))
        return DivergedError(
            f"the loss or gradient norm was not finite at steps {steps} ({len(self.streak)} in a row = "
            f"train.max_nonfinite_steps), first at step {self.streak[0]}; none of these updates was applied and no "
            f"checkpoint was written after step {self.streak[0] - 1}. The skipped batches are in metrics.jsonl "
            f"(event nonfinite_step); lower train.lr (now {lr:g}; a resume takes the new value) and resume with "
            "--train.resume latest (the newest checkpoint is from before the divergence)",
            self.streak[0],
        )


def describe_batches(
    batches: Sequence[PackedBatch], losses: Sequence[float], rank: int, sources: Sequence[str]
) -> list[dict]:
    """What this rank's micro-batches held, for finding a bad sample: rank, micro-batch, loss sum, token and image
    counts, the dataset rows (``sources``: a mixture's source names in config order, whose sample ``i`` is row
    ``i // n`` of source ``i % n``, as ``data.mixture.Mixture.source_of`` reads it; empty: one source)."""
    out = []
    for i, (batch, loss) in enumerate(zip(batches, losses, strict=True)):
        indices = [j for row in batch.sample_indices for j in row]
        n = len(sources)
        out.append({
            "rank": rank, "micro_batch": i, "loss_sum": loss, "trainable_tokens": batch.num_trainable_tokens,
            "real_tokens": batch.num_real_tokens, "images": batch.num_images,
            "rows": [[sources[j % n], j // n] for j in indices] if n else indices,
        })  # fmt: skip
    return out


def suspects(batches: list[dict]) -> list[dict]:
    """The micro-batches to look at: those whose loss was not finite, or every one when all losses were finite
    (then the gradients overflowed, and any of them may hold the cause)."""
    bad = [b for b in batches if not math.isfinite(b["loss_sum"])]
    return bad or batches


def _local_tensors(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """This rank's pieces of the weights and of the optimizer's floating-point state."""
    tensors: list[torch.Tensor] = list(model.parameters())
    tensors += [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
    local = [t.to_local() if hasattr(t, "to_local") else t for t in tensors]
    return [t for t in local if t.is_floating_point() and t.numel()]


def check_finite_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, env: DistEnv, step: int) -> None:
    """Raise ``DivergedError`` on every rank when any rank holds a non-finite weight or optimizer state (before a
    save or the export: such a file is never written). One read per device and one all-reduce."""
    local = _local_tensors(model, optimizer)
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for t in local:
        by_device.setdefault(t.device, []).append(t)
    bad = any(not bool(torch.stack([torch.isfinite(t).all() for t in ts]).all()) for ts in by_device.values())
    if float(all_reduce(torch.tensor([float(bad)]), env, "max")[0]) > 0:
        raise DivergedError(
            f"the weights or the optimizer state hold a non-finite value after step {step} (its loss and gradient "
            "norm were finite): nothing was saved; lower train.lr and resume with --train.resume latest",
            step,
        )


def log_skip(step: int, guard: NonFiniteGuard, grad_norm: float, suspect: list[dict]) -> None:
    """The warning for a skipped step (rank 0): where the non-finite loss was, and what those micro-batches held."""
    if any(not math.isfinite(b["loss_sum"]) for b in suspect):
        parts = [
            f"rank {b['rank']} micro-batch {b['micro_batch']} ({b['trainable_tokens']} trainable tokens, "
            f"{b['images']} images, rows {b['rows'][:8]}{' ...' if len(b['rows']) > 8 else ''})"
            for b in suspect[:4]
        ]
        more = f" and {len(suspect) - 4} more" if len(suspect) > 4 else ""
        where = f"non-finite loss in {'; '.join(parts)}{more}"
    else:
        where = "every loss was finite (the gradients overflowed)"
    logger.warning(
        "step %d not applied: gradient norm %s, %s; %d skipped in a row (the run stops at "
        "train.max_nonfinite_steps = %d), %d in all; the rows of each micro-batch are in metrics.jsonl",
        step, grad_norm, where, len(guard.streak), guard.limit, guard.total,
    )  # fmt: skip
