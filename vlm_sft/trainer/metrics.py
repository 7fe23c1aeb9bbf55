"""Metrics: one JSON line per logged step in ``metrics.jsonl``, a tqdm bar on rank 0, optional tensorboard / wandb."""

from __future__ import annotations

import json
import logging
import math
import time
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

logger = logging.getLogger(__name__)


def peak_memory_mb(device: torch.device) -> float:
    """Peak memory of this process: CUDA allocator peak on GPU, max resident set size on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


class MetricsLogger:
    """Writes metrics on rank 0 only; every other rank gets a silent logger with the same interface."""

    def __init__(
        self,
        output_dir: str | Path,
        *,
        enabled: bool,
        total_steps: int,
        start_step: int = 0,
        report_to: list[str] = (),
        run_config: dict | None = None,
    ) -> None:
        self.enabled = enabled
        self.path = Path(output_dir) / "metrics.jsonl"
        self._bar = None
        self._sinks: list[Any] = []
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if start_step == 0 and self.path.exists():
            self.path.unlink()
        elif start_step > 0 and self.path.exists():
            self._truncate_after(start_step)
        self._bar = tqdm(total=total_steps, initial=start_step, desc="train", unit="step", dynamic_ncols=True)
        for sink in report_to:
            self._sinks.append(_make_sink(sink, Path(output_dir), run_config or {}))

    def _truncate_after(self, step: int) -> None:
        """On resume, drop lines logged after the checkpoint so the file reads as one uninterrupted run."""
        kept = [line for line in self.path.read_text().splitlines() if json.loads(line).get("step", 0) <= step]
        self.path.write_text("".join(line + "\n" for line in kept))

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
        for sink in self._sinks:
            sink(record)

    def write(self, message: str) -> None:
        """Print a line without breaking the progress bar."""
        if self.enabled:
            tqdm.write(message)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def _short(v: float) -> str:
    if isinstance(v, float) and (abs(v) >= 1e4 or (v != 0 and abs(v) < 1e-3)) and math.isfinite(v):
        return f"{v:.3g}"
    return f"{v:.4f}" if isinstance(v, float) else str(v)


def _make_sink(name: str, output_dir: Path, run_config: dict):
    if name == "tensorboard":
        from torch.utils.tensorboard import SummaryWriter

        writer = SummaryWriter(log_dir=str(output_dir / "tensorboard"))

        def tb(record: dict) -> None:
            step = int(record.get("step", 0))
            for k, v in record.items():
                if isinstance(v, int | float) and k != "step":
                    writer.add_scalar(k, v, step)
            writer.flush()

        return tb
    if name == "wandb":
        import wandb

        run = wandb.init(config=run_config, dir=str(output_dir))

        def wb(record: dict) -> None:
            run.log({k: v for k, v in record.items() if isinstance(v, int | float)}, step=int(record.get("step", 0)))

        return wb
    raise ValueError(f"unknown report_to sink {name!r}; use 'tensorboard' or 'wandb'")


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
