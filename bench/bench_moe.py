"""One Qwen3.5-MoE layer, forward + backward on the CPU: our ``SparseMoeBlock`` vs transformers' block, in one run.

    python bench/bench_moe.py [--reps 5] [--threads 2] [--experts 32] [--tokens 1024 256] [--quick]

About 2.5 minutes on 2 idle cores (4 with other jobs on them); ``--quick`` is a smoke run of about 20 seconds (1 repetition, 16 experts, fewer
tokens; it writes nothing). The layer has the real Qwen3.5-35B-A3B widths (``Qwen/Qwen3.5-35B-A3B`` text config:
hidden 2048, ``moe_intermediate_size`` 512, ``shared_expert_intermediate_size`` 512, top-8 routing, SiLU) but **32
experts instead of 256**: two layers' fp32 weights and gradients (ours and transformers', 0.4 GB of weights each)
fit the shared machine, and a repetition stays near 30 s on 2 cores (2048 tokens at 64 experts took 10-16 s per
contender and 50-60 s for transformers' eager loop). Fewer experts at the same top-8 means more tokens per expert
for the same tokens, so two cases:

- ``1024 tok``: 1024 tokens, 256 routed slots per expert on average (4x the real model's load at 2048 tokens);
- ``256 tok``: 256 tokens, 64 slots per expert: the real model's average load at 2048 tokens (256 experts), i.e. the
  same per-expert matmul shapes, with 32 experts active instead of 256.

Contenders, all on the same weights (transformers' block with every parameter ~ N(0, 0.02), the checkpoint init
std; ours loads its state dict) and the same input and output cotangent, in float32:

- ``ours sorted``: ``SparseMoeBlock(x, experts_impl="sorted")``, one matmul pair per active expert from Python;
- ``ours grouped_mm``: ``experts_impl="grouped_mm"``, each projection one ``torch._grouped_mm`` over all experts;
- ``hf grouped_mm``: ``Qwen3_5MoeSparseMoeBlock`` with ``experts_implementation = "grouped_mm"``, transformers'
  default (also on the CPU);
- ``hf eager``: the same block with ``experts_implementation = "eager"`` (a Python loop over the hit experts).

Before timing, every contender's output and input / expert-weight gradients are checked against ``ours sorted``
(the run stops if one differs by more than 1e-4 of the scale). A timed call is the forward, ``(y * cotangent).sum()``
and the backward (gradients reset to None first). Method of the other benches: one untimed warm-up call each, then
per repetition the contenders run interleaved, the order rotating; figures are medians over repetitions, and each
ratio is taken within a repetition, then the median. ``host reads`` counts the forward's Python-visible reads of
tensor values (``tolist``, ``item``, ``bool`` of a tensor, ``nonzero``, one-argument ``where``, ``bincount``): each is
a host sync on CUDA. Prints the tables and writes ``bench/results/moe.json`` (not with ``--quick``).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import harness  # first: the CPU environment, before torch is imported

# isort: split
import torch
from torch.overrides import TorchFunctionMode
from transformers import Qwen3_5MoeTextConfig
from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeSparseMoeBlock

from vlm_sft.model.moe import SparseMoeBlock

RESULTS = harness.results_path("moe")
REAL = {"hidden_size": 2048, "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512, "top_k": 8}
"""Qwen3.5-35B-A3B's MoE widths (its text config); it has 256 experts, 40 layers."""
REAL_EXPERTS = 256
INIT_STD = 0.02
CONTENDERS = ("ours sorted", "ours grouped_mm", "hf grouped_mm", "hf eager")
REFERENCE = "hf grouped_mm"
"""Ratios are against transformers' default experts implementation."""
AGREE_RTOL = 1e-4
HOST_READS = {"tolist", "item", "__bool__", "__int__", "__index__", "__float__", "nonzero", "bincount", "unique"}


