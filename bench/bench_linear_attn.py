"""Forward+backward time of our CPU GatedDeltaNet path against transformers' ``torch_chunk_gated_delta_rule``.

Run: ``python bench/bench_linear_attn.py`` (add ``--reps 3`` for a quick look). Prints a table and writes
``bench/results/bench_linear_attn.json``.

Cases (float32, CPU, all in one run, the contenders interleaved rep by rep, median reported):
- one 2k-token segment, tiny head config (4 value heads x 16) and a mid-size one (16 value heads x 128):
  ours vs transformers' chunked fallback (which cannot do varlen at all; one segment is its best case);
- a packed row of ~40-token segments vs the same tokens as one segment, through our path: the cost of exact
  segment boundaries when samples are short.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule

from vlm_sft.model.gdn import gated_delta_rule
from vlm_sft.model.varlen import Segments

RESULTS = Path(__file__).resolve().parent / "results" / "bench_linear_attn.json"


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


def race(contenders: dict, inputs, reps: int) -> dict[str, dict[str, float]]:
    """Interleave the contenders rep by rep (one warm-up each) so machine noise hits them alike; medians."""
    for fn, cu in contenders.values():
        fwd_bwd_seconds(fn, inputs, cu)
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in contenders}
    for _ in range(reps):
        for name, (fn, cu) in contenders.items():
            times[name].append(fwd_bwd_seconds(fn, inputs, cu))
    return {
        name: {
            "fwd_ms": 1e3 * statistics.median(t[0] for t in ts),
            "fwd_bwd_ms": 1e3 * statistics.median(t[1] for t in ts),
        }
        for name, ts in times.items()
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--segment-len", type=int, default=40)
    args = parser.parse_args()
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

    header = f"{'case':<28} {'A':<8} {'B':<13} {'A fwd ms':>9} {'B fwd ms':>9} {'A f+b ms':>9} {'B f+b ms':>9} {'B/A f+b':>8}"
    print(f"GatedDeltaNet fwd+bwd, float32, CPU ({torch.get_num_threads()} threads), median of {args.reps}")
    print(header)
    print("-" * len(header))
    for r in rows:
        print(
            f"{r['case']:<28} {r['a']:<8} {r['b']:<13} {r['a_fwd_ms']:>9.1f} {r['b_fwd_ms']:>9.1f} "
            f"{r['a_fwd_bwd_ms']:>9.1f} {r['b_fwd_bwd_ms']:>9.1f} {r['b_over_a_fwd_bwd']:>8.2f}"
        )
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    meta = {"tokens": args.tokens, "reps": args.reps, "threads": torch.get_num_threads(), "torch": torch.__version__}
    RESULTS.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    print(f"wrote {RESULTS}")


def _pair(res: dict[str, dict[str, float]]) -> dict[str, float]:
    (_, ra), (_, rb) = res.items()
    return {
        "a_fwd_ms": ra["fwd_ms"],
        "b_fwd_ms": rb["fwd_ms"],
        "a_fwd_bwd_ms": ra["fwd_bwd_ms"],
        "b_fwd_bwd_ms": rb["fwd_bwd_ms"],
        "b_over_a_fwd_bwd": rb["fwd_bwd_ms"] / ra["fwd_bwd_ms"],
    }


if __name__ == "__main__":
    main()
