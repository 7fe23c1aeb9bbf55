"""``--dry-run``'s table: what a run would hold per rank, measured after the set-up and planned for its steady state.

``trainer.dry_run.dry_run(cfg)`` builds everything exactly as training would (checkpoint load, LoRA / context-parallel
/ MoE wrapping, sharding, the start-up self-check, the data pipeline up to the first step's batches) and then,
instead of the first optimizer step, calls ``report`` on every rank. A user runs it before spending GPU hours: the
measured peaks say whether the load fits, the plan whether the steps will.

Two kinds of figures, labelled as such wherever they are printed:

- **measured**, per rank, so far in this process: the host memory high-water mark (``VmHWM`` of
  ``/proc/self/status``, the peak resident set; ``ru_maxrss`` where there is no ``/proc``) and on CUDA the allocator's
  peaks (``torch.cuda.max_memory_allocated`` / ``max_memory_reserved``). Data workers are processes of their own and
  are not included.
- **planned** (``memory_plan.py``: estimates, the formulas are in its docstring), per rank, from the rank's *actual*
  parameter shard (the local bytes of its DTensors; frozen parameters get no gradient or AdamW state), the model's
  shape and the run's settings: load, training steady state (parameters, gradients, AdamW state, the optimizer step's
  temporaries, FSDP2's gathered units, activations) and save.

Every rank computes its figures; one all-reduce of a host tensor (the control-plane rule, ``parallel.collectives``)
gives every rank the whole table. Rank 0 writes it to ``<train.output_dir>/dry_run.json``.
"""

from __future__ import annotations

import json
import resource
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from vlm_sft.checks.memory_plan import GB, MemoryPlan, plan, step_shape
from vlm_sft.checks.model_counts import ModelCounts
from vlm_sft.config import RunConfig
from vlm_sft.parallel.collectives import all_ranks_or_none, all_reduce_sum
from vlm_sft.parallel.env import DistEnv

REPORT_FILE = "dry_run.json"

MEASURED = ("peak_rss", "rss", "cuda_peak_allocated", "cuda_peak_reserved", "local_param_bytes", "local_trainable")
"""Per-rank values gathered into the report (the last two: this rank's shard, input to its plan)."""


@dataclass(frozen=True)
class RankMemory:
    """One rank's measured memory (bytes) and its planned figures (estimates)."""

    rank: int
    peak_rss: int
    """Measured: host memory high-water mark of this process (VmHWM)."""
    rss: int
    """Measured: host memory resident now (VmRSS)."""
    cuda_peak_allocated: int | None
    """Measured on CUDA: ``torch.cuda.max_memory_allocated`` (None on the CPU)."""
    cuda_peak_reserved: int | None
    """Measured on CUDA: ``torch.cuda.max_memory_reserved`` (None on the CPU)."""
    plan: MemoryPlan
    """Estimates from this rank's actual shard (``memory_plan.plan``)."""


