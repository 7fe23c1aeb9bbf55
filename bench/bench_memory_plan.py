"""The memory plan against what the CPU measures: each rank's training peak above a tiny baseline vs the plan's
``training`` term, dense and MoE, 1, 2 and 4 ranks, expert parallelism 1 and 2, activation checkpointing off and on.

    python bench/bench_memory_plan.py [--quick] [--size-mib 24] [--pack-len 1024] [--ranks 1 2 4] [--ac-ranks 1 2]

About 9 minutes on 2 cores at the defaults (38 runs of the real trainer, two side by side); ``--quick`` (1 and 2
ranks, activation checkpointing off, 512-token packs, nothing written unless ``--out``) about 3. Every run is the real
entry point (``vlm_sft/train.py``, one process per rank through ``torch.distributed.run``, gloo, float32 on the CPU)
for 2 optimizer steps on packs of ``--pack-len`` tokens of the shapes data (many 30-50-token samples a pack; bfd pads
every pack to ``pack_len``, so a micro-batch is exactly the plan's ``T``). The checkpoints are
``tests/big_checkpoints.py``'s random bf16 Qwen3.5 (hidden 512, MLP 1536) and Qwen3.5-MoE (16 experts of 256, top 2,
a shared expert of 256; its load-balancing loss on, ``MOE_AUX_COEF``), the multiple of 4 layers nearest
``--size-mib`` of bf16 (at least 4: 26 and 59 MiB at the default); the baseline is the
same kind at hidden 64 and 4 layers, run with the same settings at expert parallelism 1 and without checkpointing.

**Measured**: a rank's peak resident set (``VmHWM``) over the run outside its final export (``bench_load.worker``:
glibc's free lists trimmed and the high-water mark restarted around the export, so the save is measured apart),
minus the same rank's peak in the baseline run; the worst rank. Each run is made twice, side by side (peaks are per
process: sharing the cores changes their times, not their memory), under two allocator settings (``MODES``):

- **rss**: glibc's defaults, what a CPU run of the trainer holds;
- **alloc**: ``MALLOC_MMAP_THRESHOLD_=131072``, so every block of 128 KiB or more is a mapping of its own, returned to
  the kernel when freed: the resident set follows the bytes allocated, the quantity the plan models (on a GPU, what
  the CUDA allocator's ``max_memory_allocated`` reports). The difference is what glibc's heap keeps of freed blocks.

The high-water mark is also read (not reset) at the start and end of each step and after each step's backward, so
the JSON says which phase set the peak; under expert parallelism each rank's received / balanced routed slots over the
run are counted (its routing imbalance).

**Planned**: ``checks.memory_plan.plan_for_run`` of the same arguments and world size with ``device_type="cpu"`` (the
kernels a CPU run resolves: the pure-torch GatedDeltaNet and conv, SDPA, the chunked loss), at the measured routing
imbalance under expert parallelism (the plan's default assumes ``EP_IMBALANCE``), the big checkpoint's ``training``
minus the baseline's. Prints the table and writes ``bench/results/memory_plan.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import harness  # first: the CPU environment, before any torch import

# isort: split

import bench_load  # the per-rank worker (its peak outside the final export)

REPO = harness.REPO
RESULTS = harness.results_path("memory_plan")
MIB = 2**20
MODES = {"rss": {}, "alloc": {"MALLOC_MMAP_THRESHOLD_": "131072"}}
"""Allocator settings of the two runs of every case (module docstring): glibc's defaults, and every block of 128 KiB
or more its own mapping, so freed blocks leave the resident set."""
TERMS = ("params", "grads", "optimizer_state", "gathered_weights", "activations", "expert_dispatch")
"""The plan's terms shown per case (``MemoryPlan`` fields; the others are 0 in these runs)."""
MOE_AUX_COEF = 0.01
"""``model.router_aux_loss_coef`` of the MoE runs (the big checkpoints' own is 0): as the 35B-A3B's, it trains."""


@dataclass(frozen=True)
class Case:
    """One run's layout."""

    kind: str
    """``dense`` or ``moe``."""
    ranks: int
    ep: int = 1
    """``train.ep_size``."""
    ac: bool = False
    """``model.activation_checkpointing``."""

    @property
    def name(self) -> str:
        return f"{self.kind} x{self.ranks} ep{self.ep}" + (" ac" if self.ac else "")

    @property
    def baseline(self) -> Case:
        """The baseline run's layout: expert parallelism 1, no checkpointing (the plan subtracts its own figures)."""
        return Case(self.kind, self.ranks)


