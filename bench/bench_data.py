"""Do the data workers keep a GPU fed? Render + pack throughput per worker, time to the first batch, and the
default run's data-wait share.

    python bench/bench_data.py            (about 6-8 minutes on 2 cores)
    python bench/bench_data.py --quick    (a smoke run: 24 samples, one repetition, 60 training steps)

Data: ``--samples`` conversations (seeded) written to a temporary folder as a jsonl with image paths relative to it;
each is a user turn with 1-4 distinct photo-like JPEG images of 1024x768 (smooth colour fields, a wave and pixel
noise, quality 90: 120-220 KB each) and a question, then an assistant answer. They are rendered by the tiny offline
processor with the real Qwen3.5 pixel limits (``size = {"shortest_edge": 65536, "longest_edge": 16777216}``, patch
16, merge 2), so one image is 3072 patches = 768 image tokens, as for the real model (checked and printed first).

Method, one part per table:

1. **Render + pack**: the pipelines are built as training builds them (``load_config`` with overrides:
   ``--data.pack_len 8192 --data.seq_len 8192 --data.bfd_buffer 64 --model.vlm.freeze_vision true``, then
   ``data_build.load_sources``, ``data_build.TrainPipelines`` with ``epochs=1`` and ``TrainBatches``) with
   ``data.num_workers`` = 0, 1, 2, 4, and one pass is drawn. Rates are over the whole pass, from building the
   batches to the end of the stream (the first batch included): with a 64-sample ``bfd`` buffer the first batch
   already waits for most of a short pass's rendering, so a clock started after it would count packs rendered
   before it. One pass renders every image once (a second epoch would hit the renderer's image cache). The data is
   cut into 4 streams (``DataLayout(streams_per_micro_batch=4)``: 1, 2 and 4 workers share them evenly), so the pack
   stream is the same for every N; the drawn pass ends when the first stream runs out (the other streams' last
   packs are not drawn).
   ``--reps`` repetitions (default 2), the worker counts interleaved in a rotating order; medians, and ``vs 1`` a
   ratio against one worker within each repetition, then the median. A worker runs torch with one thread, and so
   does the main process here (``workers = 0``). Also timed alone: JPEG decode and the image processor per image.
2. **First batch, prepared vs streaming**: ``prepared`` = ``load_sources`` on a fresh copy of the jsonl (a new
   path, so the Arrow cache is built again) + the first batch; ``streaming`` = the same rows as 4 parquet shards
   (``--data.streaming true --data.image_root <folder>``) + the first batch; the default worker count. Once each:
   both wait mostly for the samples of the first ``bfd`` buffer to render, which part 1 times repeatedly.
   ``datasets``' cache is redirected to the temporary folder, so the bench leaves nothing in ``~/.cache``.
3. **Against the GPU it must feed**: one H200 (``flops.PEAK_BF16_DENSE_FLOPS``) training the Qwen3.5-0.8B shape at
   40% MFU processes ``0.4 x peak / (training FLOPs per real token)`` tokens/s, with the FLOPs per token of the
   packs drawn in part 1 (``flops.batch_flops`` on ``qwen3_5_0_8b_config()``, vision tower frozen). Workers needed =
   ceil(GPU tokens/s / one worker's tokens/s).
4. **Data wait of the default run**: ``python vlm_sft/train.py --train.max_steps 200 --train.eval_every none`` in a
   subprocess (default config and worker count), then with ``--data.num_workers 0``; from ``metrics.jsonl``:
   sum(data_wait_s) / sum(window_s), and the median of the per-window ``data_wait_fraction`` (goal: < 10%).

Prints the tables and writes ``bench/results/data.json`` (with the load average at the start of each part: the
machine is shared, so absolute times drift from run to run; not with ``--quick`` unless ``--out`` is given). No figure
is asserted.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import harness  # first: the CPU environment, before torch is imported

# isort: split
import datasets
import numpy as np
from PIL import Image

from processors import load_tiny_processor
from vlm_sft.config import load_config
from vlm_sft.data import build as data_build
from vlm_sft.data.sources import rows_to_dataset
from vlm_sft.flops import PEAK_BF16_DENSE_FLOPS, batch_flops
from vlm_sft.model.presets import qwen3_5_0_8b_config
from vlm_sft.trainer.batches import DataLayout, TrainBatches, resolve_num_workers

ROOT = Path(__file__).resolve().parent.parent
RESULTS = harness.results_path("data")
WORKERS = (0, 1, 2, 4)
REAL_SIZE = {"shortest_edge": 65536, "longest_edge": 16777216}
"""Qwen3.5's own image processor limits (min / max pixels); the tiny processor's are small-image bounds."""
IMAGE_W, IMAGE_H = 1024, 768
TOKENS_PER_IMAGE = (IMAGE_W // 16) * (IMAGE_H // 16) // 4  # patch 16, merge 2 x 2: 768
OVERRIDES = [
    "--data.pack_len", "8192", "--data.seq_len", "8192", "--data.bfd_buffer", "64",
    "--model.vlm.freeze_vision", "true",
]  # fmt: skip
GPU, TARGET_MFU = "H200", 0.40
SHARDS = 4
WORDS = (
    "the", "a", "light", "shadow", "colour", "left", "right", "above", "below", "window", "tree", "road", "sky",
    "water", "wall", "person", "car", "sign", "building", "small", "large", "bright", "dark", "red", "green", "blue",
    "near", "far", "behind", "front", "corner", "centre", "texture", "edge", "surface",
)  # fmt: skip
QUESTIONS = (
    "Describe what you see in these pictures.",
    "What changes between the images?",
    "Which image is the brightest, and why?",
    "Write a short caption for each image.",
)


# ------------------------------------------------------------------------------------------------ data


def photo_like(rng: np.random.Generator) -> Image.Image:
    """Smooth colour field (a bicubic upsampling of 8x6 random colours) + a wave + pixel noise: JPEG sizes of photos."""
    small = Image.fromarray(rng.integers(0, 256, (6, 8, 3), dtype=np.uint8))
    base = np.asarray(small.resize((IMAGE_W, IMAGE_H), Image.BICUBIC), dtype=np.float32)
    ys, xs = np.mgrid[0:IMAGE_H, 0:IMAGE_W]
    fx, fy = rng.uniform(0.005, 0.03, 2)
    wave = 20 * np.sin(xs * fx + ys * fy)[..., None]
    noise = rng.normal(0, rng.uniform(4, 8), (IMAGE_H, IMAGE_W, 3))
    return Image.fromarray(np.clip(base + wave + noise, 0, 255).astype(np.uint8))


def _words(rng: np.random.Generator, n: int) -> str:
    return " ".join(rng.choice(WORDS, n)).capitalize() + "."


def make_dataset(folder: Path, n: int, seed: int) -> tuple[Path, list[dict]]:
    """``n`` conversations with 1-4 distinct JPEG images each; returns the jsonl path and its rows."""
    (folder / "images").mkdir(parents=True)
    rows = []
    for i in range(n):
        rng = np.random.default_rng([seed, i])
        content = []
        for k in range(int(rng.integers(1, 5))):
            rel = f"images/s{i:04d}-{k}.jpg"
            photo_like(rng).save(folder / rel, "JPEG", quality=90)
            content.append({"type": "image", "image": rel})
        content.append({"type": "text", "text": f"{QUESTIONS[i % len(QUESTIONS)]} {_words(rng, 12)}"})
        answer = " ".join(_words(rng, int(rng.integers(8, 20))) for _ in range(int(rng.integers(2, 8))))
        rows.append(
            {
                "messages": [
                    {"role": "user", "content": content},
                    {"role": "assistant", "content": [{"type": "text", "text": answer}]},
                ]
            }
        )
    path = folder / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path, rows


def write_shards(rows: list[dict], folder: Path) -> Path:
    """The same rows as ``SHARDS`` parquet files (image paths still relative) in ``folder/shards``."""
    out = folder / "shards"
    out.mkdir()
    for k in range(SHARDS):
        rows_to_dataset(rows[k::SHARDS]).to_parquet(str(out / f"part-{k:05d}.parquet"))
    return out


def real_size_processor():
    """The tiny offline processor with Qwen3.5's real pixel limits (the renderer calls its image processor)."""
    processor = load_tiny_processor()
    processor.image_processor.size = dict(REAL_SIZE)
    return processor


