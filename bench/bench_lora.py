"""Full fine-tuning vs LoRA on the same model and the same packed row, in one run (CPU, float32).

    python bench/bench_lora.py [--reps 3] [--threads 2] [--pack-len 1024] [--steps 1] [--vocab 41408] [--quick]

About 6 minutes on 2 idle cores (most of it the 0.8B-4L steps and the 12 processes' imports); ``--quick`` is a
smoke run of about a minute. Two models, each trained in two modes:

- ``tiny``: the tiny Qwen3.5 of ``configs/debug.toml`` (hidden 64, 4 text layers, 2-block vision tower of hidden 64,
  init range 0.08). The debug config trains its vision tower; here it is **frozen in both modes** so that the modes
  differ only in how the text model trains (a LoRA run never trains the tower). Data: one 1280-token ``bfd`` row
  (the debug config's ``pack_len``) of shapes-like synthetic samples (``SyntheticSource("short")``); 8 timed steps.
- ``0.8B-4L``: the real Qwen3.5-0.8B widths (``vlm_sft.model.presets.qwen3_5_0_8b_config``: hidden 1024, MLP 3584, 8 / 2
  heads of 256, GatedDeltaNet 16 + 16 heads of 128, tied embeddings) with fewer layers: 4 text layers (3
  GatedDeltaNet + 1 full attention, of 24) and a 2-block vision tower (of 12, width 768 kept), vision frozen. **The
  vocabulary is cut** from 248,320 to 41,408, by the factor the layers were (4 / 24): it keeps the embedding's share
  of the text parameters as in the real model (33% here, 34% there; 75% with the whole vocabulary, which would also
  make the LM head and loss 3/4 of the step: about 100 s per 2048-token step on 2 cores). ``--vocab 248320`` runs it
  with the real one. Data: one 1024-token ``bfd`` row of long-tailed synthetic text + image samples
  (``SyntheticSource("long_tail")``: here 752 text tokens and one image of 272 tokens); one timed step per process
  (``--pack-len``, ``--steps``). The real vocabulary is in the analytic table below.

Modes: ``full`` trains every text-model parameter (embeddings, all layers, norms; ``lm_head`` is tied to the
embeddings in the 0.8B shape); ``lora`` is ``vlm_sft.model.lora.attach_lora`` with the trainer's defaults
(``model.lora``: r 16, alpha 32, dropout 0, every text linear of ``LORA_TEXT_TARGETS``), base frozen in float32
(``store_frozen_in(model, float32)``, what the trainer does for a float32 run). A step is the trainer's: loss sum /
trainable tokens, backward, gradient clipping at 1.0, AdamW over ``vlm_sft.trainer.optim.param_groups`` (only
parameters that require gradients), on the same fixed packed row every step, from the same initial weights.

Figures per case: trainable parameters; optimizer state (bytes of AdamW's ``exp_avg`` + ``exp_avg_sq`` after the
first step); peak memory; step time (forward + backward + clip + AdamW; the median of a process's timed steps, which
follow one untimed warm-up step). Peak memory is the **process** peak RSS growth: ``VmHWM`` after the steps minus
the RSS measured right before the model is built (the batch is built before), so it includes the weights, gradients,
optimizer state, activations and the allocator's slack, in one fresh process per case.

Method: each repetition runs every (model, mode) case in its own fresh subprocess, the cases' order rotating from one
repetition to the next; each figure is the median over repetitions, and each LoRA / full ratio is taken within a
repetition (same model), then the median. Last, an analytic table (no run): parameters and the static training memory
(weights + gradients + AdamW moments, no activations) of the full 0.8B, 9B and 27B shapes, full fine-tuning (fp32
master weights) vs LoRA with the frozen base in fp32 or in bf16 (``store_frozen_in(model, bfloat16)``, what the
trainer does for a bf16 LoRA run). Prints the tables and writes ``bench/results/lora.json`` (not with ``--quick``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import harness  # first: the CPU environment, before any torch import

RESULTS = harness.results_path("lora")
MODELS = ("tiny", "0.8B-4L")
MODES = ("full", "lora")
REAL_VOCAB = 248_320
REDUCED_LAYERS = {"text": 4, "vision": 2}
"""The 0.8B shape's depth here: 4 text layers (3 GatedDeltaNet + 1 full attention) and 2 vision blocks."""
REDUCED_VOCAB = round(REAL_VOCAB * REDUCED_LAYERS["text"] / 24 / 64) * 64
"""41,408: the 0.8B vocabulary cut by the factor its text layers were (4 of 24), a multiple of 64; keeps the
embedding's share of the text parameters (34% in the real model, 33% here; 75% with the whole vocabulary)."""
SETTINGS = {
    "tiny": {"pack_len": 1280, "steps": 8, "vocab": None},
    "0.8B-4L": {"pack_len": 1024, "steps": 1, "vocab": REDUCED_VOCAB},
}
"""Per model: tokens of the fixed packed row, timed steps per process (after one warm-up step), vocabulary (None:
the config's). ``--pack-len``, ``--steps`` and ``--vocab`` change the 0.8B ones."""


