"""Launch real training runs (1 or 2 processes) for the trainer tests, with a hard timeout instead of a hang."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from vlm_sft.config import REPO_ROOT

TRAIN_SCRIPT = str(REPO_ROOT / "vlm_sft" / "train.py")


def tiny_run_args(tmp: Path, **overrides: object) -> list[str]:
    """Overrides for a seconds-long run: a small shapes set, short packs, no eval unless asked."""
    base: dict[str, object] = {
        "data.shapes.root": str(tmp / "shapes"),
        "data.shapes.num_train": 48,
        "data.shapes.num_eval": 0,
        "data.seq_len": 128,
        "data.pack_len": 160,
        "train.output_dir": str(tmp / "run"),
        "train.max_steps": 2,
        "train.warmup_steps": 1,
        "train.log_every": 1,
        "train.eval_every": "none",
        "data.num_workers": 0,
    }
    base.update(overrides)
    args: list[str] = []
    for key, value in base.items():
        args += [f"--{key}", value if isinstance(value, str) else json.dumps(value)]
    return args


def launch_env() -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    }
    env.update(
        {"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}
    )
    return env


def train_command(args: list[str], nproc: int = 1) -> list[str]:
    if nproc == 1:
        return [sys.executable, TRAIN_SCRIPT, *args]
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        TRAIN_SCRIPT,
        *args,
    ]


def run_training(args: list[str], *, nproc: int = 1, timeout: float = 120.0) -> subprocess.CompletedProcess:
    """Run to completion; a hang (e.g. mismatched collectives) fails after ``timeout`` seconds instead of stalling CI."""
    proc = subprocess.run(
        train_command(args, nproc), env=launch_env(), cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout
    )
    if proc.returncode != 0:
        raise AssertionError(f"training failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}")
    return proc


class Background:
    """A training run started in the background (``run_training``'s checks on ``wait``), so that independent runs of
    one test share the cores: a run is mostly one process importing torch and transformers."""

    def __init__(self, args: list[str], *, nproc: int = 1) -> None:
        self.proc = subprocess.Popen(
            train_command(args, nproc), env=launch_env(), cwd=REPO_ROOT, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True,
        )  # fmt: skip

    def wait(self, timeout: float = 120.0) -> None:
        try:
            out, err = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise
        if self.proc.returncode != 0:
            raise AssertionError(f"training failed ({self.proc.returncode}):\n{out[-4000:]}\n{err[-8000:]}")


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


DETERMINISTIC_KEYS = (
    "step",
    "loss",
    "lr",
    "grad_norm",
    "real_tokens",
    "trainable_tokens",
    "padding_fraction",
    "images",
)
"""Metrics that must repeat exactly between runs (timings and memory are left out)."""


def deterministic(records: list[dict]) -> list[dict]:
    return [{k: r[k] for k in DETERMINISTIC_KEYS if k in r} for r in records if "loss" in r]