def check_image_tokens(renderer, image: Path) -> int:
    """Image tokens of one 1024x768 image through the renderer; the bench is meaningless unless it is 768."""
    messages = [
        {"role": "user", "content": [{"type": "image", "image": str(image)}, {"type": "text", "text": "Hi"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "Hello"}]},
    ]
    mm = renderer.render(messages).multi_modal_data
    t, h, w = (int(x) for x in mm.image_grid_thw[0])
    tokens = t * h * w // renderer.merge_size**2
    print(f"one {IMAGE_W}x{IMAGE_H} image: grid {t}x{h}x{w} = {t * h * w} patches = {tokens} image tokens")
    if tokens != TOKENS_PER_IMAGE:
        raise SystemExit(f"expected {TOKENS_PER_IMAGE} image tokens; the real pixel limits are not in effect")
    return tokens


# ------------------------------------------------------------------------------------------------ drawing


def draw_pass(cfg, source, processor, *, workers: int, pad_id: int, limit: int | None = None) -> dict:
    """Draw one pass (or ``limit`` batches) as training does; wall time to the first batch and to the end.

    A fresh renderer each time: its image cache would otherwise carry the last pass's images (up to 512 MB, about
    27 of these images) into this one, and forked workers would inherit it."""
    renderer = data_build.build_renderer(cfg, processor)
    shape = qwen3_5_0_8b_config()
    pipelines = dataclasses.replace(data_build.TrainPipelines(cfg, source, renderer), epochs=1)
    start = time.perf_counter()
    layout = DataLayout(streams_per_micro_batch=4)  # 1, 2 and 4 workers divide its 4 streams
    batches = TrainBatches(pipelines, layout, pad_id=pad_id, num_workers=workers, prefetch=cfg.data.prefetch_packs)
    first, real, images, flops = None, 0, 0, 0.0
    count = 0
    for batch in batches:
        if first is None:
            first = time.perf_counter() - start
        count += 1
        real += batch.num_real_tokens
        images += 0 if batch.image_grid_thw is None else len(batch.image_grid_thw)
        flops += batch_flops(batch, shape, vision_trainable=False).train
        if limit is not None and count >= limit:
            break
    total = time.perf_counter() - start
    samples = batches.accounting().packed
    del batches  # shuts the workers down before the next configuration starts its own
    gc.collect()
    return {
        "workers": workers,
        "first_batch_s": first,
        "total_s": total,
        "batches": count,
        "samples": samples,
        "images": images,
        "real_tokens": real,
        "train_flops": flops,
    }


