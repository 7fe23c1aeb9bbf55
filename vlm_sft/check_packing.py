"""Packing self-check: ``python -m vlm_sft.check_packing --config X [--section.field value ...]``.

Builds the configured model on the configured backends, takes the first packed rows of the configured data (samples
capped at ``self_check.CHECK_SEQ_LEN`` tokens), and runs every sample both inside its packed row and alone, at the
configured precision (``model.dtype``), next to a float64 reference of the sample alone on the pure-torch kernels.
It checks what training checks: the model's slice (``checks.slice``: the first layers up to one of each kind,
a vision block, a few experts, the rows' vocabulary); ``--whole-model`` checks every layer instead, with a float64
copy of the whole model. For the logits, the loss gradients and each op class (vision, conv, linear attention,
attention, MLP) it prints the floor (the sample's own rounding noise: |alone - reference|), the leak
(|packed - reference|) and their ratio. An exact packed row scores about 1; a backend that lets packed samples see
each other scores tens to thousands. Exits 1 when the logits' or gradients' ratio is over the bound (default
``RATIO_BOUND``), 0 otherwise. ``train.check_packing = true`` runs the same check
(``vlm_sft.checks.self_check.run_packing_check``) at the start of training.
"""

from __future__ import annotations

import logging
import sys

from vlm_sft.config import cli_parser, exits_cleanly, parse_cli


@exits_cleanly
def main(argv: list[str] | None = None) -> int:
    parser = cli_parser(
        "python -m vlm_sft.check_packing",
        "Packed rows vs each sample alone, on the configured model, kernels, precision and data. Prints per op\n"
        "class, logits and gradients the floor (the sample's own rounding noise: |alone - float64 reference|), the\n"
        "leak (|packed - reference|) and their ratio; exits 1 when a ratio is over the bound.",
    )
    parser.add_argument("--rows", type=int, default=2, help="packed rows to check (default 2)")
    parser.add_argument("--max-samples", type=int, default=8, help="samples per row (default 8)")
    parser.add_argument(
        "--bound",
        type=float,
        default=None,
        help="largest leak / floor ratio that passes (default: the calibrated RATIO_BOUND, 4; exact rows score ~1)",
    )
    parser.add_argument(
        "--whole-model",
        action="store_true",
        help="check every layer of the model (a float64 copy of all of it) instead of the slice training checks",
    )
    known, cfg = parse_cli(parser, sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if cfg is None:
        return 2
    from vlm_sft.checkpoint import build
    from vlm_sft.checks.packing_check import RATIO_BOUND  # the model stack loads only after --help was handled
    from vlm_sft.checks.self_check import run_packing_check
    from vlm_sft.data import build as data_build
    from vlm_sft.parallel.env import resolve_device

    processor = data_build.build_processor(cfg)
    renderer = data_build.build_renderer(cfg, processor)
    sources = data_build.load_sources(cfg)
    model = build.build_model(cfg, resolve_device(cfg.train.device))
    report = run_packing_check(
        cfg,
        model=model,
        renderer=renderer,
        source=sources.train,
        pad_id=int(processor.tokenizer.pad_token_id),
        rows=known.rows,
        max_samples_per_row=known.max_samples,
        bound=known.bound if known.bound is not None else RATIO_BOUND,
        whole_model=known.whole_model,
    )
    print(report.format())
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
