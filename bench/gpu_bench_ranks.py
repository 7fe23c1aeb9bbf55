"""The several-rank cases of ``bench/gpu_bench.py``: context parallelism (``--cp N``) and expert parallelism (``--ep N``).

``gpu_bench.py`` starts this script for a case when asked (``--rank-case``); it launches each layout as a
``torch.distributed.run`` of itself, whose ranks (``--cp-worker`` / ``--ep-worker``) build the model and the packs
with ``gpu_bench``'s own code and write their rows; the case's table is printed here and its JSON handed back.

Context parallelism (``--cp N``, default 1: none; only when asked, so ``bash bench/gpu.sh`` is unchanged): with N or
more CUDA GPUs, the 0.8B model (full fine-tuning, first backend) on the ``bfd`` packs at cp 1 (one GPU) and at cp N
(N GPUs over NCCL, one packed row split over them: ``vlm_sft.parallel.context_parallel``), each a
``torch.distributed.run`` of this script; the cp N ranks sum their gradients over the group before clipping (in the
backward time). Per rank: real tokens/s of the group (the row's tokens over the step time) and per GPU, step time,
peak memory, MFU over the N GPUs. With fewer GPUs it prints that it skipped and records why; ``--smoke --cp 2`` runs
the same launch on the CPU over gloo. The pack length must divide by N.

Expert parallelism (``--ep N``, default 1: none; **not run yet**: no machine with several GPUs was available when it
was written): with N or more CUDA GPUs, the MoE model of the MoE rows (``--moe-layers`` layers, first backend) on the
``bfd`` packs, on N GPUs at ep 1 (FSDP2 over the N ranks: every layer's experts gathered) and at ep N (each rank holds
E / N experts whole and sends the tokens to them: ``vlm_sft.parallel.expert_parallel``), through the trainer's own
``build_mesh`` / ``parallelize`` (bf16 FSDP2 compute over fp32 master weights; the experts an FSDP2 unit of their
own over a one-rank ``edp``) and its per-mesh clipping; each rank trains its own packs (``batches[rank::N]``), so
both launches take the same global batch. Per rank: real tokens/s, step time, peak memory, MFU; the ep N / ep 1 ratio of tokens/s per GPU. With fewer GPUs it
prints that it skipped and why, and exits 0 when no GPU is visible at all; ``--smoke --ep 2`` runs the same launches
on the CPU over gloo (shrunken model, float32). ``bench/bench_ep.py`` has the expected bytes per layer.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import harness  # first: the CPU environment, before torch is imported

# isort: split
import torch
import torch.distributed as dist
from gpu_bench import Bench, _shown, make_batches, model_configs, parse_args, run_row

from vlm_sft.data.synthetic import SyntheticSource
from vlm_sft.flops import peak_flops
from vlm_sft.parallel.context_parallel import NO_CP, ContextParallel
from vlm_sft.parallel.env import cleanup, init_distributed
from vlm_sft.parallel.mesh import build_mesh


def _missing_gpus(flag: str, size: int, smoke: bool) -> dict | None:
    """``{"skipped": why}`` (printed) when the case needs more CUDA GPUs than are visible; None to go on."""
    gpus = torch.cuda.device_count()
    if smoke or gpus >= size:
        return None
    reason = f"--{flag} {size} needs {size} CUDA GPUs; this machine has {gpus}"
    print(f"{flag} case skipped: {reason}", flush=True)
    return {"skipped": reason}


def _worker_args(args: argparse.Namespace, *extra: str) -> list[str]:
    """The options every rank of a case gets: the run's sizes, its first backend, ``bfd`` packs, no LoRA row."""
    forwarded = ["--pack-len", str(args.pack_len), "--samples", str(args.samples), "--warmup", str(args.warmup)]
    forwarded += ["--steps", str(args.steps), "--backends", args.backends.split(",")[0], "--modes", "bfd"]
    return [*forwarded, "--lora", "none", *extra, *(["--smoke"] if args.smoke else [])]


