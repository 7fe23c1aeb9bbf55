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

Seven files go to ``--out`` (``OUT_FILES``): ``gpu_check.json`` (every figure, the runs' metrics records and packing
self-check reports included), ``summary.txt`` (the table printed at the end) and one log per part; by default
``$OUT/gpu_check/`` when ``OUT`` is set, else ``bench/results/gpu_check/``; ``--cpu-smoke`` uses a new temporary
folder unless ``--out`` is given, never ``bench/results``. Models, checkpoints and data (about 25 GB for the 0.8B
shape) go to ``--work`` (a temporary folder, emptied at the end unless ``--keep-work``). Exit status 1 when a part
failed.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from vlm_sft.config import load_config  # noqa: E402  (the repository root is put on the path first)

CONFIG = REPO / "configs" / "gpu_check.toml"
TRAIN = REPO / "vlm_sft" / "train.py"
WORKER = REPO / "bench" / "gpu_check_worker.py"
BENCH = REPO / "bench" / "gpu_bench.py"

WORK_FOLDERS = ("model", "run", "resumed", "shapes", "scratch")
"""What the check writes under ``--work``: the random checkpoint, the two runs, the shapes data, the parts' raw
outputs (pytest's XML, the workers' and the benchmark's JSON), whose figures all end up in ``gpu_check.json``."""

OUT_FILES = (
    "gpu_check.json",
    "summary.txt",
    "pytest_gpu.log",
    "worker.log",
    "train.log",
    "resume.log",
    "gpu_bench.log",
)
"""Everything the check writes under ``--out``: 7 files, since a GPU session brings back at most 8 from ``$OUT``.
``worker.log`` holds the ``gpu_check_worker.py`` parts (environment, random checkpoint, reload), one after another;
the runs' ``metrics.jsonl`` records and packing self-check reports are inside ``gpu_check.json``."""

RESUME_RTOL = 1e-2
"""Largest |loss_resumed - loss_uninterrupted| / loss_uninterrupted allowed at a step after the resume point.

Resume restores the fp32 master weights, the AdamW moments, the schedule, the RNG and the data position exactly, so
in float32 on the CPU the losses agree to the last bit (the smoke run reports 0). On a GPU the bf16 kernels are not
bitwise deterministic (atomic adds in flash-attn's and fla's backward, split-K GEMMs): two runs of the same steps
already differ by a few bf16 roundings (2^-8 = 0.4% of an operand) in some gradients, which moves the loss by
about 1e-4 to 1e-3 relative over 15 steps. 1e-2 leaves an order of magnitude for that noise, while a resume that
loses state (reset AdamW moments: the first update becomes a full-lr sign step; a restarted warmup; other weights)
moves a freshly initialised model's fast-falling loss by more. The parts that can be exact are checked exactly
instead: every step's token and image counts (the data position) and learning rate must be identical."""

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
        caps = {"env": 60, "pytest": 60, "model": 60, "train": 120, "resume": 90, "reload": 60, "bench": 90}
    else:
        bench = ["--backends", "auto,torch"]
        caps = {"env": 60, "pytest": 150, "model": 90, "train": 240, "resume": 150, "reload": 90, "bench": 180}
    return Plan(smoke, list(overrides), steps, save, [*bench, *bench_extra], caps)


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


def read_metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []


def _median(records: list[dict], key: str) -> float | None:
    values = [r[key] for r in records if r.get(key) is not None]
    return statistics.median(values) if values else None


def summarize_run(run_dir: Path) -> dict:
    """Figures of one training run from its ``metrics.jsonl`` (kept whole, as ``metrics``) and packing self-check."""
    records = read_metrics(run_dir)
    steps = [r for r in records if "loss" in r]
    timed = steps[1:] or steps  # the first step of a run compiles and autotunes the kernels
    sections = ("data_s", "vision_s", "text_forward_s", "backward_s", "optimizer_s", "step_time_s")
    summary = {
        "first_step": steps[0]["step"] if steps else None,
        "last_step": steps[-1]["step"] if steps else None,
        "logged_steps": len(steps),
        "losses": [[r["step"], r["loss"]] for r in steps],
        "losses_finite": bool(steps) and all(math.isfinite(r["loss"]) for r in steps),
        "loss_first": steps[0]["loss"] if steps else None,
        "loss_last": steps[-1]["loss"] if steps else None,
        "tokens_per_s_median": _median(timed, "tokens_per_s"),
        "tflops_median": _median(timed, "tflops"),
        "mfu_median": _median(timed, "mfu"),
        "peak_memory_mb": max((r["peak_memory_mb"] for r in steps if r.get("peak_memory_mb")), default=None),
        "real_tokens_per_step_median": _median(steps, "real_tokens"),
        "padding_fraction_median": _median(steps, "padding_fraction"),
        "step_time_median_s": {k: _median(timed, k) for k in sections},
        "first_step_time_s": steps[0].get("step_time_s") if steps else None,
        "evals": [r for r in records if "eval_loss" in r],
        "checkpoints": sorted(p.name for p in (run_dir / "checkpoints").glob("step-*")),
        "final_written": (run_dir / "final" / "config.json").is_file(),
        "metrics": records,
    }
    report = run_dir / "packing_check.json"
    if report.is_file():  # the trainer's packing self-check (train.check_packing)
        summary["packing_check"] = json.loads(report.read_text())
    return summary


