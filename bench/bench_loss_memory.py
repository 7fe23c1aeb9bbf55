"""Peak memory of our chunked cross-entropy against full ``F.cross_entropy`` over materialised logits (CPU).

Run: ``python bench/bench_loss_memory.py`` (defaults: Qwen3.5's vocabulary 248,320, 4,096 tokens, hidden 1,024,
float32; forward + backward). Prints a table and writes ``bench/results/bench_loss_memory.json``.

Each variant runs in a fresh child process; its peak resident memory (``ru_maxrss``) after building the inputs is
the baseline, and the figure reported is how far forward + backward raised the peak above it. The weight and
hidden-state gradients (which both variants produce) are included. The full variant needs about 13 GB.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results" / "bench_loss_memory.json"
QWEN3_5_VOCAB = 248_320


def child(mode: str, tokens: int, hidden: int, vocab: int, chunk_size: int) -> None:
    """Run one variant and print its figures as one JSON line (this process's memory is what gets measured)."""
    import torch
    import torch.nn.functional as F

    from vlm_sft.model.loss import chunked_cross_entropy

    gen = torch.Generator().manual_seed(0)
    h = torch.randn(tokens, hidden, generator=gen).requires_grad_()
    w = torch.randn(vocab, hidden, generator=gen).mul_(0.02).requires_grad_()  # in place: no transient copy
    targets = torch.randint(0, vocab, (tokens,), generator=gen)
    mask = torch.rand(tokens, generator=gen) > 0.2
    baseline_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    if mode == "full":
        logits = h @ w.T
        loss = F.cross_entropy(logits, targets.masked_fill(~mask, -100), reduction="sum")
        del logits
    else:
        loss, _ = chunked_cross_entropy(h, w, targets, mask, chunk_size=chunk_size)
    loss.backward()
    seconds = time.perf_counter() - t0
    peak_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"loss": loss.item(), "seconds": seconds, "extra_peak_mb": (peak_kb - baseline_kb) / 1024}))


def run_child(mode: str, args: argparse.Namespace, chunk_size: int) -> dict:
    cmd = [sys.executable, __file__, "--child", mode, "--tokens", str(args.tokens), "--hidden", str(args.hidden)]
    cmd += ["--vocab", str(args.vocab), "--chunk-size", str(chunk_size)]
    done = subprocess.run(cmd, check=True, capture_output=True, text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=QWEN3_5_VOCAB)
    parser.add_argument("--chunk-sizes", type=int, nargs="+", default=[1024, 256])
    parser.add_argument("--chunk-size", type=int, default=1024, help=argparse.SUPPRESS)
    parser.add_argument("--child", choices=["full", "chunked"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.tokens, args.hidden, args.vocab, args.chunk_size)
        return

    full = run_child("full", args, 0)
    rows = [{"variant": "full F.cross_entropy", "chunk_size": None, **full, "ratio_to_full": 1.0}]
    for size in args.chunk_sizes:
        res = run_child("chunked", args, size)
        rows.append(
            {
                "variant": "chunked",
                "chunk_size": size,
                **res,
                "ratio_to_full": res["extra_peak_mb"] / full["extra_peak_mb"],
            }
        )
    logits_gb = args.tokens * args.vocab * 4 / 2**30
    print(
        f"cross-entropy fwd+bwd, float32, CPU: {args.tokens} tokens, hidden {args.hidden}, vocab {args.vocab:,} "
        f"(full fp32 logits alone: {logits_gb:.1f} GiB)"
    )
    header = f"{'variant':<22} {'chunk':>6} {'extra peak MB':>14} {'ratio':>7} {'seconds':>8} {'loss sum':>14}"
    print(header)
    print("-" * len(header))
    for r in rows:
        chunk = "-" if r["chunk_size"] is None else str(r["chunk_size"])
        print(
            f"{r['variant']:<22} {chunk:>6} {r['extra_peak_mb']:>14.0f} {r['ratio_to_full']:>7.3f} "
            f"{r['seconds']:>8.1f} {r['loss']:>14.3f}"
        )
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    meta = {"tokens": args.tokens, "hidden": args.hidden, "vocab": args.vocab, "dtype": "float32"}
    RESULTS.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
