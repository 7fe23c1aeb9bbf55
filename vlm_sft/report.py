"""Data report: ``python -m vlm_sft.report --config X [--section.field value ...] [--out report.json]``.

Runs load, render, truncate and pack over one whole pass of the configured dataset without a model, prints a
summary and writes JSON: samples seen / packed, skips by reason with example row indices, packs, real, trainable and
padding tokens, packing efficiency, images and patches per pack; every skip reason is listed with example rows and
the error's detail (which file, which line, what went wrong). Every sample is accounted for: seen == packed +
skipped, or the report fails. Run it before spending GPU hours.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

from tqdm.auto import tqdm

from vlm_sft.config import RunConfig, cli_parser, parse_cli
from vlm_sft.data.accounting import format_skips, format_sources
from vlm_sft.data.pipeline import summarize_pass


def build_report(cfg: RunConfig, *, packing: str | None = None, progress: bool = True) -> dict:
    """One pass over the training data with the configured (or the given) packing mode; see the module docstring."""
    from vlm_sft.data import build as data_build

    processor = data_build.build_processor(cfg)
    renderer = data_build.build_renderer(cfg, processor)
    sources = data_build.load_sources(cfg)
    bar = tqdm(total=sources.train_rows, desc="rendering + packing", unit="sample", disable=not progress)
    pipeline = data_build.build_pipeline(
        cfg, sources.train, renderer, epochs=1, shuffle=False, packing=packing, progress=bar
    )
    summary = summarize_pass(pipeline)  # raises unless seen == packed + skipped
    bar.close()
    d = cfg.data
    label = "mixture of " + ", ".join(e.label for e in d.sources) if d.sources else d.source
    weights = {"weights": {e.label: e.weight for e in d.sources}} if d.sources else {}
    return {"source": label, "packing": packing or d.packing, "seq_len": d.seq_len, **weights, **summary}


def format_report(report: dict) -> str:
    lines = [
        f"data report: {report['source']} ({report['packing']} packing, pack_len {report['pack_len']})",
        f"  samples seen      {report['samples_seen']:>10}",
        f"  samples packed    {report['samples_packed']:>10}",
        f"  samples skipped   {sum(v['count'] for v in report['skipped'].values()):>10}",
    ]
    lines += format_skips(report["skipped"])
    lines += format_sources(report.get("sources", {}), report.get("weights"))
    lines += [
        f"  packs             {report['packs']:>10}",
        f"  real tokens       {report['real_tokens']:>10}",
        f"  trainable tokens  {report['trainable_tokens']:>10}",
        f"  padding tokens    {report['padding_tokens']:>10}",
        f"  packing efficiency{report['packing_efficiency']:>10.4f}",
        f"  images            {report['images']:>10}",
        "  patches per pack  min {min} / median {median} / max {max}".format(**report["patches_per_pack"]),
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = cli_parser("python -m vlm_sft.report", __doc__.split("\n\n")[1].replace("``", ""))
    parser.add_argument("--out", default=None, help="JSON path (default: <train.output_dir>/data_report.json)")
    known, cfg = parse_cli(parser, sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.WARNING)
    if cfg is None:
        return 2
    report = build_report(cfg)
    print(format_report(report))
    out = Path(known.out) if known.out else Path(cfg.train.output_dir) / "data_report.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