@dataclass(frozen=True)
class DryRunReport:
    """What ``--dry-run`` prints and writes (the same on every rank)."""

    device: str
    """Where the ranks compute (``cpu``, ``cuda:0``: rank 0's)."""
    world_size: int
    """Ranks of the job."""
    checkpoint_bytes: int | None
    """S: the checkpoint's bytes on disk (a local directory's safetensors files); None: random init or a hub id."""
    first_step: dict[str, int]
    """The first step's batches over all ranks: micro-batches per rank and real / trainable / padded tokens."""
    ranks: list[RankMemory]

    def to_dict(self) -> dict[str, Any]:
        ranks = [
            {k: getattr(r, k) for k in ("rank", "peak_rss", "rss", "cuda_peak_allocated", "cuda_peak_reserved")}
            | {"plan": r.plan.to_dict()}
            for r in self.ranks
        ]
        return {
            "device": self.device,
            "world_size": self.world_size,
            "checkpoint_bytes": self.checkpoint_bytes,
            "first_step": self.first_step,
            "ranks": ranks,
        }

    def format(self) -> str:
        """The per-rank table: measured peaks first, then the plan (estimates); one column per rank, or rank 0, the
        smallest and the largest value over ranks beyond ``MAX_RANK_COLUMNS`` ranks (``dry_run.json`` has them all)."""
        s, step, ranks = self.checkpoint_bytes, self.first_step, self.ranks
        lines = [
            f"dry run on {self.world_size} rank(s), {self.device}: set-up done, stopped before the first optimizer step",
            f"checkpoint S = {format_bytes(s)}"
            if s
            else "checkpoint: none read (random init) or size unknown (hub id)",
            f"first step: {step['micro_batches']} micro-batch(es) per rank, {step['capacity']} tokens over all ranks "
            f"({step['real']} real, {step['trainable']} trainable)",
            "",
        ]
        wide = len(ranks) > MAX_RANK_COLUMNS
        head = _row("per rank", ["rank 0", "min", "max"] if wide else [f"rank {r.rank}" for r in ranks])
        lines += [head, "-" * len(head), "measured so far (this process):"]

        def row(label: str, values: list, fmt=format_bytes) -> str:
            return _row(label, [fmt(v) for v in ([values[0], min(values), max(values)] if wide else values)])

        lines.append(row("  peak host memory (RSS high-water mark)", [r.peak_rss for r in ranks]))
        if s:
            ratio = [r.peak_rss / s for r in ranks]
            lines.append(row("  peak host memory / S (with the process's own)", ratio, lambda v: f"{v:.2f}"))
        lines.append(row("  host memory now", [r.rss for r in ranks]))
        if ranks[0].cuda_peak_allocated is not None:
            lines.append(row("  peak GPU memory allocated", [r.cuda_peak_allocated for r in ranks]))
            lines.append(row("  peak GPU memory reserved", [r.cuda_peak_reserved for r in ranks]))
        lines.append("planned (estimates; formulas in vlm_sft/checks/memory_plan.py):")
        plans = [r.plan.to_dict() for r in ranks]
        lines += [row(f"  {label}", [p[key] for p in plans]) for key, label in PLAN_ROWS]
        if self.device.startswith("cuda"):
            lines.append("(planned figures are GPU memory, except the load's read buffer and the save's shard: host)")
        else:
            lines.append("(on the CPU every figure is host memory)")
        return "\n".join(lines)


PLAN_ROWS = (
    ("load", "at load: shard + one tensor's read buffer"),
    ("params", "training: parameters (this rank's shard)"),
    ("grads", "training: gradients (fp32)"),
    ("optimizer_state", "training: AdamW exp_avg + exp_avg_sq"),
    ("optimizer_temporaries", "training: AdamW step temporaries"),
    ("accumulated_grads", "training: unsharded grads (micro-batches)"),
    ("gathered_weights", "training: FSDP2 gathered units"),
    ("expert_dispatch", "training: expert-parallel dispatch buffers"),
    ("activations", "training: activations (one micro-batch)"),
    ("training", "training: total"),
    ("save", "at save: state + gathered tensor + out shard"),
)
"""(``MemoryPlan.to_dict`` key, label) of the planned rows."""


LABEL_WIDTH = 48
MAX_RANK_COLUMNS = 8
"""Beyond this many ranks the printed table shows rank 0, the minimum and the maximum instead of every rank."""


def _row(label: str, cells: list[str]) -> str:
    return f"{label:<{LABEL_WIDTH}}" + "".join(f"{c:>12}" for c in cells)


def format_bytes(n: int | None) -> str:
    """``n`` bytes for a log line or a table: GB from 1 GB on, MiB or KiB below (a tiny model's state is not
    "0.00 GB")."""
    if n is None:
        return "-"
    if n >= GB:
        return f"{n / GB:.2f} GB"
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"


# ------------------------------------------------------------------------------------------------ measuring


def host_memory() -> tuple[int, int]:
    """(peak, current) resident set of this process in bytes: ``VmHWM`` / ``VmRSS`` from ``/proc/self/status``, or
    ``ru_maxrss`` (KiB on Linux) for both where there is no ``/proc``."""
    status = Path("/proc/self/status")
    if status.is_file():
        fields = dict(line.split(":", 1) for line in status.read_text().splitlines() if ":" in line)
        if "VmHWM" in fields and "VmRSS" in fields:
            return _kib(fields["VmHWM"]), _kib(fields["VmRSS"])
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return peak, peak