def cases(kinds: list[str], ranks: list[int], ac_ranks: list[int]) -> list[Case]:
    """Each of ``kinds`` at every world size of ``ranks`` (MoE also at ``ep_size = 2`` where it divides), without
    activation checkpointing, and with it at the world sizes of ``ac_ranks``."""
    out = []
    for kind in kinds:
        for n in ranks:
            eps = [1, 2] if kind == "moe" and n >= 2 and n % 2 == 0 else [1]
            out += [Case(kind, n, ep, ac) for ep in eps for ac in ([False, True] if n in ac_ranks else [False])]
    return out


# ------------------------------------------------------------------------------------------------ one rank


def worker(out_dir: Path, args: list[str]) -> int:
    """One rank: ``bench_load.worker`` (the trainer, its peak outside the final export), with the high-water mark
    read at the step boundaries and the routed slots it sends and receives counted (``extra-rank-N.json``)."""
    from vlm_sft.checks.memory_report import host_memory
    from vlm_sft.parallel import expert_parallel
    from vlm_sft.trainer import loop

    probes: list[tuple[str, int, int]] = []
    slots = [0, 0]  # received, sent
    train_step, clip = loop.train_step, loop._clip
    exchange_counts = expert_parallel._exchange_counts

    def probed_step(run, step):
        probes.append((f"step {run.step + 1} start", *host_memory()))
        out = train_step(run, step)
        probes.append((f"step {run.step + 1} end", *host_memory()))
        return out

    def probed_clip(model, max_norm):
        probes.append(("backward done", *host_memory()))
        return clip(model, max_norm)

    def counted_exchange(ends, ep):
        send, recv = exchange_counts(ends, ep)
        slots[0], slots[1] = slots[0] + sum(recv), slots[1] + sum(send)
        return send, recv

    # Each is resolved through its module at every call: one place to probe.
    loop.train_step, loop._clip = probed_step, probed_clip
    expert_parallel._exchange_counts = counted_exchange
    rc = bench_load.worker(out_dir, args)
    rank = int(os.environ.get("RANK", "0"))
    extra = {"probes": probes, "slots_received": slots[0], "slots_sent": slots[1]}
    (out_dir / f"extra-rank-{rank}.json").write_text(json.dumps(extra))
    return rc


# ------------------------------------------------------------------------------------------------ the runs


@dataclass
class Launched:
    """A run started in the background (output to files: nobody reads a pipe until it ends)."""

    ranks: int
    out_dir: Path
    cmd: list[str]
    proc: subprocess.Popen

    def figures(self) -> list[dict]:
        """Every rank's figures once the run has ended (``bench_load.worker``'s and ``worker``'s)."""
        if self.proc.wait(timeout=1800) != 0:
            log = (self.out_dir / "log.txt").read_text()
            raise RuntimeError(f"run failed ({self.proc.returncode}): {' '.join(self.cmd)}\n{log[-8000:]}")
        out = []
        for r in range(self.ranks):
            rank = json.loads((self.out_dir / f"rank-{r}.json").read_text())
            out.append(rank | json.loads((self.out_dir / f"extra-rank-{r}.json").read_text()))
        return out