def compare_resume(full: list[dict], resumed: list[dict], resume_step: int) -> dict:
    """The resumed run against the uninterrupted one, at every step after ``resume_step``."""
    a = {r["step"]: r for r in full if "loss" in r and r["step"] > resume_step}
    b = {r["step"]: r for r in resumed if "loss" in r}
    common = sorted(a.keys() & b.keys())
    rel = {s: abs(b[s]["loss"] - a[s]["loss"]) / max(abs(a[s]["loss"]), 1e-12) for s in common}
    counts = ("real_tokens", "trainable_tokens", "images")
    data_equal = all(a[s][k] == b[s][k] for s in common for k in counts)
    lr_equal = all(math.isclose(a[s]["lr"], b[s]["lr"], rel_tol=1e-9) for s in common)
    grad_rel = [abs(b[s]["grad_norm"] - a[s]["grad_norm"]) / max(abs(a[s]["grad_norm"]), 1e-12) for s in common]
    ea = {r["step"]: r["eval_loss"] for r in full if "eval_loss" in r and r["step"] > resume_step}
    eb = {r["step"]: r["eval_loss"] for r in resumed if "eval_loss" in r}
    eval_rel = [abs(eb[s] - ea[s]) / max(abs(ea[s]), 1e-12) for s in sorted(ea.keys() & eb.keys())]
    max_rel = max(rel.values(), default=None)
    same_steps = bool(common) and a.keys() == b.keys()
    return {
        "resume_step": resume_step,
        "steps_compared": len(common),
        "same_steps": same_steps,
        "first_resumed_step": min(b, default=None),
        "max_rel_loss_diff": max_rel,
        "worst_step": max(rel, key=rel.get) if rel else None,
        "rel_loss_diff_by_step": [[s, rel[s]] for s in common],
        "data_identical": data_equal,
        "lr_identical": lr_equal,
        "max_rel_grad_norm_diff": max(grad_rel, default=None),
        "max_rel_eval_loss_diff": max(eval_rel, default=None),
        "bound": RESUME_RTOL,
        "ok": same_steps and data_equal and lr_equal and max_rel is not None and max_rel <= RESUME_RTOL,
    }


def part_train(plan: Plan, dirs: Dirs, budget: Budget) -> dict:
    """Write the random checkpoint; train uninterrupted; resume from the mid-run checkpoint; reload ``final/``."""
    model_dir, full_dir, resumed_dir, shapes_dir = (dirs.work_path(n) for n in ("model", "run", "resumed", "shapes"))
    base = [sys.executable, str(TRAIN), "--config", str(CONFIG), *plan.train_overrides]
    base += ["--model.name_or_path", str(model_dir), "--data.shapes.root", str(shapes_dir)]
    res: dict = {"config": str(CONFIG.relative_to(REPO)), "overrides": plan.train_overrides}
    smoke = ["--smoke"] if plan.smoke else []
    res["model"] = run_worker(["write-model", str(model_dir), *smoke], dirs, budget, plan.caps["model"])
    if res["model"]["status"] != "ok":
        return res
    cmd = [*base, "--train.output_dir", str(full_dir)]
    res["train"] = run_logged(cmd, dirs.out / "train.log", budget.timeout(plan.caps["train"]))
    res["train"] |= summarize_run(full_dir)
    res["train"]["ok"] = _train_ok(res["train"], first=1, last=plan.max_steps)
    ckpt = full_dir / "checkpoints" / f"step-{plan.resume_step:06d}"
    if (ckpt / "COMPLETE").is_file():
        cmd = [*base, "--train.output_dir", str(resumed_dir), "--train.resume", str(ckpt)]
        cmd += ["--train.check_packing", "false"]  # checked in the first run; the resumed state is the checkpoint's
        res["resume"] = run_logged(cmd, dirs.out / "resume.log", budget.timeout(plan.caps["resume"]))
        res["resume"] |= summarize_run(resumed_dir)
        res["resume"]["ok"] = _train_ok(res["resume"], first=plan.resume_step + 1, last=plan.max_steps)
        res["resume"]["comparison"] = compare_resume(
            read_metrics(full_dir), read_metrics(resumed_dir), plan.resume_step
        )
    else:
        res["resume"] = {"status": "skipped", "reason": f"no complete checkpoint {ckpt.name} in the first run"}
    if (full_dir / "final" / "config.json").is_file():
        other = resumed_dir / "final"
        args = ["reload", str(full_dir / "final"), *(["--other", str(other)] if other.is_dir() else [])]
        res["reload"] = run_worker(args, dirs, budget, plan.caps["reload"])
        res["reload"]["ok"] = res["reload"]["status"] == "ok" and _reload_ok(res["reload"])
    else:
        res["reload"] = {"status": "skipped", "reason": "the first run wrote no final/"}
    return res