def throughput(cfg, source, processor, pad_id: int, reps: int) -> list[dict]:
    """Every worker count once per repetition, in a rotating order; the median of each figure per count."""
    runs: dict[int, list[dict]] = {n: [] for n in WORKERS}
    for rep in range(reps):
        for n in harness.rotation(WORKERS, rep):
            run = draw_pass(cfg, source, processor, workers=n, pad_id=pad_id)
            runs[n].append(run)
            print(
                f"  rep {rep} workers {n}: {run['samples']} samples, {run['batches']} packs, first batch "
                f"{run['first_batch_s']:.1f} s, pass {run['total_s']:.1f} s",
                flush=True,
            )
    rows = []
    for n in WORKERS:
        first = runs[n][0]
        # a ratio within each repetition (against N = 1 of the same repetition), then the median
        vs_1 = harness.ratio_stats([r["total_s"] for r in runs[1]], [r["total_s"] for r in runs[n]])
        rows.append(
            {
                "workers": n,
                "samples": first["samples"],
                "packs": first["batches"],
                "images": first["images"],
                "real_tokens": first["real_tokens"],
                "train_flops": first["train_flops"],
                "first_batch_s": statistics.median(r["first_batch_s"] for r in runs[n]),
                "pass_s": statistics.median(r["total_s"] for r in runs[n]),
                "samples_per_s": statistics.median(r["samples"] / r["total_s"] for r in runs[n]),
                "tokens_per_s": statistics.median(r["real_tokens"] / r["total_s"] for r in runs[n]),
                "vs_1_worker": vs_1["median"],
                "vs_1_worker_range": [vs_1["min"], vs_1["max"]],
                "reps": [{k: r[k] for k in ("first_batch_s", "total_s", "samples")} for r in runs[n]],
            }
        )
    return rows