def launch(ranks: int, out_dir: Path, args: list[str], env_extra: dict[str, str]) -> Launched:
    """Start ``args`` on ``ranks`` processes (a plain process for 1), each through ``worker``."""
    cmd, env = bench_load.worker_launch(__file__, ranks, out_dir, args, drop=tuple(MODES["alloc"]))
    env |= env_extra
    with (out_dir / "log.txt").open("w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    return Launched(ranks, out_dir, cmd, proc)


def run_args(case: Case, checkpoint: Path, run_dir: Path, shapes: Path, pack_len: int, num_train: int) -> list[str]:
    """The trainer's arguments of one run: 2 steps of ``pack_len``-token packs, float32, no eval, final export."""
    from train_helpers import tiny_run_args

    overrides = {"model.name_or_path": str(checkpoint), "model.initializer_range": "none"}
    overrides |= {"model.activation_checkpointing": case.ac, "train.ep_size": case.ep}
    overrides |= {"data.shapes.root": str(shapes), "data.shapes.num_train": num_train, "train.output_dir": str(run_dir)}
    overrides |= {"data.pack_len": pack_len, "data.seq_len": min(pack_len, 1024), "train.max_steps": 2}
    overrides["data.bfd_buffer"] = BFD_BUFFER
    if case.kind == "moe":  # the load-balancing loss trains: its router probabilities are kept for backward
        overrides["model.router_aux_loss_coef"] = MOE_AUX_COEF
    return tiny_run_args(run_dir.parent, **overrides)


def planned(case: Case, args: list[str], imbalance: float) -> dict[str, int]:
    """The plan of ``args`` at ``case.ranks`` ranks on the CPU at routing ``imbalance`` (``MemoryPlan.to_dict``)."""
    from vlm_sft.checks.memory_plan import plan_for_run
    from vlm_sft.config import config_from_cli

    return plan_for_run(config_from_cli(args), case.ranks, device_type="cpu", ep_imbalance=imbalance).to_dict()


def imbalance_of(ranks: list[dict]) -> float:
    """The worst rank's routed slots received over the slots it sent (its balanced share), at least 1."""
    return max([1.0] + [r["slots_received"] / r["slots_sent"] for r in ranks if r["slots_sent"]])


def run_pair(case: Case, checkpoint: Path, tag: str, setup: dict) -> tuple[dict[str, list[dict]], list[str]]:
    """``case`` on ``checkpoint`` under both ``MODES`` side by side, each in its own output folder: each mode's per-rank
    figures, and the trainer's arguments (the same but for the folder)."""
    work, started = setup["work"], {}
    for mode, env in MODES.items():
        out = work / f"{tag}-{mode}"
        args = run_args(case, checkpoint, out / "run", setup["shapes"], setup["pack_len"], setup["num_train"])
        started[mode] = launch(case.ranks, out, args, env)
    return {mode: run.figures() for mode, run in started.items()}, args


def measure(case: Case, checkpoints: dict, setup: dict, baselines: dict) -> dict:
    """One case: the big checkpoint's runs and the baseline's (cached per kind and world size); measured (worst
    rank, per mode) and planned figures above the baseline."""
    base = case.baseline
    if base not in baselines:
        tag = f"{base.kind}-{base.ranks}-baseline"
        figures, args = run_pair(base, checkpoints[f"{base.kind}_baseline"].path, tag, setup)
        baselines[base] = (figures, planned(base, args, 1.0))
    base_figures, base_plan = baselines[base]
    tag = f"{case.kind}-{case.ranks}-ep{case.ep}-{'ac' if case.ac else 'noac'}"
    figures, args = run_pair(case, checkpoints[case.kind].path, tag, setup)
    imbalance = imbalance_of(figures["alloc"]) if case.ep > 1 else 1.0
    plan = planned(case, args, imbalance)
    row = asdict(case) | {"name": case.name, "imbalance": imbalance, "plan": plan, "baseline_plan": base_plan}
    row["planned"] = plan["training"] - base_plan["training"]
    for mode in MODES:
        above = [b["peak_rss"] - a["peak_rss"] for b, a in zip(figures[mode], base_figures[mode], strict=True)]
        row[mode] = {"measured": max(above), "per_rank": above, "ratio": max(above) / row["planned"]}
    without_grads = row["planned"] - (plan["grads"] - base_plan["grads"])
    row["alloc"]["ratio_without_grads"] = row["alloc"]["measured"] / without_grads
    row["runs"], row["baseline_runs"] = figures, base_figures
    ratios = ", ".join(f"{mode} {row[mode]['measured'] / MIB:.0f} MiB ({row[mode]['ratio']:.2f})" for mode in MODES)
    print(f"  {case.name}: planned {row['planned'] / MIB:.0f} MiB; measured {ratios}", flush=True)
    return row


# ------------------------------------------------------------------------------------------------ report


def print_table(rows: list[dict], pack_len: int) -> str:
    """Planned and measured (worst rank, both modes) training peak above the baseline, MiB; the plan's terms."""
    shown = [
        {"case": r["kind"], "ranks": r["ranks"], "ep": r["ep"], "ac": "on" if r["ac"] else "off"}
        | {"planned": r["planned"] / MIB, "imb": r["imbalance"] if r["ep"] > 1 else None}
        | {f"{m}_{k}": r[m][k] / (MIB if k == "measured" else 1) for m in MODES for k in ("measured", "ratio")}
        | {"alloc_no_grads": r["alloc"]["ratio_without_grads"]}
        | {t: r["plan"][t] / MIB for t in TERMS}
        | {"baseline": r["baseline_plan"]["training"] / MIB}
        for r in rows
    ]
    title = (
        f"Training peak per rank above a tiny checkpoint's baseline, MiB (worst rank; fp32 on the CPU, gloo, "
        f"{pack_len}-token packs, 2 steps): planned, measured (rss: glibc's defaults; alloc: blocks >= 128 KiB "
        "mapped apart), their ratios (also to the plan without its gradients); the big run's planned terms and the "
        "baseline's planned total"
    )
    columns = [("case", "case"), ("ranks", "ranks"), ("ep", "ep"), ("ac", "ac"), ("planned", "planned", ".0f")]
    columns += [("rss_measured", "rss", ".0f"), ("rss_ratio", "rss/plan", ".2f")]
    columns += [("alloc_measured", "alloc", ".0f"), ("alloc_ratio", "alloc/plan", ".2f")]
    columns += [("alloc_no_grads", "alloc/(plan-grads)", ".2f"), ("imb", "imb.", ".2f")]
    columns += [("params", "params", ".0f"), ("grads", "grads", ".0f"), ("optimizer_state", "AdamW", ".0f")]
    columns += [("gathered_weights", "gathered", ".0f"), ("activations", "activ.", ".0f")]
    columns += [("expert_dispatch", "dispatch", ".0f"), ("baseline", "-baseline", ".0f")]
    return harness.print_table(title, columns, shown)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="1 and 2 ranks, no checkpointing, 512-token packs")
    p.add_argument("--size-mib", type=int, default=24, help="bf16 bytes of the big checkpoints (default 24)")
    p.add_argument("--pack-len", type=int, default=1024, help="tokens per pack (default 1024)")
    p.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4], help="world sizes (default 1 2 4)")
    p.add_argument("--ac-ranks", type=int, nargs="*", default=[1, 2], help="world sizes run with checkpointing too")
    p.add_argument("--kinds", nargs="+", default=["dense", "moe"], choices=["dense", "moe"])
    p.add_argument("--work", type=Path, default=None, help="scratch folder (default: a temporary one)")
    p.add_argument("--out", type=Path, help=f"JSON path (default {RESULTS.name} in bench/results; none with --quick)")
    args = p.parse_args()
    if args.quick:
        args.ranks, args.ac_ranks = [r for r in args.ranks if r <= 2], []
        args.pack_len = min(args.pack_len, 512)
    return args


