"""Rendering throughput: our renderer vs calling the HF processor's ``apply_chat_template`` per sample.

Run: ``python bench/bench_render.py`` (``--quick``: 60 conversations, 2 reps, nothing written). Prints a table and
writes ``bench/results/render.json``.

Data: shapes-like conversations (coloured shapes on noisy backgrounds, 64x64 and 96x96 PNG files; ~10% with two
images, ~10% text-only, some with a system prompt), from ``vlm_sft.data.shapes``. Two scenarios:
- ``no-repeat``: every image is a distinct file, so the image cache never hits (the honest floor);
- ``repeat``: the same conversations with their images drawn from a pool of 32 files (an epoch over a small pool).

Contenders, interleaved in blocks of 10 conversations (rotating order; this machine is shared, so load from other
processes drifts), median over reps of samples/s reported; ``ours / this`` is a ratio within each rep, then the median
(min-max):
- ``ours``: ``Qwen3_5Renderer.render`` (a fresh renderer each rep, so its cache starts empty each pass), which yields token
  ids, loss mask, modality types and images;
- ``hf``: ``processor.apply_chat_template(..., tokenize=True, return_dict=True, return_tensors="pt")``;
- ``hf+mask``: the same with ``return_assistant_tokens_mask=True``, the HF call that yields what ours yields.
``ip share`` is the share of each contender's time spent inside the image processor's ``__call__``.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import harness  # first: the CPU environment, before torch is imported

# isort: split
import torch

from processors import load_tiny_processor
from renderers import get_renderer
from vlm_sft.data.shapes import make_sample

RESULTS = harness.results_path("render")
POOL = 32


class TimedImageProcessor:
    """Delegates to an image processor and adds up the seconds spent in its ``__call__``."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.seconds = 0.0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return self.inner(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - t0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def make_conversations(root: Path, n: int) -> tuple[list[list[dict]], list[list[dict]]]:
    """(no-repeat, repeat) conversations with image paths under ``root``."""
    distinct: list[list[dict]] = []
    all_paths: list[str] = []
    for i in range(n):
        sample = make_sample(0, "bench", i, image_size=64 if i % 2 == 0 else 96)
        for rel, img in sample.images.items():
            path = root / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            img.save(path)
        messages = copy.deepcopy(sample.messages)
        for m in messages:
            for block in m["content"]:
                if block["type"] == "image":
                    block["image"] = str(root / block["image"])
                    all_paths.append(block["image"])
        distinct.append(messages)
    pool = all_paths[:POOL]
    repeated = copy.deepcopy(distinct)
    k = 0
    for messages in repeated:
        for m in messages:
            for block in m["content"]:
                if block["type"] == "image":
                    block["image"] = pool[k % len(pool)]
                    k += 1
    return distinct, repeated


class Contender:
    """One way of rendering, timed block by block; ``start_rep`` resets per-pass state (our cache)."""

    def __init__(self, name: str, processor: Any) -> None:
        self.name = name
        self.processor = processor
        self.renderer = None
        self.seconds = 0.0
        self.timed: TimedImageProcessor | None = None

    def start_rep(self) -> None:
        self.seconds = 0.0
        if self.name == "ours":
            self.renderer = get_renderer(self.processor)
            self.timed = TimedImageProcessor(self.renderer.images.image_processor)
            self.renderer.images.image_processor = self.timed
        else:
            self.timed = TimedImageProcessor(self.processor.image_processor)

    def run(self, block: list[list[dict]]) -> None:
        if self.name == "ours":
            t0 = time.perf_counter()
            for messages in block:
                self.renderer.render(messages)
            self.seconds += time.perf_counter() - t0
            return
        original, self.processor.image_processor = self.processor.image_processor, self.timed
        try:
            t0 = time.perf_counter()
            for messages in block:
                self.processor.apply_chat_template(
                    messages,
                    tokenize=True,
                    return_dict=True,
                    return_tensors="pt",
                    return_assistant_tokens_mask=self.name == "hf+mask",
                )
            self.seconds += time.perf_counter() - t0
        finally:
            self.processor.image_processor = original


