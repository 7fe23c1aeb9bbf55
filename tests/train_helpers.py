"""Launch real training runs (1 or 2 processes) for the trainer tests, with a hard timeout instead of a hang."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from vlm_sft.config import REPO_ROOT

TRAIN_SCRIPT = str(REPO_ROOT / "vlm_sft" / "train.py")
LEARNING_CHECK = "VLM_SFT_LEARNING_CHECKS"
"""Set to 1 to run the learning checks (default-size runs of about 4 minutes each on 2 CPU cores; the suite's
budget has no room for them)."""


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
        "train.plot": False,  # run.png costs ~1.5 s a run; the plot's own tests draw it
    }
    base.update(overrides)
    args: list[str] = []
    for key, value in base.items():
        args += [f"--{key}", value if isinstance(value, str) else json.dumps(value)]
    return args


def mixture_run_args(config: Path, run: Path) -> list[str]:
    """A mixture config (``configs/debug_mixture.toml`` or one built like it) made a 2-step run with an eval at its
    end, into ``run``."""
    train = {"max_steps": 2, "eval_every": 2, "eval_generate": 0, "output_dir": run, "log_every": 1, "plot": "false"}
    args = ["--config", str(config), "--data.num_workers", "0", "--data.pack_len", "640", "--data.seq_len", "320"]
    return args + [a for k, v in train.items() for a in (f"--train.{k}", str(v))]


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


def train_command(args: list[str], nproc: int = 1, script: str = TRAIN_SCRIPT) -> list[str]:
    if nproc == 1:
        return [sys.executable, script, *args]
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        script,
        *args,
    ]


class Background:
    """A training run started in the background, so that independent runs of one test share the cores (a run is
    mostly one process importing torch and transformers); ``wait`` collects it, ``kill`` ends all of it."""

    def __init__(
        self, args: list[str], *, nproc: int = 1, script: str = TRAIN_SCRIPT, env: dict[str, str] | None = None
    ) -> None:
        """``script``: the entry point (a test wrapper of it, e.g. ``fault_run.py``); ``env``: added variables."""
        # Output goes to files, not pipes: a run nobody reads until it ends must never block on a full pipe.
        self.out = tempfile.TemporaryFile("w+")  # noqa: SIM115 (lives as long as the run; read back by wait)
        self.err = tempfile.TemporaryFile("w+")  # noqa: SIM115
        self.nproc = nproc
        self.proc = subprocess.Popen(
            train_command(args, nproc, script), env=launch_env() | (env or {}), cwd=REPO_ROOT, stdout=self.out,
            stderr=self.err, text=True, start_new_session=True,
        )  # fmt: skip

    def kill(self, workers: list[int] | None = None) -> list[int]:
        """SIGKILL every process of the run, as a node lost at once (``kill_process_tree``); returns the workers.
        ``workers``: torchrun's, when already known (found now otherwise); a one-process run has none of its own
        session (its data workers share its group)."""
        if workers is None:
            workers = child_pids(self.proc.pid) if self.nproc > 1 else []
        return kill_process_tree(self.proc, workers)

    def _output(self) -> tuple[str, str]:
        for f in (self.out, self.err):
            f.seek(0)
        return self.out.read(), self.err.read()

    def wait(self, timeout: float = 120.0, *, check: bool = True) -> subprocess.CompletedProcess:
        """The finished run; a hang (e.g. mismatched collectives) is killed after ``timeout`` seconds instead of
        stalling CI; ``check``: a non-zero exit fails with the run's output."""
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise
        out, err = self._output()
        if check and self.proc.returncode != 0:
            raise AssertionError(f"training failed ({self.proc.returncode}):\n{out[-4000:]}\n{err[-8000:]}")
        return subprocess.CompletedProcess(self.proc.args, self.proc.returncode, out, err)

    def kill_after(self, checkpoint: Path, timeout: float = 120.0) -> list[int]:
        """SIGKILL the whole run as soon as ``checkpoint`` is complete; returns the workers killed (torchrun's; none
        for one process). Fails if the run ended, or never wrote ``checkpoint``, before the kill."""
        deadline, workers, found_at = time.monotonic() + timeout, [], 0.0
        while not (checkpoint / "COMPLETE").exists() and self.proc.poll() is None and time.monotonic() < deadline:
            if self.nproc > 1 and time.monotonic() - found_at > 0.25:  # known before the checkpoint: no walk of
                workers, found_at = child_pids(self.proc.pid), time.monotonic()  # /proc between it and the kill
            time.sleep(0.02)
        finished = self.proc.poll() is not None
        workers = self.kill(workers)
        if finished or self.proc.returncode != -signal.SIGKILL or not (checkpoint / "COMPLETE").exists():
            raise AssertionError(
                f"the run ended, or never wrote {checkpoint.name}, before the kill:\n{self._output()[1][-6000:]}"
            )
        return workers


def kill_process_tree(proc: subprocess.Popen, children: list[int] | None = None, wait_s: float = 30.0) -> list[int]:
    """SIGKILL ``proc``'s process group (started with ``start_new_session``) and the group of each of its children
    (``children``: found now when None), then wait until every one is dead; returns the children. torchrun starts each
    worker in a session of its own (torch.distributed.elastic's ``SubprocessHandler``), so killing the launcher's group
    alone would leave them training. Nothing once ``proc`` was collected (its group id may belong to another process by
    then)."""
    if proc.poll() is not None:
        return []
    children = child_pids(proc.pid) if children is None else children
    groups = {proc.pid}
    for pid in children:
        with contextlib.suppress(ProcessLookupError):  # a child that ended meanwhile has no group to kill
            groups.add(os.getpgid(pid))
    for group in groups:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(group, signal.SIGKILL)
    proc.wait(timeout=wait_s)
    deadline = time.monotonic() + wait_s
    while any(is_alive(pid) for pid in children) and time.monotonic() < deadline:
        time.sleep(0.02)
    return children


def child_pids(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (Linux ``/proc``)."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):  # a process that ended while the folder was read
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(stat.parent.name))
    return out


def process_table() -> dict[int, tuple[int, int]]:
    """``{pid: (parent pid, session)}`` of every live process, from one read of ``/proc`` (zombies left out)."""
    table = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError):  # a process that ended while the folder was read
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if fields[0] != "Z":
                table[int(stat.parent.name)] = (int(fields[1]), int(fields[3]))
    return table


def descendants(pid: int, table: dict[int, tuple[int, int]] | None = None) -> list[int]:
    """Every process below ``pid``: its children, theirs, ... (torchrun's workers and their data workers too)."""
    table = process_table() if table is None else table
    found, frontier = [], [pid]
    while frontier:
        below = frontier.pop()
        children = [c for c, (parent, _) in table.items() if parent == below]
        found += children
        frontier += children
    return found


def is_alive(pid: int) -> bool:
    """Still running (a killed process that nobody reaped yet is a zombie, ``Z``: dead)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def run_training(args: list[str], *, nproc: int = 1, timeout: float = 120.0) -> subprocess.CompletedProcess:
    """Run to completion in the foreground (``Background(...).wait``)."""
    return Background(args, nproc=nproc).wait(timeout)


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
