"""Experiment trackers (``train.report_to``): TensorBoard, W&B, MLflow and trackio through accelerate's tracker classes.

``metrics.jsonl`` stays the run's record; a tracker is a view of it. ``MetricsLogger`` (rank 0 only) owns one
``Trackers``, which sends each tracker

- every number of each metrics record (loss, lr, grad norm, tokens/s, padding, eval losses, ``eval_acc_*``,
  ``eval_gen_acc_*``, ...) at the record's ``step``;
- the run config once, when the tracker run is new, flattened to dotted keys (``train.lr``). TensorBoard gets it as a
  ``config`` text (JSON) instead of hparams: ``add_hparams`` writes into a new, time-named sub-run on every call,
  which TensorBoard lists as a run of its own, with no metric beside it;
- generated samples (``log_samples``) as a table: W&B ``log_table``, MLflow ``mlflow.log_table`` (a JSON artifact per
  step), trackio ``trackio.Table``; TensorBoard a markdown table as ``samples`` text.

**Resume.** ``Trackers.state()`` is plain JSON that the trainer keeps in the checkpoint's ``trainer_state.json``
(``TrainerState.trackers``); a resumed run passes it back and each tracker continues the same run: W&B by run id
(``resume="allow"``), MLflow by ``run_id``, trackio by project and run name (``resume="allow"``), TensorBoard in the
same folder with ``purge_step = start_step + 1``, which hides what the killed run logged after the checkpoint, so the
resumed run's steps replace it (the run's ``metrics.jsonl`` is truncated the same way). W&B and MLflow cannot hide
such points: W&B drops values logged at a step below its last one (with a warning), MLflow keeps both.

**Installed packages** are checked without importing them (``check_installed``, at start-up, before the model is
built), and a missing one fails with the ``pip install`` that fixes it. accelerate's trackers log through its
multi-process logger, which needs accelerate's ``PartialState``: ``_accelerate_state`` builds it on rank 0.
"""

from __future__ import annotations

import importlib.util
import json
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vlm_sft.config import ConfigError

logger = logging.getLogger(__name__)

TRACKER_PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow", "trackio": "trackio"}
"""``train.report_to`` name -> the package it needs (what ``pip install`` and ``importlib`` call it)."""
NO_TRACKER = "none"
"""``train.report_to`` value for no tracker (the default, ``["none"]``)."""
SAMPLE_COLUMNS = ("step", "prompt", "images", "reference", "reply", "correct")
"""Preferred column order of a samples table; keys of the rows outside it follow, in order of appearance."""
TENSORBOARD_DIR = "tensorboard"
"""TensorBoard's folder inside ``train.output_dir``."""
MARKDOWN_CELL_CHARS = 1000
"""A TensorBoard sample cell is cut to this many characters (the table is a summary; the full text is in the
samples file)."""


def tracker_names(report_to: Iterable[str]) -> list[str]:
    """The trackers of ``train.report_to`` (``"none"`` dropped); an unknown name is refused with the known ones."""
    names = [n for n in report_to if n != NO_TRACKER]
    unknown = [n for n in names if n not in TRACKER_PACKAGES]
    if unknown:
        raise ConfigError(f"train.report_to names unknown trackers {unknown}; use {[*TRACKER_PACKAGES, NO_TRACKER]}")
    return names


def check_installed(report_to: Iterable[str]) -> None:
    """Refuse trackers whose package is not installed, with the ``pip install`` line (nothing is imported)."""
    names = list(report_to)
    missing = sorted({TRACKER_PACKAGES[n] for n in tracker_names(names)} - _installed(TRACKER_PACKAGES.values()))
    if missing:
        raise ConfigError(
            f"train.report_to = {names} needs {', '.join(missing)}, not installed here: pip install {' '.join(missing)} "
            f'(or pip install -e ".[{",".join(missing)}]"), or take {missing} out of train.report_to'
        )


def _installed(packages: Iterable[str]) -> set[str]:
    return {p for p in packages if importlib.util.find_spec(p) is not None}


def flatten_config(config: dict[str, Any], prefix: str = "") -> dict[str, bool | int | float | str | None]:
    """``{"train": {"lr": 1e-3, "betas": [0.9, 0.98]}}`` -> ``{"train.lr": 0.001, "train.betas": "[0.9, 0.98]"}``:
    the flat, scalar values that every tracker's config store takes (lists and tuples as JSON text)."""
    flat: dict[str, bool | int | float | str | None] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flatten_config(value, prefix=f"{name}."))
        elif value is None or isinstance(value, bool | int | float | str):
            flat[name] = value
        else:
            flat[name] = json.dumps(value)
    return flat


