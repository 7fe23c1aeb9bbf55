"""How the GPU check (``bench/gpu_check.py``) runs a part: its plan (the check vs ``--cpu-smoke``), its folders, one
deadline for all parts, and each part as a subprocess with its own log and time limit, so that a crash or a hang is
recorded and the next part still runs."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from vlm_sft.config import load_config  # noqa: E402  (the repository root is put on the path first)

CONFIG = REPO / "configs" / "gpu_check.toml"
TRAIN = REPO / "vlm_sft" / "train.py"
WORKER = REPO / "bench" / "gpu_check_worker.py"
BENCH = REPO / "bench" / "gpu_bench.py"
VS_BENCH = REPO / "bench" / "bench_vs_transformers.py"

WORK_FOLDERS = ("model", "run", "resumed", "shapes", "scratch")
"""What the check writes under ``--work``: the random checkpoint, the two runs, the shapes data, the parts' raw
outputs (pytest's XML, the workers' and the benchmark's JSON), whose figures all end up in ``gpu_check.json``."""


SMOKE_OVERRIDES = [
    *("--train.device", "cpu", "--model.dtype", "float32"),  # the trainer refuses bf16 without CUDA
    *("--data.seq_len", "192", "--data.pack_len", "256"),
    *("--data.shapes.num_train", "120", "--data.shapes.num_eval", "8", "--data.shapes.image_size", "64"),
    *("--train.max_steps", "6", "--train.save_every", "3", "--train.eval_every", "2", "--train.warmup_steps", "1"),
]
"""``--cpu-smoke`` on top of ``configs/gpu_check.toml``: CPU, float32, 256-token packs of 64-pixel images, 6 steps,
a save at step 3 (and the 2-layer model of ``gpu_check_worker.py write-model --smoke``)."""


@dataclass(frozen=True)
class Plan:
    """What the GPU check and its CPU smoke run differ in."""

    smoke: bool
    """True for ``--cpu-smoke``."""
    train_overrides: list[str]
    """Overrides of ``configs/gpu_check.toml`` for both training runs."""
    max_steps: int
    """Steps of the uninterrupted run (from the resolved config)."""
    resume_step: int
    """The step the resumed run starts from: the first ``train.save_every``."""
    bench_args: list[str]
    """Arguments of ``bench/gpu_bench.py``."""
    vs_args: list[str]
    """Arguments of ``bench/bench_vs_transformers.py`` (ours vs transformers' model, side by side)."""
    caps: dict[str, float]
    """Time limit per part, seconds (each also bounded by what is left of the budget)."""


def make_plan(smoke: bool, bench_extra: list[str]) -> Plan:
    overrides = SMOKE_OVERRIDES if smoke else []
    cfg = load_config(CONFIG, overrides)  # fails here, before any part, if the config does not validate
    save, steps = cfg.train.save_every, cfg.train.max_steps
    if not save or not steps or save >= steps:
        raise SystemExit(f"{CONFIG}: the check needs 0 < train.save_every ({save}) < train.max_steps ({steps})")
    if smoke:  # on a CPU "auto" is the pure-torch kernels: one backend; each row's first step costs ~10 s there
        bench = shlex.split("--smoke --backends auto --pack-len 256 --samples 4 --warmup 1 --steps 1")
        vs = shlex.split("--device cpu --threads 1 --workloads shapes --shapes-samples 64 --reps 1 --slices 1")
        caps = {"env": 60, "pytest": 60, "model": 60, "train": 120, "resume": 90, "reload": 60, "bench": 90, "vs": 60}
    else:
        bench = ["--backends", "auto,torch"]
        vs = shlex.split("--device cuda --model 0.8b --layers 4 --reps 3 --slices 2")
        caps = {"env": 60, "pytest": 150, "model": 90, "train": 240, "resume": 150, "reload": 90, "bench": 180}
        caps["vs"] = 120
    return Plan(smoke, list(overrides), steps, save, [*bench, *bench_extra], vs, caps)


@dataclass(frozen=True)
class Dirs:
    """Where the check writes."""

    out: Path
    """The figures and logs (``OUT_FILES``), kept."""
    work: Path
    """Models, checkpoints, data and raw part outputs (``WORK_FOLDERS``), removed at the end unless kept."""

    def work_path(self, name: str) -> Path:
        assert name in WORK_FOLDERS, name
        return self.work / name

    def scratch(self, name: str) -> Path:
        """A raw output of a part, read into the report."""
        folder = self.work_path("scratch")
        folder.mkdir(parents=True, exist_ok=True)
        (folder / name).unlink(missing_ok=True)
        return folder / name


class Budget:
    """One deadline for the whole check; each part gets ``min(its cap, time left)``."""

    def __init__(self, seconds: float) -> None:
        self.deadline = time.monotonic() + seconds

    def timeout(self, cap: float) -> float:
        return max(0.0, min(cap, self.deadline - time.monotonic()))


def child_env(drop: tuple[str, ...] = ()) -> dict[str, str]:
    skip = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", *drop}
    env = {k: v for k, v in os.environ.items() if k not in skip}
    env.update({"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"})
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])
    return env


def run_logged(cmd: list[str], log: Path, timeout: float, env: dict[str, str] | None = None) -> dict:
    """Run ``cmd`` with stdout and stderr appended to ``log``; after ``timeout`` s kill it with its children.

    Returns status (``ok`` / ``failed`` / ``timeout`` / ``skipped`` when no time is left), return code, wall seconds.
    The command runs in a session of its own, so a kill takes its workers too (the trainer's data worker).
    """
    if timeout < 5:
        with log.open("a") as f:
            f.write(f"$ {shlex.join(cmd)}\nskipped: {timeout:.0f} s left of the budget\n")
        reason = f"not run: {timeout:.0f} s left of the budget"
        return {"status": "skipped", "reason": reason, "returncode": None, "wall_s": 0.0, "log": log.name}
    start = time.perf_counter()
    with log.open("a") as f:
        f.write(f"$ {shlex.join(cmd)}\n")
        f.flush()
        proc = subprocess.Popen(
            cmd, stdout=f, stderr=subprocess.STDOUT, cwd=REPO, env=env or child_env(), start_new_session=True
        )
        timed_out = False
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            rc, timed_out = proc.wait(), True
            f.write(f"\nkilled after {timeout:.0f} s (time limit of this part)\n")
        finally:
            if proc.poll() is None:  # the check itself was stopped (Ctrl-C, SIGTERM): stop the part's processes too
                os.killpg(proc.pid, signal.SIGKILL)
    wall = time.perf_counter() - start
    status = "timeout" if timed_out else ("ok" if rc == 0 else "failed")
    if status != "ok":
        tail = log.read_text(errors="replace").splitlines()[-25:]  # this part's end: the last lines of the log
        print(f"  {log.name}: {status} (rc {rc}); last lines:\n    " + "\n    ".join(tail), flush=True)
    return {"status": status, "returncode": rc, "wall_s": round(wall, 1), "timeout_s": round(timeout), "log": log.name}


def run_worker(args: list[str], dirs: Dirs, budget: Budget, cap: float) -> dict:
    """``gpu_check_worker.py --json X <args>`` (logged to ``worker.log``): its status plus the figures it wrote."""
    result_json = dirs.scratch(f"{args[0]}.json")
    cmd = [sys.executable, str(WORKER), "--json", str(result_json), *args]
    res = run_logged(cmd, dirs.out / "worker.log", budget.timeout(cap))
    if result_json.is_file():
        res |= json.loads(result_json.read_text())
    return res
