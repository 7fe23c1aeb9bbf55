"""End-to-end training throughput on CPU: ``bfd`` / ``cat`` packed rows vs ``stack`` padded batches.

    python bench/bench_train_throughput.py [--reps 3] [--shapes-samples 960] [--long-samples 64] [--quick]

Same data and same model for every mode: the tiny Qwen3.5 of ``configs/debug.toml`` (hidden 64, vision tower
trainable, float32, AdamW, gradient clipping), trained step by step exactly as the trainer does (loss sum / trainable
tokens, backward, clip, AdamW). Two workloads:

- ``shapes``: the embedded shapes dataset through the real renderer, the debug config's packing (seq_len 512,
  pack_len 1280, stack batches of 32 rows from a 512-sample length-sorted buffer, rows padded to a multiple of 8);
- ``long_tail``: ``SyntheticSource("long_tail")`` (median 700 tokens, 0-4 images of up to 400 tokens), truncated to
  2048 tokens so padded batches fit; packed rows of 4096; ``stack`` = 8 samples per batch in arrival order (the
  plain padded baseline, as a trainer without length grouping batches), ``stack-sorted`` = the same from a
  512-sample length-sorted buffer (length grouping).

Method: samples are rendered and packed and collated *before* the timed region (their cost is reported apart, as
``data ms/step``: one process, no workers). A pass trains on every batch of a mode once, from the same initial
weights and a fresh optimizer; the varlen layout caches are cleared before each pass so every packed row pays its
layout cost once, as in training. The modes' passes are interleaved (the order rotates each repetition) and each
figure is the median over repetitions; the packed/padded ratios are taken within a repetition, then the median.
The ideal gain of packing is the padded baseline's capacity / its real tokens (all padding removed at no cost);
"of ideal" = measured gain / ideal gain. Peak memory: resident-set high-water mark above the start of the pass
(glibc's free lists trimmed first). FLOPs: ``vlm_sft.flops`` (useful = real tokens and segments, x3 for training).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import harness  # first: the CPU environment, before torch is imported

# isort: split
import torch

from vlm_sft.checkpoint import build
from vlm_sft.config import load_config
from vlm_sft.data import build as data_build
from vlm_sft.data.batch import PackedBatch
from vlm_sft.data.collate import collate
from vlm_sft.data.pipeline import PackingPipeline
from vlm_sft.data.sources import render_fn
from vlm_sft.data.synthetic import SyntheticSource
from vlm_sft.flops import batch_flops
from vlm_sft.model import varlen
from vlm_sft.trainer.metrics import ModuleTimer
from vlm_sft.trainer.optim import build_optimizer

REPO = Path(__file__).resolve().parents[1]
RESULTS = harness.results_path("train_throughput")


@dataclass(frozen=True)
class Mode:
    """One way of batching a workload."""

    label: str
    packing: str
    rows: int = 1
    """Samples per ``stack`` batch."""
    buffer: int = 512
    """Look-ahead buffer of the packer (``stack`` sorts it by length; buffer = rows keeps arrival order)."""


@dataclass
class Workload:
    name: str
    samples: list
    """Pre-rendered ``RenderedSample`` values, index = sample index."""
    render_ms_per_sample: float
    seq_len: int
    pack_len: int
    truncation: str
    modes: list[Mode]
    baselines: list[str]
    """Labels of the padded modes the packed ones are compared with."""
    batches: dict[str, list[PackedBatch]] = field(default_factory=dict)
    pack_seconds: dict[str, float] = field(default_factory=dict)


# ------------------------------------------------------------------------------------------------ data


def shapes_workload(cfg, n: int) -> Workload:
    root = Path(tempfile.gettempdir()) / "vlm-sft-bench-shapes"
    cfg = cfg.model_copy(deep=True)
    cfg.data.shapes.root = str(root)
    cfg.data.shapes.num_train = n
    cfg.data.shapes.num_eval = 0
    processor = data_build.build_processor(cfg)
    renderer = data_build.build_renderer(cfg, processor)
    sources = data_build.load_sources(cfg)
    fn = render_fn(sources.train, renderer)
    start = time.perf_counter()
    samples = [fn(i) for i in range(n)]
    render_ms = (time.perf_counter() - start) / n * 1e3
    d = cfg.data
    return Workload(
        name="shapes",
        samples=samples,
        render_ms_per_sample=render_ms,
        seq_len=d.seq_len,
        pack_len=d.pack_len,
        truncation=d.truncation,
        modes=[Mode("bfd", "bfd", buffer=d.bfd_buffer), Mode("cat", "cat"), Mode("stack", "stack", d.stack_batch_size)],
        baselines=["stack"],
    )


def long_tail_workload(n: int, *, seq_len: int = 2048, pack_len: int = 4096, rows: int = 8) -> Workload:
    source = SyntheticSource(n, distribution="long_tail", seed=0)
    start = time.perf_counter()
    samples = [source(i) for i in range(n)]
    render_ms = (time.perf_counter() - start) / n * 1e3
    return Workload(
        name="long_tail",
        samples=samples,
        render_ms_per_sample=render_ms,
        seq_len=seq_len,
        pack_len=pack_len,
        truncation="truncate",
        modes=[
            Mode("bfd", "bfd"),
            Mode("cat", "cat"),
            Mode("stack", "stack", rows, buffer=rows),
            Mode("stack-sorted", "stack", rows, buffer=512),
        ],
        baselines=["stack", "stack-sorted"],
    )


def pack_workload(w: Workload, pad_id: int) -> None:
    """Truncate, shift, pack and collate every sample once per mode (outside the timed region)."""
    for mode in w.modes:
        start = time.perf_counter()
        pipeline = PackingPipeline(
            len(w.samples),
            w.samples.__getitem__,
            seq_len=w.seq_len,
            pack_len=w.pack_len if mode.packing != "stack" else w.seq_len,
            packing=mode.packing,
            batch_size=mode.rows,
            buffer_size=mode.buffer,
            truncation=w.truncation,
            shuffle=True,
            seed=0,
            epochs=1,
        )
        w.batches[mode.label] = [collate([p], pad_id=pad_id) for p in pipeline]
        w.pack_seconds[mode.label] = time.perf_counter() - start
    real = {label: sum(b.num_real_tokens for b in bs) for label, bs in w.batches.items()}
    if len(set(real.values())) != 1:
        raise RuntimeError(f"{w.name}: modes saw different data (real tokens per mode: {real})")


# ------------------------------------------------------------------------------------------------ training


@dataclass
class Trainee:
    """One mode's model and optimizer (every mode trains its own copy from the same initial weights)."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    vision_timer: ModuleTimer


