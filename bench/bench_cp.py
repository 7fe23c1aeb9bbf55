"""Context parallelism (Ulysses) on the CPU: peak memory and step time per rank of one long packed row at cp 1 and 2.

    python bench/bench_cp.py [--reps 1] [--tokens 8192] [--images 20] [--vocab 8192] [--quick]

About 3.5 minutes on 2 idle cores (5 with other jobs on them), most of it the cp 1 step (~110 s) and the cp 2 step
(~60 s); ``--quick`` (a 2048-token row with 4 images) about 1.5 minutes. Needs ~15 GB of memory (cp 1). The model
is the real Qwen3.5-0.8B widths (``vlm_sft.flops.qwen3_5_0_8b_config``: hidden 1024, MLP 3584, 8 / 2 attention
heads of 256, GatedDeltaNet 16 + 16 heads of 128, tied embeddings) with **4 text layers** (3 GatedDeltaNet + 1 full
attention, one period of the 24 layers' 3:1 pattern) and a 2-block vision tower (of 12, width 768 kept), frozen, as
``configs/qwen3_5_0_8b.toml`` trains it; float32, random init (seed 0). **The vocabulary is cut** to 8,192 (real:
248,320): the LM head and loss are per-token work that context parallelism divides exactly like the MLPs, and at
the real (or ``bench_lora.py``'s 41,408) vocabulary they would be most of a CPU step (``--vocab``).

The row: ``--images`` samples back to back, each ``<3 text> <image> <user text> <trained reply>`` with one image of
a seeded grid (even sides from 16 to 40 patches, capped so an image takes at most about half its sample: 16-28 at
8192 tokens and 20 images, 64-196 tokens each), filling ``--tokens`` exactly (no padding), the last sample
taking the remainder; it goes through the training path's ``shift_sample`` and ``collate``. **Default 8192 tokens,
not the issue's 16k**: cp 1 holds 1.44 MB of fp32 activations per token here (11.8 GB at 8192 tokens), so a 16k
row would need ~24 GB at cp 1, more than this 23 GB machine has, and its step would take ~4 minutes on one core
(``--tokens 16384`` runs it where memory allows).

A case is one fresh process per rank, **one thread each** (``OMP_NUM_THREADS=1``, ``torch.set_num_threads(1)``), so
cp 2's two processes do not fight over the 2 cores; cp 1 is therefore one thread too. cp 2 is two processes over
gloo (``torch.distributed.run``, launched by this script), each ``apply_context_parallel(model, ContextParallel(...))``:
its ranks encode their share of the images, keep half the tokens, and run attention and GatedDeltaNet on the whole row
for half the heads between all-to-alls. Per process: build the model, one warm-up step on a 512-token row (imports,
kernels, gradient buffers allocated and kept), then the timed step on the long row: forward, then backward of the
rank's ``loss_sum``.

Figures per rank:
- **saved MB**: activation memory, the bytes of the distinct storages the autograd graph holds for backward at the
  end of the forward (``torch.autograd.graph.saved_tensors_hooks``; parameters excluded): what divides by cp;
- **peak MB**: the process's peak RSS during the step above the RSS just before it (weights, gradient buffers and
  the row already resident; glibc's free lists trimmed and the kernel's high-water mark reset via
  ``/proc/self/clear_refs``): activations plus transients (the all-to-all buffers, the loss's chunks, the weight
  gradients' temporaries);
- **fwd / bwd / step ms**: forward, backward and their sum, timed on each rank (ranks start at a barrier; the cp 2
  step is its slower rank's); **CPU ms**: the process's CPU time over the same step (``time.process_time``: its
  compute thread and gloo's), which other jobs on the shared cores do not inflate as they do wall time.

Before anything is reported the cp 2 ranks' gradients are summed over the group (what the trainer must do) and
checked against cp 1: the summed loss within 1e-5 relative and every parameter's gradient norm within 1e-3. Method:
each repetition runs cp 1 and cp 2 (the order alternating), figures are medians over repetitions and the cp2 / cp1
ratios are taken within a repetition, then the median. Prints the table and writes ``bench/results/cp.json`` (not
with ``--quick``).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
import weakref
from pathlib import Path

import harness  # first: the CPU environment, before any torch import
from bench_lora import REDUCED_LAYERS as LAYERS  # 4 text layers (3 GatedDeltaNet + 1 full attention), 2 vision blocks
from bench_lora import model_config as lora_model_config

RESULTS = harness.results_path("cp")
REAL_VOCAB = 248_320
VOCAB = 8192
"""The reduced vocabulary (module docstring)."""
WARMUP_ROW = {"tokens": 512, "images": 2}
LOSS_RTOL, GRAD_NORM_RTOL = 1e-5, 1e-3
"""cp 2 vs cp 1: the group's summed loss, and each parameter's gradient norm after the sum over the group."""


# ------------------------------------------------------------------------------------------------ one rank (child)


def model_config(vocab: int):
    """The 0.8B widths with ``LAYERS`` and ``vocab`` (pad and eos id 0 when cut): ``bench_lora.py``'s 0.8B-4L."""
    return lora_model_config("0.8B-4L", vocab)