def image_costs(folder: Path, processor, n: int = 8) -> dict:
    """ms per image to decode a JPEG and to run the image processor on it (one thread), the two steps of a render
    that scale with pixels; the rest of a pass is copying pixel rows (renderer, collate), tokenizing and packing."""
    paths = sorted((folder / "images").iterdir())[:n]
    start = time.perf_counter()
    images = [Image.open(p).convert("RGB") for p in paths]
    decode = (time.perf_counter() - start) / n
    start = time.perf_counter()
    for img in images:
        processor.image_processor(images=[img], return_tensors=None)
    return {"decode_ms": decode * 1e3, "image_processor_ms": (time.perf_counter() - start) / n * 1e3}


def first_batch(jsonl: Path, rows: list[dict], folder: Path, pad_id: int, processor) -> list[dict]:
    """Load + first batch of a prepared (Arrow-cached jsonl) and a streamed (parquet shards) source, once each:
    both are dominated by rendering the ``bfd`` buffer's samples, which part 1 times with repetitions."""
    shards = write_shards(rows, folder)
    copy = jsonl.with_name("train-copy.jsonl")  # a new path: the Arrow cache is built again
    shutil.copyfile(jsonl, copy)
    streamed = ["--data.source", str(shards), "--data.streaming", "true", "--data.image_root", str(folder)]
    workers = resolve_num_workers(None)
    out = []
    for mode, extra in (("prepared", ["--data.source", str(copy)]), ("streaming", streamed)):
        cfg = load_config(None, [*OVERRIDES, *extra])
        start = time.perf_counter()
        source = data_build.load_sources(cfg).train
        loaded = time.perf_counter() - start
        run = draw_pass(cfg, source, processor, workers=workers, pad_id=pad_id, limit=1)
        out.append({"mode": mode, "workers": workers, "load_s": loaded, "first_batch_s": loaded + run["first_batch_s"]})
        print(f"  {mode}: load {loaded:.2f} s, first batch at {out[-1]['first_batch_s']:.1f} s", flush=True)
    return out


# ------------------------------------------------------------------------------------------------ GPU and trainer


def gpu_demand(rows: list[dict]) -> dict:
    """Tokens/s one H200 consumes at ``TARGET_MFU`` on the packs drawn, and the workers that takes."""
    peak = dict(PEAK_BF16_DENSE_FLOPS)[GPU]
    ref = next(r for r in rows if r["workers"] == 0)
    flops_per_token = ref["train_flops"] / ref["real_tokens"]
    gpu_tokens_per_s = TARGET_MFU * peak / flops_per_token
    one = next(r for r in rows if r["workers"] == 1)["tokens_per_s"]
    per_worker_at_2 = one * next(r for r in rows if r["workers"] == 2)["vs_1_worker"] / 2
    return {
        "gpu": GPU,
        "peak_bf16_flops": peak,
        "mfu": TARGET_MFU,
        "train_flops_per_real_token": flops_per_token,
        "gpu_tokens_per_s": gpu_tokens_per_s,
        "worker_tokens_per_s": one,
        "workers_needed": math.ceil(gpu_tokens_per_s / one),
        "worker_tokens_per_s_at_2": per_worker_at_2,
        "workers_needed_at_2_worker_efficiency": math.ceil(gpu_tokens_per_s / per_worker_at_2),
    }


