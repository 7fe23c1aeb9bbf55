"""The GPU check (``bash bench/gpu.sh``) on the CPU, so the one command a rare GPU session runs cannot rot unseen.

``bash bench/gpu.sh --cpu-smoke`` runs every part of the check (pytest -m gpu, the trainer end to end through
``vlm_sft/train.py`` with a mid-run checkpoint, the resumed run and its comparison, the reload of ``final/`` by our
model and by transformers, ``bench/gpu_bench.py``, the JSON and the table) on a 2-layer model in float32. On the CPU
the resume must be exact and both loaders must agree to float32 rounding. The comparison itself is also checked on
made-up runs, with the resume bugs it exists to catch.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from vlm_sft.config import REPO_ROOT

sys.path.insert(0, str(REPO_ROOT / "bench"))

import gpu_check  # bench/ is not a package: imported from its folder, put on the path above

SMOKE_STEPS, SMOKE_SAVE = 6, 3
"""``gpu_check.SMOKE_OVERRIDES``: 6 steps, a checkpoint at step 3."""


@pytest.fixture(scope="module")
def smoke(tmp_path_factory) -> tuple[dict, Path, str]:
    tmp = tmp_path_factory.mktemp("gpu_check")
    out, work = tmp / "out", tmp / "work"
    env = {k: v for k, v in os.environ.items() if k != "OUT"}
    env.update({"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "2", "PYTHON": sys.executable})
    # The check's own budget for --cpu-smoke is 170 s; 220 leaves room for a machine shared with other jobs.
    cmd = ["bash", "bench/gpu.sh", "--cpu-smoke", "--out", str(out), "--work", str(work), "--budget-s", "220"]
    proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=270)
    assert proc.returncode == 0, f"{proc.stdout[-6000:]}\n{proc.stderr[-4000:]}"
    assert not any(work.iterdir()), "the check must remove its models, checkpoints and data"
    return json.loads((out / "gpu_check.json").read_text()), out, proc.stdout


@pytest.mark.slow
def test_every_part_passes_and_is_recorded(smoke):
    report, out, stdout = smoke
    assert report["smoke"] and report["ok"] and all(report["verdicts"].values()), report["verdicts"]
    env = report["environment"]
    assert env["versions"]["torch"] and env["versions"]["transformers"] and env["cuda_available"] is False
    pytest_part = report["pytest"]
    assert pytest_part["files"] and pytest_part["tests"] >= 1
    assert pytest_part["skipped"] == pytest_part["tests"]  # no CUDA here: every gpu test skips
    model = report["trainer"]["model"]
    assert (model["layers"], model["linear_attention_layers"]) == (2, 1)
    assert sorted(p.name for p in out.iterdir()) == sorted(gpu_check.OUT_FILES)  # a GPU session brings back 8
    assert len(report["trainer"]["train"]["metrics"]) >= SMOKE_STEPS
    assert (out / "summary.txt").read_text().strip() == report["summary"]
    assert "total                  ok" in stdout and "gpu_bench.py" in stdout


@pytest.mark.slow
def test_training_runs_resume_exactly_and_reload(smoke):
    report = smoke[0]
    train, resume, reload = (report["trainer"][k] for k in ("train", "resume", "reload"))
    assert (train["first_step"], train["last_step"], train["logged_steps"]) == (1, SMOKE_STEPS, SMOKE_STEPS)
    assert train["losses_finite"] and train["loss_last"] < train["loss_first"]
    assert train["evals"] and all(math.isfinite(e["eval_loss"]) for e in train["evals"])
    assert f"step-{SMOKE_SAVE:06d}" in train["checkpoints"] and train["final_written"]
    assert train["tokens_per_s_median"] > 0 and train["peak_memory_mb"] > 0
    assert train["packing_check"]["ok"]
    assert (resume["first_step"], resume["last_step"]) == (SMOKE_SAVE + 1, SMOKE_STEPS)
    c = resume["comparison"]
    assert c["ok"] and c["steps_compared"] == SMOKE_STEPS - SMOKE_SAVE
    assert c["data_identical"] and c["lr_identical"]
    assert c["max_rel_loss_diff"] <= 1e-6  # float32 on the CPU: the resume is exact, far inside the GPU bound
    assert reload["finite"] and reload["rel_logit_diff"] <= 1e-4
    assert reload["vs_resumed"]["same_keys"] and reload["vs_resumed"]["max_abs_diff"] <= 1e-6


@pytest.mark.slow
def test_throughput_rows(smoke):
    bench = smoke[0]["bench"]
    assert bench["complete"] and {r["mode"] for r in bench["rows"]} == {"bfd", "stack"}  # packed and padded
    assert all(r["real_tok_s"] > 0 and r["steps"] == 1 for r in bench["rows"])
    moe = [r for r in bench["rows"] if r["model"] == "35B-A3B/4L"]  # the MoE row: 4 layers of the 35B-A3B shape
    assert len(moe) == 1 and moe[0]["mode"] == "bfd" and moe[0]["useful_tflop_s"] > 0


def _steps(losses: dict[int, float], changes: dict[int, dict] | None = None) -> list[dict]:
    base = {"lr": 1e-4, "grad_norm": 1.0, "real_tokens": 500, "trainable_tokens": 100, "images": 3}
    return [{"step": s, "loss": loss, **base, **(changes or {}).get(s, {})} for s, loss in losses.items()]


def test_compare_resume_accepts_noise_and_flags_bad_resumes():
    full = _steps({1: 9.0, 2: 8.0, 3: 7.0, 4: 6.0})
    noisy = _steps({3: 7.0 * (1 + 1e-3), 4: 6.0 * (1 - 2e-3)})  # bf16 rounding noise
    good = gpu_check.compare_resume(full, noisy, resume_step=2)
    assert good["ok"] and good["steps_compared"] == 2 and good["max_rel_loss_diff"] == pytest.approx(2e-3)
    lost_state = gpu_check.compare_resume(full, _steps({3: 7.4, 4: 6.3}), resume_step=2)  # e.g. reset AdamW moments
    assert not lost_state["ok"] and lost_state["worst_step"] == 3
    other_data = gpu_check.compare_resume(full, _steps({3: 7.0, 4: 6.0}, {4: {"images": 4}}), resume_step=2)
    assert not other_data["ok"] and not other_data["data_identical"]
    restarted_schedule = gpu_check.compare_resume(full, _steps({3: 7.0, 4: 6.0}, {3: {"lr": 2e-5}}), resume_step=2)
    assert not restarted_schedule["ok"] and not restarted_schedule["lr_identical"]
    missing_step = gpu_check.compare_resume(full, _steps({3: 7.0}), resume_step=2)
    assert not missing_step["ok"] and not missing_step["same_steps"]


def test_a_hanging_part_is_stopped_with_its_children(tmp_path):
    pid_file = tmp_path / "grandchild.pid"
    cmd = ["bash", "-c", f"sleep 120 & echo $! > {pid_file}; wait"]
    start = time.perf_counter()
    res = gpu_check.run_logged(cmd, tmp_path / "hang.log", timeout=5)
    assert res["status"] == "timeout" and time.perf_counter() - start < 30
    grandchild = pid_file.read_text().strip()
    deadline = time.monotonic() + 10
    while _running(grandchild) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _running(grandchild)
    assert "killed after 5 s" in (tmp_path / "hang.log").read_text()


def _running(pid: str) -> bool:
    try:
        return "zombie" not in Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