def make_row(tokens: int, images: int, pad_id: int, seed: int = 0):
    """One packed row of exactly ``tokens`` tokens: ``images`` one-image samples (module docstring)."""
    from vlm_sft.data.collate import collate
    from vlm_sft.data.pack import Pack
    from vlm_sft.data.shift import shift_sample
    from vlm_sft.data.synthetic import ImageSpan, TextSpan, compose_sample

    rng = random.Random(seed)
    share, samples, used = tokens // images, [], 0
    top = min(40, int((2 * share) ** 0.5) // 2 * 2)  # an image takes at most about half its sample
    grids = [(rng.randrange(min(16, top), top + 1, 2), rng.randrange(min(16, top), top + 1, 2)) for _ in range(images)]
    for i, (h, w) in enumerate(grids):
        length = (tokens - used if i == images - 1 else share) + 1  # shift_sample drops one token
        text = length - 3 - (h * w // 4 + 2)
        if text < 2:
            raise ValueError(f"{tokens} tokens over {images} images leave no text for sample {i}: more tokens")
        reply = max(1, text // 3)
        spans = [TextSpan(3), ImageSpan(h, w), TextSpan(text - reply), TextSpan(reply, trainable=True)]
        samples.append(shift_sample(compose_sample(spans, sample_index=i, seed=seed)))
        used += len(samples[-1])
    batch = collate([Pack(rows=(tuple(samples),), row_len=tokens)], pad_id=pad_id)
    assert batch.num_real_tokens == tokens and len(batch.image_grid_thw) == images
    return batch


class SavedActivations:
    """Counts the distinct storages the autograd graph saves for backward (parameters excluded), while they live."""

    def __init__(self, model) -> None:
        self.params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.saved: dict[int, list] = {}

    def pack(self, t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in self.params:
            self.saved.setdefault(ptr, []).append((t.untyped_storage().nbytes(), weakref.ref(t)))
        return t

    def live_mb(self) -> float:
        """MiB of the storages some saved tensor still holds (freed graph parts are not counted)."""
        live = (max((n for n, ref in refs if ref() is not None), default=0) for refs in self.saved.values())
        return sum(live) / 2**20

    def hooks(self):
        import torch

        return torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t)


def build(vocab: int, cp_size: int):
    """The model (seed 0, float32, vision frozen) on this rank, context-parallel over the world when ``cp_size > 1``."""
    import torch
    import torch.distributed as dist

    from vlm_sft.model import build_model
    from vlm_sft.parallel.context_parallel import ContextParallel
    from vlm_sft.parallel.parallelize import apply_context_parallel

    torch.manual_seed(0)
    model = build_model(model_config(vocab), dtype=torch.float32, freeze_vision=True)
    model.train()
    if cp_size > 1:
        apply_context_parallel(model, ContextParallel(dist.group.WORLD, dist.get_rank(), cp_size))
    return model


def timed_step(model, batch, barrier) -> dict:
    """Forward + backward of ``loss_sum`` on ``batch``: times, saved activations and peak RSS growth."""
    harness.trim_heap()
    barrier()
    if not harness.reset_peak_rss():
        raise RuntimeError("cannot reset the peak RSS (/proc/self/clear_refs): peak MB needs Linux >= 4.0")
    rss0 = harness.rss_mb()
    saved = SavedActivations(model)
    t0, c0 = time.perf_counter(), time.process_time()
    with saved.hooks():
        out = model(**batch.model_kwargs())
    t1 = time.perf_counter()
    saved_mb = saved.live_mb()
    out.loss_sum.backward()
    t2, c2 = time.perf_counter(), time.process_time()
    peak = harness.peak_rss_mb() - rss0
    return {
        "loss_sum": out.loss_sum.detach().item(),
        "forward_ms": 1e3 * (t1 - t0),
        "backward_ms": 1e3 * (t2 - t1),
        "step_ms": 1e3 * (t2 - t0),
        "cpu_ms": 1e3 * (c2 - c0),
        "saved_mb": saved_mb,
        "peak_rss_growth_mb": peak,
        "baseline_rss_mb": rss0,
    }


def run_rank(args: argparse.Namespace) -> None:
    """One process of a case: build, warm up, the timed step, the group's gradient sum; writes ``rank<R>.json``."""
    import torch
    import torch.distributed as dist

    harness.set_threads(1)
    cp = args.child
    if cp > 1:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if cp > 1 else 0
    model = build(args.vocab, cp)
    pad_id = int(model.config.text_config.pad_token_id)
    warm = make_row(WARMUP_ROW["tokens"], WARMUP_ROW["images"], pad_id, seed=1)
    row = make_row(args.tokens, args.images, pad_id)
    model(**warm.model_kwargs()).loss_sum.backward()  # allocates the gradient buffers, kept for the timed step
    model.zero_grad(set_to_none=False)
    built_mb = harness.rss_mb()
    result = timed_step(model, row, dist.barrier if cp > 1 else lambda: None)
    loss = torch.tensor(result["loss_sum"], dtype=torch.float64)
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    if cp > 1:  # ranks hold shards of one row: the loss and the gradients are sums over the group
        dist.all_reduce(loss)
        for g in grads.values():
            dist.all_reduce(g)
    result |= {
        "cp": cp,
        "rank": rank,
        "rss_before_step_mb": built_mb,
        "group_loss_sum": float(loss),
        "grad_norms": {n: float(g.double().norm()) for n, g in grads.items()},
        "row_tokens": row.num_real_tokens,
        "row_images": len(row.image_grid_thw),
        "rank_tokens": row.num_real_tokens // cp,
        "trainable_tokens": row.num_trainable_tokens,
    }
    (Path(args.out_dir) / f"rank{rank}.json").write_text(json.dumps(result))
    if cp > 1:
        dist.destroy_process_group()


# ------------------------------------------------------------------------------------------------ the run (parent)


def launch(cp: int, args: argparse.Namespace) -> list[dict]:
    """One case in fresh processes (cp 1: one; cp > 1: ``torch.distributed.run``); the ranks' results in order."""
    with tempfile.TemporaryDirectory(prefix="bench_cp_") as out:
        child = [__file__, "--child", str(cp), "--out-dir", out]
        child += ["--tokens", str(args.tokens), "--images", str(args.images), "--vocab", str(args.vocab)]
        if cp == 1:
            cmd = [sys.executable, *child]
        else:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={cp}", *child]
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
        env |= {"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
        done = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if done.returncode:
            raise RuntimeError(f"cp {cp} failed (exit {done.returncode}):\n{done.stderr[-4000:]}")
        return [json.loads((Path(out) / f"rank{r}.json").read_text()) for r in range(cp)]


def check_parity(cp1: dict, ranks: list[dict]) -> dict:
    """The cp 2 group's summed loss and gradient norms against cp 1's; raises when they disagree."""
    loss_rel = abs(ranks[0]["group_loss_sum"] - cp1["loss_sum"]) / abs(cp1["loss_sum"])
    norms1, norms2 = cp1["grad_norms"], ranks[0]["grad_norms"]
    assert norms1.keys() == norms2.keys()
    grad_rel = {n: abs(norms2[n] - g) / max(g, 1e-30) for n, g in norms1.items()}
    worst = max(grad_rel, key=grad_rel.get)
    if loss_rel > LOSS_RTOL or grad_rel[worst] > GRAD_NORM_RTOL:
        raise RuntimeError(
            f"cp {len(ranks)} disagrees with cp 1: loss {ranks[0]['group_loss_sum']} vs {cp1['loss_sum']} (rel "
            f"{loss_rel:.1e}), gradient norm of {worst} rel {grad_rel[worst]:.1e}"
        )
    return {"loss_rel_diff": loss_rel, "max_grad_norm_rel_diff": grad_rel[worst], "worst_param": worst}


def run_reps(args: argparse.Namespace) -> list[dict]:
    """``args.reps`` repetitions of cp 1 and cp 2 (order alternating), each checked for parity."""
    reps = []
    for rep in range(args.reps):
        cases = {}
        for cp in (1, 2) if rep % 2 == 0 else (2, 1):
            start = time.perf_counter()
            cases[cp] = launch(cp, args)
            step = max(r["step_ms"] for r in cases[cp])
            peak = max(r["peak_rss_growth_mb"] for r in cases[cp])
            elapsed = time.perf_counter() - start
            print(f"  rep {rep + 1}/{args.reps} cp {cp}: step {step:8.0f} ms, peak +{peak:.0f} MB ({elapsed:.0f} s)")
        parity = check_parity(cases[1][0], cases[2])
        reps.append({"cp1": cases[1], "cp2": cases[2], "parity": parity})
    return reps


# ------------------------------------------------------------------------------------------------ analytic (no run)

SUSTAINED_FLOPS = 0.4 * 989e12
"""40% of an H100 / H200's bf16 dense peak: the matmul rate the all-to-all is compared with."""
BF16 = 2


def all_to_all_volume(text) -> dict[str, dict]:
    """Per layer type of ``text``: elements per token that one forward sends through the all-to-alls (into the head
    shard, and the output back) and the layer's forward matmul FLOPs per token (projections + MLP)."""
    import copy

    from vlm_sft.flops import dense_flops_per_token

    hd = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    key_dim = text.linear_num_key_heads * text.linear_key_head_dim
    value_dim = text.linear_num_value_heads * text.linear_value_head_dim
    volumes = {
        # q, k and v (k and v once each; repeated when cp exceeds the kv heads: added in expected_scaling)
        "full_attention": {"in": (text.num_attention_heads + 2 * text.num_key_value_heads) * hd,
                           "out": text.num_attention_heads * hd},
        # the conv channels (q, k, v), beta and the decay input
        "linear_attention": {"in": 2 * key_dim + value_dim + 2 * text.linear_num_value_heads, "out": value_dim},
    }  # fmt: skip
    for kind, v in volumes.items():
        one = copy.deepcopy(text)
        one.layer_types, one.num_hidden_layers = [kind], 1
        v["flops"] = dense_flops_per_token(one)
    return volumes


def expected_scaling(cp_sizes=(2, 8), row_tokens: int = 16384) -> list[dict]:
    """The all-to-all bytes per token and per rank of the 0.8B and 9B shapes at bf16, and the link bandwidth at which a
    layer's all-to-alls (forward + backward) take as long as its matmuls (forward + backward) at ``SUSTAINED_FLOPS``."""
    from bench_lora import full_shape_config  # beside this file

    from vlm_sft.model.sequence_split import kv_heads_layout

    rows = []
    for name in ("0.8B", "9B"):
        text = full_shape_config(name).text_config
        for kind, v in all_to_all_volume(text).items():
            for cp in cp_sizes:
                repeat = kv_heads_layout(text.num_key_value_heads, cp) if kind == "full_attention" else 1
                hd = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
                elements = v["in"] + v["out"] + (repeat - 1) * 2 * text.num_key_value_heads * hd
                fwd_bytes = BF16 * elements  # per token of the row, sent by its owner: (cp - 1) / cp leaves the rank
                sent = (cp - 1) / cp * 2 * fwd_bytes  # forward + backward, per token a rank holds
                rows.append({
                    "model": name, "layer": kind, "cp": cp, "bytes_per_token_fwd": fwd_bytes,
                    "bytes_per_token_sent_fwd_bwd": sent,
                    "per_rank_mb_per_layer": sent * row_tokens / cp / 2**20, "row_tokens": row_tokens,
                    "flops_per_token_fwd": v["flops"],
                    "break_even_gb_s": sent * SUSTAINED_FLOPS / (3 * v["flops"]) / 1e9,
                })  # fmt: skip
    return rows


# ------------------------------------------------------------------------------------------------ report

PER_RANK_KEYS = (
    "forward_ms",
    "backward_ms",
    "step_ms",
    "cpu_ms",
    "saved_mb",
    "peak_rss_growth_mb",
    "rss_before_step_mb",
)


def summarize(reps: list[dict]) -> tuple[list[dict], dict]:
    """Per (cp, rank) medians over repetitions, and the cp2 / cp1 ratios (cp 2's worse rank; within a repetition)."""
    rows = []
    for case in ("cp1", "cp2"):
        for rank in range(len(reps[0][case])):
            runs = [rep[case][rank] for rep in reps]
            row = {k: runs[0][k] for k in ("cp", "rank", "row_tokens", "row_images", "rank_tokens", "loss_sum")}
            row |= harness.medians(runs, PER_RANK_KEYS)
            row["step_ms_per_rep"] = [r["step_ms"] for r in runs]
            rows.append(row)
    fields = {"step_time": "step_ms", "cpu_time": "cpu_ms", "saved_activations": "saved_mb"}
    fields["peak_memory"] = "peak_rss_growth_mb"
    stats = {
        key: harness.ratio_stats([max(r[f] for r in rep["cp2"]) for rep in reps], [rep["cp1"][0][f] for rep in reps])
        for key, f in fields.items()
    }
    ratios = {k: v["median"] for k, v in stats.items()}
    ratios |= {"range": {k: [v["min"], v["max"]] for k, v in stats.items()}}
    ratios |= {"per_rep": {k: v["per_rep"] for k, v in stats.items()}}
    return rows, ratios


def print_tables(rows: list[dict], ratios: dict, reps: list[dict], analytic: list[dict], meta: dict) -> None:
    r0 = rows[0]
    print(
        f"\nContext parallelism (Ulysses), Qwen3.5-0.8B widths with {LAYERS['text']} text layers (3 GatedDeltaNet + 1 "
        f"full attention), vocabulary {meta['vocab']:,} (real {REAL_VOCAB:,}), vision frozen, float32, CPU, 1 thread "
        f"per rank; one row of {r0['row_tokens']} tokens with {r0['row_images']} images; forward + backward; median "
        f"of {meta['reps']} repetitions"
    )
    columns = [("cp", "cp"), ("rank", "rank"), ("rank_tokens", "tokens"), ("forward_ms", "fwd ms", ".0f")]
    columns += [("backward_ms", "bwd ms", ".0f"), ("step_ms", "step ms", ".0f"), ("cpu_ms", "CPU ms", ".0f")]
    columns += [("saved_mb", "saved MB", ".0f"), ("peak_rss_growth_mb", "peak MB", ".0f")]
    harness.print_table(None, [*columns, ("rss_before_step_mb", "RSS before MB", ".0f")], rows)
    print(
        f"cp2 / cp1 (cp 2's slower or larger rank; within a repetition, then the median): step time "
        f"{ratios['step_time']:.3f}, CPU time {ratios['cpu_time']:.3f}, saved activations "
        f"{ratios['saved_activations']:.3f}, peak memory {ratios['peak_memory']:.3f}"
    )
    parity = [rep["parity"] for rep in reps]
    print(
        f"parity: cp 2's summed loss vs cp 1's, rel diff <= {max(p['loss_rel_diff'] for p in parity):.1e}; gradient "
        f"norms per parameter <= {max(p['max_grad_norm_rel_diff'] for p in parity):.1e} ({parity[0]['worst_param']})"
    )
    print(
        f"\nExpected on GPU: all-to-all per layer at bf16 (in: q, k, v or the conv channels + beta + decay input; out: "
        f"the mixer's output), and the link bandwidth at which it takes as long as the layer's matmuls at "
        f"{SUSTAINED_FLOPS / 1e12:.0f} TFLOP/s (forward + backward both)"
    )
    columns = [("model", "model"), ("layer", "layer"), ("cp", "cp"), ("bytes_per_token_fwd", "B/token fwd", ".0f")]
    columns += [("bytes_per_token_sent_fwd_bwd", "sent B/token", ".0f")]
    columns += [("per_rank_mb_per_layer", f"MB/rank ({analytic[0]['row_tokens']} tok)", ".1f")]
    columns += [("mflops_per_token_fwd", "MFLOP/token", ".1f"), ("break_even_gb_s", "break-even GB/s", ".1f")]
    harness.print_table(None, columns, [a | {"mflops_per_token_fwd": a["flops_per_token_fwd"] / 1e6} for a in analytic])
    print("sent B/token: forward + backward, per token a rank holds, (cp - 1) / cp of it leaving the rank")


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=1, help="repetitions (default 1: about 3.5 minutes each)")
    ap.add_argument("--tokens", type=int, default=8192, help="tokens of the row (default 8192; even)")
    ap.add_argument("--images", type=int, default=20, help="images of the row, one per sample (default 20)")
    ap.add_argument("--vocab", type=int, default=VOCAB, help=f"vocabulary (default {VOCAB:,}; {REAL_VOCAB} = real)")
    ap.add_argument("--quick", action="store_true", help="a smoke run: 1 repetition, a 2048-token row, 4 images")
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--child", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--out-dir", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.quick:
        args.reps, args.tokens, args.images = 1, 2048, 4
    if args.tokens % 2:
        raise SystemExit(f"--tokens {args.tokens}: the row must split evenly over cp 2 ranks; pass an even number")
    return args


def main() -> None:
    args = parse_args()
    if args.child:
        run_rank(args)
        return
    with harness.wall_clock() as meta:
        reps = run_reps(args)
        rows, ratios = summarize(reps)
        analytic = expected_scaling()
    meta |= {
        "threads_per_rank": 1,
        "reps": args.reps,
        "tokens": args.tokens,
        "images": args.images,
        "vocab": args.vocab,
        "layers": LAYERS,
        "quick": args.quick,
    }
    print_tables(rows, ratios, reps, analytic, meta)
    print(f"\nwall {meta['wall_s']:.0f} s")
    if not args.quick:
        payload = {"meta": meta, "ranks": rows, "ratios": ratios, "parity": [r["parity"] for r in reps]}
        harness.write_results("cp", payload | {"analytic": analytic}, path=args.out)


if __name__ == "__main__":
    main()