def _train_ok(run: dict, *, first: int, last: int) -> bool:
    steps_ok = run.get("first_step") == first and run.get("last_step") == last
    check = run.get("packing_check", {}).get("ok", True)
    return run["status"] == "ok" and steps_ok and run["losses_finite"] and run["final_written"] and bool(check)


def _reload_ok(reload: dict) -> bool:
    """Both loaders agree on the probe within 1e-2 of the logits' scale (fp32; fla / tf32 kernels on a GPU)."""
    return bool(reload.get("finite")) and reload.get("rel_logit_diff", 1.0) <= 1e-2


def part_bench(plan: Plan, dirs: Dirs, budget: Budget) -> dict:
    """``bench/gpu_bench.py``; its JSON (rewritten after each row, so a time limit keeps the rows done) is read in."""
    target = dirs.scratch("gpu_bench.json")
    cmd = [sys.executable, str(BENCH), *plan.bench_args, "--out", str(target)]
    timeout = budget.timeout(plan.caps["bench"])
    res = run_logged(cmd, dirs.out / "gpu_bench.log", timeout, child_env(drop=("OUT",)))
    if target.is_file():
        payload = json.loads(target.read_text())
        res |= {"complete": payload.get("complete"), "pack_len": payload.get("pack_len"), "rows": payload["rows"]}
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
    }


def _fmt(x: float | None, spec: str = ".3g", none: str = "n/a") -> str:
    return none if x is None else format(x, spec)


def _train_line(run: dict) -> str:
    if not run.get("losses"):
        return run.get("reason", "no steps logged")
    mem, mfu = run["peak_memory_mb"], run["mfu_median"]
    line = (
        f"steps {run['first_step']}-{run['last_step']}: loss {run['loss_first']:.3f} -> {run['loss_last']:.3f}; "
        f"{_fmt(run['tokens_per_s_median'], '.0f')} tok/s; MFU {'n/a' if mfu is None else f'{100 * mfu:.1f}%'}; "
        f"peak {_fmt(mem and mem / 1024, '.1f')} GiB"
    )
    if run["evals"]:
        last = run["evals"][-1]
        line += f"; eval loss {last['eval_loss']:.3f}, acc {_fmt(last.get('eval_acc_all'), '.2f')}"
    return line


def _train_detail(run: dict) -> str:
    med = run["step_time_median_s"]
    split = "/".join(_fmt(med[k], ".3f") for k in ("data_s", "vision_s", "text_forward_s", "backward_s", "optimizer_s"))
    return f"median step s, data/vision/text fwd/bwd/opt: {split}; {_packing_check_text(run.get('packing_check'))}"


def _packing_check_text(check: dict | None) -> str:
    """The trainer's self-check report (``vlm_sft.model.packing_check``), read defensively: its fields may grow."""
    if not check:
        return "no packing_check.json"
    ratios = ", ".join(
        f"{k} {_fmt(check[k].get('ratio'), '.2g')}" for k in ("logits", "grad") if isinstance(check.get(k), dict)
    )
    bound = f"; bound {check['bound']}" if "bound" in check else ""
    return f"packing self-check {'ok' if check.get('ok') else 'FAILED'} (leak/floor ratio {ratios}{bound})"


