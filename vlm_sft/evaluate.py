"""Benchmark scores of a checkpoint: ``python -m vlm_sft.evaluate CHECKPOINT [--config X | --source FILE --metric M]``.

CHECKPOINT is a run's ``final/`` or ``checkpoints/step-N/hf``, a LoRA adapter folder (on the base its
``adapter_config.json`` names, or ``--base``), or a base HF checkpoint (a folder or a hub id), so a fine-tune and its
base are scored on the same prompts. What is scored: every held-out source of the config that sets a ``metric``
(``[[data.eval_sources]]`` tables, or ``data.eval_source`` with ``data.metric``), or the one ``--source`` (any file,
folder, hub snapshot or hub id the trainer reads, in any schema it reads) with ``--metric``.

Each row is cut before its last reply and asked as a server asks the checkpoint (its own chat template; its thinking
default unless a source sets ``thinking``), greedily, ``max_new_tokens`` at most. ``--backend ours`` answers on our
model and decode cache, in packed batches, on one process or under ``accelerate launch`` over N; ``--backend
transformers`` through transformers' ``generate``, one prompt at a time (one process), as a reference. Writes
``scores.json`` (per source: score, count, unparsed replies, a bootstrap 95% interval, the settings that affect the
score) and ``predictions.jsonl`` (one line per row, in the source's order) into ``--output-dir``.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from vlm_sft.config import METRICS, ConfigError, RunConfig, SourceConfig, cli_parser, exits_cleanly, parse_cli

logger = logging.getLogger(__name__)

CHUNK_PROMPTS = 64
"""Prompts per rank answered between two updates of the progress bar."""


def _parser():
    parser = cli_parser("python -m vlm_sft.evaluate", __doc__.split("\n\n")[0].replace("``", ""))
    parser.add_argument("checkpoint", help="final/, step-N/hf, an adapter folder, or a base checkpoint (dir or hub id)")
    parser.add_argument("--source", help="score this file / folder / snapshot / hub id instead of the config's")
    parser.add_argument("--metric", choices=METRICS, help="the metric of --source")
    parser.add_argument("--subset", help="--source's subset (a hub dataset's config name)")
    parser.add_argument("--split", help="--source's split (default: data.split)")
    parser.add_argument("--instruction", help="--source's answer-format suffix (docs/serving.md)")
    parser.add_argument("--thinking", choices=("true", "false"), help="--source's thinking mode")
    parser.add_argument(
        "--max-new-tokens", type=int, help="--source's longest reply (default train.eval_generate_max_tokens)"
    )
    parser.add_argument("--limit", type=int, help="score only the first N rows of each source")
    parser.add_argument(
        "--output-dir", type=Path, help="where scores.json and predictions.jsonl go (default CHECKPOINT/eval)"
    )
    parser.add_argument(
        "--backend", choices=("ours", "transformers"), default="ours", help="who answers (default ours)"
    )
    parser.add_argument("--base", help="adapter folders: the base checkpoint (default: adapter_config.json's)")
    return parser


def scored_tables(cfg: RunConfig, args: Any) -> list[SourceConfig]:
    """The held-out tables to score: ``--source`` as one, else the config's tables that set a metric."""
    from vlm_sft.data.build import held_out_tables

    if args.source is not None:
        if args.metric is None:
            raise ConfigError(f"--source {args.source} needs --metric (one of {', '.join(METRICS)})")
        thinking = None if args.thinking is None else args.thinking == "true"
        table = SourceConfig(
            source=args.source, metric=args.metric, subset=args.subset, split=args.split, instruction=args.instruction,
            thinking=thinking, max_new_tokens=args.max_new_tokens, max_scored=args.limit, streaming=False,
        )  # fmt: skip
        return [table]
    tables = [t for t in held_out_tables(cfg) if t.metric is not None]
    if not tables:
        raise ConfigError(
            "nothing to score: pass --source FILE --metric NAME, or a config whose [[data.eval_sources]] tables (or "
            "data.eval_source with data.metric) set a metric"
        )
    return [t.model_copy(update={"max_scored": args.limit}) if args.limit else t for t in tables]


def main_config(cfg: RunConfig, checkpoint: str, processor: Any) -> RunConfig:
    """The run config with the checkpoint as its model and the checkpoint template's thinking default as
    ``data.enable_thinking`` (what a server calling it with no arguments gets)."""
    from renderers.served import default_thinking_mode

    served = default_thinking_mode(processor.chat_template, processor.tokenizer.special_tokens_map)
    data = cfg.data if served is None else cfg.data.model_copy(update={"enable_thinking": served})
    model = cfg.model.model_copy(update={"name_or_path": checkpoint, "lora": None})
    return cfg.model_copy(update={"data": data, "model": model})


def merged_adapter(path: Path, base: str | None, into: Path) -> Path:
    """An adapter folder merged into its base with peft and saved as an HF checkpoint under ``into`` (our model
    loads HF checkpoints; a checkpoint folder is returned as it is)."""
    if not (path / "adapter_config.json").is_file():
        return path
    import torch

    from vlm_sft.generate import load_model

    model, processor = load_model(path, base, device=torch.device("cpu"))
    model.merge_and_unload().save_pretrained(into)
    processor.save_pretrained(into)
    return into