class Runner:
    """Trains over batches the way the trainer's loop does (loss sum / trainable tokens, backward, clip, AdamW),
    timing each part of each step."""

    def __init__(self, cfg, labels: list[str]) -> None:
        torch.manual_seed(cfg.train.seed)
        self.cfg = cfg
        self.model = build.build_model(cfg, torch.device("cpu"))
        self.init_state = {k: v.clone() for k, v in self.model.state_dict().items()}
        self.trainees: dict[str, Trainee] = {}
        for label in labels:
            model = build.build_model(cfg, torch.device("cpu"))
            model.load_state_dict(self.init_state)
            model.train()
            cpu = torch.device("cpu")
            self.trainees[label] = Trainee(
                model, build_optimizer(model, cfg.train), ModuleTimer(model.model.visual, cpu)
            )

    def reset(self) -> None:
        """Every mode back to the initial weights and a fresh optimizer (start of a repetition)."""
        for t in self.trainees.values():
            t.model.load_state_dict(self.init_state)
            t.optimizer = build_optimizer(t.model, self.cfg.train)

    def run(self, label: str, batches: list[PackedBatch]) -> tuple[list[dict], float | None]:
        """Train ``label``'s model on ``batches``; per-step timings and the peak RSS increase (MB) over the slice."""
        t = self.trainees[label]
        varlen.clear_layout_caches()  # a packed row pays its layout once, as in training
        peak_ok = harness.reset_peak_rss()  # glibc's free lists trimmed first
        rss0 = harness.rss_mb()
        steps = []
        for batch in batches:
            t.vision_timer.take()
            t0 = time.perf_counter()
            out = t.model(**batch.model_kwargs())
            t1 = time.perf_counter()
            (out.loss_sum / max(batch.num_trainable_tokens, 1)).backward()
            t2 = time.perf_counter()
            torch.nn.utils.clip_grad_norm_([p for p in t.model.parameters() if p.grad is not None], 1.0)
            t.optimizer.step()
            t.optimizer.zero_grad(set_to_none=True)
            t3 = time.perf_counter()
            steps.append(
                {"vision": t.vision_timer.take(), "forward": t1 - t0, "backward": t2 - t1, "optimizer": t3 - t2}
            )
        peak = harness.peak_rss_mb() - rss0 if peak_ok else None
        return steps, peak


# ------------------------------------------------------------------------------------------------ report


