"""Metrics: one JSON line per logged step in ``metrics.jsonl``, progress on rank 0, optional experiment trackers
(``train.report_to``: TensorBoard, W&B, MLflow, trackio; ``trainer.trackers``).

Progress is a tqdm bar in a terminal. Where stderr is a file or a pipe (a cluster job, ``nohup ... > log``) a bar
redrawn per step would write a line per step; there progress is one plain line per metrics record instead.
"""

from __future__ import annotations

import json
import logging
import math
import sys
import time
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any, TextIO

import torch
from tqdm.auto import tqdm

from vlm_sft.trainer.trackers import RunInfo, Trackers

logger = logging.getLogger(__name__)


def peak_memory_mb(device: torch.device) -> float:
    """Peak memory of this process: CUDA allocator peak on GPU, max resident set size on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


PROGRESS_FIELDS = (
    ("loss", "loss", ".4f"),
    ("lr", "lr", ".3g"),
    ("grad_norm", "grad_norm", ".3g"),
    ("tokens_per_s", "tok/s", ".0f"),
)
"""(record key, label, format) of the values in a plain progress line, in order."""


class MetricsLogger:
    """Writes metrics on rank 0 only; every other rank gets a silent logger with the same interface.

    ``stream`` (default stderr) takes the progress; ``is_tty`` (default ``stream.isatty()``) picks the tqdm bar or
    the plain lines. Both are parameters so that tests can drive either mode.

    Trackers (``report_to``, ``trainer.trackers``) start here, on rank 0: ``run_config`` is stored in a new tracker
    run, ``run_name`` names it (None: the output_dir's folder name) in ``project``; ``tracker_state`` is what
    ``tracker_state()`` returned when the resumed checkpoint was written (None: new tracker runs).
    """

    def __init__(
        self,
        output_dir: str | Path,
        *,
        enabled: bool,
        total_steps: int,
        start_step: int = 0,
        report_to: Sequence[str] = (),
        run_config: dict | None = None,
        run_name: str | None = None,
        project: str = "vlm-sft",
        tracker_state: dict | None = None,
        stream: TextIO | None = None,
        is_tty: bool | None = None,
    ) -> None:
        self.enabled = enabled
        self.path = Path(output_dir) / "metrics.jsonl"
        self.samples_path = Path(output_dir) / "samples.jsonl"
        """Generated eval replies, one JSON line each (``log_samples``)."""
        self.stream = stream if stream is not None else sys.stderr
        self.is_tty = self.stream.isatty() if is_tty is None else is_tty
        self.total_steps = total_steps
        self._start_step, self._t0 = start_step, time.perf_counter()
        self._bar = None
        self._trackers: Trackers | None = None
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        for path in (self.path, self.samples_path):
            if start_step == 0 and path.exists():
                path.unlink()
            elif start_step > 0 and path.exists():
                _truncate_after(path, start_step)
        if self.is_tty:
            self._bar = tqdm(
                total=total_steps, initial=start_step, desc="train", unit="step", dynamic_ncols=True, file=self.stream
            )
        run = RunInfo(Path(output_dir), run_name or Path(output_dir).resolve().name, project, start_step)
        self._trackers = Trackers(report_to, run, config=run_config, state=tracker_state)

    def advance(self, n: int = 1, **postfix: float) -> None:
        if self._bar is not None:
            self._bar.update(n)
            if postfix:
                self._bar.set_postfix({k: _short(v) for k, v in postfix.items()}, refresh=False)

    def log(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        record = {k: (float(v) if isinstance(v, torch.Tensor) else v) for k, v in record.items()}
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        if self._trackers:
            self._trackers.log(record)
        if not self.is_tty and "loss" in record and "step" in record:
            self._print(self._progress_line(record))

    def _progress_line(self, record: dict[str, Any]) -> str:
        """``step 20/600 loss 1.2340 lr 0.001 grad_norm 0.5 tok/s 1234 elapsed 0:00:42 left 0:20:18``."""
        step = int(record["step"])
        parts = [f"step {step}/{self.total_steps}"]
        for key, label, fmt in PROGRESS_FIELDS:
            if isinstance(record.get(key), int | float):
                parts.append(f"{label} {record[key]:{fmt}}")
        elapsed = time.perf_counter() - self._t0
        parts.append(f"elapsed {timedelta(seconds=round(elapsed))}")
        if step > self._start_step:
            left = elapsed / (step - self._start_step) * max(self.total_steps - step, 0)
            parts.append(f"left {timedelta(seconds=round(left))}")
        return " ".join(parts)

    def _print(self, message: str) -> None:
        print(message, file=self.stream, flush=True)

    def write(self, message: str) -> None:
        """Print a line without breaking the progress bar."""
        if not self.enabled:
            return
        if self._bar is not None:
            tqdm.write(message, file=self.stream)
        else:
            self._print(message)

    def log_samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        """Generated samples (keys ``step, prompt, images, reference, reply`` and maybe ``correct``) appended to
        ``samples.jsonl``, and as a table in every tracker that has tables (markdown text in TensorBoard)."""
        if not self.enabled:
            return
        with self.samples_path.open("a") as f:
            f.writelines(json.dumps({"step": step, **row}) + "\n" for row in rows)
        if self._trackers:
            self._trackers.log_samples(step, rows)

    def tracker_state(self) -> dict[str, dict]:
        """What continues this run's tracker runs on resume (JSON, for the checkpoint); ``{}`` without trackers and
        on ranks other than 0."""
        return self._trackers.state() if self._trackers is not None else {}

    def close(self) -> None:
        """End the progress bar and the tracker runs (TensorBoard: flush and close its event file); once."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        if self._trackers is not None:
            self._trackers.finish()
            self._trackers = None


def _truncate_after(path: Path, step: int) -> None:
    """On resume, drop lines logged after the checkpoint so the file reads as one uninterrupted run."""
    kept = [line for line in path.read_text().splitlines() if json.loads(line).get("step", 0) <= step]
    path.write_text("".join(line + "\n" for line in kept))


def _short(v: float) -> str:
    if isinstance(v, float) and (abs(v) >= 1e4 or (v != 0 and abs(v) < 1e-3)) and math.isfinite(v):
        return f"{v:.3g}"
    return f"{v:.4f}" if isinstance(v, float) else str(v)


class StepTimer:
    """Wall-clock sections of one step (data wait, forward, backward, optimizer), synchronized on CUDA.

    ``mark(name)`` charges the time since the previous mark to ``name``; the sections of one step are disjoint and
    sum to the step's wall time. ``add`` records a sub-section measured elsewhere (e.g. the vision tower inside the
    forward), which is *not* part of that sum.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.sections: dict[str, float] = {}
        self._t = time.perf_counter()

    def mark(self, name: str) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        now = time.perf_counter()
        self.sections[name] = self.sections.get(name, 0.0) + (now - self._t)
        self._t = now

    def add(self, name: str, seconds: float) -> None:
        self.sections[name] = self.sections.get(name, 0.0) + seconds

    def reset(self) -> dict[str, float]:
        out, self.sections = self.sections, {}
        self._t = time.perf_counter()
        return out


class ModuleTimer:
    """Seconds spent inside one module's forward, from forward pre/post hooks (synchronized on CUDA).

    The trainer attaches one to the vision tower to split the forward into vision and text time: the tower runs
    once per forward, so ``take()`` after each forward returns that call's time. A module that is re-entered before
    it returns (it is not, for the vision tower) would be timed from its outermost call.
    """

    def __init__(self, module: torch.nn.Module, device: torch.device) -> None:
        self.device = device
        self._seconds = 0.0
        self._start: float | None = None
        self._depth = 0
        self._handles = [
            module.register_forward_pre_hook(self._enter),
            module.register_forward_hook(self._exit),
        ]

    def _now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def _enter(self, module, args) -> None:
        if self._depth == 0:
            self._start = self._now()
        self._depth += 1

    def _exit(self, module, args, output) -> None:
        self._depth -= 1
        if self._depth == 0 and self._start is not None:
            self._seconds += self._now() - self._start
            self._start = None

    def take(self) -> float:
        """Seconds accumulated since the last ``take`` (and reset)."""
        out, self._seconds = self._seconds, 0.0
        return out

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


STEP_SECTIONS = ("data_s", "forward_s", "backward_s", "optimizer_s")
"""The disjoint wall-clock sections of a step; they sum to ``step_time_s``."""


def step_breakdown(sections: dict[str, float]) -> dict[str, float]:
    """Where one step's time went, as logged in ``metrics.jsonl`` (seconds, this rank).

    ``data_s`` (waiting for packs, collating, the step's all-reduce), ``forward_s`` = ``vision_s`` (the vision
    tower) + ``text_forward_s`` (embedding, text decoder and the chunked loss, which also computes the LM head's
    gradients), ``backward_s``, ``optimizer_s`` (clipping, AdamW, schedule); ``step_time_s`` is the sum of the four
    disjoint sections. Synchronized on CUDA, so each section holds its own kernels.
    """
    out = {name: float(sections.get(name, 0.0)) for name in STEP_SECTIONS}
    vision = float(sections.get("vision_s", 0.0))
    out["vision_s"] = vision
    out["text_forward_s"] = out["forward_s"] - vision
    out["step_time_s"] = sum(out[name] for name in STEP_SECTIONS)
    return out
