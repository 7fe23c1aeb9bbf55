"""A small weighted mixture to try ``[[data.sources]]`` on: the shapes dataset split by task into three sources, each
written in another of the row formats the loader reads (``configs/debug_mixture.toml`` trains on it).

    python -m vlm_sft.data.mixture_example [--out data/mixture_example] [--num-train 600] [--num-eval 60] [--seed 0]

Layout under ``--out`` (each source a ``train`` and an ``eval`` file, rows keep the shapes ``task`` / ``answer`` /
``id`` so the eval scores per task and a row can be traced to its shapes sample):

- ``messages/train.jsonl``, ``messages/eval.jsonl``: OpenAI / HF chat rows exactly as the shapes dataset writes them
  (``{"messages", "task", "answer", "id"}``), image blocks holding a path relative to the file's folder
  (``images/train-000012.png``); the colour and shape questions.
- ``llava/train.json``, ``llava/eval.json``: ShareGPT / LLaVA rows in one JSON array, one row per line
  (``{"id", "image", "conversations": [{"from": "human", "value": "<image>\\n..."}, {"from": "gpt", ...}],
  "task", "answer"}``, plus ``"system"`` where the sample has a system prompt); the count and position questions.
- ``parquet/train.parquet``, ``parquet/eval.parquet``: chat rows with ``{"type": "image"}`` placeholder blocks,
  filled in order from an ``images`` column of the ``datasets`` ``Image`` feature that embeds the PNG bytes (no
  image files on disk); the two-image compare and text-only questions.

Why split by task: every source then holds questions of its own kind, so ``samples/<name>`` and ``eval_loss/<name>``
in ``metrics.jsonl`` say something per source. The training rows are shared out in proportion to the config's
weights (6 : 3 : 1), so one pass of the weighted mixture reads each source about once; the held-out rows are shared
out evenly, since each eval source is scored on its own. Source ``s`` holds the first shapes samples whose task is
one of ``s``'s, so every file is a pure function of the settings. A ``manifest.json`` records the settings and the
row counts; a folder with a matching manifest is left as it is, any other is rewritten.
"""

from __future__ import annotations

import argparse
import io
import json
import logging
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import datasets
import pyarrow.parquet as pq
from tqdm.auto import tqdm

from vlm_sft.data.placeholders import IMAGE_MARKER
from vlm_sft.data.shapes import ShapesSample, make_sample

logger = logging.getLogger(__name__)

DEFAULT_OUT = Path("data/mixture_example")
"""Where the CLI writes by default (relative to the repo root, as ``configs/debug_mixture.toml`` reads it)."""
SPLITS = ("train", "eval")
"""Shapes generator split of each file: ``eval`` rows are held out from every training file."""
_MANIFEST_VERSION = 1  # bump when the written rows change, so old folders are rewritten


@dataclass(frozen=True)
class SourceSpec:
    """One source of the example mixture."""

    name: str
    """Folder name and the ``name`` of its ``[[data.sources]]`` table."""
    tasks: tuple[str, ...]
    """Shapes tasks whose samples go to this source (the three sources partition ``shapes.TASK_WEIGHTS``)."""
    weight: float
    """Its weight in ``configs/debug_mixture.toml``; also its share of the training rows written."""
    suffix: str
    """File suffix of its ``train`` / ``eval`` files, which tells the loader how to read them."""

    def path(self, out: Path, split: str) -> Path:
        """The file of ``split`` under ``out``."""
        return out / self.name / f"{split}{self.suffix}"


SPECS: tuple[SourceSpec, ...] = (
    SourceSpec("messages", ("colour", "shape"), 6.0, ".jsonl"),
    SourceSpec("llava", ("count", "position"), 3.0, ".json"),
    SourceSpec("parquet", ("compare", "text"), 1.0, ".parquet"),
)
"""The three sources, in the order of the config's tables."""

PARQUET_FEATURES = datasets.Features(
    {
        "messages": datasets.List(
            {
                "role": datasets.Value("string"),
                "content": datasets.List({"type": datasets.Value("string"), "text": datasets.Value("string")}),
            }
        ),
        "images": datasets.List(datasets.Image()),
        "task": datasets.Value("string"),
        "answer": datasets.Value("string"),
        "id": datasets.Value("string"),
    }
)
"""Column types of the parquet files. Arrow gives every block both fields (an image placeholder's ``text`` is null,
which the loader's ``drop_none`` removes again); ``images`` holds ``{"bytes": <png>, "path": <file name>}``, and the
loader reads the bytes (the name only labels errors)."""


@dataclass(frozen=True)
class WrittenSource:
    """What the CLI wrote (or found) for one source."""

    name: str
    """Source name (``SourceSpec.name``)."""
    weight: float
    """Its weight in the mixture config."""
    files: dict[str, Path]
    """Split (``train`` / ``eval``) -> data file."""
    rows: dict[str, int]
    """Split -> number of rows in that file."""