def bench_workload(w: Workload, runner: Runner, reps: int, slices: int) -> list[dict]:
    """Time every mode of ``w`` (``time_modes``), then one row per mode, with its gain over each padded baseline."""
    steps, peaks = time_modes(w, runner, reps, slices)
    rows = [mode_row(w, runner, mode.label, steps[mode.label], peaks[mode.label]) for mode in w.modes]
    by_label = {r["mode"]: r for r in rows}
    for base in w.baselines:
        b = by_label[base]
        ideal = b["capacity_tokens"] / b["real_tokens"]
        for r in rows:
            if r["mode"] in w.baselines:
                continue
            # same real tokens in both: the padded / packed time ratio is the packed / padded real tokens/s ratio
            g = harness.ratio_stats(b["pass_seconds"], r["pass_seconds"])
            vs = {
                "gain": g["median"],
                "ideal": ideal,
                "of_ideal": g["median"] / ideal,
                "gain_range": [g["min"], g["max"]],
            }
            r.setdefault("vs", {})[base] = vs
    return rows


def time_modes(w: Workload, runner: Runner, reps: int, slices: int) -> tuple[dict[str, list], dict[str, list]]:
    """Each repetition trains every mode on all its batches, interleaved slice by slice (slice k of every mode, the
    mode order rotating), so a burst of machine noise hits all modes of a repetition alike. Returns per mode the
    steps' timings of each repetition and the slices' memory peaks."""
    labels = [m.label for m in w.modes]
    for label in labels:  # warm-up: first-call costs (allocator, kernels' caches) hit no timed pass
        runner.run(label, w.batches[label][:2])
    steps: dict[str, list[list[dict]]] = {label: [] for label in labels}
    peaks: dict[str, list[float]] = {label: [] for label in labels}
    for rep in range(reps):
        runner.reset()
        per_mode = {label: harness.slices(w.batches[label], slices) for label in labels}
        done: dict[str, list[dict]] = {label: [] for label in labels}
        for k in range(slices):
            for label in harness.rotation(labels, rep + k):
                if per_mode[label][k]:
                    out, peak = runner.run(label, per_mode[label][k])
                    done[label] += out
                    if peak is not None:
                        peaks[label].append(peak)
        for label in labels:
            steps[label].append(done[label])
        line = "  ".join(f"{label} {sum(_step_s(s) for s in done[label]):.2f} s" for label in labels)
        print(f"  {w.name} rep {rep + 1}/{reps}: {line}", flush=True)
    return steps, peaks


def mode_row(w: Workload, runner: Runner, label: str, reps_steps: list[list[dict]], peaks: list[float]) -> dict:
    """One mode's row of the table: tokens, padding, median pass time, step shares, FLOP rates."""
    vision_trainable, config = runner.model.vision_trainable, runner.model.config
    bs = w.batches[label]
    real = sum(b.num_real_tokens for b in bs)
    trainable = sum(b.num_trainable_tokens for b in bs)
    capacity = sum(b.input_ids.numel() for b in bs)
    useful = sum(batch_flops(b, config, vision_trainable=vision_trainable).train for b in bs)
    executed = sum(batch_flops(b, config, vision_trainable=vision_trainable, count_padding=True).train for b in bs)
    pass_s = [sum(_step_s(s) for s in rep_steps) for rep_steps in reps_steps]
    seconds = statistics.median(pass_s)
    per_rep_parts = [{k: sum(s[k] for s in rep_steps) for k in PARTS} for rep_steps in reps_steps]
    parts = harness.medians(per_rep_parts, PARTS)
    step_total = parts["forward"] + parts["backward"] + parts["optimizer"]
    shape = sorted({b.shape for b in bs})
    return {
        "dataset": w.name,
        "mode": label,
        "steps": len(bs),
        "row_shape": f"{shape[0][0]} x {shape[0][1]}" if len(shape) == 1 else f"{shape[0][0]} x <={w.seq_len}",
        "real_tokens": real,
        "trainable_tokens": trainable,
        "capacity_tokens": capacity,
        "padding_fraction": 1 - real / capacity,
        "pass_s": seconds,
        "real_tok_s": real / seconds,
        "trainable_tok_s": trainable / seconds,
        "step_ms": 1e3 * statistics.median(_step_s(s) for rep_steps in reps_steps for s in rep_steps),
        "vision_frac": parts["vision"] / step_total,
        "text_forward_frac": (parts["forward"] - parts["vision"]) / step_total,
        "backward_frac": parts["backward"] / step_total,
        "optimizer_frac": parts["optimizer"] / step_total,
        "peak_mb": max(peaks, default=None),
        "useful_gflop_s": useful / seconds / 1e9,
        "executed_over_useful_flops": executed / useful,
        "pass_seconds": pass_s,
    }


PARTS = ("vision", "forward", "backward", "optimizer")
"""The timed parts of a step (vision is inside forward)."""


def _step_s(step: dict) -> float:
    return step["forward"] + step["backward"] + step["optimizer"]


