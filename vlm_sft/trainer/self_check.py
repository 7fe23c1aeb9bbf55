"""The packing self-check on the configured data and model: what the trainer runs at start-up.

``train.check_packing = true`` makes the trainer call ``run_packing_check`` before sharding the model; the CLI
``python -m vlm_sft.check_packing --config X`` wraps the same function. It takes the first rows of the configured
packing pipeline, runs ``vlm_sft.model.packing_check.check_packing`` on each (packed row vs every sample alone,
both judged against a float64 reference on the pure-torch kernels) and returns the worst report. It never raises on
a failed check: the caller decides (the trainer stops every rank, the CLI exits 1).

Every sample's tensors and its MRoPE positions stay on the CPU here: positions are built from CPU metadata (a CPU
tensor indexed with a CUDA index crashes), and ``check_packing`` builds each row on the CPU and moves it as a whole.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from vlm_sft.config import RunConfig
from vlm_sft.data.mrope import sample_position_ids
from vlm_sft.data.shift import ShiftedSample
from vlm_sft.model.packing_check import RATIO_BOUND, PackingReport, check_packing
from vlm_sft.trainer.build import build_pipeline

logger = logging.getLogger(__name__)

PADDING_TOKENS = 8
"""Length of the padding segment appended to every checked row (real rows end in one; it must stay inert)."""


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


def run_packing_check(
    cfg: RunConfig,
    *,
    model: nn.Module,
    renderer: Any,
    source: Any,
    pad_id: int | None = None,
    rows: int = 2,
    max_samples_per_row: int = 8,
    bound: float = RATIO_BOUND,
) -> PackingReport:
    """Check the first ``rows`` packs of the configured pipeline (their first ``max_samples_per_row`` samples, plus a
    padding segment of ``pad_id`` when given); returns the worst ``PackingReport`` (see ``_severity``).

    ``model`` is the unsharded model with float32 master weights; ``cfg.model.dtype = "bfloat16"`` runs the packed
    and alone passes under bf16 autocast (training gets bf16 through FSDP2 mixed precision; on the unsharded model
    autocast hands the same kernels bf16 inputs). ``stack`` packing is checked as ``cat`` packs (a
    stacked batch has no packed rows). Raises ``ValueError`` only when the data yields no pack at all.
    """
    compute_dtype = torch.bfloat16 if cfg.model.dtype == "bfloat16" else None
    merge = model.config.vision_config.spatial_merge_size
    packing = "cat" if cfg.data.packing == "stack" else None
    pipeline = build_pipeline(cfg, source, renderer, epochs=1, packing=packing)
    worst: PackingReport | None = None
    for _, pack in zip(range(rows), pipeline, strict=False):
        samples = [sample_inputs(s, spatial_merge_size=merge) for s in pack.samples[:max_samples_per_row]]
        if pad_id is not None:
            samples.append(padding_inputs(pad_id))
        report = check_packing(model, samples, compute_dtype=compute_dtype, bound=bound)
        if worst is None or _severity(report) > _severity(worst):
            worst = report
    if worst is None:
        raise ValueError("the configured data produced no pack to check")
    return worst


__all__ = ["PADDING_TOKENS", "padding_inputs", "run_packing_check", "sample_inputs"]