class HostReads(TorchFunctionMode):
    """Counts the torch calls that read tensor values on the host (a device sync on CUDA)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in HOST_READS or (name == "where" and len(args) == 1 and not kwargs):
            self.count += 1
        return func(*args, **(kwargs or {}))


def make_blocks(num_experts: int) -> tuple[SparseMoeBlock, Qwen3_5MoeSparseMoeBlock, Qwen3_5MoeTextConfig]:
    cfg = Qwen3_5MoeTextConfig(
        hidden_size=REAL["hidden_size"],
        moe_intermediate_size=REAL["moe_intermediate_size"],
        shared_expert_intermediate_size=REAL["shared_expert_intermediate_size"],
        num_experts=num_experts,
        num_experts_per_tok=REAL["top_k"],
        num_hidden_layers=1,
    )
    cfg._experts_implementation = "grouped_mm"  # read at every forward; the bench switches it per contender
    torch.manual_seed(0)
    hf = Qwen3_5MoeSparseMoeBlock(cfg)
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0.0, INIT_STD)
    ours = SparseMoeBlock(cfg)
    ours.load_state_dict(hf.state_dict(), strict=True)
    return ours, hf, cfg


def call(name: str, blocks: tuple, x_TD: torch.Tensor) -> torch.Tensor:
    """One contender's forward on ``x_TD`` (``[T, D]``); returns ``[T, D]``."""
    ours, hf, cfg = blocks
    if name.startswith("ours"):
        return ours(x_TD, experts_impl=name.split()[1])[0]
    cfg._experts_implementation = name.split()[1]
    return hf(x_TD.unsqueeze(0)).squeeze(0)


def step(name: str, blocks: tuple, x_TD: torch.Tensor, cotangent_TD: torch.Tensor) -> tuple[float, dict]:
    """Forward + backward of one contender from reset gradients: (seconds, its output and gradients)."""
    module = blocks[0] if name.startswith("ours") else blocks[1]
    for p in module.parameters():
        p.grad = None
    x = x_TD.detach().requires_grad_()
    start = time.perf_counter()
    y = call(name, blocks, x)
    (y * cotangent_TD).sum().backward()
    seconds = time.perf_counter() - start
    grads = {"y": y.detach(), "x.grad": x.grad, "gate_up.grad": module.experts.gate_up_proj.grad}
    grads["down.grad"] = module.experts.down_proj.grad
    return seconds, grads


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def check_agreement(blocks: tuple, x_TD: torch.Tensor, cotangent_TD: torch.Tensor) -> dict:
    """Every contender's output and gradients vs ``ours sorted`` (largest error / largest reference magnitude);
    also the warm-up call. Raises if one is above ``AGREE_RTOL``."""
    _, reference = step("ours sorted", blocks, x_TD, cotangent_TD)
    errors = {}
    for name in CONTENDERS[1:]:
        _, got = step(name, blocks, x_TD, cotangent_TD)
        errors[name] = {key: rel_err(got[key], reference[key]) for key in reference}
        worst = max(errors[name].values())
        if worst > AGREE_RTOL:
            raise SystemExit(f"{name} disagrees with ours sorted: {errors[name]} (> {AGREE_RTOL})")
    return errors


def count_host_reads(blocks: tuple, x_TD: torch.Tensor) -> dict[str, int]:
    counts = {}
    for name in CONTENDERS:
        with torch.no_grad(), HostReads() as reads:
            call(name, blocks, x_TD)
        counts[name] = reads.count
    return counts


def run_case(label: str, tokens: int, num_experts: int, reps: int) -> dict:
    """Build, check, count host reads, then time ``reps`` interleaved repetitions; the case's figures."""
    blocks = make_blocks(num_experts)
    gen = torch.Generator().manual_seed(1)
    x_TD = torch.randn(tokens, REAL["hidden_size"], generator=gen)
    cotangent_TD = torch.randn(tokens, REAL["hidden_size"], generator=gen)
    errors = check_agreement(blocks, x_TD, cotangent_TD)
    host_reads = count_host_reads(blocks, x_TD)
    with torch.no_grad():
        _, _, experts_TK = blocks[0].gate(x_TD)
    load = torch.bincount(experts_TK.reshape(-1), minlength=num_experts)
    # each contender times itself (the gradient reset left out); the warm-up calls were check_agreement's
    times = harness.interleave({n: lambda n=n: step(n, blocks, x_TD, cotangent_TD)[0] for n in CONTENDERS}, reps)
    print(f"  {label}: " + ", ".join(f"{n} {statistics.median(times[n]) * 1e3:.0f} ms" for n in CONTENDERS), flush=True)
    stats = {name: harness.ratio_stats(times[name], times[REFERENCE]) for name in CONTENDERS}
    ratios = {name: v["median"] for name, v in stats.items()}
    grouped_vs_sorted = harness.ratio_stats(times["ours grouped_mm"], times["ours sorted"])["median"]
    return {
        "case": label,
        "tokens": tokens,
        "experts": num_experts,
        "slots_per_expert": {
            "mean": tokens * REAL["top_k"] / num_experts,
            "min": int(load.min()),
            "max": int(load.max()),
        },
        "median_ms": {name: statistics.median(t) * 1e3 for name, t in times.items()},
        "times_ms": {name: [s * 1e3 for s in t] for name, t in times.items()},
        "ratio_vs_" + REFERENCE.replace(" ", "_"): ratios,
        "ratio_range": {name: [v["min"], v["max"]] for name, v in stats.items()},
        "ours_grouped_vs_ours_sorted": grouped_vs_sorted,
        "host_reads_per_forward": host_reads,
        "max_rel_err_vs_ours_sorted": errors,
    }