def share_out(total: int, weights: Sequence[float]) -> list[int]:
    """``total`` rows split in proportion to ``weights`` (largest remainder, ties to the earlier source): the
    counts sum to ``total`` exactly, whatever the rounding."""
    exact = [total * w / sum(weights) for w in weights]
    counts = [int(x) for x in exact]
    by_remainder = sorted(range(len(weights)), key=lambda i: (counts[i] - exact[i], i))
    for i in by_remainder[: total - sum(counts)]:
        counts[i] += 1
    return counts


def row_counts(num_train: int, num_eval: int) -> dict[str, list[int]]:
    """Rows per source of each split (in ``SPECS`` order); ``ValueError`` when a source would get none (an empty
    file is not a useful example, and an empty eval source scores nothing)."""
    counts = {"train": share_out(num_train, [s.weight for s in SPECS]), "eval": share_out(num_eval, [1.0] * len(SPECS))}
    for split, given, flag in (("train", num_train, "--num-train"), ("eval", num_eval, "--num-eval")):
        if min(counts[split]) < 1:
            shares = dict(zip((s.name for s in SPECS), counts[split], strict=True))
            raise ValueError(
                f"{flag} {given} shares out as {shares}: every source needs at least one {split} row; raise {flag}"
            )
    return counts


def collect(
    seed: int, split: str, counts: Sequence[int], image_size: int, bar: Any
) -> list[list[tuple[int, ShapesSample]]]:
    """Per source (``SPECS`` order), ``(shapes index, sample)`` of the first ``counts[s]`` shapes samples of
    ``split`` whose task belongs to that source. Ends: every task has a positive share in the generator."""
    owner = {task: s for s, spec in enumerate(SPECS) for task in spec.tasks}
    picked: list[list[tuple[int, ShapesSample]]] = [[] for _ in SPECS]
    index = 0
    while any(len(p) < c for p, c in zip(picked, counts, strict=True)):
        sample = make_sample(seed, split, index, image_size)
        s = owner[sample.task]
        if len(picked[s]) < counts[s]:
            picked[s].append((index, sample))
            bar.update(1)
        index += 1
    return picked


def messages_row(split: str, index: int, sample: ShapesSample) -> dict:
    """The shapes dataset's own row (``materialize_shapes``): image blocks hold ``images/<name>.png``."""
    return {"messages": sample.messages, "task": sample.task, "answer": sample.answer, "id": f"{split}-{index}"}


def _text_of(blocks: list[dict]) -> str:
    """A message's blocks as one string, an image block as an ``<image>`` marker on its own line (LLaVA's way)."""
    return "\n".join(IMAGE_MARKER if b["type"] == "image" else b["text"] for b in blocks)


def llava_row(split: str, index: int, sample: ShapesSample) -> dict:
    """A ShareGPT / LLaVA row: ``<image>`` markers where the image blocks were, the path in ``image`` (a list when
    there are several), the system prompt in ``system``."""
    row: dict[str, Any] = {"id": f"{split}-{index}"}
    paths = [b["image"] for m in sample.messages for b in m["content"] if b["type"] == "image"]
    if paths:
        row["image"] = paths[0] if len(paths) == 1 else paths
    speaker = {"user": "human", "assistant": "gpt"}
    turns = [m for m in sample.messages if m["role"] != "system"]
    row["conversations"] = [{"from": speaker[m["role"]], "value": _text_of(m["content"])} for m in turns]
    system = [m for m in sample.messages if m["role"] == "system"]
    if system:
        row["system"] = _text_of(system[0]["content"])
    return {**row, "task": sample.task, "answer": sample.answer}


def parquet_row(split: str, index: int, sample: ShapesSample) -> dict:
    """A chat row with placeholder image blocks and the pictures' PNG bytes in ``images`` (block order)."""
    messages = [
        {"role": m["role"], "content": [{"type": "image"} if b["type"] == "image" else b for b in m["content"]]}
        for m in sample.messages
    ]
    images = []
    for rel, img in sample.images.items():
        buffer = io.BytesIO()
        img.save(buffer, format="PNG", optimize=False)
        images.append({"bytes": buffer.getvalue(), "path": Path(rel).name})
    return {
        "messages": messages,
        "images": images,
        "task": sample.task,
        "answer": sample.answer,
        "id": f"{split}-{index}",
    }