def _kib(field: str) -> int:
    value, unit = field.split()
    assert unit == "kB", f"unexpected /proc/self/status unit {unit!r}"
    return int(value) * 1024


def local_shard(model: torch.nn.Module) -> tuple[int, int]:
    """(bytes of this rank's parameters, trainable elements of them): a DTensor counts its local shard only."""
    nbytes = trainable = 0
    for p in model.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        nbytes += local.numel() * local.element_size()
        trainable += local.numel() if p.requires_grad else 0
    return nbytes, trainable


def _measure(env: DistEnv, model: torch.nn.Module) -> torch.Tensor:
    """Every rank's ``MEASURED`` values as a ``[world_size, len(MEASURED)]`` host tensor (one all-reduce)."""
    peak, now = host_memory()
    cuda = env.device.type == "cuda"
    alloc = torch.cuda.max_memory_allocated(env.device) if cuda else -1
    reserved = torch.cuda.max_memory_reserved(env.device) if cuda else -1
    table = torch.zeros(env.world_size, len(MEASURED), dtype=torch.float64)
    table[env.rank] = torch.tensor([peak, now, alloc, reserved, *local_shard(model)], dtype=torch.float64)
    return all_reduce_sum(table, env)


# ------------------------------------------------------------------------------------------------ the report


@dataclass(frozen=True)
class FirstStep:
    """The first step's batches over all ranks, as training drew them (``trainer.step_batches.StepBatches``)."""

    micro_batches: int
    """Micro-batches per rank."""
    capacity: int
    """Tokens over all ranks, padding included."""
    real: int
    trainable: int


def report(
    cfg: RunConfig,
    env: DistEnv,
    model: torch.nn.Module,
    out_dir: Path,
    *,
    first_step: FirstStep | None,
    compute_dtype: torch.dtype | None,
    weights_source: Any,
) -> DryRunReport:
    """The dry run's report on every rank (a collective: every rank must call it); rank 0 writes
    ``out_dir / dry_run.json``. ``first_step``: None when the data ended before it; ``weights_source``: the
    checkpoint's index (``CheckpointIndex``; None for a random init)."""
    table = _measure(env, model).long().tolist()
    counts = ModelCounts.of_model(model)
    compute_bytes = 2 if compute_dtype == torch.bfloat16 else 4
    step = step_shape(cfg, model.config, compute_bytes, model.backends)
    source = weights_source  # the loader's index: tensor bytes and dtype from the headers, read once
    size = None if source is None else source.total_bytes
    elem_bytes = 2 if source is None else source.dtype.itemsize  # no checkpoint: plan as the bf16 releases
    ranks = []
    for rank, row in enumerate(table):
        values = dict(zip(MEASURED, row, strict=True))
        p = plan(
            counts, model.config, step, world_size=env.world_size, sharded=env.sharded,
            micro_batches=cfg.train.micro_batches, grad_sync=cfg.train.grad_sync,
            checkpoint_elem_bytes=elem_bytes, checkpoint_bytes=size,
            local_param_bytes=values["local_param_bytes"], local_trainable=values["local_trainable"],
            optimizer_impl=cfg.train.optimizer_impl, ep_size=cfg.train.ep_size,
            optimizer_offload=cfg.train.optimizer_offload,
        )  # fmt: skip
        cuda = [None if values[k] < 0 else values[k] for k in ("cuda_peak_allocated", "cuda_peak_reserved")]
        ranks.append(RankMemory(rank, values["peak_rss"], values["rss"], *cuda, p))
    first = asdict(first_step or FirstStep(0, 0, 0, 0))
    result = DryRunReport(str(env.device), env.world_size, size, first, ranks)
    with all_ranks_or_none(env, f"writing {REPORT_FILE}"):
        if env.is_main:
            (out_dir / REPORT_FILE).write_text(json.dumps(result.to_dict(), indent=2) + "\n")
    return result
