"""The packing self-check on the configured data and model: what the trainer runs at start-up.

``train.check_packing = true`` makes the trainer call ``run_packing_check`` on every rank after sharding the model;
the CLI ``python -m vlm_sft.check_packing --config X`` wraps the same function. It takes the first rows of the
configured packing pipeline (samples capped at ``CHECK_SEQ_LEN`` tokens), builds the model's slice for them
(``checks.slice.build_slice``: the first layer of each kind, a vision block, a few experts, only the rows' vocabulary;
collectives when the model is sharded) and runs ``vlm_sft.checks.packing_check.check_packing`` on the slice for each
row (packed row vs every sample alone, both judged against a float64 reference of the slice on the pure-torch
kernels). It returns the worst report on rank 0 (None elsewhere) and never raises on a failed check: the caller
decides (the trainer stops every rank, the CLI exits 1). No rank ever holds a copy of the whole model.

Every sample's tensors and its MRoPE positions stay on the CPU here: positions are built from CPU metadata (a CPU
tensor indexed with a CUDA index crashes), and ``check_packing`` builds each row on the CPU and moves it as a whole.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from vlm_sft.checks.packing_check import RATIO_BOUND, PackingReport, check_packing
from vlm_sft.checks.slice import build_slice, compact_vocab, remap_ids
from vlm_sft.config import RunConfig
from vlm_sft.data.build import build_pipeline
from vlm_sft.data.mrope import sample_position_ids
from vlm_sft.data.shift import ShiftedSample
from vlm_sft.parallel.collectives import all_ranks_or_none, gather_objects
from vlm_sft.parallel.env import DistEnv

logger = logging.getLogger(__name__)

PADDING_TOKENS = 8
"""Length of the padding segment appended to every checked row (real rows end in one; it must stay inert)."""
CHECK_SEQ_LEN = 1024
"""Longest checked sample, in tokens (the check's pipeline truncates longer ones image-safely, as training would at
this ``data.seq_len``). Each sample also runs alone in float64 on SDPA, whose float64 path holds a [heads, T, T]
score matrix, per image in the vision tower: 0.13 GB per copy at 16 heads and T = 1024 (2 GB for an image of 4096
patches, the most 1024 tokens hold), 2 TB at a long-context run's 128k. Leaks are at segment boundaries, and 1024
tokens span many kernel chunks (GatedDeltaNet 64, flash 128)."""
CHECK_PACK_LEN = 4096
"""Longest checked row, in tokens (the check's ``data.pack_len``)."""


def sample_inputs(s: ShiftedSample, *, spatial_merge_size: int) -> dict[str, torch.Tensor | None]:
    """One shifted sample as ``check_packing`` takes it: CPU tensors, positions of the sample alone."""
    positions = sample_position_ids(s.mm_token_type_ids, s.image_grid_thw, spatial_merge_size=spatial_merge_size)
    return {
        "input_ids": s.input_ids,
        "position_ids": positions,
        "target_ids": s.target_ids,
        "loss_mask": s.loss_mask,
        "mm_token_type_ids": s.mm_token_type_ids,
        "pixel_values": s.pixel_values,
        "image_grid_thw": s.image_grid_thw,
    }


def padding_inputs(pad_id: int, n: int = PADDING_TOKENS) -> dict[str, torch.Tensor | None]:
    """A padding segment as the collator writes one: ``pad_id`` tokens, positions from 0, no loss."""
    return {
        "input_ids": torch.full((n,), pad_id, dtype=torch.long),
        "position_ids": torch.arange(n).expand(3, n),
        "target_ids": torch.full((n,), pad_id, dtype=torch.long),
        "loss_mask": torch.zeros(n, dtype=torch.bool),
        "mm_token_type_ids": torch.zeros(n, dtype=torch.long),
        "pixel_values": None,
        "image_grid_thw": None,
    }


def _severity(report: PackingReport) -> tuple[bool, float]:
    """Sort key of the worst report: a failed one first, then the larger of the logits' and gradients' ratios."""
    return (not report.ok, max(report.logits.ratio, report.grad.ratio))


def check_config(cfg: RunConfig) -> RunConfig:
    """``cfg`` with the data capped at ``CHECK_SEQ_LEN`` / ``CHECK_PACK_LEN`` (longer samples truncated, not dropped:
    a long-context run's data must still give rows); unchanged when it fits."""
    d = cfg.data
    if d.seq_len <= CHECK_SEQ_LEN and d.pack_len <= CHECK_PACK_LEN:
        return cfg
    capped = {"seq_len": min(d.seq_len, CHECK_SEQ_LEN), "pack_len": min(d.pack_len, CHECK_PACK_LEN)}
    return cfg.model_copy(update={"data": d.model_copy(update={**capped, "truncation": "truncate"})})


def checked_rows(
    cfg: RunConfig, renderer: Any, source: Any, *, spatial_merge_size: int, pad_id: int | None, rows: int,
    max_samples_per_row: int,
) -> list[list[dict]]:  # fmt: skip
    """The first ``rows`` packs of the check's pipeline (``check_config``), their first ``max_samples_per_row``
    samples each plus a padding segment of ``pad_id`` when given. ``stack`` packing is checked as ``cat`` packs (a
    stacked batch has no packed rows). Raises ``ValueError`` when the data yields no pack at all."""
    packing = "cat" if cfg.data.packing == "stack" else None
    pipeline = build_pipeline(check_config(cfg), source, renderer, epochs=1, packing=packing)
    out = []
    for _, pack in zip(range(rows), pipeline, strict=False):
        samples = [sample_inputs(s, spatial_merge_size=spatial_merge_size) for s in pack.samples[:max_samples_per_row]]
        out.append([*samples, padding_inputs(pad_id)] if pad_id is not None else samples)
    if not out:
        raise ValueError("the configured data produced no pack to check")
    return out


def rows_vocab(rows: Sequence[Sequence[dict]], pad_id: int | None) -> torch.Tensor:
    """The compact vocabulary of ``rows``: every input and target id, and the model's pad id."""
    ids = [s[k] for row in rows for s in row for k in ("input_ids", "target_ids")]
    return compact_vocab(ids, [pad_id])


def remap_row(row: Sequence[dict], vocab: torch.Tensor) -> list[dict]:
    """``row``'s samples with their input and target ids renumbered into the slice's compact ``vocab``."""
    return [{**s, "input_ids": remap_ids(s["input_ids"], vocab), "target_ids": remap_ids(s["target_ids"], vocab)}
            for s in row]  # fmt: skip


def worst_report(model: nn.Module, rows, *, compute_dtype: torch.dtype | None, bound: float) -> PackingReport:
    """``check_packing`` on each row; the worst report (see ``_severity``)."""
    reports = [check_packing(model, row, compute_dtype=compute_dtype, bound=bound) for row in rows]
    return max(reports, key=_severity)


def run_packing_check(
    cfg: RunConfig,
    *,
    model: nn.Module,
    renderer: Any,
    source: Any,
    pad_id: int | None = None,
    env: DistEnv | None = None,
    rows: int = 2,
    max_samples_per_row: int = 8,
    bound: float = RATIO_BOUND,
    whole_model: bool = False,
) -> PackingReport | None:
    """Check the first ``rows`` packs of the configured pipeline (``checked_rows``) on the model's slice; returns
    the worst ``PackingReport`` on rank 0, None on the other ranks.

    ``model`` has float32 master weights, FSDP2-sharded (then every rank of ``env`` calls this: the slice's
    gathers are collectives) or not (``env`` None: one process). ``cfg.model.dtype = "bfloat16"`` runs the packed
    and alone passes under bf16 autocast (training gets bf16 through FSDP2 mixed precision; autocast hands the same
    kernels bf16 inputs). ``whole_model`` (unsharded only) checks the model itself, every layer, with a float64 copy
    of all of it. Failures in rank 0's sections stop every rank (``all_ranks_or_none``).
    """
    env = env or DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    compute_dtype = torch.bfloat16 if cfg.model.dtype == "bfloat16" else None
    config = model.config
    packs = None
    with all_ranks_or_none(env, "reading the packing self-check's rows"):
        if env.is_main:
            merge = config.vision_config.spatial_merge_size
            packs = checked_rows(
                cfg, renderer, source, spatial_merge_size=merge, pad_id=pad_id, rows=rows,
                max_samples_per_row=max_samples_per_row,
            )  # fmt: skip
    if whole_model:
        if env.distributed:
            raise ValueError("whole_model=True checks an unsharded model in one process")
        return worst_report(model, packs, compute_dtype=compute_dtype, bound=bound)
    vocab = gather_objects(rows_vocab(packs, config.text_config.pad_token_id) if env.is_main else None, env)[0]
    check_model = build_slice(model, vocab, env)  # every rank: the gathers of a sharded model are collectives
    report = None
    with all_ranks_or_none(env, "running the packing self-check"):
        if env.is_main:
            remapped = [remap_row(row, vocab) for row in packs]
            report = worst_report(check_model, remapped, compute_dtype=compute_dtype, bound=bound)
    return report


__all__ = [
    "CHECK_PACK_LEN",
    "CHECK_SEQ_LEN",
    "PADDING_TOKENS",
    "check_config",
    "checked_rows",
    "padding_inputs",
    "remap_row",
    "rows_vocab",
    "run_packing_check",
    "sample_inputs",
    "worst_report",
]