def ask_all(
    cfg: RunConfig, args: Any, tables: list[SourceConfig], env: Any, workdir: Path
) -> tuple[list[dict], dict[str, dict[str, int]]]:
    """Every table's rows asked and scored: the rows on rank 0 (empty elsewhere), and per source the rows that could
    not be asked, by reason."""
    from processors import load_processor
    from renderers import get_renderer
    from vlm_sft.data.build import open_held_out
    from vlm_sft.trainer.scored_eval import scored_prompts, scored_source

    path = Path(args.checkpoint)
    local = merged_adapter(path, args.base, workdir) if path.exists() else path
    processor = load_processor(local)
    cfg = main_config(cfg, str(local), processor)
    renderer = get_renderer(processor, enable_thinking=cfg.data.enable_thinking)
    prompts, left_out = {}, {}
    for table in tables:
        scored = scored_source(cfg, table, open_held_out(cfg, table))
        prompts[scored.name], skipped = scored_prompts(scored, renderer)
        left_out[scored.name] = dict(skipped)
        if skipped:
            logger.warning("source %r: %d rows left out: %s", scored.name, sum(skipped.values()), dict(skipped))
    if args.backend == "transformers":
        if env.world_size > 1:
            raise ConfigError("--backend transformers runs on one process (it is the reference, not the fast path)")
        return transformers_rows(local if path.exists() else path, args.base, prompts, processor.tokenizer), left_out
    return ours_rows(cfg, prompts, env, processor.tokenizer), left_out


def ours_rows(cfg: RunConfig, prompts: dict[str, list], env: Any, tokenizer: Any) -> list[dict]:
    """Replies on our model and decode cache, every rank in step, ``CHUNK_PROMPTS`` per rank between bar updates."""
    from vlm_sft.checkpoint.build import build_model
    from vlm_sft.trainer.scored_eval import evaluate_scores

    model = build_model(cfg, env.device, env=env if env.sharded else None)
    step = CHUNK_PROMPTS * env.world_size
    rows: list[dict] = []
    total = sum(len(p) for p in prompts.values())
    with tqdm(total=total, desc="scoring", unit="prompt", disable=not env.is_main) as bar:
        for name, asked in prompts.items():
            for start in range(0, len(asked), step):
                chunk = asked[start : start + step]
                rows += evaluate_scores(model, {name: chunk}, env, tokenizer, token_budget=cfg.data.pack_len)[1]
                bar.update(len(chunk))
    return rows


def transformers_rows(checkpoint: Path, base: str | None, prompts: dict[str, list], tokenizer: Any) -> list[dict]:
    """Replies through transformers' ``generate`` and the checkpoint's own template (the reference backend)."""
    import torch

    from vlm_sft.generate import ask, load_model
    from vlm_sft.trainer.scored_eval import prediction_text, score_prediction

    model, processor = load_model(Path(checkpoint), base, torch.device("cpu"))
    rows = []
    for asked in prompts.values():
        for p in tqdm(asked, desc=f"scoring {asked[0].source}" if asked else "scoring", unit="prompt"):
            tokens = ask(
                model, processor, p.messages, tools=p.tools, max_new_tokens=p.max_new_tokens,
                template_kwargs={"enable_thinking": p.thinking},
            )  # fmt: skip
            rows.append(score_prediction(p, prediction_text(tokenizer, tokens, thinking=p.thinking)))
    return rows


def write_results(
    out: Path, rows: list[dict], left_out: dict[str, dict[str, int]], tables: list[SourceConfig], args: Any
) -> dict:
    """``scores.json`` and ``predictions.jsonl`` under ``out``; returns the scores (a source with no row asked has
    score None)."""
    from vlm_sft.trainer.scored_eval import summarize

    found = summarize(rows)
    scores = {}
    for table in tables:
        empty = {"metric": table.metric, "score": None, "count": 0, "unparsed": 0, "interval95": [None, None]}
        settings = table.model_dump(include={"metric", "instruction", "thinking", "max_new_tokens", "max_scored"})
        settings.update(source=table.source, subset=table.subset, split=table.split)
        scores[table.label] = {
            **found.get(table.label, empty),
            "left_out": left_out.get(table.label, {}),
            "settings": {**settings, "backend": args.backend, "checkpoint": args.checkpoint},
        }
    out.mkdir(parents=True, exist_ok=True)
    (out / "scores.json").write_text(json.dumps(scores, indent=2) + "\n")
    with (out / "predictions.jsonl").open("w") as f:
        f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
    return scores


@exits_cleanly
def main(argv: list[str] | None = None) -> int:
    known, cfg = parse_cli(_parser(), sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.WARNING)
    if cfg is None:
        return 2
    from vlm_sft.parallel.env import cleanup, init_distributed

    tables = scored_tables(cfg, known)
    env = init_distributed(cfg.train.device)
    finished = False
    try:
        with tempfile.TemporaryDirectory() as workdir:
            rows, left_out = ask_all(cfg, known, tables, env, Path(workdir))
        finished = True
    finally:
        cleanup(env, finished=finished)
    if not env.is_main:
        return 0
    out = known.output_dir or Path(known.checkpoint) / "eval"
    scores = write_results(out, rows, left_out, tables, known)
    for name, s in scores.items():
        skipped = f", {sum(s['left_out'].values())} rows left out {s['left_out']}" if s["left_out"] else ""
        if s["score"] is None:
            print(f"{name}: no row could be asked{skipped}", file=sys.stderr)
            continue
        interval = "-".join(f"{v:.4f}" for v in s["interval95"] if v is not None)
        print(
            f"{name}: {s['metric']} {s['score']:.4f} (95% interval {interval}) over {s['count']} rows, "
            f"{s['unparsed']} unparsed{skipped}"
        )
    print(f"wrote {out}/scores.json and {out}/predictions.jsonl")
    return 1 if any(s["score"] is None for s in scores.values()) else 0


if __name__ == "__main__":
    exit_code = main()
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # a process of a multi-process run: skip the teardown that aborts
        from vlm_sft.parallel.env import end_process

        end_process(exit_code)
    sys.exit(exit_code)
