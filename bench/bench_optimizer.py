"""Peak memory of one AdamW step above the steady state, fused vs foreach (``train.optimizer_impl``), on the CPU.

Run: ``python bench/bench_optimizer.py`` (defaults: 24 blocks of ``Linear(2048, 2048)`` + ``LayerNorm(2048)``, 100.7 M
fp32 trainable parameters = 384 MiB, both decay groups; 3 repetitions; ``--quick``: 4 blocks of 512, one
repetition, nothing written). Prints a table and writes ``bench/results/bench_optimizer.json``.

The optimizer is the trainer's own (``vlm_sft.trainer.optim.build_optimizer``). Two layouts: ``plain`` tensors, and
``fsdp2``: every block and the root wrapped by ``fully_shard`` on a 1-rank gloo group, so the parameters, gradients
and AdamW state are DTensors as in a sharded run. Each (layout, implementation) runs in a fresh child process, in a
rotating order over the repetitions. The child takes one step (AdamW creates its state), so it holds the steady state
(parameters + gradients + exp_avg + exp_avg_sq, 16 bytes per parameter); then, for each further step, it refills the
gradients in place, trims the heap, restarts the resident-set high-water mark (``VmHWM``) and reads how far the step
raised it above the resident set before it: ``extra peak``. Its ratio to the trainable bytes is what
``vlm_sft/checks/memory_plan.py`` counts as the step's temporaries (``STEP_TEMPORARY_COPIES``). Step seconds are a
side figure (2 cores shared with other jobs; the ratio is taken within each repetition).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

import harness  # first: the CPU environment, before any torch import

RESULTS = harness.results_path("bench_optimizer")
IMPLS = ("fused", "foreach")
LAYOUTS = ("plain", "fsdp2")
MIB = 2**20


def build(layout: str, blocks: int, width: int):
    """The model and its optimizer (the trainer's), with zero gradients; FSDP2 on a 1-rank gloo group for fsdp2."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Sequential(nn.Linear(width, width), nn.LayerNorm(width)) for _ in range(blocks)))
    if layout == "fsdp2":
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        dist.init_process_group("cpu:gloo", store=dist.HashStore(), rank=0, world_size=1)
        mesh = init_device_mesh("cpu", (1,))
        for block in model:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    return model


def child(layout: str, impl: str, blocks: int, width: int, steps: int) -> None:
    """One (layout, implementation): print its figures as one JSON line (this process's memory is what is measured)."""
    import torch

    from vlm_sft.config import TrainConfig
    from vlm_sft.trainer.optim import build_optimizer

    model = build(layout, blocks, width)
    optimizer = build_optimizer(model, TrainConfig(optimizer_impl=impl, lr=1e-3, weight_decay=0.1))
    grads = [p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad for p in model.parameters()]
    gen = torch.Generator().manual_seed(1)

    def refill() -> None:  # in place: no allocation between the measurements
        for g in grads:
            g.normal_(generator=gen)

    refill()
    harness.reset_peak_rss()
    before_first = harness.rss_mb()
    optimizer.step()  # creates exp_avg and exp_avg_sq
    first_extra = harness.peak_rss_mb() - before_first
    extras, seconds = [], []
    for _ in range(steps):
        refill()
        harness.reset_peak_rss()
        steady = harness.rss_mb()
        with harness.Timer() as t:
            optimizer.step()
        extras.append(harness.peak_rss_mb() - steady)
        seconds.append(t.seconds)
    trainable = sum(g.numel() * g.element_size() for g in grads)
    flags = {k: optimizer.defaults[k] for k in IMPLS}
    print(json.dumps({
        "trainable_mib": trainable / MIB, "steady_rss_mib": steady, "first_step_extra_mib": first_extra,
        "step_extra_mib": max(extras), "step_extra_per_trainable": max(extras) * MIB / trainable,
        "step_seconds": statistics.median(seconds), "optimizer_flags": flags,
    }))  # fmt: skip


def run_child(layout: str, impl: str, args: argparse.Namespace) -> dict:
    cmd = [sys.executable, __file__, "--child", layout, impl, "--blocks", str(args.blocks), "--width", str(args.width)]
    cmd += ["--steps", str(args.steps)]
    done = subprocess.run(cmd, check=True, capture_output=True, text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def measure(args: argparse.Namespace) -> list[dict]:
    """Every (layout, implementation) once per repetition, in a rotating order; one row each: medians over the
    repetitions, and fused / foreach ratios taken within each repetition."""
    names = [(layout, impl) for layout in LAYOUTS for impl in IMPLS]
    records = harness.interleave_records({name: lambda n=name: run_child(*n, args) for name in names}, args.reps)
    rows = []
    for layout, impl in names:
        runs = records[(layout, impl)]
        row = {"layout": layout, "impl": impl, "optimizer_flags": runs[0]["optimizer_flags"]}
        keys = ("trainable_mib", "steady_rss_mib", "first_step_extra_mib", "step_extra_mib")
        row |= harness.medians(runs, (*keys, "step_extra_per_trainable", "step_seconds"))
        row["per_rep"] = runs
        if impl == "fused":
            foreach = records[(layout, "foreach")]
            row["extra_vs_foreach"] = harness.ratio_stats(
                [r["step_extra_mib"] for r in runs], [r["step_extra_mib"] for r in foreach]
            )
            row["seconds_vs_foreach"] = harness.ratio_stats(
                [r["step_seconds"] for r in runs], [r["step_seconds"] for r in foreach]
            )
        rows.append(row)
    return rows


def print_table(rows: list[dict], args: argparse.Namespace) -> None:
    title = (
        f"AdamW step, fp32, CPU: {args.blocks} x (Linear({args.width}, {args.width}) + LayerNorm), "
        f"{rows[0]['trainable_mib']:.0f} MiB trainable, median of {args.reps} (fused / foreach within each)"
    )
    for row in rows:
        for key in ("extra_vs_foreach", "seconds_vs_foreach"):
            row[key + "_text"] = harness.fmt_range(row[key], ".3f") if key in row else None
    columns = [
        ("layout", "layout"), ("impl", "impl"), ("steady_rss_mib", "steady RSS MiB", ".0f"),
        ("first_step_extra_mib", "1st step +MiB", ".0f"), ("step_extra_mib", "step +MiB", ".1f"),
        ("step_extra_per_trainable", "step + / trainable", ".3f"), ("extra_vs_foreach_text", "+MiB fused/foreach"),
        ("step_seconds", "step s", ".3f"), ("seconds_vs_foreach_text", "s fused/foreach"),
    ]  # fmt: skip
    harness.print_table(title, columns, rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks", type=int, default=24)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=3, help="measured steps per child (after the first)")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="a smoke run: small sizes, no JSON unless --out")
    parser.add_argument("--out", type=Path, help=f"JSON path (default {RESULTS.name} in bench/results)")
    parser.add_argument("--child", nargs=2, metavar=("LAYOUT", "IMPL"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.quick:
        args.blocks, args.width, args.reps = 4, 512, 1
    if args.child:
        child(*args.child, args.blocks, args.width, args.steps)
        return
    rows = measure(args)
    print_table(rows, args)
    if not args.quick or args.out:
        meta = {"blocks": args.blocks, "width": args.width, "steps": args.steps, "reps": args.reps, "dtype": "float32"}
        harness.write_results("bench_optimizer", {"meta": meta, "rows": rows}, path=args.out)


if __name__ == "__main__":
    main()