def check_same_output(processor: Any, conversations: list[list[dict]]) -> None:
    """The contenders must compute the same thing, or the timing means nothing."""
    renderer = get_renderer(processor)
    for messages in conversations[:20]:
        ours = renderer.render(messages)
        ref = processor.apply_chat_template(messages, tokenize=True, return_dict=True, return_tensors="pt")
        assert torch.equal(ours.token_ids, ref["input_ids"][0]), "token ids differ"
        if ours.multi_modal_data is not None:
            assert torch.equal(ours.multi_modal_data.pixel_values, ref["pixel_values"]), "pixels differ"


def bench(processor: Any, conversations: list[list[dict]], reps: int, block: int) -> dict[str, dict[str, float]]:
    """Each rep is one pass over all conversations per contender, interleaved in blocks of ``block``
    conversations (rotating order), so load from other processes on this shared machine hits all alike."""
    contenders = [Contender(name, processor) for name in ("ours", "hf", "hf+mask")]
    seconds: dict[str, list[float]] = {c.name: [] for c in contenders}
    shares: dict[str, list[float]] = {c.name: [] for c in contenders}
    blocks = [conversations[i : i + block] for i in range(0, len(conversations), block)]
    by_name = {c.name: c for c in contenders}
    for rep in range(reps + 1):  # rep 0 warms up: imports, template compilation, allocator
        for c in contenders:
            c.start_rep()
        for k, chunk in enumerate(blocks):
            for name in harness.rotation(list(by_name), rep + k):
                by_name[name].run(chunk)
        if rep == 0:
            continue
        for c in contenders:
            seconds[c.name].append(c.seconds)
            shares[c.name].append(c.timed.seconds / c.seconds)
    n = len(conversations)
    return {
        name: {
            "samples_per_s": n / statistics.median(seconds[name]),
            "ms_per_sample": 1e3 * statistics.median(seconds[name]) / n,
            "image_processor_share": statistics.median(shares[name]),
            "ours_over_this_stats": harness.ratio_stats(seconds[name], seconds["ours"]),  # ours' speed / this one's
        }
        for name in seconds
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=300)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--block", type=int, default=10, help="conversations per interleaved block")
    parser.add_argument("--quick", action="store_true", help="a smoke run: 60 conversations, 2 reps, no JSON")
    parser.add_argument("--out", type=Path, help=f"JSON path (default {RESULTS.name} in bench/results)")
    args = parser.parse_args()
    if args.quick:
        args.samples, args.reps = 60, 2
    processor = load_tiny_processor()
    with tempfile.TemporaryDirectory() as tmp:
        distinct, repeated = make_conversations(Path(tmp), args.samples)
        check_same_output(processor, distinct)
        n_images = sum(1 for c in distinct for m in c for b in m["content"] if b["type"] == "image")
        results = {
            "no-repeat": bench(processor, distinct, args.reps, args.block),
            "repeat": bench(processor, repeated, args.reps, args.block),
        }
    rows = [
        {"scenario": scenario, "contender": name, **r, "ours_over_this": r["ours_over_this_stats"]["median"]}
        for scenario, by_name in results.items()
        for name, r in by_name.items()
    ]
    columns = [("scenario", "scenario"), ("contender", "contender"), ("samples_per_s", "samples/s", ".0f")]
    columns += [("ms_per_sample", "ms/sample", ".2f"), ("image_processor_share", "ip share", ".0%")]
    title = f"{args.samples} conversations, {n_images} images, {args.reps} interleaved reps, median"
    shown = [r | {"ratio": harness.fmt_range(r["ours_over_this_stats"])} for r in rows]
    harness.print_table(title, [*columns, ("ratio", "ours / this")], shown)
    meta = {
        "samples": args.samples,
        "images": n_images,
        "reps": args.reps,
        "block": args.block,
        "image_pool_repeat": POOL,
        "torch_threads": torch.get_num_threads(),
    }
    if not args.quick or args.out:
        harness.write_results("render", {"meta": meta, "rows": rows}, path=args.out)


if __name__ == "__main__":
    main()
