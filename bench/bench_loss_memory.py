"""Peak memory of our chunked cross-entropy against full ``F.cross_entropy`` over materialised logits (CPU).

Run: ``python bench/bench_loss_memory.py`` (defaults: Qwen3.5's vocabulary 248,320, 4,096 tokens, hidden 1,024,
float32; ``--quick``: 512 tokens, hidden 256, vocabulary 32,768, nothing written). Prints a table and writes
``bench/results/bench_loss_memory.json``.

Two kinds of rows: ``train`` (forward + backward of the loss sum: full ``F.cross_entropy`` against
``chunked_cross_entropy``) and ``eval`` (per-token loss and argmax, no gradient: what eval did before, full fp32
logits with ``F.cross_entropy(reduction="none")`` and ``argmax``, against ``token_scores``, which eval and the
notebooks now use). The eval rows show that teacher-forced scoring fits inside the chunked training loss's budget.

Each variant runs in a fresh child process; its peak resident memory (``VmHWM``) after building the inputs is
the baseline, and the figure reported is how far the variant raised the peak above it. The weight and hidden-state
gradients (which both train variants produce) are included. The full variants need about 13 GB.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import harness  # first: the CPU environment, before any torch import

RESULTS = harness.results_path("bench_loss_memory")
QWEN3_5_VOCAB = 248_320
MODES = ("full", "chunked", "full-eval", "eval")
"""Child variants: train full / chunked, eval full (the old eval) / chunked (``token_scores``)."""


def child(mode: str, tokens: int, hidden: int, vocab: int, chunk_size: int) -> None:
    """Run one variant and print its figures as one JSON line (this process's memory is what gets measured)."""
    import torch
    import torch.nn.functional as F

    from vlm_sft.model.loss import chunked_cross_entropy, token_scores

    train = mode in ("full", "chunked")
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(tokens, hidden, generator=gen).requires_grad_(train)
    w = torch.randn(vocab, hidden, generator=gen).mul_(0.02).requires_grad_(train)  # in place: no transient copy
    targets = torch.randint(0, vocab, (tokens,), generator=gen)
    mask = torch.rand(tokens, generator=gen) > 0.2
    baseline_mb = harness.peak_rss_mb()
    t0 = time.perf_counter()
    if mode == "full":
        logits = h @ w.T
        loss = F.cross_entropy(logits, targets.masked_fill(~mask, -100), reduction="sum")
        del logits
        loss.backward()
    elif mode == "chunked":
        loss, _ = chunked_cross_entropy(h, w, targets, mask, chunk_size=chunk_size)
        loss.backward()
    elif mode == "full-eval":  # what eval did before: [T, V] fp32 logits, then per-token loss and argmax
        with torch.no_grad():
            logits = (h @ w.T).float()
            nll = F.cross_entropy(logits[mask], targets[mask], reduction="none")
            argmax = logits.argmax(-1)
            loss = nll.sum()
            del logits, nll, argmax
    else:
        nll, argmax = token_scores(h, w, targets, mask, chunk_size=chunk_size)
        loss = nll.sum()
    seconds = time.perf_counter() - t0
    extra_mb = harness.peak_rss_mb() - baseline_mb
    print(json.dumps({"loss": loss.item(), "seconds": seconds, "extra_peak_mb": extra_mb}))


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
    parser.add_argument("--quick", action="store_true", help="a smoke run: small sizes, no JSON unless --out")
    parser.add_argument("--out", type=Path, help=f"JSON path (default {RESULTS.name} in bench/results)")
    parser.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.quick:
        args.tokens, args.hidden, args.vocab, args.chunk_sizes = 512, 256, 32768, [256]
    if args.child:
        child(args.child, args.tokens, args.hidden, args.vocab, args.chunk_size)
        return

    rows = []
    for kind, full_mode, chunked_mode in (("train", "full", "chunked"), ("eval", "full-eval", "eval")):
        full = run_child(full_mode, args, 0)
        rows.append({"kind": kind, "variant": f"full {kind}", "chunk_size": None, **full, "ratio_to_full": 1.0})
        for size in args.chunk_sizes:
            res = run_child(chunked_mode, args, size)
            ratio = res["extra_peak_mb"] / full["extra_peak_mb"]
            rows.append({"kind": kind, "variant": f"chunked {kind}", "chunk_size": size, **res, "ratio_to_full": ratio})
    print_table(rows, args)
    if not args.quick or args.out:
        meta = {"tokens": args.tokens, "hidden": args.hidden, "vocab": args.vocab, "dtype": "float32"}
        harness.write_results("bench_loss_memory", {"meta": meta, "rows": rows}, path=args.out)


def print_table(rows: list[dict], args: argparse.Namespace) -> None:
    logits_gb = args.tokens * args.vocab * 4 / 2**30
    title = (
        f"cross-entropy, float32, CPU: {args.tokens} tokens, hidden {args.hidden}, vocab {args.vocab:,} "
        f"(full fp32 logits alone: {logits_gb:.1f} GiB)"
    )
    columns = [("variant", "variant"), ("chunk_size", "chunk"), ("extra_peak_mb", "extra peak MB", ".0f")]
    columns += [("ratio_to_full", "ratio", ".3f"), ("seconds", "seconds", ".1f"), ("loss", "loss sum", ".3f")]
    harness.print_table(title, columns, rows)


if __name__ == "__main__":
    main()
