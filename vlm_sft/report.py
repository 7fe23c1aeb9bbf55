"""Data report: ``python -m vlm_sft.report --config X [--section.field value ...] [--out report.json] [--show N]``.

Runs load, render, truncate and pack over one whole pass of the configured dataset without a model, prints a
summary and writes JSON: the schema each source was read as, samples seen / packed, skips by reason with example row
indices, packs, real, trainable and padding tokens, packing efficiency, images and patches per pack; every skip
reason is listed with example rows and the error's detail (which file, which line, what went wrong). Every sample is
accounted for: seen == packed + skipped, or the report fails. Run it before spending GPU hours.

``--show N`` prints instead the first N rows of each training source as the trainer will see them: the rendered
text, image placeholders collapsed, the trained spans marked (``vlm_sft.data.show``).
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

from tqdm.auto import tqdm

from vlm_sft.config import RunConfig, cli_parser, exits_cleanly, parse_cli
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
    schemas = data_build.source_schemas(sources)
    return {
        "source": label,
        "packing": packing or d.packing,
        "seq_len": d.seq_len,
        "schemas": schemas,
        **weights,
        **summary,
    }


def show_samples(cfg: RunConfig, count: int) -> str:
    """The first ``count`` rows of every training source as the trainer will see them (``vlm_sft.data.show``)."""
    from vlm_sft.data import build as data_build
    from vlm_sft.data.show import show_source

    renderer = data_build.build_renderer(cfg, data_build.build_processor(cfg))
    sources = data_build.load_sources(cfg)
    train = sources.train
    parts = (
        [(p.name, p.source) for p in train.parts] if isinstance(train, data_build.MixedSources) else [("train", train)]
    )
    return "\n".join(show_source(name, source, renderer, count) for name, source in parts)


def format_report(report: dict) -> str:
    lines = [
        f"data report: {report['source']} ({report['packing']} packing, pack_len {report['pack_len']})",
        *(f"  schema of {name!r}: {schema}" for name, schema in report.get("schemas", {}).items()),
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
        *(
            [
                f"  videos            {report['videos']:>10} ({report['video_frames']} frames, "
                f"{report['video_tokens']} video tokens)"
            ]
            if report.get("videos")
            else []
        ),
        "  patches per pack  min {min} / median {median} / max {max}".format(**report["patches_per_pack"]),
    ]
    return "\n".join(lines)


@exits_cleanly
def main(argv: list[str] | None = None) -> int:
    parser = cli_parser("python -m vlm_sft.report", __doc__.split("\n\n")[1].replace("``", ""))
    parser.add_argument("--out", default=None, help="JSON path (default: <train.output_dir>/data_report.json)")
    parser.add_argument(
        "--show",
        type=int,
        default=None,
        metavar="N",
        help="print the first N rows of each training source as the trainer sees them (text, <|image_pad|> runs "
        "collapsed, [TRAIN]...[/TRAIN] around the trained tokens, the schema read) and exit, without the full pass",
    )
    known, cfg = parse_cli(parser, sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.WARNING)
    if cfg is None:
        return 2
    if known.show is not None:
        print(show_samples(cfg, known.show))
        return 0
    report = build_report(cfg)
    print(format_report(report))
    out = Path(known.out) if known.out else Path(cfg.train.output_dir) / "data_report.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