def _launch(nproc: int, worker_args: list[str]) -> subprocess.CompletedProcess:
    """One ``torch.distributed.run`` of this script's workers on ``nproc`` ranks (a launcher's variables removed)."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT", "OUT")}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", __file__]
    return subprocess.run([*cmd, *worker_args], capture_output=True, text=True, env=env)


def run_cp_case(args: argparse.Namespace) -> dict:
    """The cp case (module docstring): cp 1, then cp ``args.cp``, each a ``torch.distributed.run`` of this script.
    Returns the ranks' rows, or why it was skipped, or the failing launch's error (with the rows done before it)."""
    skipped = _missing_gpus("cp", args.cp, args.smoke)
    if skipped:
        return skipped
    forwarded = _worker_args(args, "--stack-rows", str(args.stack_rows), "--moe", "none")
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="gpu_bench_cp_") as out:
        for size in (1, args.cp):
            start = time.perf_counter()
            done = _launch(size, ["--cp-worker", out, *forwarded])
            if done.returncode:
                print(f"cp {size} failed (exit {done.returncode}):\n{done.stderr[-4000:]}", flush=True)
                return {"rows": rows, "error": f"cp {size}, exit {done.returncode}: {done.stderr[-6000:]}"}
            ranks = [json.loads(Path(out, f"cp{size}_rank{r}.json").read_text()) for r in range(size)]
            rows += ranks
            wall = time.perf_counter() - start
            print(
                f"  cp {size}: {ranks[0]['real_tok_s']:.0f} real tok/s over {size} device(s) ({wall:.0f} s)", flush=True
            )
    print(f"\nContext parallelism, 0.8B bfd rows of {args.pack_len} tokens, one row split over the cp ranks")
    print(format_cp_rows(rows))
    return {"rows": rows}


def cp_worker(args: argparse.Namespace) -> None:
    """One rank of the cp case: the 0.8B model, context-parallel over the launch's world (NCCL on CUDA, gloo for
    ``--smoke``), on the ``bfd`` packs; writes its row to ``<--cp-worker>/cp<N>_rank<R>.json``."""
    cuda = not args.smoke
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    config = model_configs(args)["full"]
    source = SyntheticSource(args.samples, distribution="long_tail", seed=0)
    samples = [source(i) for i in range(args.samples)]
    pad_id = int(config.text_config.pad_token_id)
    batches = make_batches(samples, "bfd", pack_len=args.pack_len, stack_rows=args.stack_rows, pad_id=pad_id)
    cp = ContextParallel(dist.group.WORLD, rank, size) if size > 1 else NO_CP
    bench = Bench(config, device, args.backends, cp=cp)
    row = run_row(bench, batches, args, peak_flops(device, torch.bfloat16))
    if row["mfu"] is not None:
        row["mfu"] /= size  # the row's useful FLOPs over the group's devices
    row |= {
        "backend": args.backends,
        "mode": "bfd",
        "cp": size,
        "rank": rank,
        "real_tok_s_per_gpu": row["real_tok_s"] / size,
    }
    Path(args.cp_worker, f"cp{size}_rank{rank}.json").write_text(json.dumps(row))
    dist.destroy_process_group()


def format_cp_rows(rows: list[dict], first: tuple[str, str] = ("cp", "cp")) -> str:
    """The cp case's table: one line per (cp, rank); tokens/s of the group (the whole row) and per GPU. The ep case's
    too (``first`` = ep; its ranks train packs of their own, so the group's tokens/s is their sum)."""
    columns = [first, ("rank", "rank"), ("kernels", "kernels"), ("rows_x_len", "rows x len")]
    columns += [("real_tok_s", "real tok/s", ".0f"), ("real_tok_s_per_gpu", "tok/s/GPU", ".0f")]
    columns += [("step_ms", "step ms", ".1f"), ("split", "vis/txt/bwd/opt ms"), ("mfu_text", "MFU")]
    return harness.format_table(None, [*columns, ("mem_text", "mem GiB")], [r | _shown(r) for r in rows])


# ------------------------------------------------------------------------------------------------ expert parallelism


def run_ep_case(args: argparse.Namespace) -> dict:
    """The ep case (module docstring): ep 1 and ep ``args.ep`` on ``args.ep`` ranks, each a ``torch.distributed.run``
    of this script. Returns the ranks' rows and the ratio, or why it was skipped, or the failing launch's error."""
    skipped = _missing_gpus("ep", args.ep, args.smoke)
    if skipped:
        return skipped
    forwarded = _worker_args(args, "--moe-layers", str(args.moe_layers), "--moe", "bfd")
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="gpu_bench_ep_") as out:
        for ep in (1, args.ep):
            done = _launch(args.ep, ["--ep-worker", out, "--ep", str(ep), *forwarded])
            if done.returncode:
                print(f"ep {ep} failed (exit {done.returncode}):\n{done.stderr[-4000:]}", flush=True)
                return {"rows": rows, "error": f"ep {ep}, exit {done.returncode}: {done.stderr[-6000:]}"}
            rows += [json.loads(Path(out, f"ep{ep}_rank{r}.json").read_text()) for r in range(args.ep)]
    per_gpu = {ep: statistics.mean(r["real_tok_s"] for r in rows if r["ep"] == ep) for ep in (1, args.ep)}
    ratio = per_gpu[args.ep] / per_gpu[1]
    print(f"\nExpert parallelism, MoE bfd rows of {args.pack_len} tokens, {args.ep} ranks, each its own packs")
    print(format_cp_rows(rows, first=("ep", "ep")))
    print(f"ep {args.ep} / ep 1, real tokens/s per GPU: {ratio:.2f}")
    return {"rows": rows, "ep_over_ep1_tok_s": ratio}


def ep_worker(args: argparse.Namespace) -> None:
    """One rank of the ep case at ep ``args.ep``: the MoE model on the trainer's mesh (NCCL on CUDA, gloo for
    ``--smoke``), trained on this rank's share of the ``bfd`` packs; writes ``<--ep-worker>/ep<E>_rank<R>.json``."""
    env = init_distributed("cpu" if args.smoke else "cuda")
    mesh = build_mesh(env, ep_size=args.ep)
    config = model_configs(args)["moe"]
    source = SyntheticSource(args.samples, distribution="long_tail", seed=0)
    samples = [source(i) for i in range(args.samples)]
    pad_id = int(config.text_config.pad_token_id)
    batches = make_batches(samples, "bfd", pack_len=args.pack_len, stack_rows=args.stack_rows, pad_id=pad_id)
    bench = Bench(config, env.device, args.backends, mesh=mesh)
    row = run_row(bench, batches[env.rank :: env.world_size], args, peak_flops(env.device, torch.bfloat16))
    row |= {"backend": args.backends, "mode": "bfd", "ep": args.ep, "rank": env.rank, "world": env.world_size}
    row["real_tok_s_per_gpu"] = row["real_tok_s"]  # this rank's own packs on its own GPU
    Path(args.ep_worker, f"ep{args.ep}_rank{env.rank}.json").write_text(json.dumps(row))
    cleanup(env, finished=True)


def main() -> None:
    args = parse_args()
    if args.cp_worker:
        cp_worker(args)
    elif args.ep_worker:
        ep_worker(args)
    elif args.rank_case:
        result = (run_cp_case if args.rank_case == "cp" else run_ep_case)(args)
        args.rank_case_out.write_text(json.dumps(result))
    else:
        raise SystemExit("run by bench/gpu_bench.py --cp N / --ep N, not on its own")


if __name__ == "__main__":
    main()
