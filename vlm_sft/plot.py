"""A run at a glance: ``python -m vlm_sft.plot <output_dir> [--out PATH]`` draws ``<output_dir>/metrics.jsonl`` into
one PNG (default ``<output_dir>/run.png``).

Four panels over optimizer steps: **loss** (train, and eval where the run evaluated), **accuracy** on the held-out
set, teacher-forced (``eval_acc_<task>``, solid) and generated (``eval_gen_acc_<task>``, dashed, the same colour per
task; ``all`` in black), **learning rate** and **tokens/s**. A series the run did not log (no eval, no generated
accuracy) leaves a note in its panel instead of a line. The title holds the run folder and the final numbers.

``plot_run`` is what the trainer calls at the end of a run; ``draw_run`` builds the figure from records and says
which series it drew. Figures are built without pyplot (no display, no backend to pick: ``savefig`` renders with Agg).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from matplotlib.figure import Figure
from matplotlib.lines import Line2D

logger = logging.getLogger(__name__)

PLOT_FILE = "run.png"
"""Default file name of the plot, inside the run folder."""
TEACHER_FORCED, GENERATED = "eval_acc_", "eval_gen_acc_"
SCORE = "eval_score/"
"""Prefix of a scored held-out source's benchmark score (dotted lines in the accuracy panel)."""
"""Prefixes of the accuracy keys of an eval record: scored on the teacher-forced logits, and on generated replies."""
ALL_TASKS = "all"
"""The task name of the accuracy over every scored sample (drawn in black, thicker)."""
COLOUR_TASK = "colour"
"""The task whose accuracy the title also gives: the default shapes run's proof that image features reach the
language model."""
PANELS = ("loss", "accuracy", "learning rate", "tokens/s")
"""Panel titles, left to right, top to bottom; the keys of ``draw_run``'s report."""


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """The records of a ``metrics.jsonl`` that have a ``step``; a line that is not JSON (the last line of a killed
    run may be cut) is skipped with a warning."""
    records = []
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            logger.warning("%s line %d is not JSON (%s); skipped", path, number, err)
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), int | float):
            records.append(record)
    return records


def series(records: Sequence[dict[str, Any]], key: str) -> tuple[list[float], list[float]]:
    """Steps and values of ``key`` over the records that hold it as a finite number."""
    steps, values = [], []
    for r in records:
        v = r.get(key)
        if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v):
            steps.append(float(r["step"]))
            values.append(float(v))
    return steps, values


def accuracy_tasks(records: Sequence[dict[str, Any]]) -> list[str]:
    """Tasks with a teacher-forced or generated accuracy, ``all`` first, then by name."""
    prefixes = (TEACHER_FORCED, GENERATED)  # disjoint: "eval_gen_acc_x" does not start with "eval_acc_"
    tasks = {k.removeprefix(p) for r in records for k in r for p in prefixes if k.startswith(p)}
    return sorted(tasks, key=lambda t: (t != ALL_TASKS, t))


def _note(ax, text: str) -> None:
    ax.text(0.5, 0.5, text, transform=ax.transAxes, ha="center", va="center", color="0.45", fontsize=10, wrap=True)


def _log_scale_if_wide(ax, values: Sequence[float]) -> None:
    """Log y where positive values span more than a decade (a loss from 10 to 0.05 reads better so)."""
    if values and min(values) > 0 and max(values) / min(values) > 10:
        ax.set_yscale("log")


def _draw_loss(ax, records) -> list[str]:
    drawn, values = [], []
    for key, label, style in (("loss", "train", {"lw": 1.2}), ("eval_loss", "eval", {"marker": "o", "ms": 3})):
        steps, ys = series(records, key)
        if steps:
            ax.plot(steps, ys, label=label, **style)
            drawn.append(key)
            values += ys
    if not drawn:
        _note(ax, "no loss logged")
    else:
        if "eval_loss" not in drawn:
            ax.set_title("loss (no eval loss: no held-out data)", fontsize=10)
        _log_scale_if_wide(ax, values)
        ax.legend(fontsize=8)
    return drawn


def _draw_accuracy(ax, records) -> list[str]:
    drawn = []
    tasks = accuracy_tasks(records)
    colours = (f"C{i % 10}" for i in range(len(tasks)))
    task_handles = []
    for task in tasks:
        colour = "black" if task == ALL_TASKS else next(colours)
        width = 2.0 if task == ALL_TASKS else 1.2
        task_drawn = False
        for prefix, dash in ((TEACHER_FORCED, "-"), (GENERATED, "--")):
            steps, ys = series(records, prefix + task)
            if steps:
                ax.plot(steps, ys, ls=dash, color=colour, lw=width, marker="o", ms=3)
                drawn.append(prefix + task)
                task_drawn = True
        if task_drawn:
            task_handles.append(Line2D([], [], color=colour, lw=width, label=task))
    drawn += _draw_scores(ax, records, task_handles)
    if not drawn:
        _note(ax, "no accuracy logged (no held-out data)")
        return drawn
    kinds = {TEACHER_FORCED: ("-", "teacher-forced"), GENERATED: ("--", "generated")}
    missing = [name for prefix, (_, name) in kinds.items() if not any(k.startswith(prefix) for k in drawn)]
    style_handles = [
        Line2D([], [], color="0.3", ls=dash, label=name)
        for prefix, (dash, name) in kinds.items()
        if any(k.startswith(prefix) for k in drawn)
    ]
    ax.set_ylim(-0.02, 1.02)
    ax.legend(handles=task_handles + style_handles, fontsize=7, ncol=2, loc="best")
    if missing:
        ax.set_title(f"accuracy (no {missing[0]} accuracy logged)", fontsize=10)
    return drawn


