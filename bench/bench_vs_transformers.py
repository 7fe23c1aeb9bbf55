"""Ours (packed) vs what a user would pick instead: transformers' own Qwen3.5 with padded batches.

    python bench/bench_vs_transformers.py [--reps 5] [--threads 2] [--mode steps,packer] [--pack-len 4096] [--quick]
                                          [--device cpu|cuda]

The question a user asks: how much faster is fine-tuning with vlm-sft than with transformers'
``Qwen3_5ForConditionalGeneration`` and padded batches (what TRL gives a VLM user), random or length-grouped?

Every contender trains the same model from the same weights (ours built from ``configs/debug.toml``, transformers'
model loading our state dict: the parameter names are the same), on the same samples, with the same samples in every
optimizer step, the same loss (sum of token losses / trainable tokens of the step), the same AdamW groups
(``build_optimizer``), clipping at 1.0. Contenders:

- ``ours packed``: each step's samples back to back in one row (``seq_lens`` boundaries, no padding);
- ``hf padded``: transformers on the same step's samples as a right-padded batch (random batches);
- ``ours padded``: our model on that same padded batch (what packing buys with our model on both sides);
- ``hf grouped``: transformers with length-grouped batches (``group_by_length``: megabatches of 50 batches of a
  random order, each sorted by length, then cut into batches), the strongest padded baseline.

Two modes (``--mode``, both with ``steps,packer``):

- ``steps`` (the default): ``ours packed`` trains each random step's samples back to back in one row of exactly their
  tokens, so every contender sees the same samples in every step;
- ``packer``: ``ours packed`` trains the rows the trainer itself trains on: the real ``PackingPipeline`` with ``bfd``
  at ``--pack-len`` (default: the debug config's 1280 for shapes, 4096 for the long tail), one row per step, rows
  padded to the pack length. The padded contenders get the same samples (as truncated and shifted by the packer) in
  batches of B = the rows' average sample count, in a random order (``hf padded``, ``ours padded``) or length-grouped
  (``hf grouped``). The steps differ, the samples do not: every contender trains on the same tokens.

Before timing, the first step's loss is checked equal across ``ours packed``, ``hf padded`` and ``ours padded``
(relative 1e-5 in float32; in ``packer`` mode ``ours packed``'s first row against transformers on that row's samples
as a padded batch): the contenders compute the same thing. Each repetition trains every contender over all its
steps from the initial weights, interleaved slice by slice with the order rotating; a ratio is taken within each
repetition, then the median and the range over repetitions. Workloads: the default run's ``shapes`` data (32 samples
per step) and ``long_tail`` (``SyntheticSource``, truncated to 2048 tokens, 0-4 images, 8 samples per step). The ideal
gain is the padded batches' token slots / real tokens (all padding removed at no cost). CPU runs set
``OMP_WAIT_POLICY=PASSIVE`` before torch is imported (busy-waiting OpenMP threads made 2-thread steps 10-40x slower
under load) and ``--threads`` threads, 1 by default: the trainer's own choice on a 2-core machine
(``vlm_sft/cpu_threads.py``), and under PASSIVE every contender ran the short-row shapes steps faster on 1 thread than
on 2 (each parallel region wakes a sleeping thread; on the long tail 2 threads were 4-32% faster); ``--threads 2`` is
measured too (``bench/README.md``).
"""

from __future__ import annotations

import harness  # sets OMP_WAIT_POLICY before torch is imported

# isort: split

import argparse
import importlib.util
import random
import statistics
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import Qwen3_5ForConditionalGeneration

from vlm_sft.checkpoint import build
from vlm_sft.config import load_config
from vlm_sft.data import build as data_build
from vlm_sft.data.batch import PackedBatch
from vlm_sft.data.collate import collate
from vlm_sft.data.pack import Pack
from vlm_sft.data.pipeline import PackingPipeline
from vlm_sft.data.shift import ShiftedSample, shift_sample
from vlm_sft.data.sources import render_fn
from vlm_sft.data.synthetic import SyntheticSource
from vlm_sft.data.truncate import truncate_sample
from vlm_sft.model import build_model, tiny_qwen3_5_config, varlen
from vlm_sft.model.presets import qwen3_5_0_8b_config
from vlm_sft.trainer.optim import build_optimizer