def _save_images(folder: Path, picked: list[tuple[int, ShapesSample]]) -> None:
    """The pictures the rows reference, overwritten: another seed writes other pictures under the same names."""
    (folder / "images").mkdir(parents=True, exist_ok=True)
    for _, sample in picked:
        for rel, img in sample.images.items():
            img.save(folder / rel, format="PNG", optimize=False)


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _write_json_array(path: Path, rows: list[dict]) -> None:
    # one row per line, so a loader error's line number points at the row
    path.write_text("[\n" + ",\n".join(json.dumps(r) for r in rows) + "\n]\n")


def _write_parquet(path: Path, rows: list[dict]) -> None:
    columns = {name: [r[name] for r in rows] for name in PARQUET_FEATURES}
    table = datasets.Dataset.from_dict(columns, features=PARQUET_FEATURES).data.table
    # pyarrow rather than ``Dataset.to_parquet``: the same file (the schema metadata carries the ``Image`` feature)
    # without a second progress bar per file
    pq.write_table(table, str(path))


_FORMATS: dict[str, tuple[Callable[[str, int, ShapesSample], dict], Callable[[Path, list[dict]], None]]] = {
    "messages": (messages_row, _write_jsonl),
    "llava": (llava_row, _write_json_array),
    "parquet": (parquet_row, _write_parquet),
}
"""Source name -> (row builder, file writer)."""


def _write_source(spec: SourceSpec, out: Path, split: str, picked: list[tuple[int, ShapesSample]]) -> None:
    """One source's file of ``split`` (and its image files, except for parquet), written to a temporary name first
    so an interrupted run never leaves a half file under the real name."""
    make_row, write = _FORMATS[spec.name]
    folder = out / spec.name
    folder.mkdir(parents=True, exist_ok=True)
    if spec.name != "parquet":  # parquet rows embed their pictures
        _save_images(folder, picked)
    path = spec.path(out, split)
    tmp = path.with_name(path.name + ".tmp")
    write(tmp, [make_row(split, index, sample) for index, sample in picked])
    tmp.replace(path)
    logger.info("wrote %d %s rows (%s) to %s", len(picked), split, ", ".join(spec.tasks), path)


def _written(out: Path, rows: Mapping[str, Mapping[str, int]]) -> list[WrittenSource]:
    return [
        WrittenSource(s.name, s.weight, {split: s.path(out, split) for split in SPLITS}, dict(rows[s.name]))
        for s in SPECS
    ]


def write_mixture_example(
    out: str | Path = DEFAULT_OUT,
    *,
    num_train: int = 600,
    num_eval: int = 60,
    seed: int = 0,
    image_size: int = 64,
    progress: bool = True,
) -> list[WrittenSource]:
    """Write the three sources under ``out`` (module docstring), or find them there with the same settings."""
    out = Path(out)
    counts = row_counts(num_train, num_eval)
    settings = {
        "seed": seed,
        "num_train": num_train,
        "num_eval": num_eval,
        "image_size": image_size,
        "version": _MANIFEST_VERSION,
    }
    manifest_path = out / "manifest.json"
    if manifest_path.is_file():
        manifest = json.loads(manifest_path.read_text())
        same = manifest.get("settings") == settings and set(manifest.get("rows", {})) == {s.name for s in SPECS}
        found = _written(out, manifest["rows"]) if same else None
        if found and all(p.is_file() for w in found for p in w.files.values()):
            logger.info("mixture example already in %s (%s); nothing written", out, manifest_path)
            return found
    out.mkdir(parents=True, exist_ok=True)
    manifest_path.unlink(missing_ok=True)  # a crash below must not leave a manifest that vouches for old files
    bar = tqdm(total=num_train + num_eval, desc=f"writing mixture example to {out}", disable=not progress, unit="row")
    rows: dict[str, dict[str, int]] = {s.name: {} for s in SPECS}
    for split in SPLITS:
        picked = collect(seed, split, counts[split], image_size, bar)
        for spec, chosen in zip(SPECS, picked, strict=True):
            _write_source(spec, out, split, chosen)
            rows[spec.name][split] = len(chosen)
    bar.close()
    manifest_path.write_text(json.dumps({"settings": settings, "rows": rows}, indent=1) + "\n")
    logger.info(
        "mixture example ready in %s: %d train + %d eval rows over %d sources", out, num_train, num_eval, len(SPECS)
    )
    return _written(out, rows)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m vlm_sft.data.mixture_example", description=__doc__.split("\n\n")[0].replace("``", "")
    )
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="folder to write (default: %(default)s)")
    parser.add_argument("--num-train", type=int, default=600, help="training rows, all sources (default: %(default)s)")
    parser.add_argument("--num-eval", type=int, default=60, help="held-out rows, all sources (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="shapes generator seed (default: %(default)s)")
    parser.add_argument("--image-size", type=int, default=64, help="picture side in pixels (default: %(default)s)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        write_mixture_example(
            args.out, num_train=args.num_train, num_eval=args.num_eval, seed=args.seed, image_size=args.image_size
        )
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
