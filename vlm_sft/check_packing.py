"""Packing self-check: ``python -m vlm_sft.check_packing --config X [--section.field value ...]``.

Builds the configured model on the configured backends, takes a few real packed rows from the configured data, and
compares every sample's logits and loss gradient in the packed forward against the same sample run alone. Prints
the max |delta| per op class (vision, conv, linear attention, attention, MLP) and exits non-zero over tolerance:
a backend that lets packed samples see each other cannot train unnoticed. ``train.check_packing = true`` runs the
same check at the start of training.
"""

from __future__ import annotations

import argparse
import logging
import sys

import torch

from vlm_sft.config import RunConfig, config_from_cli
from vlm_sft.data.mrope import sample_position_ids
from vlm_sft.data.shift import ShiftedSample

logger = logging.getLogger(__name__)

DEFAULT_TOL = {"float32": 1e-4, "bfloat16": 5e-2}
"""Max |logit delta| allowed per dtype: fp32 paths agree to ~1e-6 on CPU; bf16 kernels round differently per shape."""


def _as_sample_dict(s: ShiftedSample, device: torch.device, merge: int) -> dict:
    """The sample's tensors on ``device``; its positions are built here, on the CPU, from CPU metadata."""
    move = lambda t: None if t is None else t.to(device)  # noqa: E731
    positions = sample_position_ids(s.mm_token_type_ids, s.image_grid_thw, spatial_merge_size=merge)
    return {
        "input_ids": move(s.input_ids),
        "position_ids": move(positions),
        "target_ids": move(s.target_ids),
        "loss_mask": move(s.loss_mask),
        "mm_token_type_ids": move(s.mm_token_type_ids),
        "pixel_values": move(s.pixel_values),
        "image_grid_thw": move(s.image_grid_thw),
    }


def run_packing_check(
    cfg: RunConfig,
    *,
    model,
    renderer,
    source,
    pad_id: int,
    rows: int = 2,
    max_samples_per_row: int = 8,
    tol: float | None = None,
):
    """Check ``rows`` packs of the configured pipeline (first ``max_samples_per_row`` samples of each).

    Returns the worst ``PackingReport`` (the one with the largest logit delta).
    """
    from vlm_sft.model.packing_check import check_packing
    from vlm_sft.trainer.build import build_pipeline

    del pad_id  # the check packs by plain concatenation: no padding segment is needed
    tol = DEFAULT_TOL[cfg.model.dtype] if tol is None else tol
    device = next(model.parameters()).device
    pipeline = build_pipeline(cfg, source, renderer, epochs=1, packing="cat" if cfg.data.packing == "stack" else None)
    worst = None
    for _, pack in zip(range(rows), pipeline, strict=False):
        merge = model.config.vision_config.spatial_merge_size
        samples = [_as_sample_dict(s, device, merge) for s in pack.samples[:max_samples_per_row]]
        autocast = cfg.model.dtype == "bfloat16" and device.type == "cuda"
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            report = check_packing(model, samples, tol=tol)
        if worst is None or report.logits_delta > worst.logits_delta:
            worst = report
    if worst is None:
        raise ValueError("the configured data produced no pack to check")
    return worst


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], add_help=True)
    parser.add_argument("--rows", type=int, default=2, help="packed rows to check")
    parser.add_argument("--max-samples", type=int, default=8, help="samples per row")
    parser.add_argument("--tol", type=float, default=None, help="max |logit delta| (default by dtype)")
    known, rest = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    cfg = config_from_cli(rest)
    if cfg is None:
        return 2
    from vlm_sft.trainer import build
    from vlm_sft.trainer.distributed import resolve_device

    processor = build.build_processor(cfg)
    renderer = build.build_renderer(cfg, processor)
    sources = build.load_sources(cfg)
    model = build.build_model(cfg, resolve_device(cfg.train.device))
    report = run_packing_check(
        cfg,
        model=model,
        renderer=renderer,
        source=sources.train,
        pad_id=int(processor.tokenizer.pad_token_id),
        rows=known.rows,
        max_samples_per_row=known.max_samples,
        tol=known.tol,
    )
    print(report.format())
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