# ------------------------------------------------------------------------------------------------ one case (child)


def model_config(name: str, vocab: int | None = None):
    """The config of ``name`` (module docstring); ``vocab`` cuts the 0.8B shape's vocabulary (pad and eos id 0)."""
    if name == "tiny":
        from vlm_sft.model.presets import tiny_qwen3_5_config

        return tiny_qwen3_5_config(initializer_range=0.08)  # configs/debug.toml's model
    from vlm_sft.model.presets import qwen3_5_0_8b_config

    config = qwen3_5_0_8b_config()
    t = config.text_config
    t.num_hidden_layers = REDUCED_LAYERS["text"]
    t.layer_types = t.layer_types[: REDUCED_LAYERS["text"]]
    config.vision_config.depth = REDUCED_LAYERS["vision"]
    if vocab is not None and vocab != t.vocab_size:
        t.vocab_size, t.pad_token_id, t.eos_token_id = vocab, 0, 0
    return config


def make_row(name: str, pack_len: int, pad_id: int):
    """The fixed packed row of ``name``: the fullest of the first ``bfd`` rows of its synthetic samples."""
    from gpu_bench import make_batches  # beside this file

    from vlm_sft.data.synthetic import SyntheticSource

    distribution, count = ("short", 96) if name == "tiny" else ("long_tail", 3 * pack_len // 700 + 4)
    source = SyntheticSource(count, distribution=distribution, seed=0)
    rows = make_batches([source(i) for i in range(count)], "bfd", pack_len=pack_len, stack_rows=1, pad_id=pad_id)
    return max(rows, key=lambda b: b.num_real_tokens)


def build_trainee(name: str, mode: str, vocab: int | None = None):
    """The model of ``name`` (vision frozen, float32, seed 0) in ``mode``, and its AdamW over the trainable params."""
    import torch

    from vlm_sft.config import LoraSettings
    from vlm_sft.model import build_model
    from vlm_sft.model.lora import attach_lora, store_frozen_in
    from vlm_sft.trainer.optim import param_groups

    torch.manual_seed(0)
    model = build_model(model_config(name, vocab), dtype=torch.float32, freeze_vision=True)
    if mode == "lora":
        lora = LoraSettings()  # the trainer's defaults: r 16, alpha 32, dropout 0, every text linear
        torch.manual_seed(1)
        attach_lora(model, r=lora.r, alpha=lora.alpha, dropout=lora.dropout, targets=lora.target_modules)
        store_frozen_in(model, torch.float32)  # a float32 run: the base stays float32 (a no-op, as the trainer)
    model.train()
    optimizer = torch.optim.AdamW(param_groups(model, 0.01), lr=1e-4, betas=(0.9, 0.95))
    return model, optimizer


def run_case(name: str, mode: str, *, steps: int, threads: int, pack_len: int, vocab: int | None) -> dict:
    """Build the row, then the model, then train ``1 + steps`` steps; this process's figures (module docstring)."""
    import torch

    from vlm_sft.model.lora import TEXT_MODEL_PREFIX

    harness.set_threads(threads)
    row = make_row(name, pack_len, int(model_config(name, vocab).text_config.pad_token_id))
    harness.trim_heap()
    rss0 = harness.rss_mb()
    model, optimizer = build_trainee(name, mode, vocab)
    built_mb = harness.rss_mb() - rss0
    trainable = [p for p in model.parameters() if p.requires_grad]
    records, losses, state_bytes = [], [], None
    for i in range(1 + steps):
        t0 = time.perf_counter()
        out = model(**row.model_kwargs())
        t1 = time.perf_counter()
        loss = out.loss_sum / max(row.num_trainable_tokens, 1)
        loss.backward()
        t2 = time.perf_counter()
        torch.nn.utils.clip_grad_norm_([p for p in trainable if p.grad is not None], 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        t3 = time.perf_counter()
        losses.append(loss.item())
        if i == 0:
            state_bytes = sum(
                s[k].numel() * s[k].element_size() for s in optimizer.state.values() for k in ("exp_avg", "exp_avg_sq")
            )
        else:
            records.append({"forward": t1 - t0, "backward": t2 - t1, "optimizer": t3 - t2, "step": t3 - t0})
    peak_mb = harness.peak_rss_mb() - rss0  # the process's high-water mark (never reset here)
    text = [p for n, p in model.named_parameters() if n.startswith(TEXT_MODEL_PREFIX) or n == "lm_head.weight"]
    return {
        "model": name,
        "mode": mode,
        "row_tokens": row.num_real_tokens,
        "row_images": 0 if row.image_grid_thw is None else len(row.image_grid_thw),
        "total_params": sum(p.numel() for p in model.parameters()),
        "text_params": sum(p.numel() for p in {id(p): p for p in text}.values()),
        "trainable_params": sum(p.numel() for p in trainable),
        "optimizer_state_bytes": state_bytes,
        "built_mb": built_mb,
        "peak_rss_growth_mb": peak_mb,
        "losses": losses,
        **{
            f"{k}_ms": 1e3 * v
            for k, v in harness.medians(records, ("step", "forward", "backward", "optimizer")).items()
        },
    }


# ------------------------------------------------------------------------------------------------ the run (parent)


def spawn(name: str, mode: str, args: argparse.Namespace) -> dict:
    """``run_case`` in a fresh interpreter; its last stdout line is the case's JSON."""
    case = args.settings[name]
    cmd = [sys.executable, __file__, "--child", f"{name}:{mode}", "--threads", str(args.threads)]
    cmd += ["--steps", str(case["steps"]), "--pack-len", str(case["pack_len"]), "--vocab", str(case["vocab"] or 0)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": str(args.threads)}
    done = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env)
    return json.loads(done.stdout.strip().splitlines()[-1])


def run_reps(args: argparse.Namespace) -> list[list[dict]]:
    """``args.reps`` repetitions of every case, each in its own process, the order rotating per repetition."""
    cases = [(m, mode) for mode in MODES for m in MODELS]  # tiny full, 0.8B full, tiny lora, 0.8B lora
    reps = []
    for rep in range(args.reps):
        order = harness.rotation(cases, rep)
        results = []
        for name, mode in order:
            start = time.perf_counter()
            res = spawn(name, mode, args)
            print(
                f"  rep {rep + 1}/{args.reps} {name:<8} {mode:<5} step {res['step_ms']:8.1f} ms, "
                f"peak +{res['peak_rss_growth_mb']:.0f} MB ({time.perf_counter() - start:.0f} s)",
                flush=True,
            )
            results.append(res)
        reps.append(results)
    return reps


MEDIAN_KEYS = ("step_ms", "forward_ms", "backward_ms", "optimizer_ms", "peak_rss_growth_mb", "built_mb")
"""Case figures reported as the median over repetitions."""
RATIO_KEYS = {
    "trainable": "trainable_params",
    "optimizer_state": "optimizer_state_bytes",
    "peak_memory": "peak_rss_growth_mb",
    "step_time": "step_ms",
}
"""LoRA / full ratios reported: name -> the case figure it divides."""


def summarize(reps: list[list[dict]]) -> tuple[list[dict], list[dict]]:
    """Per-case medians over repetitions, and the per-model LoRA / full ratios (within a repetition, then median)."""
    by_case: dict[tuple[str, str], list[dict]] = {}
    for results in reps:
        for r in results:
            by_case.setdefault((r["model"], r["mode"]), []).append(r)
    rows = []
    for _case, runs in sorted(by_case.items(), key=lambda kv: (MODELS.index(kv[0][0]), kv[0][1])):
        row = {k: v for k, v in runs[0].items() if not k.endswith("_ms") and k != "losses"}
        row |= harness.medians(runs, MEDIAN_KEYS)
        row |= {"step_ms_per_rep": [r["step_ms"] for r in runs], "first_loss": runs[0]["losses"][0]}
        row["peak_rss_growth_mb_per_rep"] = [r["peak_rss_growth_mb"] for r in runs]
        rows.append(row)
    ratios = []
    for name in MODELS:
        cases = [{r["mode"]: r for r in results if r["model"] == name} for results in reps]
        stats = {
            k: harness.ratio_stats([c["lora"][f] for c in cases], [c["full"][f] for c in cases])
            for k, f in RATIO_KEYS.items()
        }
        ratios.append(
            {"model": name}
            | {k: v["median"] for k, v in stats.items()}
            | {"range": {k: [v["min"], v["max"]] for k, v in stats.items()}}
            | {"per_rep": {k: v["per_rep"] for k, v in stats.items()}}
        )
    return rows, ratios


# ------------------------------------------------------------------------------------------------ analytic (no run)

BIG_SHAPES = {
    "9B": {"text": {"hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 32,
                    "num_attention_heads": 16, "num_key_value_heads": 4, "linear_num_value_heads": 32},
           "vision_out": 4096},
    "27B": {"text": {"hidden_size": 5120, "intermediate_size": 17408, "num_hidden_layers": 64,
                     "num_attention_heads": 24, "num_key_value_heads": 4, "linear_num_value_heads": 48},
            "vision_out": 5120},
}  # fmt: skip
"""Qwen3.5-9B / -27B as recorded in ``tests/test_model_real_shapes.py`` (``REAL_SHAPES`` and its sources): the
0.8B config's other fields (GatedDeltaNet 16 key heads of 128, head_dim 256, rope, vocabulary 248,320), untied
embeddings, and a vision tower of 27 blocks, hidden 1152, 16 heads, MLP 4304."""


def full_shape_config(name: str):
    """The full-depth config of ``0.8B``, ``9B`` or ``27B``."""
    from transformers import Qwen3_5Config

    from vlm_sft.model.presets import qwen3_5_0_8b_config

    base = qwen3_5_0_8b_config()
    if name == "0.8B":
        return base
    shape = BIG_SHAPES[name]
    text = base.text_config.to_dict() | shape["text"] | {"tie_word_embeddings": False}
    text["layer_types"] = (["linear_attention"] * 3 + ["full_attention"]) * (text["num_hidden_layers"] // 4)
    vision = base.vision_config.to_dict() | {"depth": 27, "hidden_size": 1152, "num_heads": 16}
    vision |= {"intermediate_size": 4304, "out_hidden_size": shape["vision_out"]}
    ids = {k: getattr(base, k) for k in ("image_token_id", "video_token_id", "vision_start_token_id")}
    ids["vision_end_token_id"] = base.vision_end_token_id
    return Qwen3_5Config(text_config=text, vision_config=vision, tie_word_embeddings=False, **ids)


def analytic_memory(name: str, r: int) -> dict:
    """Parameters (counted on a meta-device model: nothing allocated) and static training bytes of ``name``."""
    import torch

    from vlm_sft.config import LORA_TEXT_TARGETS
    from vlm_sft.model import Qwen3_5VLM
    from vlm_sft.model.backends import resolve_backends
    from vlm_sft.model.lora import lora_target_names

    with torch.device("meta"):
        model = Qwen3_5VLM(full_shape_config(name), resolve_backends("cpu"), freeze_vision=True)
    total = sum(p.numel() for p in model.parameters())
    text = sum(p.numel() for p in model.parameters() if p.requires_grad)  # vision frozen: text model + lm_head
    modules = dict(model.named_modules())
    adapters = sum(
        r * (modules[n].in_features + modules[n].out_features) for n in lora_target_names(model, LORA_TEXT_TARGETS)
    )
    gib = 2**30
    return {
        "model": name,
        "total_params": total,
        "text_params": text,
        "lora_params": adapters,
        "frozen_fp32_gib": 4 * total / gib,
        "frozen_bf16_gib": 2 * total / gib,
        # weights + grads + AdamW moments: fp32 everywhere; grads and moments only for trainable parameters
        "full_static_gib": (4 * total + 12 * text) / gib,
        "lora_fp32_static_gib": (4 * total + 16 * adapters) / gib,
        "lora_bf16_static_gib": (2 * total + 16 * adapters) / gib,
    }


# ------------------------------------------------------------------------------------------------ report


def print_tables(rows: list[dict], ratios: list[dict], analytic: list[dict], meta: dict) -> None:
    title = (
        f"\nFull fine-tuning vs LoRA (r {meta['lora']['r']}, alpha {meta['lora']['alpha']:g}, every text linear), "
        f"float32, CPU ({meta['threads']} threads), vision frozen; median of {meta['reps']} repetitions, "
        "each case in its own process, order rotating"
    )
    columns = [("model", "model"), ("mode", "mode"), ("row_tokens", "row tok"), ("params_m", "params M", ".2f")]
    columns += [("trainable_m", "trainable M", ".3f"), ("state_mb", "opt state MB", ".1f")]
    columns += [("peak_rss_growth_mb", "peak MB", ".0f"), ("step_ms", "step ms", ".1f")]
    columns += [("split", "fwd/bwd/opt ms"), ("first_loss", "loss 1", ".4f")]
    shown = [
        r
        | {"params_m": r["total_params"] / 1e6, "trainable_m": r["trainable_params"] / 1e6}
        | {"state_mb": r["optimizer_state_bytes"] / 2**20}
        | {"split": "/".join(f"{r[k]:.0f}" for k in ("forward_ms", "backward_ms", "optimizer_ms"))}
        for r in rows
    ]
    harness.print_table(title, columns, shown)
    big = meta["settings"]["0.8B-4L"]
    vocab = f"vocabulary {big['vocab']:,} (real: {REAL_VOCAB:,})" if big["vocab"] else f"vocabulary {REAL_VOCAB:,}"
    print(
        f"tiny: configs/debug.toml's model, vision frozen here. 0.8B-4L: Qwen3.5-0.8B widths, 4 text layers, {vocab}."
    )
    print("peak MB: process peak RSS (VmHWM) after the steps minus the RSS before the model was built: weights,")
    print("gradients, AdamW state, activations, allocator slack. loss 1: first step's loss (same init: must agree).")
    columns = [("model", "model"), ("trainable", "trainable", ".4f"), ("optimizer_state", "opt state", ".4f")]
    columns += [("peak_memory", "peak mem", ".3f"), ("step_time", "step time", ".3f")]
    harness.print_table("\nLoRA / full (ratios within a repetition, then the median)", columns, ratios)
    title = (
        "\nStatic training memory of the full shapes (analytic, GiB: weights + gradients + AdamW moments; no "
        "activations, not sharded; full = fp32 master weights, vision frozen)"
    )
    columns = [("model", "model"), ("params_b", "params B", ".2f"), ("text_b", "text B", ".2f")]
    columns += [("lora_m", "LoRA M", ".1f"), ("frozen_fp32_gib", "base fp32", ".1f")]
    columns += [("frozen_bf16_gib", "base bf16", ".1f"), ("full_static_gib", "full FT", ".1f")]
    columns += [("lora_fp32_static_gib", "LoRA fp32", ".1f"), ("lora_bf16_static_gib", "LoRA bf16", ".1f")]
    shown = [
        a | {"params_b": a["total_params"] / 1e9, "text_b": a["text_params"] / 1e9, "lora_m": a["lora_params"] / 1e6}
        for a in analytic
    ]
    harness.print_table(title, columns, shown)


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--pack-len", type=int, help="tokens of the 0.8B-4L row (default 1024)")
    ap.add_argument("--steps", type=int, help="timed 0.8B-4L steps per process, after a warm-up step (default 1)")
    ap.add_argument("--vocab", type=int, help=f"0.8B-4L vocabulary (default {REDUCED_VOCAB:,}; {REAL_VOCAB} = real)")
    ap.add_argument("--quick", action="store_true", help="a smoke run: 1 repetition, a 256-token 0.8B-4L row")
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.settings = {name: dict(s) for name, s in SETTINGS.items()}
    big = args.settings["0.8B-4L"]
    if args.quick:
        args.reps, big["pack_len"], args.settings["tiny"]["steps"] = 1, 256, 2
    for key in ("pack_len", "steps", "vocab"):
        if getattr(args, key) is not None:
            big[key] = getattr(args, key) or None
    return args


def main() -> None:
    args = parse_args()
    if args.child:
        name, mode = args.child.split(":")
        case = {"steps": args.steps, "pack_len": args.pack_len, "vocab": args.vocab or None}
        print(json.dumps(run_case(name, mode, threads=args.threads, **case)))
        return
    with harness.wall_clock() as meta:
        rows, ratios = summarize(run_reps(args))
        from vlm_sft.config import LoraSettings

        lora = LoraSettings()
        analytic = [analytic_memory(name, lora.r) for name in ("0.8B", "9B", "27B")]
    meta |= {
        "threads": args.threads,
        "reps": args.reps,
        "settings": args.settings,
        "reduced_0_8b_layers": REDUCED_LAYERS,
        "lora": {"r": lora.r, "alpha": lora.alpha, "dropout": lora.dropout, "targets": list(lora.target_modules)},
        "quick": args.quick,
    }
    print_tables(rows, ratios, analytic, meta)
    print(f"\nwall {meta['wall_s']:.0f} s")
    if not args.quick:
        payload = {"meta": meta, "cases": rows, "ratios": ratios, "analytic": analytic}
        harness.write_results("lora", payload, path=args.out)


if __name__ == "__main__":
    main()
