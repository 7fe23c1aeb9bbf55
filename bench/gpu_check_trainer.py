"""Part 2 of the GPU check: the real trainer end to end. A random checkpoint, an uninterrupted run, a run resumed from
its mid-run checkpoint (compared step by step with ``RESUME_RTOL``), and ``final/`` reloaded by our model and by
transformers; the figures come from the runs' ``metrics.jsonl`` and packing self-check reports."""

from __future__ import annotations

import json
import math
import statistics
import sys
from pathlib import Path

from gpu_check_run import CONFIG, REPO, TRAIN, Budget, Dirs, Plan, run_logged, run_worker

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


def read_metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []


def _median(records: list[dict], key: str) -> float | None:
    """The median of ``key`` over the records that carry a value (None where none does: MFU on a CPU run)."""
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
