"""Host memory per rank while a big bf16 checkpoint is loaded, saved and resumed, at 1, 2 and 4 ranks (CPU, gloo).

    python bench/bench_load.py [--size-mib 128] [--ranks 1 2 4] [--kinds dense moe]

About 12 minutes on 2 idle cores at the defaults (27 runs of the real trainer; the 4-rank ones dominate). The
checkpoints are ``tests/big_checkpoints.py``'s: random bf16 Qwen3.5 (hidden 512, the size in its decoder layers) and
Qwen3.5-MoE (16 experts per layer, stored per expert as transformers writes them), each with a few ``mtp.*`` tensors,
in 2 safetensors files, and the tiny offline processor; S is the bytes of their tensors. Every run is the real entry
point (``vlm_sft/train.py``, launched per rank by ``torch.distributed.run``) on the shapes data with 160-token packs
(``tests/train_helpers.tiny_run_args``), float32 on the CPU, so a rank's fp32 parameter shard is ``2 S / W``.

Per (kind, ranks), three runs, each against the same run on a tiny checkpoint of the same kind (hidden 64, 4 layers,
~2 MiB) as the baseline; every figure is **that rank's peak RSS minus the baseline's same rank, over S**:

- **load**: ``--dry-run`` (everything up to the first step's batches: load, sharding, the data pipeline). **load s**:
  the wall time of the trainer's model build (``checkpoint.build.build_model``, the load included) on rank 0.
- **train** and **save**: one run of two optimizer steps (lr 1e-12: the weights stay as loaded, to rounding), a
  resumable checkpoint after the first (its DCP state and its ``hf/`` export) and the final export. **save** is the
  peak inside the exports (the larger of the two), **train** the peak of the rest of the run (load, steps, the DCP
  save): the fp32 training state (parameters, gradients, AdamW state: ``8 S / W``) plus a step's transients. Around
  each export glibc's free lists are trimmed and the kernel's high-water mark restarted (``/proc/self/clear_refs``),
  so the two are measured apart. Rank 0, which writes the exports, against the others shows what writing adds.
- **resume**: ``--train.resume latest --dry-run`` on that run's checkpoint: everything a resume does before its first
  step.

Every rank process runs this script (``--worker``: it calls ``vlm_sft.train.main``, with the model build and
``export_final`` wrapped to time and measure them, and writes its figures to a file at exit); the peak is the
process's own high-water mark (``VmHWM``). Prints the table and writes ``bench/results/load.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import harness  # first: the CPU environment, before any torch import

REPO = harness.REPO
sys.path.insert(0, str(REPO / "tests"))  # the checkpoint writer and the tests' run settings
RESULTS = harness.results_path("load")
MIB = 2**20


# ------------------------------------------------------------------------------------------------ one rank


def worker(out_dir: Path, args: list[str]) -> int:
    """One rank: the trainer's entry point with its model build timed and its final export's peak taken apart, then
    this process's figures to ``rank-N.json``."""
    from vlm_sft import train
    from vlm_sft.checkpoint import build
    from vlm_sft.checks.memory_report import host_memory
    from vlm_sft.trainer import loop

    figures: dict[str, float] = {}
    build_model, export_final = build.build_model, loop.export_final

    def timed_build(*a, **kw):
        with harness.Timer() as t:
            model = build_model(*a, **kw)
        figures["load_s"] = t.seconds
        return model

    def measured_export(*a, **kw):
        figures["peak_rss"] = max(figures.get("peak_rss", 0), host_memory()[0])
        _reset_peak()
        out = export_final(*a, **kw)
        figures["peak_in_export"] = max(figures.get("peak_in_export", 0), host_memory()[0])
        _reset_peak()  # what follows the export is measured apart from it
        return out

    build.build_model = timed_build  # the loop calls both through their modules: one place to time and measure
    loop.export_final = measured_export
    rc = train.main(args)
    assert "load_s" in figures, "the trainer no longer builds its model through checkpoint.build.build_model"
    figures["peak_rss"] = max(figures.get("peak_rss", 0), host_memory()[0])  # the run outside its exports
    rank = int(os.environ.get("RANK", "0"))
    (out_dir / f"rank-{rank}.json").write_text(json.dumps(figures))
    return rc


def _reset_peak() -> None:
    """Restart the kernel's high-water mark from the resident set now, after handing glibc's free lists back to the
    kernel, so that memory the run freed does not count as held; these figures need it (Linux >= 4.0)."""
    if not harness.reset_peak_rss():
        raise RuntimeError("cannot reset the peak RSS (/proc/self/clear_refs): bench_load.py needs Linux >= 4.0")


# ------------------------------------------------------------------------------------------------ the runs


def worker_launch(
    script: str, ranks: int, out_dir: Path, args: list[str], *, drop: tuple[str, ...] = ()
) -> tuple[list[str], dict[str, str]]:
    """``(command, environment)`` that run ``script --worker out_dir -- args`` on ``ranks`` processes (one plain
    process for 1, else ``torch.distributed.run``), offline, one thread each; ``drop``: more variables left out of
    this process's environment. Creates ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    me = [str(Path(script).resolve()), "--worker", str(out_dir), "--"]
    if ranks == 1:
        cmd = [sys.executable, *me, *args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}", *me, *args]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", *drop)}
    env |= {"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    return cmd, env


def launch(ranks: int, out_dir: Path, args: list[str]) -> list[dict]:
    """``args`` on ``ranks`` processes (one plain process for 1), each through ``worker``; every rank's figures."""
    cmd, env = worker_launch(__file__, ranks, out_dir, args)
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(
            f"run failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
        )
    return [json.loads((out_dir / f"rank-{r}.json").read_text()) for r in range(ranks)]


