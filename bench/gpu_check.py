"""The GPU check: one command that proves the first real training run works on one CUDA GPU, and leaves every figure.

    bash bench/gpu.sh                      (carried wheels installed offline, then this script; < 8 min on one H200)
    bash bench/gpu.sh --cpu-smoke          (the same parts on the CPU: 2-layer model, float32; < 3 min on 2 cores)
    python bench/gpu_check.py [--cpu-smoke] [--out DIR] [--work DIR] [--budget-s S] [--keep-work]

Why one script: GPU sessions here are rare, short and offline, so the first one must answer "does training work on a
GPU, how fast, and is a checkpoint usable" in one go, and whatever happens, leave the figures behind. Every part runs
as a subprocess with its own time limit and log; a crash or a hang is recorded and the next part still runs; the
parts share one deadline (``--budget-s``), and the JSON and the table are written at the end in every case. On the
GPU the parts run one at a time; under ``--cpu-smoke`` parts 1 and 3 run beside part 2 (on 2 cores the parts are
mostly imports, and the smoke runs in the test suite).

1. ``pytest -m gpu`` on the test files with ``gpu`` marks (CUDA kernels vs the pure-torch references): counts.
2. The real trainer end to end, through its entry point ``python vlm_sft/train.py --config configs/gpu_check.toml``:
   a randomly initialised model of the full Qwen3.5-0.8B shape (24 layers; ``bench/gpu_check_worker.py
   write-model``) loaded from an HF checkpoint directory, bf16, activation checkpointing, shapes data (images +
   text) in 8k-token packs, the packing self-check, eval every 10 steps, a resumable checkpoint at step 15, 30
   steps. A second run resumes from that checkpoint into its own folder; its steps 16-30 are compared with the
   uninterrupted run's (``RESUME_RTOL``). Then ``final/`` is reloaded by ``Qwen3_5VLM`` and by transformers'
   ``Qwen3_5ForConditionalGeneration``, which score the same probe (``gpu_check_worker.py reload``).
3. Throughput and MFU: ``bench/gpu_bench.py`` (packed vs padded, fastest vs pure-torch kernels, a LoRA row, an MoE
   row of the Qwen3.5-35B-A3B widths on 4 layers whose MFU counts the active experts, peak memory).
4. Ours vs what users pick instead: ``bench/bench_vs_transformers.py --device cuda`` (the 0.8B shape on 4 layers,
   bf16 autocast; transformers with its fla kernels and its best attention, padded random and length-grouped
   batches; ours packed with our GPU backends), last, so it never takes time from the parts above.

Eight files go to ``--out`` (``OUT_FILES``): ``gpu_check.json`` (every figure, the runs' metrics records and packing
self-check reports included), ``summary.txt`` (the table printed at the end) and one log per part; by default
``$OUT/gpu_check/`` when ``OUT`` is set, else ``bench/results/gpu_check/``; ``--cpu-smoke`` uses a new temporary
folder unless ``--out`` is given, never ``bench/results``. Models, checkpoints and data (about 25 GB for the 0.8B
shape) go to ``--work`` (a temporary folder, emptied at the end unless ``--keep-work``). Exit status 1 when a part
failed.

Modules: this one (the parts in order, pytest -m gpu and the benchmark, the verdicts), ``gpu_check_run.py`` (the plan,
folders, deadline, and a part as a logged subprocess), ``gpu_check_trainer.py`` (part 2: train, resume, reload),
``gpu_check_report.py`` (the table), ``gpu_check_worker.py`` (the parts that need torch: environment, random
checkpoint, reload).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from gpu_check_report import summary_table
from gpu_check_run import BENCH, REPO, VS_BENCH, WORK_FOLDERS, Budget, Dirs, Plan, child_env, make_plan, run_worker
from gpu_check_run import run_logged as run_logged  # re-exported: tests/test_gpu_check.py uses gpu_check.run_logged
from gpu_check_trainer import RESUME_RTOL, part_train
from gpu_check_trainer import compare_resume as compare_resume  # re-exported for tests/test_gpu_check.py

OUT_FILES = (
    "gpu_check.json",
    "summary.txt",
    "pytest_gpu.log",
    "worker.log",
    "train.log",
    "resume.log",
    "gpu_bench.log",
    "vs_transformers.log",
)
"""Everything the check writes under ``--out``: 8 files, since a GPU session brings back at most 8 from ``$OUT``.
``worker.log`` holds the ``gpu_check_worker.py`` parts (environment, random checkpoint, reload), one after another;
the runs' ``metrics.jsonl`` records and packing self-check reports are inside ``gpu_check.json``."""