def default_run(steps: int, workers: int | None, timeout: float) -> dict:
    """The default config through ``vlm_sft/train.py`` in a subprocess; its data-wait share from metrics.jsonl."""
    with tempfile.TemporaryDirectory(prefix="bench_data_run_") as out:
        cmd = [sys.executable, "vlm_sft/train.py", "--train.max_steps", str(steps), "--train.eval_every", "none"]
        cmd += ["--train.output_dir", out] + ([] if workers is None else ["--data.num_workers", str(workers)])
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
        start = time.perf_counter()
        try:  # a run past the time limit still reports the windows it logged
            proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            proc = None
        wall = time.perf_counter() - start
        if proc is not None and proc.returncode != 0:
            raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
        metrics = Path(out) / "metrics.jsonl"
        records = [json.loads(line) for line in metrics.read_text().splitlines() if line] if metrics.exists() else []
    steps_logged = [r for r in records if "data_wait_s" in r]
    if not steps_logged:
        raise SystemExit(f"{' '.join(cmd)} logged no step within {timeout:.0f} s")
    wait = sum(r["data_wait_s"] for r in steps_logged)
    window = sum(r["window_s"] for r in steps_logged)
    return {
        "workers": resolve_num_workers(None) if workers is None else workers,
        "workers_setting": "default" if workers is None else workers,
        "steps": steps_logged[-1]["step"],
        "timed_out": proc is None,
        "wall_s": wall,
        "windows": len(steps_logged),
        "data_wait_s": wait,
        "window_s": window,
        "data_wait_share": wait / window,
        "median_window_fraction": statistics.median(r["data_wait_fraction"] for r in steps_logged),
        "max_window_fraction": max(r["data_wait_fraction"] for r in steps_logged),
        "median_step_s": statistics.median(r["step_time_s"] for r in steps_logged),
        "ms_per_step": window / steps_logged[-1]["step"] * 1e3,
        "busy_ms_per_step": (window - wait) / steps_logged[-1]["step"] * 1e3,
        "window_fractions": [round(r["data_wait_fraction"], 4) for r in steps_logged],
    }


# ------------------------------------------------------------------------------------------------ report


def print_tables(res: dict) -> None:
    data, rows, firsts, gpu, runs = (
        res["data"],
        res["render_pack"],
        res["first_batch"],
        res["gpu_demand"],
        res["default_run"],
    )
    cores = res["machine"]["cores"]
    print(
        f"\nRender + pack: {data['samples']} samples, {data['images']} JPEG images of {IMAGE_W}x{IMAGE_H} "
        f"({TOKENS_PER_IMAGE} tokens each), 8192-token bfd packs, {cores} cores, median of {res['reps']}"
    )
    columns = [("workers", "workers"), ("packs", "packs"), ("first_batch_s", "first s", ".1f")]
    columns += [("pass_s", "pass s", ".1f"), ("samples_per_s", "samples/s", ".2f")]
    columns += [("tokens_per_s", "real tok/s", ".0f"), ("vs_1_worker", "vs 1", ".2f")]
    harness.print_table(None, columns, rows)
    one = next(r for r in rows if r["workers"] == 1)
    per_image = one["pass_s"] / one["images"] * 1e3
    costs = res["image_costs"]
    print(
        f"one worker: {per_image:.0f} ms per image in a pass; of it JPEG decode {costs['decode_ms']:.0f} ms, "
        f"image processor {costs['image_processor_ms']:.0f} ms"
    )
    title = f"\nFirst batch, {firsts[0]['workers']} worker(s) (the default here)"
    columns = [("mode", "source"), ("load_s", "load s", ".2f"), ("first_batch_s", "first batch s", ".1f")]
    harness.print_table(title, columns, firsts)
    print(
        f"\nOne {gpu['gpu']} at {gpu['mfu']:.0%} MFU on Qwen3.5-0.8B (frozen vision tower): "
        f"{gpu['train_flops_per_real_token'] / 1e9:.2f} GFLOP per real token -> {gpu['gpu_tokens_per_s']:,.0f} tokens/s"
    )
    scaling = ", ".join(f"{r['workers']} workers x{r['vs_1_worker']:.2f}" for r in rows if r["workers"] > 1)
    print(
        f"workers needed per {gpu['gpu']} = ceil({gpu['gpu_tokens_per_s']:,.0f} / {gpu['worker_tokens_per_s']:,.0f}) "
        f"= {gpu['workers_needed']} (one core each; {gpu['workers_needed_at_2_worker_efficiency']} at the "
        f"2-worker efficiency here); scaling here: {scaling}: a {cores}-core machine cannot scale past 2 processes"
    )
    columns = [("name", "workers"), ("steps", "steps"), ("wall_s", "wall s", ".1f"), ("ms_per_step", "ms/step", ".0f")]
    columns += [("busy_ms_per_step", "busy ms", ".0f"), ("data_wait_share", "wait share", ".1%")]
    columns += [("median_window_fraction", "median win", ".1%"), ("max_window_fraction", "max win", ".1%")]
    shown = [
        r | {"name": f"{r['workers']} (default)" if r["workers_setting"] == "default" else str(r["workers"])}
        for r in runs
    ]
    harness.print_table("\nDefault run (configs/debug.toml), time waiting for data; goal < 10%", columns, shown)
    print("ms/step: sum(window_s) / steps; busy ms: the same without the data wait; win: per-window data_wait_fraction")