def numeric_fields(record: dict[str, Any]) -> dict[str, float | int]:
    """The values a tracker plots: every int / float field of a metrics record but ``step`` (booleans as 0 / 1)."""
    return {
        k: int(v) if isinstance(v, bool) else v
        for k, v in record.items()
        if k != "step" and isinstance(v, bool | int | float)
    }


def sample_table(rows: Sequence[dict[str, Any]]) -> tuple[list[str], list[list[Any]]]:
    """Columns and cells of a samples table; cells that are not scalars (a list of image paths) become JSON text."""
    keys = [k for k in SAMPLE_COLUMNS if any(k in r for r in rows)]
    keys += [k for r in rows for k in r if k not in keys]
    keys = list(dict.fromkeys(keys))

    def cell(value: Any) -> Any:
        return value if value is None or isinstance(value, bool | int | float | str) else json.dumps(value)

    return keys, [[cell(r.get(k)) for k in keys] for r in rows]


def markdown_table(columns: Sequence[str], data: Sequence[Sequence[Any]]) -> str:
    """A GitHub-flavoured markdown table (what TensorBoard's text tab renders); pipes escaped, newlines as <br>."""

    def cell(value: Any) -> str:
        text = "" if value is None else str(value)
        if len(text) > MARKDOWN_CELL_CHARS:
            text = text[:MARKDOWN_CELL_CHARS] + "…"
        return text.replace("\\", "\\\\").replace("|", "\\|").replace("\r", "").replace("\n", "<br>")

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in data]
    return "\n".join(lines)


@dataclass(frozen=True)
class RunInfo:
    """What every tracker is built from."""

    output_dir: Path
    """``train.output_dir``."""
    run_name: str
    """The run's name in the trackers (``train.run_name``, or the output_dir's folder name)."""
    project: str
    """W&B / trackio project, MLflow experiment (``train.project``)."""
    start_step: int
    """Optimizer steps done before this process started (0, or the resumed checkpoint's step)."""


def _accelerate_state() -> None:
    """accelerate's trackers log through its multi-process logger, which refuses to run before ``PartialState``
    exists. Built on rank 0 after the trainer's process group is up, it adopts that group (no collective, no new
    group) and sets the CUDA device the trainer set already; on CPU under several processes without
    ``OMP_NUM_THREADS`` it would also set the thread count, so the trainer's count is put back."""
    import torch
    from accelerate.state import PartialState

    threads = torch.get_num_threads()
    PartialState()
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


class _Tracker:
    """One accelerate tracker and what this project adds to it: its resume state, the config and the samples."""

    name = ""

    def __init__(self, run: RunInfo, saved: dict | None) -> None:
        self.run, self.saved = run, saved
        self.tracker = self._build()

    def _build(self) -> Any:
        raise NotImplementedError

    def state(self) -> dict[str, Any]:
        """Plain JSON that ``_build`` takes back as ``saved`` to continue this tracker run."""
        raise NotImplementedError

    def store_config(self, flat: dict[str, Any]) -> None:
        self.tracker.store_init_configuration(flat)

    def log(self, values: dict[str, float | int], step: int) -> None:
        self.tracker.log(values, step=step)

    def log_samples(self, step: int, columns: list[str], data: list[list[Any]]) -> None:
        raise NotImplementedError

    def finish(self) -> None:
        self.tracker.finish()


class _TensorBoard(_Tracker):
    name = "tensorboard"

    def _build(self) -> Any:
        from accelerate import tracking

        folder = (self.saved or {}).get("logging_dir", TENSORBOARD_DIR)
        self.folder = folder
        path = self.run.output_dir / folder  # relative to the run folder, so a moved run still resumes
        # purge_step: events of steps after the checkpoint, left by the run that was killed, are hidden on read.
        kwargs = {"purge_step": self.run.start_step + 1} if self.run.start_step > 0 else {}
        return tracking.TensorBoardTracker(path.name, path.parent, **kwargs)

    def state(self) -> dict[str, Any]:
        return {"logging_dir": str(self.folder)}

    def store_config(self, flat: dict[str, Any]) -> None:
        text = "```json\n" + json.dumps(flat, indent=1) + "\n```"  # code block: TensorBoard renders text as markdown
        self.tracker.writer.add_text("config", text, global_step=self.run.start_step)
        self.tracker.writer.flush()

    def log_samples(self, step: int, columns: list[str], data: list[list[Any]]) -> None:
        self.tracker.writer.add_text("samples", markdown_table(columns, data), global_step=step)
        self.tracker.writer.flush()