def _resume_detail(c: dict) -> str:
    data = "identical" if c["data_identical"] else "DIFFER"
    lr = "identical" if c["lr_identical"] else "DIFFERS"
    return (
        f"vs uninterrupted, {c['steps_compared']} steps: max rel loss diff {_fmt(c['max_rel_loss_diff'], '.2e')} "
        f"(bound {c['bound']:.0e}), eval {_fmt(c['max_rel_eval_loss_diff'], '.2e')}; tokens/images {data}, lr {lr}"
    )


def _reload_line(rl: dict) -> str:
    if "tokens" not in rl:
        return rl.get("reason", "no figures: see worker.log")
    w = rl.get("vs_resumed", {})
    return (
        f"Qwen3_5VLM + transformers, {rl['tokens']}-token probe: max |logit diff| "
        f"{_fmt(rl['max_abs_logit_diff'], '.2e')} (rel {_fmt(rl['rel_logit_diff'], '.1e')}); "
        f"weights vs resumed final: max |diff| {_fmt(w.get('max_abs_diff'), '.2e')}"
    )


def _part_lines(report: dict) -> list[tuple[str, str, dict, str]]:
    """(name, verdict key, part, result text) per line of the table."""
    p, t, b = report["pytest"], report["trainer"], report["bench"]
    m, tr, rs, rl = (t.get(k, {}) for k in ("model", "train", "resume", "reload"))
    pytest_text = (
        f"{p.get('passed', 0)} passed, {p.get('failures', 0)} failed, {p.get('errors', 0)} errors, "
        f"{p.get('skipped', 0)} skipped ({len(p.get('files', []))} files)"
    )
    params = m.get("parameters")
    model_text = (
        f"{m.get('layers')} layers ({m.get('linear_attention_layers')} linear attention), "
        f"{_fmt(params and params / 1e6, '.1f')} M parameters, vision {m.get('vision')}"
    )
    bench_text = b.get("reason") or f"{len(b.get('rows', []))} rows"
    bench_text += "" if b.get("complete", True) else " (stopped early)"
    return [
        ("pytest -m gpu", "pytest", p, pytest_text),
        ("random checkpoint", "model", m, model_text),
        ("train (uninterrupted)", "train", tr, _train_line(tr)),
        ("", "train", {}, _train_detail(tr) if tr.get("losses") else ""),
        ("resume", "resume", rs, _train_line(rs)),
        ("", "resume", {}, _resume_detail(rs["comparison"]) if "comparison" in rs else ""),
        ("reload final/", "reload", rl, _reload_line(rl)),
        ("throughput (gpu_bench)", "bench", b, bench_text),
    ]


def summary_table(report: dict) -> str:
    """The table printed at the end (and saved as summary.txt): one line per part, then the throughput rows."""
    env, ok, b = report["environment"], report["verdicts"], report["bench"]
    v = env.get("versions", {})
    lines = [
        f"GPU check{' (--cpu-smoke)' if report['smoke'] else ''}: {env.get('device', '?')}; torch {v.get('torch')}, "
        f"transformers {v.get('transformers')}, triton {v.get('triton')}, fla {v.get('flash-linear-attention')}, "
        f"flash-attn {v.get('flash-attn')}; kernels {'/'.join(env.get('kernels', {}).values()) or '?'}",
        f"{'part':<22} {'status':<8} {'wall s':>7}  result",
        "-" * 120,
    ]
    for name, key, part, text in _part_lines(report):
        if not name:  # a detail line under its part
            if text:
                lines.append(f"{'':<40}{text}")
            continue
        status = part.get("status", "skipped")
        if not ok[key] and status == "ok":
            status = "FAILED"  # ran to the end, but a figure is outside its bound
        elif ok[key]:
            status = "ok"
        lines.append(f"{name:<22} {status:<8} {part.get('wall_s', 0):>7.1f}  {text}")
    lines.append(f"{'total':<22} {'ok' if all(ok.values()) else 'FAILED':<8} {report['wall_s']:>7.1f}")
    if b.get("rows"):
        from gpu_bench import format_rows  # beside this file; imports torch, so only once the parts are done

        lines += ["", f"gpu_bench.py, {b.get('pack_len')}-token packs:", format_rows(b["rows"])]
    return "\n".join(lines)


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


def _pytest_then_bench(plan: Plan, dirs: Dirs, budget: Budget) -> tuple[dict, dict]:
    return _pytest(plan, dirs, budget), _bench(plan, dirs, budget)


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
            report["pytest"], report["bench"] = independent.result()
    else:  # on the GPU one part at a time: the throughput figures must not share the device
        report["pytest"] = _pytest(plan, dirs, budget)
        report["trainer"] = _trainer(plan, dirs, budget)
        report["bench"] = _bench(plan, dirs, budget)
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
