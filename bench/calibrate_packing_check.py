"""Calibration of the packing check's ratio bound: exact rows vs leaking rows, over seeds, on the CPU.

    python bench/calibrate_packing_check.py [--seeds 16] [--dtype bf16 fp32] [--out bench/results/...json]

For each seed: the tiny model (vision tower trainable on even seeds) and a random row of 6-9 segments (1-3-token
texts, samples with 1-2 images, 20-80-token texts, a padding segment, shuffled), checked by
``vlm_sft.checks.packing_check.check_packing`` in each of these cases:

- ``exact``: the model as it is;
- ``exact, packed GDN chunk 16``: the packed row's GatedDeltaNet runs with chunk 16 instead of 64 (same math, other
  rounding: what the CUDA kernels' shape-dependent rounding does to a packed row);
- ``exact, packed-length linears jittered`` (bf16 only): every Linear output of a row of the packed length scaled by
  a random ``1 +- 2^-8``, a bf16 rounding's worth of independent noise per pass (pessimistic);
- ``seq_lens withheld``, ``conv leaks``, ``GDN leaks``, ``attention leaks``: the whole row as one segment, or only
  that op ignoring the segment starts.

Prints the range of the logits' and gradients' ratios per case and writes them as JSON. The bound
(``RATIO_BOUND``) must sit above every exact case and below every leak. bf16 runs under CPU autocast on the
pure-torch kernels (the only bf16 a CPU has). About 5 minutes per dtype for 16 seeds on one core.
"""

from __future__ import annotations

import argparse
import logging
import random
import sys
from pathlib import Path

import harness  # first: the CPU environment, before torch is imported

# isort: split
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the tests' sample builders

from packing_helpers import make_sample, padding_segment

import vlm_sft.model.layers as layers
from vlm_sft.checks.packing_check import RATIO_BOUND, check_packing
from vlm_sft.model import build_model, tiny_qwen3_5_config
from vlm_sft.model.varlen import Segments

GRIDS = [(1, 2, 2), (1, 4, 4), (1, 2, 4), (1, 4, 2), (1, 4, 6), (1, 6, 4)]
DTYPES = {"bf16": torch.bfloat16, "fp32": None}


def random_row(cfg, seed: int) -> list[dict]:
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    out = []
    for _ in range(rng.randint(5, 8)):
        kind = rng.random()
        if kind < 0.3:
            out.append(make_sample(cfg, rng.randint(1, 3), [], 0, gen))
        elif kind < 0.6:
            grids = [rng.choice(GRIDS) for _ in range(rng.randint(1, 2))]
            out.append(make_sample(cfg, rng.randint(1, 8), grids, rng.randint(0, 8), gen))
        else:
            out.append(make_sample(cfg, rng.randint(20, 80), [], 0, gen))
    out.append(padding_segment(cfg, rng.randint(1, 9)))
    rng.shuffle(out)
    return out


class _IgnoresSeqLens(torch.nn.Module):
    def __init__(self, inner) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, input_ids, *, seq_lens=None, **kwargs):
        return self.inner(input_ids, **kwargs)


def _one_segment(x: torch.Tensor) -> Segments:
    return Segments.from_lengths([x.shape[0]], x.device)


def _patches() -> dict:
    """name -> (layers attribute, replacement) for the op-level cases."""
    gdn, conv, attn = layers.gated_delta_rule, layers.causal_conv1d, layers.varlen_attention

    def gdn_chunk16(q, k, v, g, beta, segments, **kw):
        return gdn(q, k, v, g, beta, segments, **({**kw, "chunk_size": 16} if len(segments.lengths) > 1 else kw))

    return {
        "exact, packed GDN chunk 16": ("gated_delta_rule", gdn_chunk16),
        "conv leaks": ("causal_conv1d", lambda x, w, b, s, **kw: conv(x, w, b, _one_segment(x), **kw)),
        "GDN leaks": ("gated_delta_rule", lambda q, k, v, g, b, s, **kw: gdn(q, k, v, g, b, _one_segment(v), **kw)),
        "attention leaks": ("varlen_attention", lambda q, k, v, s, **kw: attn(q, k, v, _one_segment(q), **kw)),
    }