def measure_data(samples: int, reps: int, seed: int) -> dict:
    """Parts 1 and 2 on a generated dataset in a temporary folder (removed at the end, with its Arrow cache)."""
    with tempfile.TemporaryDirectory(prefix="bench_data_") as tmp:
        folder = Path(tmp) / "data"
        datasets.config.HF_DATASETS_CACHE = Path(tmp) / "hf_datasets"  # a fresh Arrow cache, not ~/.cache
        start = time.perf_counter()
        jsonl, rows = make_dataset(folder, samples, seed)
        sizes = [p.stat().st_size for p in (folder / "images").iterdir()]
        print(
            f"wrote {samples} conversations, {len(sizes)} JPEG images ({min(sizes) // 1024}-{max(sizes) // 1024} KB, "
            f"median {statistics.median(sizes) / 1024:.0f} KB) in {time.perf_counter() - start:.0f} s"
        )
        processor = real_size_processor()
        cfg = load_config(None, [*OVERRIDES, "--data.source", str(jsonl)])
        tokens = check_image_tokens(data_build.build_renderer(cfg, processor), folder / "images" / "s0000-0.jpg")
        pad_id = int(processor.tokenizer.pad_token_id)
        loads = {"render_pack": os.getloadavg()}
        print(f"1. render + pack (load average {loads['render_pack'][0]:.1f})", flush=True)
        render_pack = throughput(cfg, data_build.load_sources(cfg).train, processor, pad_id, reps)
        costs = image_costs(folder, processor)
        loads["first_batch"] = os.getloadavg()
        print(f"2. first batch (load average {loads['first_batch'][0]:.1f})", flush=True)
        firsts = first_batch(jsonl, rows, folder, pad_id, processor)
    kb = sorted(s / 1024 for s in sizes)
    return {
        "data": {
            "samples": samples,
            "images": len(sizes),
            "image_size": [IMAGE_W, IMAGE_H],
            "jpeg_kb": {"min": kb[0], "median": statistics.median(kb), "max": kb[-1]},
            "tokens_per_image": tokens,
            "image_processor_size": REAL_SIZE,
            "overrides": OVERRIDES,
        },
        "render_pack": render_pack,
        "image_costs": costs,
        "first_batch": firsts,
        "load_average": loads,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="24 samples, one repetition, 60 training steps")
    ap.add_argument("--samples", type=int, default=None, help="conversations generated (default 96; quick 24)")
    ap.add_argument("--reps", type=int, default=None, help="repetitions of part 1 (default 2; quick 1)")
    ap.add_argument("--steps", type=int, default=None, help="training steps of part 4 (default 200; quick 60)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, help=f"JSON path (default {RESULTS.name} in bench/results; --quick: none)")
    args = ap.parse_args()
    samples = args.samples or (24 if args.quick else 96)
    reps = args.reps or (1 if args.quick else 2)
    steps = args.steps or (60 if args.quick else 200)
    harness.set_threads(1)  # workers: 1 thread each (TrainBatches); the main process alike for workers = 0
    datasets.disable_progress_bars()
    warnings.filterwarnings("ignore", message="This DataLoader will create")  # 4 workers on 2 cores, on purpose
    machine = harness.machine_facts()
    res = {
        "machine": machine | {"cores": machine["cpus_usable"], "datasets": datasets.__version__},
        "quick": args.quick,
        "seed": args.seed,
        "reps": reps,
        **measure_data(samples, reps, args.seed),
    }
    res["gpu_demand"] = gpu_demand(res["render_pack"])
    res["load_average"]["default_run"] = os.getloadavg()
    print(f"4. default training run, {steps} steps (load average {os.getloadavg()[0]:.1f})", flush=True)
    res["default_run"] = [default_run(steps, None, timeout=600), default_run(steps, 0, timeout=600)]
    res["load_average"]["end"] = os.getloadavg()
    print_tables(res)
    if not args.quick or args.out:
        harness.write_results("data", res, path=args.out)


if __name__ == "__main__":
    main()