def junit_counts(xml: Path) -> dict:
    root = ET.parse(xml).getroot()
    suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
    total = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    total["passed"] = total["tests"] - total["failures"] - total["errors"] - total["skipped"]
    return total


def part_pytest(dirs: Dirs, budget: Budget, cap: float) -> dict:
    """``pytest -m gpu`` over the test files holding ``gpu`` marks (on a CPU they are all skipped)."""
    files = sorted(str(p.relative_to(REPO)) for p in (REPO / "tests").glob("test_*.py") if "mark.gpu" in p.read_text())
    xml = dirs.scratch("pytest_gpu.xml")
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider", f"--junitxml={xml}", *files]
    res = run_logged(cmd, dirs.out / "pytest_gpu.log", budget.timeout(cap))
    res["files"] = files
    if xml.is_file():
        res |= junit_counts(xml)
    return res


def run_bench_script(script: Path, args: list[str], name: str, cap: float, dirs: Dirs, budget: Budget) -> dict:
    """Run a bench script with ``--out`` in the scratch folder and its log in ``--out``; its JSON under ``payload``
    when it wrote one (a script that rewrites it as it goes leaves what it did before a time limit)."""
    target = dirs.scratch(f"{name}.json")
    cmd = [sys.executable, str(script), *args, "--out", str(target)]
    res = run_logged(cmd, dirs.out / f"{name}.log", budget.timeout(cap), child_env(drop=("OUT",)))
    return res | ({"payload": json.loads(target.read_text())} if target.is_file() else {})


def part_bench(plan: Plan, dirs: Dirs, budget: Budget) -> dict:
    """``bench/gpu_bench.py``; its JSON (rewritten after each row, so a time limit keeps the rows done) is read in."""
    res = run_bench_script(BENCH, plan.bench_args, "gpu_bench", plan.caps["bench"], dirs, budget)
    if payload := res.pop("payload", None):
        res |= {"complete": payload.get("complete"), "pack_len": payload.get("pack_len"), "rows": payload["rows"]}
    return res


def part_vs_transformers(plan: Plan, dirs: Dirs, budget: Budget) -> dict:
    """``bench/bench_vs_transformers.py``: ours (packed) vs transformers' own model with padded batches; its table and
    per-workload figures are read in."""
    res = run_bench_script(VS_BENCH, plan.vs_args, "vs_transformers", plan.caps["vs"], dirs, budget)
    if payload := res.pop("payload", None):
        res |= {"table": payload["table"], "workloads": payload["workloads"]}
    return res


def verdicts(report: dict) -> dict[str, bool]:
    t = report["trainer"]
    return {
        "pytest": report["pytest"]["status"] == "ok",
        "model": t.get("model", {}).get("status") == "ok",
        "train": bool(t.get("train", {}).get("ok")),
        "resume": bool(t.get("resume", {}).get("ok")) and bool(t.get("resume", {}).get("comparison", {}).get("ok")),
        "reload": bool(t.get("reload", {}).get("ok")),
        "bench": report["bench"]["status"] == "ok" and bool(report["bench"].get("rows")),
        "vs": report["vs"]["status"] == "ok" and bool(report["vs"].get("workloads")),
    }


def default_out(smoke: bool) -> Path:
    if smoke:
        return Path(tempfile.mkdtemp(prefix="gpu_check_smoke_"))
    if os.environ.get("OUT"):
        return Path(os.environ["OUT"]) / "gpu_check"
    return REPO / "bench" / "results" / "gpu_check"


def _trainer(plan: Plan, dirs: Dirs, budget: Budget) -> dict:
    print(f"== the trainer end to end ({plan.max_steps} steps, resume from {plan.resume_step}, reload)", flush=True)
    return part_train(plan, dirs, budget)


def _pytest(plan: Plan, dirs: Dirs, budget: Budget) -> dict:
    print("== pytest -m gpu", flush=True)
    return part_pytest(dirs, budget, plan.caps["pytest"])