def _draw_scores(ax, records, handles: list) -> list[str]:
    """Each scored source's benchmark score, dotted, labelled ``score <name>``."""
    keys = sorted({k for r in records for k in r if k.startswith(SCORE)})
    for i, key in enumerate(keys):
        steps, ys = series(records, key)
        colour = f"C{(9 - i) % 10}"
        ax.plot(steps, ys, ls=":", color=colour, lw=1.5, marker="s", ms=3)
        handles.append(Line2D([], [], color=colour, ls=":", label=f"score {key.removeprefix(SCORE)}"))
    return keys


def _draw_one(ax, records, key: str, label: str) -> list[str]:
    steps, ys = series(records, key)
    if not steps:
        _note(ax, f"no {label} logged")
        return []
    ax.plot(steps, ys, lw=1.2)
    return [key]


def final_numbers(records: Sequence[dict[str, Any]]) -> str:
    """``step 900: loss 0.0512, eval loss 0.0557, acc 0.640 (colour 1.000), generated acc 0.583 (colour 0.983)``: the
    last value the run logged of each (colour: the task the default shapes run is built to learn)."""

    def last(key: str) -> float | None:
        _, ys = series(records, key)
        return ys[-1] if ys else None

    parts = []
    for key, label in (("loss", "loss"), ("eval_loss", "eval loss")):
        if (v := last(key)) is not None:
            parts.append(f"{label} {v:.4f}")
    for prefix, label in ((TEACHER_FORCED, "acc"), (GENERATED, "generated acc")):
        overall, colour = last(prefix + ALL_TASKS), last(prefix + COLOUR_TASK)
        if overall is not None:
            parts.append(f"{label} {overall:.3f}" + (f" ({COLOUR_TASK} {colour:.3f})" if colour is not None else ""))
    steps = [r["step"] for r in records]
    if not steps:
        return "no metrics logged"
    return f"step {max(steps):.0f}: " + (", ".join(parts) or "no loss logged")


def draw_run(records: Sequence[dict[str, Any]], title: str) -> tuple[Figure, dict[str, list[str]]]:
    """The figure of a run's metrics records, and per panel (``PANELS``) the metric keys it drew ([] where the run
    logged none: the panel then holds a note)."""
    fig = Figure(figsize=(13, 8.5), dpi=100, layout="constrained")
    axes = fig.subplots(2, 2, sharex=True).flatten()  # one step axis: an eval point lines up with the loss
    drawers = (
        _draw_loss,
        _draw_accuracy,
        lambda ax, rs: _draw_one(ax, rs, "lr", "learning rate"),
        lambda ax, rs: _draw_one(ax, rs, "tokens_per_s", "tokens/s"),
    )
    drawn = {}
    for ax, name, draw in zip(axes, PANELS, drawers, strict=True):
        ax.set_title(name, fontsize=10)
        ax.tick_params(labelbottom=True)  # sharex hides the top row's step labels
        ax.set_xlabel("step", fontsize=9)
        ax.grid(alpha=0.3)
        ax.tick_params(labelsize=8)
        drawn[name] = draw(ax, records)
    fig.suptitle(f"{title}\n{final_numbers(records)}", fontsize=11)
    return fig, drawn


def plot_run(output_dir: str | Path, out: str | Path | None = None) -> Path:
    """Draw ``<output_dir>/metrics.jsonl`` into ``out`` (default ``<output_dir>/run.png``) and return its path."""
    output_dir = Path(output_dir)
    metrics = output_dir / "metrics.jsonl"
    if not metrics.is_file():
        raise FileNotFoundError(f"{metrics} does not exist: is {output_dir} a run folder (train.output_dir)?")
    out = Path(out) if out is not None else output_dir / PLOT_FILE
    fig, drawn = draw_run(read_metrics(metrics), str(output_dir))
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    logger.info("wrote %s (%s)", out, "; ".join(f"{p}: {', '.join(k) or 'none'}" for p, k in drawn.items()))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m vlm_sft.plot",
        description="Draw a run's metrics.jsonl (loss, accuracy teacher-forced and generated, learning rate, tokens/s) "
        "into one PNG.",
    )
    parser.add_argument("output_dir", type=Path, help="the run folder (train.output_dir) holding metrics.jsonl")
    parser.add_argument("--out", type=Path, default=None, help=f"PNG to write (default: <output_dir>/{PLOT_FILE})")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    try:
        path = plot_run(args.output_dir, args.out)
    except FileNotFoundError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