RESULTS_NAME = "vs_transformers"
CONTENDERS = ("ours packed", "hf padded", "ours padded", "hf grouped")
GROUP_MEGABATCH = 50
"""transformers' ``LengthGroupedSampler`` sorts megabatches of 50 batches by length."""
LOSS_PARITY = {"cpu": 1e-5, "cuda": 2e-2}
"""Relative bound on the first-step losses: float32 on the CPU; bf16 autocast and other kernels on CUDA."""


@dataclass
class Workload:
    name: str
    samples: list[ShiftedSample]
    per_step: int
    """Samples per optimizer step of the padded contenders (and of ``ours packed`` in ``steps`` mode)."""
    packs: list[Pack] | None = None
    """``packer`` mode: the ``bfd`` packer's rows, one per step of ``ours packed`` (``samples`` are theirs, in row
    order); None in ``steps`` mode."""

    @property
    def mode(self) -> str:
        return "steps" if self.packs is None else "packer"


def shapes_rendered(cfg, n: int) -> list:
    """``n`` shapes samples through the real renderer (``RenderedSample``, before truncation and shift)."""
    cfg = cfg.model_copy(deep=True)
    cfg.data.shapes.root = str(Path(tempfile.gettempdir()) / "vlm-sft-bench-shapes")
    cfg.data.shapes.num_train, cfg.data.shapes.num_eval = n, 0
    renderer = data_build.build_renderer(cfg, data_build.build_processor(cfg))
    fn = render_fn(data_build.load_sources(cfg).train, renderer)
    return [fn(i) for i in range(n)]


def shapes_samples(cfg, n: int) -> list[ShiftedSample]:
    return [shift_sample(truncate_sample(s, cfg.data.seq_len)) for s in shapes_rendered(cfg, n)]


LONG_TAIL_SEQ_LEN = 2048
"""Long-tail samples are truncated to this many tokens, so padded batches fit."""


def long_tail_rendered(n: int) -> list:
    source = SyntheticSource(n, distribution="long_tail", seed=0)
    return [source(i) for i in range(n)]


def long_tail_samples(n: int, seq_len: int = LONG_TAIL_SEQ_LEN) -> list[ShiftedSample]:
    return [shift_sample(truncate_sample(s, seq_len, policy="truncate")) for s in long_tail_rendered(n)]


def packer_workload(name: str, rendered: list, *, seq_len: int, pack_len: int, truncation: str) -> Workload:
    """The trainer's own rows: ``PackingPipeline`` with ``bfd`` (default buffer, shuffled with seed 0, one epoch) at
    ``pack_len``; the padded contenders get the packed samples in batches of the rows' average sample count."""
    pipeline = PackingPipeline(
        len(rendered),
        rendered.__getitem__,
        seq_len=seq_len,
        pack_len=pack_len,
        packing="bfd",
        truncation=truncation,
        shuffle=True,
        seed=0,
        epochs=1,
    )
    packs = list(pipeline)
    samples = [s for p in packs for s in p.samples]
    per_step = max(1, round(len(samples) / len(packs)))
    return Workload(f"{name} bfd {pack_len}", samples, per_step, packs)


def random_steps(n: int, per_step: int, seed: int = 0) -> list[list[int]]:
    order = list(range(n))
    random.Random(seed).shuffle(order)
    return [order[i : i + per_step] for i in range(0, n, per_step)]