def phase_args(phase: str, checkpoint: Path, run_dir: Path, shapes: Path) -> list[str]:
    """The trainer's arguments of one phase (module docstring); ``save`` and ``resume`` share ``run_dir``."""
    from train_helpers import tiny_run_args

    overrides = {"model.name_or_path": str(checkpoint), "model.initializer_range": "none"}
    overrides |= {"data.shapes.root": str(shapes), "data.shapes.num_train": 96, "train.output_dir": str(run_dir)}
    if phase == "save":
        overrides |= {"train.max_steps": 2, "train.save_every": 1, "train.lr": 1e-12}
    args = tiny_run_args(run_dir.parent, **overrides)
    if phase == "resume":
        args += ["--train.resume", "latest"]
    return args + (["--dry-run"] if phase != "save" else [])


RUNS = {"load": ("load",), "save": ("train", "save"), "resume": ("resume",)}
"""Each run and the figures it gives: the save run's peak outside its exports (``train``) and inside them (``save``)."""


def measure(kind: str, ranks: int, checkpoints: dict, work: Path, shapes: Path) -> dict:
    """The three runs of one kind at ``ranks``, big checkpoint then baseline; figures in units of S."""
    size = checkpoints[kind].size
    row: dict = {"kind": kind, "ranks": ranks, "size_bytes": size}
    for run, figures in RUNS.items():
        ranks_of = {}
        for which in ("big", "baseline"):
            ck = checkpoints[kind if which == "big" else f"{kind}_baseline"]
            run_dir = work / f"{kind}-{ranks}-{which}" / "run"
            args = phase_args(run, ck.path, run_dir, shapes)
            ranks_of[which] = launch(ranks, work / f"{kind}-{ranks}-{which}-{run}", args)
        for figure in figures:
            key = "peak_in_export" if figure == "save" else "peak_rss"
            big, base = ([r[key] for r in ranks_of[w]] for w in ("big", "baseline"))
            above = [(b - a) / size for b, a in zip(big, base, strict=True)]
            row[figure] = {"peak_over_s": above, "peak_rss": big, "baseline_peak_rss": base}
            print(f"  {kind} x{ranks} {figure}: {' '.join(f'{a:.2f}' for a in above)} x S", flush=True)
        if run == "load":
            row["load_s"], row["baseline_load_s"] = ranks_of["big"][0]["load_s"], ranks_of["baseline"][0]["load_s"]
    return row


# ------------------------------------------------------------------------------------------------ report


def print_table(rows: list[dict]) -> str:
    """Peak RSS above the baseline / S: the worst rank for load, train and resume; rank 0 and the others' worst for
    save."""
    shown = [
        {"kind": r["kind"], "ranks": r["ranks"], "s_mib": r["size_bytes"] / MIB, "load_s": r["load_s"]}
        | {k: max(r[k]["peak_over_s"]) for k in ("load", "train", "resume")}
        | {"save_r0": r["save"]["peak_over_s"][0], "save_rest": max(r["save"]["peak_over_s"][1:], default=None)}
        for r in rows
    ]
    title = "Peak host memory per rank above a tiny checkpoint's baseline, / S (bf16 checkpoint, fp32 on the CPU, gloo)"
    columns = [("kind", "kind"), ("ranks", "ranks"), ("s_mib", "S MiB", ".0f"), ("load", "load", ".2f")]
    columns += [("train", "train", ".2f"), ("save_r0", "save r0", ".2f"), ("save_rest", "save rest", ".2f")]
    columns += [("resume", "resume", ".2f"), ("load_s", "load s", ".1f")]
    return harness.print_table(title, columns, shown)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size-mib", type=int, default=128, help="S of the big checkpoints (default 128)")
    p.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4], help="world sizes (default 1 2 4)")
    p.add_argument("--kinds", nargs="+", default=["dense", "moe"], choices=["dense", "moe"])
    p.add_argument("--work", type=Path, default=None, help="scratch folder (default: a temporary one)")
    p.add_argument("--out", type=Path, help=f"JSON path (default {RESULTS.name} in bench/results)")
    return p.parse_args()


def main() -> None:
    import tempfile

    from big_checkpoints import write_with_baselines

    from vlm_sft.data.shapes import materialize_shapes

    args = parse_args()
    with harness.wall_clock() as meta, tempfile.TemporaryDirectory(prefix="bench_load_") as scratch:
        work = args.work or Path(scratch)
        checkpoints = write_with_baselines(work, args.kinds, args.size_mib * MIB)
        shapes = work / "shapes"
        materialize_shapes(shapes, num_train=96, num_eval=0, progress=False)
        rows = [measure(kind, n, checkpoints, work, shapes) for kind in args.kinds for n in args.ranks]
    meta |= {
        "size_mib": args.size_mib,
        "layers": {k: c.layers for k, c in checkpoints.items()},
        "files": {k: c.files for k, c in checkpoints.items()},
    }
    print_table(rows)
    harness.write_results("load", {"meta": meta, "rows": rows}, path=args.out)


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--worker":
        sys.exit(worker(Path(sys.argv[2]), sys.argv[4:] if sys.argv[3:4] == ["--"] else sys.argv[3:]))
    main()