class _WandB(_Tracker):
    name = "wandb"

    def _build(self) -> Any:
        from accelerate import tracking

        kwargs: dict[str, Any] = {"name": self.run.run_name, "dir": str(self.run.output_dir)}
        self.project = self.run.project
        if self.saved:
            self.project = self.saved.get("project", self.project)
            kwargs.update(id=self.saved["id"], resume="allow")
        return tracking.WandBTracker(self.project, **kwargs)

    def state(self) -> dict[str, Any]:
        return {"id": self.tracker.tracker.id, "project": self.project}

    def log_samples(self, step: int, columns: list[str], data: list[list[Any]]) -> None:
        self.tracker.log_table("samples", columns=columns, data=data, step=step)


class _MLflow(_Tracker):
    name = "mlflow"

    def _build(self) -> Any:
        from accelerate import tracking

        self.experiment = (self.saved or {}).get("experiment", self.run.project)
        run_id = (self.saved or {}).get("run_id")
        return tracking.MLflowTracker(experiment_name=self.experiment, run_id=run_id, run_name=self.run.run_name)

    def state(self) -> dict[str, Any]:
        return {"run_id": self.tracker.tracker.info.run_id, "experiment": self.experiment}

    def log_samples(self, step: int, columns: list[str], data: list[list[Any]]) -> None:
        import mlflow

        table = {c: [row[i] for row in data] for i, c in enumerate(columns)}
        mlflow.log_table(data=table, artifact_file=f"samples/step-{step:06d}.json")


class _Trackio(_Tracker):
    name = "trackio"

    def _build(self) -> Any:
        from accelerate import tracking

        saved = self.saved or {}
        self.project = saved.get("project", self.run.project)
        kwargs: dict[str, Any] = {"name": saved.get("name", self.run.run_name)}
        if self.saved:
            kwargs["resume"] = "allow"
        return tracking.TrackioTracker(self.project, **kwargs)

    def state(self) -> dict[str, Any]:
        return {"project": self.project, "name": self.tracker.tracker.name}

    def log_samples(self, step: int, columns: list[str], data: list[list[Any]]) -> None:
        import pandas  # a dependency of trackio; its Table keeps column names from a DataFrame in every release
        import trackio

        self.tracker.log({"samples": trackio.Table(dataframe=pandas.DataFrame(data, columns=columns))}, step=step)


TRACKERS: dict[str, type[_Tracker]] = {t.name: t for t in (_TensorBoard, _WandB, _MLflow, _Trackio)}
"""``train.report_to`` name -> its tracker."""


class Trackers:
    """The run's trackers, started on construction (rank 0 only: ``MetricsLogger`` builds none elsewhere).

    ``state``: what ``state()`` returned in the run that wrote the resumed checkpoint (``TrainerState.trackers``), or
    None; a tracker without saved state starts a new tracker run and stores ``config`` in it.
    """

    def __init__(self, report_to: Iterable[str], run: RunInfo, *, config: dict | None, state: dict | None) -> None:
        names = tracker_names(report_to)
        check_installed(names)
        self._trackers: list[_Tracker] = []
        self._state: dict[str, dict] = {}
        if not names:
            return
        _accelerate_state()
        saved_all = state or {}
        flat = flatten_config(config or {})
        for name in names:
            saved = saved_all.get(name)
            tracker = TRACKERS[name](run, saved)
            tracker.tracker.start()
            if saved is None:
                tracker.store_config(flat)
            self._trackers.append(tracker)
            self._state[name] = tracker.state()
            logger.info("tracking with %s (%s): %s", name, "continued" if saved else "new run", self._state[name])

    def __bool__(self) -> bool:
        return bool(self._trackers)

    def log(self, record: dict[str, Any]) -> None:
        values = numeric_fields(record)
        if values:
            for tracker in self._trackers:
                tracker.log(values, int(record.get("step", 0)))

    def log_samples(self, step: int, rows: Sequence[dict[str, Any]]) -> None:
        if rows:
            columns, data = sample_table(rows)
            for tracker in self._trackers:
                tracker.log_samples(step, columns, data)

    def state(self) -> dict[str, dict]:
        """Per tracker, what continues its run (JSON; kept in the checkpoint)."""
        return {name: dict(s) for name, s in self._state.items()}

    def finish(self) -> None:
        """End every tracker run (TensorBoard: flush and close the event file); a second call does nothing."""
        trackers, self._trackers = self._trackers, []
        for tracker in trackers:
            tracker.finish()