SAMPLE_TOKENS = 30
"""Fewer than the tokens of any shapes sample (rendered prompt, image slots, answer): sizes the data set below."""
BFD_BUFFER = 128
"""``data.bfd_buffer`` of the runs: a few packs' samples (the default 512 renders far more than 2 steps use)."""


def samples_needed(pack_len: int, ranks: int) -> int:
    """Shapes samples enough for 2 steps of one full pack per rank, each rank's bfd buffer besides."""
    return ranks * (2 * pack_len // SAMPLE_TOKENS + BFD_BUFFER)


def main() -> None:
    from big_checkpoints import write_with_baselines

    from vlm_sft.data.shapes import materialize_shapes

    args = parse_args()
    with harness.wall_clock() as meta, tempfile.TemporaryDirectory(prefix="bench_memory_plan_") as scratch:
        work = args.work or Path(scratch)
        checkpoints = write_with_baselines(work, args.kinds, args.size_mib * MIB)
        setup = {"work": work, "shapes": work / "shapes", "pack_len": args.pack_len}
        setup["num_train"] = samples_needed(args.pack_len, max(args.ranks))
        materialize_shapes(setup["shapes"], num_train=setup["num_train"], num_eval=0, progress=False)
        baselines: dict = {}
        rows = [measure(c, checkpoints, setup, baselines) for c in cases(args.kinds, args.ranks, args.ac_ranks)]
    meta |= {"size_mib": args.size_mib, "pack_len": args.pack_len, "num_train": setup["num_train"]}
    meta |= {"quick": args.quick, "modes": MODES, "moe_aux_coef": MOE_AUX_COEF}
    meta |= {"checkpoints": {k: {"layers": c.layers, "size_bytes": c.size} for k, c in checkpoints.items()}}
    print_table(rows, args.pack_len)
    if args.out or not args.quick:
        harness.write_results("memory_plan", {"meta": meta, "rows": rows}, path=args.out)


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--worker":
        sys.exit(worker(Path(sys.argv[2]), sys.argv[4:] if sys.argv[3:4] == ["--"] else sys.argv[3:]))
    main()