def _jittered(model, samples, dtype):
    """Every Linear output of a packed-length row scaled by 1 +- 2^-8 (independent noise in every such pass)."""
    total = sum(len(s["input_ids"]) for s in samples)
    gen = torch.Generator().manual_seed(7)

    def hook(_module, _args, out):
        if out.dim() == 2 and out.shape[0] == total:
            return out * (1 + 2**-8 * (torch.rand(out.shape, generator=gen) * 2 - 1).to(out.dtype))
        return None

    handles = [m.register_forward_hook(hook) for m in model.modules() if isinstance(m, torch.nn.Linear)]
    try:
        return check_packing(model, samples, compute_dtype=dtype)
    finally:
        for h in handles:
            h.remove()


def run_case(case: str, model, samples, dtype):
    if case == "exact":
        return check_packing(model, samples, compute_dtype=dtype)
    if case == "seq_lens withheld":
        return check_packing(_IgnoresSeqLens(model), samples, compute_dtype=dtype)
    if case.startswith("exact, packed-length linears"):
        return _jittered(model, samples, dtype)
    name, fn = _patches()[case]
    real = getattr(layers, name)
    setattr(layers, name, fn)
    try:
        return check_packing(model, samples, compute_dtype=dtype)
    finally:
        setattr(layers, name, real)


def calibrate(dtype_name: str, seeds: int) -> dict:
    cases = ["exact", "exact, packed GDN chunk 16"]
    cases += ["exact, packed-length linears jittered"] if dtype_name == "bf16" else []
    cases += ["seq_lens withheld", "conv leaks", "GDN leaks", "attention leaks"]
    cfg = tiny_qwen3_5_config()
    ratios: dict[str, dict[str, list[float]]] = {c: {"logits": [], "grad": []} for c in cases}
    for seed in range(seeds):
        torch.manual_seed(seed)
        model = build_model(cfg, freeze_vision=seed % 2 == 1)
        samples = random_row(cfg, 1000 + seed)
        for case in cases:
            report = run_case(case, model, samples, DTYPES[dtype_name])
            ratios[case]["logits"].append(report.logits.ratio)
            ratios[case]["grad"].append(report.grad.ratio)
        print(f"  {dtype_name} seed {seed} done", file=sys.stderr, flush=True)
    return ratios


def print_table(dtype_name: str, ratios: dict) -> None:
    rows = []
    for case, r in ratios.items():
        passes = sum(max(a, b) <= RATIO_BOUND for a, b in zip(r["logits"], r["grad"], strict=True))
        cells = {k: f"{min(r[k]):10.4g} .. {max(r[k]):10.4g}" for k in ("logits", "grad")}
        rows.append({"case": case, **cells, "passes": f"{passes}/{len(r['grad'])}"})
    title = f"\n{dtype_name}: ratio = leak / floor, min .. max over seeds (bound {RATIO_BOUND:g})"
    columns = [("case", "case"), ("logits", "logits"), ("grad", "gradients"), ("passes", "passes")]
    harness.print_table(title, columns, rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=16)
    parser.add_argument("--dtype", nargs="+", choices=list(DTYPES), default=["bf16", "fp32"])
    parser.add_argument("--out", type=Path, help="JSON path (default packing_check_calibration.json in bench/results)")
    parser.add_argument("--quick", action="store_true", help="a smoke run: 2 seeds, fp32, no JSON unless --out")
    args = parser.parse_args()
    if args.quick:
        args.seeds, args.dtype = 2, ["fp32"]
    logging.disable(logging.WARNING)  # the fp32-kernel and fla shape warnings are expected here
    with harness.wall_clock() as meta:
        results = {name: calibrate(name, args.seeds) for name in args.dtype}
    for name, ratios in results.items():
        print_table(name, ratios)
    payload = {"bound": RATIO_BOUND, "seeds": args.seeds, "seconds": round(meta["wall_s"]), **results}
    if not args.quick or args.out:
        harness.write_results("packing_check_calibration", payload, path=args.out, indent=1)


if __name__ == "__main__":
    main()