def grouped_steps(samples: list[ShiftedSample], per_step: int, seed: int = 0) -> list[list[int]]:
    """``group_by_length``: a random order cut into megabatches, each sorted by length (longest first), then cut into
    batches (transformers' ``LengthGroupedSampler``)."""
    order = [i for step in random_steps(len(samples), per_step, seed) for i in step]
    mega = GROUP_MEGABATCH * per_step
    out = []
    for m in range(0, len(order), mega):
        chunk = sorted(order[m : m + mega], key=lambda i: -len(samples[i]))
        out += [chunk[i : i + per_step] for i in range(0, len(chunk), per_step)]
    return out


def packed_batch(samples: list[ShiftedSample]) -> PackedBatch:
    """The step's samples back to back in one row of exactly their tokens."""
    return collate([Pack(rows=(tuple(samples),), row_len=sum(len(s) for s in samples))])


def padded_batch(samples: list[ShiftedSample], multiple: int = 8) -> PackedBatch:
    """One sample per row, right-padded to the longest rounded up to ``multiple`` (a padding collator's layout)."""
    longest = max(len(s) for s in samples)
    return collate([Pack(rows=tuple((s,) for s in samples), row_len=-(-longest // multiple) * multiple, stacked=True)])


class Ours:
    """Our model trained as the trainer does: loss sum / trainable tokens, backward, clip, AdamW."""

    def __init__(self, model: torch.nn.Module, cfg) -> None:
        self.model, self.cfg = model, cfg

    def loss(self, batch: PackedBatch) -> torch.Tensor:
        out = self.model(**batch.model_kwargs())
        return out.loss_sum / max(batch.num_trainable_tokens, 1)


class Theirs:
    """transformers' model on a padded batch: its logits, the same summed cross-entropy / trainable tokens."""

    def __init__(self, model: torch.nn.Module, cfg) -> None:
        self.model, self.cfg = model, cfg

    def loss(self, batch: PackedBatch) -> torch.Tensor:
        kwargs = {"input_ids": batch.input_ids, "attention_mask": batch.attention_mask.long()}
        kwargs["mm_token_type_ids"] = batch.mm_token_type_ids
        if batch.pixel_values is not None:
            kwargs.update(pixel_values=batch.pixel_values, image_grid_thw=batch.image_grid_thw)
        logits = self.model(**kwargs).logits
        mask = batch.loss_mask
        loss = torch.nn.functional.cross_entropy(logits[mask].float(), batch.target_ids[mask], reduction="sum")
        return loss / max(batch.num_trainable_tokens, 1)


class Trainee:
    """One contender: its model (ours or theirs), its optimizer, its batches."""

    def __init__(self, runner, batches: list[PackedBatch], init_state: dict) -> None:
        self.runner, self.batches, self.init_state = runner, batches, init_state
        self.reset()

    def reset(self) -> None:
        self.runner.model.load_state_dict(self.init_state)
        self.runner.model.train()
        self.optimizer = build_optimizer(self.runner.model, self.runner.cfg.train)

    def train(self, batches: list[PackedBatch], device: torch.device) -> tuple[float, float]:
        """Wall and CPU seconds (all threads) of these steps (forward, backward, clip, AdamW), synchronised on CUDA.

        The CPU time is the figure to read on a shared machine: other jobs stretch the wall time of whichever
        contender they overlap, hardly its CPU time (OpenMP threads sleep while they wait: ``OMP_WAIT_POLICY``)."""
        varlen.clear_layout_caches()  # a packed row pays its layout once, as in training
        _sync(device)
        params = [p for p in self.runner.model.parameters() if p.requires_grad]
        with harness.Timer() as timer:
            for batch in batches:
                with autocast(device):
                    loss = self.runner.loss(batch.to(device))
                loss.backward()
                torch.nn.utils.clip_grad_norm_([p for p in params if p.grad is not None], 1.0)
                self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=True)
            _sync(device)
        return timer.seconds, timer.cpu_seconds


def autocast(device: torch.device) -> torch.autocast:
    """bf16 autocast on CUDA over fp32 master weights (one GPU, no FSDP: the trainer gets bf16 compute from FSDP2's
    mixed precision instead); off on the CPU (float32)."""
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def model_pair(cfg, args, device: torch.device) -> tuple[torch.nn.Module, Callable[[], torch.nn.Module]]:
    """Our model (random init, the run's seed) and a maker of more models of its config on ``device``: the default
    run's tiny model, or the real 0.8B shape (``presets.qwen3_5_0_8b_config``, ``--layers`` of its 24, vision trainable,
    the tiny tokenizer's special-token ids) for a GPU. Weights stay float32 (bf16 autocast on CUDA, as the trainer)."""
    torch.manual_seed(cfg.train.seed)
    if args.model == "tiny":
        return build.build_model(cfg, device), lambda: build.build_model(cfg, device)
    config = qwen3_5_0_8b_config()
    tiny = tiny_qwen3_5_config()  # the data comes from the tiny tokenizer: its special-token ids
    for key in ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id"):
        setattr(config, key, getattr(tiny, key))
    config.text_config.num_hidden_layers = args.layers
    config.text_config.layer_types = config.text_config.layer_types[: args.layers]

    def make() -> torch.nn.Module:
        return build_model(config, device=device, freeze_vision=False)

    return make(), make


def build_trainees(cfg, args, w: Workload, device: torch.device) -> dict[str, Trainee]:
    ours_model, make_ours = model_pair(cfg, args, device)
    init = {k: v.detach().clone() for k, v in ours_model.state_dict().items()}
    # On CUDA transformers picks flash-linear-attention and causal-conv1d itself when installed; attention: its best.
    best_attention = "flash_attention_2" if importlib.util.find_spec("flash_attn") else "sdpa"
    theirs_kwargs = {"attn_implementation": best_attention} if device.type == "cuda" else {}
    random_ids = random_steps(len(w.samples), w.per_step)
    grouped_ids = grouped_steps(w.samples, w.per_step)
    pick = [[w.samples[i] for i in ids] for ids in random_ids]
    padded = [padded_batch(s) for s in pick]  # both models train on the very same padded batches
    batches = {
        "ours packed": [packed_batch(s) for s in pick] if w.packs is None else [collate([p]) for p in w.packs],
        "hf padded": padded,
        "ours padded": padded,
        "hf grouped": [padded_batch([w.samples[i] for i in ids]) for ids in grouped_ids],
    }
    out = {}
    for name in CONTENDERS:
        if name.startswith("ours"):
            runner = Ours(ours_model if name == "ours packed" else make_ours(), cfg)
        else:
            model = Qwen3_5ForConditionalGeneration(ours_model.config, **theirs_kwargs).to(device)
            runner = Theirs(model, cfg)
        out[name] = Trainee(runner, batches[name], init)
    return out


def check_parity(trainees: dict[str, Trainee], w: Workload, device: torch.device) -> dict[str, float]:
    """The first step's loss of every random-batch contender (same samples), before any update; in ``packer`` mode
    ``ours packed``'s first row holds other samples, so it is held against transformers on that row's samples."""
    checks = {"ours packed": "hf padded", "ours padded": "hf padded"}
    inputs = {name: (trainees[name], trainees[name].batches[0]) for name in ("ours packed", "hf padded", "ours padded")}
    if w.packs is not None:
        inputs["hf on row 0"] = (trainees["hf padded"], padded_batch(list(w.packs[0].samples)))
        checks["ours packed"] = "hf on row 0"
    losses = {}
    with torch.no_grad():
        for name, (trainee, batch) in inputs.items():
            with autocast(device):
                losses[name] = float(trainee.runner.loss(batch.to(device)))
    worst = max(abs(losses[a] - losses[b]) / abs(losses[b]) for a, b in checks.items())
    bound = LOSS_PARITY[device.type]
    if worst > bound:
        raise RuntimeError(f"first-step losses differ by {worst:.2e} relative (> {bound}): {losses}")
    return losses


def time_workload(trainees: dict[str, Trainee], reps: int, n_slices: int, device: torch.device) -> dict[str, dict]:
    """Per contender, the wall and CPU seconds of each repetition (all its steps), interleaved slice by slice."""
    for t in trainees.values():  # warm-up: first-call costs hit no timed pass
        t.train(t.batches[:1], device)
    seconds: dict[str, dict[str, list[float]]] = {name: {"wall": [], "cpu": []} for name in trainees}
    names = list(trainees)
    for rep in range(reps):
        for t in trainees.values():
            t.reset()
        parts = {name: harness.slices(t.batches, n_slices) for name, t in trainees.items()}
        total = {name: [0.0, 0.0] for name in names}
        for k in range(n_slices):
            for name in harness.rotation(names, rep + k):
                if parts[name][k]:
                    wall, cpu = trainees[name].train(parts[name][k], device)
                    total[name][0] += wall
                    total[name][1] += cpu
        for name in names:
            seconds[name]["wall"].append(total[name][0])
            seconds[name]["cpu"].append(total[name][1])
        line = "  ".join(f"{n} {w:.2f} s ({c:.2f} cpu)" for n, (w, c) in total.items())
        print(f"  rep {rep + 1}/{reps}: {line}", flush=True)
    return seconds


def summarize(w: Workload, trainees: dict[str, Trainee], seconds: dict[str, dict[str, list[float]]]) -> dict:
    trainable = sum(b.num_trainable_tokens for b in trainees["ours packed"].batches)
    padded = trainees["hf padded"].batches
    ideal = sum(b.input_ids.numel() for b in padded) / sum(b.num_real_tokens for b in padded)
    grouped = trainees["hf grouped"].batches
    ideal_grouped = sum(b.input_ids.numel() for b in grouped) / sum(b.num_real_tokens for b in grouped)
    ours = seconds["ours packed"]
    ratios = {name: harness.ratio_stats(seconds[name]["wall"], ours["wall"]) for name in CONTENDERS[1:]}
    cpu_ratios = {name: harness.ratio_stats(seconds[name]["cpu"], ours["cpu"]) for name in CONTENDERS[1:]}
    ours_batches = trainees["ours packed"].batches
    ours_padding = 1 - sum(b.num_real_tokens for b in ours_batches) / sum(b.input_ids.numel() for b in ours_batches)
    return {
        "workload": w.name,
        "mode": w.mode,
        "samples": len(w.samples),
        "samples_per_step": w.per_step,
        "steps": len(padded),
        "ours_packed_steps": len(ours_batches),
        "ours_packed_padding_fraction": ours_padding,
        "trainable_tokens": trainable,
        "ideal_gain_random": ideal,
        "ideal_gain_grouped": ideal_grouped,
        "trainable_tok_s": {n: trainable / statistics.median(s["wall"]) for n, s in seconds.items()},
        "ours_packed_over": ratios,
        "ours_packed_over_cpu_time": cpu_ratios,
        "of_ideal_vs_hf_padded": ratios["hf padded"]["median"] / ideal,
        "seconds": seconds,
    }


def table_rows(rows: list[dict]) -> list[dict]:
    """One line per (workload, contender): its tokens/s, ours / it (median, range), the ideal gain and its share."""
    out = []
    for r in rows:
        tok = r["trainable_tok_s"]
        out.append({"workload": r["workload"], "contender": "ours packed", "tok_s": tok["ours packed"]})
        for name, q in r["ours_packed_over"].items():
            ideal = r["ideal_gain_grouped"] if name == "hf grouped" else r["ideal_gain_random"]
            line = {"workload": "", "contender": name, "tok_s": tok[name], "ratio": harness.fmt_range(q)}
            line["cpu_ratio"] = r["ours_packed_over_cpu_time"][name]["median"]
            if name != "ours padded":
                line |= {"ideal": ideal, "of_ideal": q["median"] / ideal}
            out.append(line)
    return out


COLUMNS = [
    ("workload", "workload"),
    ("contender", "contender"),
    ("tok_s", "trainable tok/s", ".0f"),
    ("ratio", "ours packed / this (range)"),
    ("cpu_ratio", "by CPU time", ".2f"),
    ("ideal", "ideal gain", ".2f"),
    ("of_ideal", "of ideal", ".2f"),
]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[1])
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--threads", type=int, default=1, help="CPU threads (default 1: the module docstring says why)")
    p.add_argument("--slices", type=int, default=3, help="interleaving slices per repetition")
    p.add_argument("--shapes-samples", type=int, default=640)
    p.add_argument("--long-samples", type=int, default=48)
    p.add_argument("--workloads", default="shapes,long_tail")
    p.add_argument("--mode", default="steps", help="comma-separated: steps, packer (module docstring)")
    p.add_argument(
        "--pack-len", type=int, default=None, help="packer mode's bfd row length (default: 1280 shapes, 4096 long tail)"
    )
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument(
        "--model", default="tiny", choices=["tiny", "0.8b"], help="the default run's model or the 0.8B shape"
    )
    p.add_argument("--layers", type=int, default=24, help="text layers of the 0.8B shape (a multiple of 4)")
    p.add_argument("--quick", action="store_true", help="smoke run: 2 repetitions of small workloads")
    p.add_argument("--out", type=Path, default=None, help="JSON path (default bench/results/vs_transformers.json)")
    args = p.parse_args()
    if args.quick:  # a smoke run: nothing written into bench/results unless --out says so
        args.reps, args.shapes_samples, args.long_samples, args.slices = 2, 128, 16, 2
        args.out = args.out or Path(tempfile.gettempdir()) / "vs_transformers_quick.json"
    device = torch.device(args.device)
    if device.type == "cpu":
        harness.set_threads(args.threads)
    cfg = load_config(harness.REPO / "configs" / "debug.toml", ["--train.device", args.device])
    makers = {
        ("steps", "shapes"): lambda: Workload("shapes", shapes_samples(cfg, args.shapes_samples), 32),
        ("steps", "long_tail"): lambda: Workload("long_tail", long_tail_samples(args.long_samples), 8),
        ("packer", "shapes"): lambda: packer_workload(
            "shapes",
            shapes_rendered(cfg, args.shapes_samples),
            seq_len=cfg.data.seq_len,
            pack_len=args.pack_len or cfg.data.pack_len,
            truncation=cfg.data.truncation,
        ),
        ("packer", "long_tail"): lambda: packer_workload(
            "long_tail",
            long_tail_rendered(args.long_samples),
            seq_len=LONG_TAIL_SEQ_LEN,
            pack_len=args.pack_len or 2 * LONG_TAIL_SEQ_LEN,
            truncation="truncate",
        ),
    }
    rows = []
    for mode in args.mode.split(","):
        for name in args.workloads.split(","):
            w = makers[mode, name]()
            trainees = build_trainees(cfg, args, w, device)
            losses = check_parity(trainees, w, device)
            steps = len(trainees["ours packed"].batches)
            print(f"{w.name}: {len(w.samples)} samples, ours in {steps} steps, first-step losses equal: {losses}")
            rows.append(summarize(w, trainees, time_workload(trainees, args.reps, args.slices, device)))
            rows[-1]["first_step_loss"] = losses
    where = f"{torch.get_num_threads()} threads" if device.type == "cpu" else torch.cuda.get_device_name()
    kind = "tiny model, float32" if args.model == "tiny" else f"0.8B shape ({args.layers} layers), bf16 autocast"
    title = f"Ours (packed) vs transformers' Qwen3.5, trainable tokens/s, {kind}, {args.device} ({where})"
    table = harness.print_table(title, COLUMNS, table_rows(rows))
    meta = {"threads": torch.get_num_threads(), "device": args.device, "reps": args.reps, "slices": args.slices}
    meta |= {"modes": args.mode.split(","), "pack_len": args.pack_len}
    meta |= {"model": args.model, "layers": args.layers if args.model != "tiny" else None}
    harness.write_results(RESULTS_NAME, {"meta": meta, "table": table, "workloads": rows}, path=args.out)


if __name__ == "__main__":
    main()