def print_tables(rows: list[dict], meta: dict) -> None:
    threads = f"{meta['threads']} thread{'s' if meta['threads'] > 1 else ''}"
    title = (
        f"\nTraining throughput, tiny Qwen3.5 ({meta['params_m']:.2f} M params, vision trainable), float32, CPU "
        f"({threads}), median of {meta['reps']} repetitions, modes interleaved"
    )
    columns = [("dataset", "dataset"), ("mode", "mode"), ("steps", "steps"), ("row_shape", "rows x len")]
    columns += [("real_tok_s", "real tok/s", ".0f"), ("trainable_tok_s", "train tok/s", ".0f")]
    columns += [("step_ms", "step ms", ".1f"), ("padding_fraction", "pad frac", ".3f"), ("peak_mb", "peak MB", ".0f")]
    columns += [("split", "vis/txt/bwd/opt %"), ("useful_gflop_s", "GFLOP/s", ".2f")]
    columns += [("executed_over_useful_flops", "exec/useful", ".2f")]
    fracs = ("vision_frac", "text_forward_frac", "backward_frac", "optimizer_frac")
    shown = [r | {"split": "/".join(f"{100 * r[k]:.0f}" for k in fracs)} for r in rows]
    harness.print_table(title, columns, shown)
    title = (
        f"\nPacked vs padded ({threads}): real tokens/s ratio within each repetition, median (min-max); "
        "bar: >= 0.90 of ideal"
    )
    columns = [("dataset", "dataset"), ("mode", "packed"), ("base", "vs padded"), ("gain", "gain")]
    columns += [("ideal", "ideal", ".2f"), ("of_ideal", "of ideal", ".2f"), ("bar", "bar")]
    shown = [
        {"dataset": r["dataset"], "mode": r["mode"], "base": base, "ideal": v["ideal"], "of_ideal": v["of_ideal"]}
        | {"gain": harness.fmt_range({"median": v["gain"], "min": v["gain_range"][0], "max": v["gain_range"][1]})}
        | {"bar": "met" if v["of_ideal"] >= 0.9 else "NOT met"}
        for r in rows
        for base, v in r.get("vs", {}).items()
    ]
    harness.print_table(title, columns, shown)


def print_data(workloads: list[Workload]) -> list[dict]:
    print("\nData preparation (outside the timed region; one process, no workers)")
    out = []
    for w in workloads:
        lens = [len(s) for s in w.samples]
        per_mode = {m.label: 1e3 * w.pack_seconds[m.label] / len(w.batches[m.label]) for m in w.modes}
        text = ", ".join(f"{k} {v:.1f}" for k, v in per_mode.items())
        print(
            f"  {w.name}: {len(w.samples)} samples, {min(lens)}-{max(lens)} tokens (median "
            f"{statistics.median(lens):.0f}); render {w.render_ms_per_sample:.2f} ms/sample; "
            f"pack+collate ms/step: {text}"
        )
        out.append(
            {
                "dataset": w.name,
                "samples": len(w.samples),
                "render_ms_per_sample": w.render_ms_per_sample,
                "pack_collate_ms_per_step": per_mode,
            }
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--slices", type=int, default=4, help="interleaving slices per repetition")
    ap.add_argument("--shapes-samples", type=int, default=640)
    ap.add_argument("--long-samples", type=int, default=48)
    ap.add_argument("--threads", default="1,2", help="comma-separated torch thread counts, one table each")
    ap.add_argument("--quick", action="store_true", help="a smoke run: few samples, one repetition")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    if args.quick:
        args.reps, args.slices, args.shapes_samples, args.long_samples = 1, 2, 96, 12
    cfg = load_config(REPO / "configs" / "debug.toml")
    pad_id = int(data_build.build_processor(cfg).tokenizer.pad_token_id)
    workloads = [shapes_workload(cfg, args.shapes_samples), long_tail_workload(args.long_samples)]
    for w in workloads:
        pack_workload(w, pad_id)
    runner = Runner(cfg, sorted({m.label for w in workloads for m in w.modes}))
    meta = {
        "reps": args.reps,
        "slices": args.slices,
        "shapes_samples": args.shapes_samples,
        "long_samples": args.long_samples,
        "params_m": sum(p.numel() for p in runner.model.parameters()) / 1e6,
    }
    tables = []
    for threads in [int(t) for t in args.threads.split(",")]:
        harness.set_threads(threads)
        rows = []
        for w in workloads:
            rows += bench_workload(w, runner, args.reps, args.slices)
        tables.append({"threads": threads, "rows": rows})
    for table in tables:
        print_tables(table["rows"], {**meta, "threads": table["threads"]})
    data = print_data(workloads)
    if not args.quick:
        harness.write_results("train_throughput", {"meta": meta, "tables": tables, "data": data}, path=args.out)


if __name__ == "__main__":
    main()