def _bench(plan: Plan, dirs: Dirs, budget: Budget) -> dict:
    print("== throughput and MFU (bench/gpu_bench.py)", flush=True)
    return part_bench(plan, dirs, budget)


def _vs(plan: Plan, dirs: Dirs, budget: Budget) -> dict:
    print("== ours vs transformers' model (bench/bench_vs_transformers.py)", flush=True)
    return part_vs_transformers(plan, dirs, budget)


def _pytest_then_bench(plan: Plan, dirs: Dirs, budget: Budget) -> tuple[dict, dict, dict]:
    return _pytest(plan, dirs, budget), _bench(plan, dirs, budget), _vs(plan, dirs, budget)


def run_check(plan: Plan, dirs: Dirs, budget: Budget) -> dict:
    start = time.perf_counter()
    print(
        f"== GPU check{' (--cpu-smoke)' if plan.smoke else ''}: figures in {dirs.out}, work in {dirs.work}", flush=True
    )
    for name in OUT_FILES:  # nothing left from an earlier check can pass for this one's
        (dirs.out / name).unlink(missing_ok=True)
    report: dict = {"smoke": plan.smoke, "out": str(dirs.out), "resume_rtol": RESUME_RTOL}
    report["environment"] = run_worker(["env"], dirs, budget, plan.caps["env"])
    if plan.smoke:  # on the CPU, pytest and the bench run beside the trainer's parts: 2 cores, mostly imports
        # One thread per part: two parts with 2 OpenMP threads each on 2 cores spin against each other (steps 50x
        # slower, measured); the smoke's tiny model gains nothing from a second thread.
        os.environ["OMP_NUM_THREADS"] = "1"
        with ThreadPoolExecutor(max_workers=1) as side:
            independent = side.submit(_pytest_then_bench, plan, dirs, budget)
            report["trainer"] = _trainer(plan, dirs, budget)
            report["pytest"], report["bench"], report["vs"] = independent.result()
    else:  # on the GPU one part at a time: the throughput figures must not share the device
        report["pytest"] = _pytest(plan, dirs, budget)
        report["trainer"] = _trainer(plan, dirs, budget)
        report["bench"] = _bench(plan, dirs, budget)
        report["vs"] = _vs(plan, dirs, budget)
    report["wall_s"] = round(time.perf_counter() - start, 1)
    report["verdicts"] = verdicts(report)
    report["ok"] = all(report["verdicts"].values())
    return report


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu-smoke", action="store_true", help="all parts on the CPU: 2-layer model, float32, 6 steps")
    ap.add_argument("--out", type=Path, help="folder for the JSON, logs and table (see the module docstring)")
    ap.add_argument("--work", type=Path, help="folder for models, checkpoints, data (default: a temporary one)")
    ap.add_argument("--keep-work", action="store_true", help="keep the work folder (checkpoints) at the end")
    ap.add_argument("--budget-s", type=float, help="deadline for all parts (default 480; --cpu-smoke 170)")
    args, bench_extra = ap.parse_known_args()  # anything else goes to gpu_bench.py, e.g. --steps 4
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind, so the running part is stopped too
    plan = make_plan(args.cpu_smoke, bench_extra)
    dirs = Dirs(
        out=(args.out or default_out(args.cpu_smoke)).resolve(),
        work=(args.work or Path(tempfile.mkdtemp(prefix="gpu_check_work_"))).resolve(),
    )
    dirs.out.mkdir(parents=True, exist_ok=True)
    dirs.work.mkdir(parents=True, exist_ok=True)
    budget = Budget(args.budget_s or (170 if args.cpu_smoke else 480))
    try:
        report = run_check(plan, dirs, budget)
    finally:
        if not args.keep_work:  # only what the check wrote: --work may name a folder holding other things
            for name in WORK_FOLDERS:
                shutil.rmtree(dirs.work / name, ignore_errors=True)
            if args.work is None:
                dirs.work.rmdir()
    report["summary"] = summary_table(report)
    (dirs.out / "gpu_check.json").write_text(json.dumps(report, indent=2) + "\n")
    (dirs.out / "summary.txt").write_text(report["summary"] + "\n")
    print(f"\n{report['summary']}\n\nwrote {', '.join(n for n in OUT_FILES if (dirs.out / n).is_file())} in {dirs.out}")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
