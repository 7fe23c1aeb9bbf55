"""Forward+backward time of our CPU GatedDeltaNet path against transformers' ``torch_chunk_gated_delta_rule``.

Run: ``python bench/bench_linear_attn.py`` (``--quick``: 512 tokens, 2 reps, nothing written). Prints a table and
writes ``bench/results/bench_linear_attn.json``.

Cases (float32, CPU, all in one run, the contenders interleaved rep by rep in a rotating order, median reported; the
B/A ratio is taken within each rep, then the median):
- one 2k-token segment, tiny head config (4 value heads x 16) and a mid-size one (16 value heads x 128):
  ours vs transformers' chunked fallback (which cannot do varlen at all; one segment is its best case);
- a packed row of ~40-token segments vs the same tokens as one segment, through our path: the cost of exact
  segment boundaries when samples are short.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import harness  # first: the CPU environment, before torch is imported

# isort: split
import torch
import torch.nn.functional as F
from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule

from vlm_sft.model.gdn import gated_delta_rule
from vlm_sft.model.varlen import Segments

RESULTS = harness.results_path("bench_linear_attn")


def make_inputs(tokens: int, heads: int, head_dim: int, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(tokens, heads, head_dim, generator=gen)
    k = torch.randn(tokens, heads, head_dim, generator=gen)
    v = torch.randn(tokens, heads, head_dim, generator=gen)
    g = F.logsigmoid(torch.randn(tokens, heads, generator=gen))
    beta = torch.rand(tokens, heads, generator=gen)
    return [x.requires_grad_() for x in (q, k, v, g, beta)]


def ours(inputs: list[torch.Tensor], segments: Segments) -> torch.Tensor:
    return gated_delta_rule(*inputs, segments, backend="torch")


def transformers_chunked(inputs: list[torch.Tensor], segments: Segments) -> torch.Tensor:
    q, k, v, g, beta = (x.unsqueeze(0) for x in inputs)
    out, _ = torch_chunk_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)
    return out[0]


def fwd_bwd_seconds(fn, inputs, segments) -> tuple[float, float]:
    for x in inputs:
        x.grad = None
    t0 = time.perf_counter()
    out = fn(inputs, segments)
    t1 = time.perf_counter()
    out.square().sum().backward()
    t2 = time.perf_counter()
    return t1 - t0, t2 - t0


def race(contenders: dict, inputs, reps: int) -> dict[str, list[tuple[float, float]]]:
    """(forward, forward + backward) seconds per rep of each contender, interleaved rep by rep in a rotating order
    (one warm-up each) so machine noise hits them alike."""
    calls = {name: (lambda fn=fn, cu=cu: fwd_bwd_seconds(fn, inputs, cu)) for name, (fn, cu) in contenders.items()}
    return harness.interleave_records(calls, reps, warmup=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--segment-len", type=int, default=40)
    parser.add_argument("--quick", action="store_true", help="a smoke run: 512 tokens, 2 reps, no JSON unless --out")
    parser.add_argument("--out", type=Path, help=f"JSON path (default {RESULTS.name} in bench/results)")
    args = parser.parse_args()
    if args.quick:
        args.tokens, args.reps = 512, 2
    torch.manual_seed(0)
    one_segment = Segments.from_lengths([args.tokens])
    rows = []

    for label, heads, dim in (("tiny 4x16", 4, 16), ("mid 16x128", 16, 128)):
        inputs = make_inputs(args.tokens, heads, dim)
        res = race(
            {"ours": (ours, one_segment), "transformers": (transformers_chunked, one_segment)}, inputs, args.reps
        )
        rows.append({"case": f"{label}, 1 x {args.tokens}", "a": "ours", "b": "transformers", **_pair(res)})

    n_full, rest = divmod(args.tokens, args.segment_len)
    lens = [args.segment_len] * n_full + ([rest] if rest else [])
    packed = Segments.from_lengths(lens)
    for label, heads, dim in (("tiny 4x16", 4, 16), ("mid 16x128", 16, 128)):
        inputs = make_inputs(args.tokens, heads, dim)
        res = race({"packed": (ours, packed), "one segment": (ours, one_segment)}, inputs, args.reps)
        rows.append(
            {"case": f"{label}, {len(lens)} x ~{args.segment_len}", "a": "packed", "b": "one segment", **_pair(res)}
        )

    title = f"GatedDeltaNet fwd+bwd, float32, CPU ({torch.get_num_threads()} threads), median of {args.reps}"
    columns = [
        ("case", "case"),
        ("a", "A"),
        ("b", "B"),
        ("a_fwd_ms", "A fwd ms", ".1f"),
        ("b_fwd_ms", "B fwd ms", ".1f"),
    ]
    columns += [("a_fwd_bwd_ms", "A f+b ms", ".1f"), ("b_fwd_bwd_ms", "B f+b ms", ".1f"), ("range", "B/A f+b")]
    harness.print_table(title, columns, [r | {"range": harness.fmt_range(r["b_over_a_stats"])} for r in rows])
    if not args.quick or args.out:
        meta = {"tokens": args.tokens, "reps": args.reps, "threads": torch.get_num_threads()}
        harness.write_results("bench_linear_attn", {"meta": meta, "rows": rows}, path=args.out)


def _pair(res: dict[str, list[tuple[float, float]]]) -> dict:
    """Medians in ms of contenders A and B (in that order), and B / A of forward + backward within each rep."""
    (ta, tb) = res.values()
    med = {f"{x}_{k}_ms": 1e3 * v for x, t in (("a", ta), ("b", tb)) for k, v in _medians(t).items()}
    stats = harness.ratio_stats([t[1] for t in tb], [t[1] for t in ta])
    return med | {"b_over_a_fwd_bwd": stats["median"], "b_over_a_stats": stats}


def _medians(times: list[tuple[float, float]]) -> dict[str, float]:
    return harness.medians(({"fwd": f, "fwd_bwd": fb} for f, fb in times), ("fwd", "fwd_bwd"))


if __name__ == "__main__":
    main()