def print_tables(cases: list[dict], meta: dict) -> None:
    print(
        f"\nOne Qwen3.5-MoE layer, forward + backward, float32, CPU ({meta['threads']} threads): hidden "
        f"{REAL['hidden_size']}, expert / shared intermediate {REAL['moe_intermediate_size']} / "
        f"{REAL['shared_expert_intermediate_size']}, top-{REAL['top_k']} of {meta['experts']} experts (the real "
        f"model: {REAL_EXPERTS}); median of {meta['reps']} repetitions, contenders interleaved"
    )
    rows = []
    for case in cases:
        ratios, ranges = case["ratio_vs_" + REFERENCE.replace(" ", "_")], case["ratio_range"]
        for name in CONTENDERS:
            stats = {"median": ratios[name], "min": ranges[name][0], "max": ranges[name][1]}
            rows.append(
                {"case": case["case"], "contender": name, "ms": case["median_ms"][name]}
                | {"ratio": harness.fmt_range(stats), "reads": case["host_reads_per_forward"][name]}
                | {"err": max(case["max_rel_err_vs_ours_sorted"].get(name, {"ref": 0.0}).values())}
            )
    columns = [("case", "case"), ("contender", "contender"), ("ms", "ms", ".0f"), ("ratio", "vs hf grouped_mm")]
    harness.print_table(None, [*columns, ("reads", "host reads"), ("err", "max rel err", ".1e")], rows)
    print(
        "\nms: forward + backward of the layer (router, routed experts, shared expert). vs hf grouped_mm: time / "
        "transformers' default experts implementation's, within a repetition, median (min-max). host reads: value reads on the "
        "host in one forward (each a device sync on CUDA). max rel err: largest difference from ours sorted over the "
        "output and the input, gate_up and down gradients, over the largest reference magnitude."
    )
    for case in cases:
        spe = case["slots_per_expert"]
        print(
            f"{case['case']}: {case['tokens']} tokens, {spe['mean']:.0f} routed slots per expert on average (min "
            f"{spe['min']}, max {spe['max']}); ours grouped_mm / ours sorted = {case['ours_grouped_vs_ours_sorted']:.2f}"
        )


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--experts", type=int, default=32, help=f"routed experts (the real model: {REAL_EXPERTS})")
    ap.add_argument("--tokens", type=int, nargs="+", default=[1024, 256], help="tokens of each case")
    ap.add_argument("--quick", action="store_true", help="a smoke run: 1 repetition, 16 experts, 256 and 64 tokens")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    if args.quick:
        args.reps, args.experts, args.tokens = 1, 16, [256, 64]
    return args


def main() -> None:
    args = parse_args()
    harness.set_threads(args.threads)
    with harness.wall_clock() as meta:
        cases = [run_case(f"{tokens} tok", tokens, args.experts, args.reps) for tokens in args.tokens]
    meta |= {
        "threads": args.threads,
        "reps": args.reps,
        "dtype": "float32",
        "widths": REAL,
        "experts": args.experts,
        "real_experts": REAL_EXPERTS,
        "init_std": INIT_STD,
        "reference": f"transformers Qwen3_5MoeSparseMoeBlock, experts_implementation={REFERENCE.split()[1]!r}",
        "quick": args.quick,
    }
    print_tables(cases, meta)
    print(f"\nwall {meta['wall_s']:.0f} s")
    if not args.quick:
        harness.write_results("moe", {"meta": meta, "cases": cases}, path=args.out)


if __name__ == "__main__":
    main()
