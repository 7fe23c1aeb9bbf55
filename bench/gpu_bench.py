"""Training throughput and MFU of a randomly initialised Qwen3.5-0.8B-shaped model on one CUDA GPU, in bf16.

    bash bench/gpu.sh                      (the whole GPU check: kernel exactness, the trainer end to end, this)
    python bench/gpu_bench.py [--pack-len 8192] [--steps 8] [--modes bfd,stack] [--backends auto,torch] [--lora bfd]
                              [--moe bfd] [--moe-layers 4] [--cp 2] [--ep 8]
    python bench/gpu_bench.py --smoke      (a CPU dry run of the same code on shrunken shapes)

The model is ``vlm_sft.flops.qwen3_5_0_8b_config()`` (the real 0.8B shape, random init, nothing downloaded): fp32
master weights, bf16 autocast, frozen vision tower (as ``configs/qwen3_5_0_8b.toml``), fused AdamW. Data: the
long-tailed synthetic distribution (``SyntheticSource("long_tail")``: median 700 tokens, up to 8192, 0-4 images)
packed into rows of ``--pack-len`` tokens (``bfd``), against padded ``stack`` batches of the same samples
(``--stack-rows`` samples per batch in arrival order, each row padded to its batch's longest sample).

LoRA rows (``--lora``, default ``bfd``: the packing modes that also train with LoRA, on the first backend): the same
model with ``vlm_sft.model.lora.attach_lora`` at the trainer's defaults (r 16, alpha 32, dropout 0, every text linear),
its frozen base kept in bf16 on a GPU (``store_frozen_in(model, bfloat16)``, as the trainer does for a bf16 LoRA run;
float32 in ``--smoke``), AdamW over the adapters only. Their TFLOP/s and MFU count LoRA's useful FLOPs: the frozen
projections, conv and LM head x 2 (forward and input gradient, no weight gradient), attention and GatedDeltaNet x 3,
the adapters x 3, the tower x 1. Without peft installed the LoRA rows are skipped with a note.

MoE rows (``--moe``, default ``bfd``, on the first backend, full fine-tuning): ``vlm_sft.flops.qwen3_5_35b_a3b_config``
at its real widths (hidden 2048, 256 experts of width 512, top 8, a shared expert of 512, vocabulary 248320, the
27-block vision tower) but only the first ``--moe-layers`` decoder layers (default 4: 3 GatedDeltaNet + 1 full
attention, one period of the 3:1 pattern), so it trains on one GPU with AdamW: 4.83B parameters, 4.38B of them
trainable (the routed experts 0.81B a layer), about 72 GB of fp32 weights, gradients and AdamW moments before activations
(8 layers would need about 125 GB). Same path as the other rows (fp32 master weights, bf16 autocast, frozen tower,
fused AdamW); their TFLOP/s and MFU count the active experts only (``vlm_sft.flops``: router, top-k routed experts,
shared expert and its gate, never all 256). The load-balancing loss is not in these steps (its FLOPs are elementwise).

Context parallelism (``--cp N``) and expert parallelism (``--ep N``), each only when asked and on N GPUs, run in
``bench/gpu_bench_ranks.py`` (launched from here as a process of its own; its docstring says what they measure).

Per mode: ``--warmup`` untimed steps (kernel compilation and autotuning), then ``--steps`` timed steps, each
synchronized; the vision tower is timed by forward hooks (synchronized). Tokens/s counts real (non-padding) tokens;
TFLOP/s and MFU count useful FLOPs only (``vlm_sft.flops``: real tokens and segments, forward x 3 for the text model,
x 1 for the frozen tower) against the bf16 dense peak of the device (``flops.PEAK_BF16_DENSE_FLOPS``).
Prints a table and writes ``bench/results/gpu_bench.json`` (and ``$OUT/gpu_bench.json`` when ``OUT`` is set).
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import harness  # first: the CPU environment, before torch is imported

# isort: split
import torch
import torch.distributed as dist

from vlm_sft.data.batch import PackedBatch
from vlm_sft.data.collate import collate
from vlm_sft.data.pipeline import PackingPipeline
from vlm_sft.data.synthetic import SyntheticSource
from vlm_sft.flops import FlopCount, batch_flops, mfu, peak_flops
from vlm_sft.model import build_model
from vlm_sft.model.moe import is_moe_text_config
from vlm_sft.model.presets import qwen3_5_0_8b_config, qwen3_5_35b_a3b_config
from vlm_sft.parallel.context_parallel import NO_CP, ContextParallel
from vlm_sft.parallel.fsdp import clip_grad_norm_
from vlm_sft.parallel.mesh import ParallelMesh
from vlm_sft.parallel.parallelize import apply_context_parallel, parallelize
from vlm_sft.trainer.metrics import ModuleTimer

RESULTS = harness.results_path("gpu_bench")
DEFAULTS = {"pack_len": 8192, "samples": 600, "warmup": 3, "steps": 8}
SMOKE_DEFAULTS = {"pack_len": 1024, "samples": 24, "warmup": 1, "steps": 2}
"""Sizes of a GPU run and of ``--smoke`` (CPU), each used where the command line leaves it unset."""
RANKS_SCRIPT = Path(__file__).with_name("gpu_bench_ranks.py")
"""The ``--cp`` / ``--ep`` cases (several ranks)."""
MOE_LAYERS = 4
"""Decoder layers of the MoE rows' 35B-A3B-wide model: one 3:1 period, 4.83B parameters (module docstring)."""


def make_batches(samples, mode: str, *, pack_len: int, stack_rows: int, pad_id: int) -> list[PackedBatch]:
    pipeline = PackingPipeline(
        len(samples),
        samples.__getitem__,
        seq_len=pack_len,
        pack_len=pack_len,
        packing=mode,
        batch_size=stack_rows,
        buffer_size=stack_rows if mode == "stack" else 512,
        truncation="truncate",
        seed=0,
        epochs=1,
    )
    return [collate([p], pad_id=pad_id) for p in pipeline]


def shrink(config):
    """A CPU-sized copy of the shape for ``--smoke`` (same layer mix and head structure, far fewer parameters); an MoE
    shape keeps its top-8 routing and shared expert over 32 experts of width 32."""
    t, v = config.text_config, config.vision_config
    if is_moe_text_config(t):
        t.num_experts, t.moe_intermediate_size, t.shared_expert_intermediate_size = 32, 32, 64
    else:
        t.intermediate_size = 256
    t.hidden_size, t.num_hidden_layers = 128, 4
    t.layer_types = t.layer_types[:4]
    t.head_dim, t.linear_key_head_dim, t.linear_value_head_dim = 32, 16, 16
    t.vocab_size = 4096
    t.pad_token_id = t.eos_token_id = 0
    t.rope_parameters["mrope_section"] = [2, 1, 1]
    v.depth, v.hidden_size, v.intermediate_size, v.num_heads, v.out_hidden_size = 2, 64, 128, 2, 128
    return config


class Bench:
    def __init__(
        self,
        config,
        device: torch.device,
        backend: str,
        *,
        lora: bool = False,
        cp: ContextParallel = NO_CP,
        mesh: ParallelMesh | None = None,
    ) -> None:
        torch.manual_seed(0)
        impl = {"attn_impl": "sdpa", "linear_attn_impl": "torch", "loss_impl": "chunked"} if backend == "torch" else {}
        with torch.device(device):  # built and initialised on the device: no host copy of a 4.8B-parameter MoE model
            self.model = build_model(config, device=device, dtype=torch.float32, freeze_vision=True, **impl)
        self.mesh = mesh  # the ep case: FSDP2 (and expert parallelism) as the trainer applies them
        if mesh is not None:
            parallelize(self.model, mesh, param_dtype=torch.bfloat16 if device.type == "cuda" else None)
        self.tuning = "lora" if lora else "full"
        self.total_params = sum(p.numel() for p in self.model.parameters())
        self.adapter_flops_per_token = attach_lora_adapters(self.model, device) if lora else 0.0
        self.model.train()
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.trainable_params = sum(p.numel() for p in params)
        self.optimizer = torch.optim.AdamW(params, lr=1e-5, betas=(0.9, 0.95), fused=device.type == "cuda")
        self.device = device
        self.autocast = torch.bfloat16 if device.type == "cuda" else None
        self.vision = ModuleTimer(self.model.model.visual, device)
        self.cp = cp
        if cp.active:
            apply_context_parallel(self.model, cp)

    def train_flops(self, count: FlopCount) -> float:
        """Training FLOPs of a batch: ``count.train`` for full fine-tuning; for LoRA no weight gradient of the frozen
        projections, conv and LM head (x 2), attention and GatedDeltaNet x 3, adapters x 3, frozen tower x 1."""
        if self.tuning == "full":
            return count.train
        frozen_linear = count.dense + count.conv + count.lm_head
        adapters = self.adapter_flops_per_token * count.tokens
        return 2 * frozen_linear + 3 * (count.attention + count.linear_attention + adapters) + count.vision

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def step(self, batch: PackedBatch) -> dict[str, float]:
        batch = batch.to(self.device)
        self.vision.take()
        self._sync()
        t0 = time.perf_counter()
        with torch.autocast(self.device.type, dtype=self.autocast, enabled=self.autocast is not None):
            out = self.model(**batch.model_kwargs())
        self._sync()
        t1 = time.perf_counter()
        (out.loss_sum / max(batch.num_trainable_tokens, 1)).backward()
        if self.cp.active:  # the group's ranks hold shards of one row: its gradient is their sum
            for p in self.model.parameters():
                if p.grad is not None:
                    dist.all_reduce(p.grad, group=self.cp.group)
        self._sync()
        t2 = time.perf_counter()
        clip_grad_norm_(self.model.parameters(), 1.0)  # per mesh (the experts' and FSDP2's), as the trainer clips
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self._sync()
        t3 = time.perf_counter()
        return {"vision": self.vision.take(), "forward": t1 - t0, "backward": t2 - t1, "optimizer": t3 - t2}


def attach_lora_adapters(model: torch.nn.Module, device: torch.device) -> float:
    """LoRA at the trainer's defaults (``model.lora``), frozen base in bf16 on a GPU; forward FLOPs of the adapters per
    token (``2 r (in + out)`` per adapted projection)."""
    from vlm_sft.config import LoraSettings  # pydantic and peft: only for LoRA rows
    from vlm_sft.model.lora import attach_lora, store_frozen_in

    lora = LoraSettings()
    torch.manual_seed(1)
    names = attach_lora(model, r=lora.r, alpha=lora.alpha, dropout=lora.dropout, targets=lora.target_modules)
    store_frozen_in(model, torch.bfloat16 if device.type == "cuda" else torch.float32)  # no CPU autocast (--smoke)
    modules = dict(model.named_modules())
    return sum(2.0 * lora.r * (modules[n].in_features + modules[n].out_features) for n in names)


def run_mode(bench: Bench, batches: list[PackedBatch], warmup: int, steps: int, peak: float | None) -> dict:
    if len(batches) < warmup + steps:
        batches = (batches * (1 + (warmup + steps) // max(len(batches), 1)))[: warmup + steps]
    for b in batches[:warmup]:
        bench.step(b)
    if bench.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(bench.device)
    timed = batches[warmup : warmup + steps]
    records = [bench.step(b) for b in timed]
    seconds = sum(r["forward"] + r["backward"] + r["optimizer"] for r in records)
    model = bench.model
    useful = sum(
        bench.train_flops(batch_flops(b, model.config, vision_trainable=model.vision_trainable)) for b in timed
    )
    executed = sum(
        bench.train_flops(batch_flops(b, model.config, vision_trainable=model.vision_trainable, count_padding=True))
        for b in timed
    )
    real = sum(b.num_real_tokens for b in timed)
    capacity = sum(b.input_ids.numel() for b in timed)
    total = {k: sum(r[k] for r in records) for k in ("vision", "forward", "backward", "optimizer")}
    return {
        "tuning": bench.tuning,
        "total_params": bench.total_params,
        "trainable_params": bench.trainable_params,
        "steps": len(timed),
        "rows_x_len": f"{timed[0].shape[0]} x {max(b.shape[1] for b in timed)}",
        "real_tokens": real,
        "padding_fraction": 1 - real / capacity,
        "real_tok_s": real / seconds,
        "trainable_tok_s": sum(b.num_trainable_tokens for b in timed) / seconds,
        "step_ms": 1e3 * statistics.median(r["forward"] + r["backward"] + r["optimizer"] for r in records),
        "vision_ms": 1e3 * total["vision"] / len(records),
        "text_forward_ms": 1e3 * (total["forward"] - total["vision"]) / len(records),
        "backward_ms": 1e3 * total["backward"] / len(records),
        "optimizer_ms": 1e3 * total["optimizer"] / len(records),
        "useful_tflop_s": useful / seconds / 1e12,
        "executed_over_useful_flops": executed / useful,
        "mfu": mfu(useful, seconds, peak),
        "peak_mem_gib": torch.cuda.max_memory_allocated(bench.device) / 2**30 if bench.device.type == "cuda" else None,
    }


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pack-len", type=int, help="tokens per packed row (default 8192; --smoke 1024)")
    ap.add_argument("--samples", type=int, help="synthetic samples (default 600; --smoke 24)")
    ap.add_argument("--modes", default="bfd,stack")
    ap.add_argument("--stack-rows", type=int, default=2)
    ap.add_argument("--backends", default="auto", help="comma list: auto (fastest installed), torch (pure torch)")
    ap.add_argument("--lora", default="bfd", help="modes (of --modes) that also train with LoRA, on the first backend")
    ap.add_argument("--moe", default="bfd", help="modes (of --modes) that also train the 35B-A3B-wide MoE model")
    ap.add_argument("--moe-layers", type=int, default=MOE_LAYERS, help="its decoder layers (default 4; of 40)")
    ap.add_argument("--warmup", type=int, help="untimed steps per row (default 3; --smoke 1)")
    ap.add_argument("--steps", type=int, help="timed steps per row (default 8; --smoke 2)")
    ap.add_argument(
        "--cp", type=int, default=1, help="also run the 0.8B bfd row at cp 1 and cp N on N GPUs (default 1: no)"
    )
    ap.add_argument("--cp-worker", help=argparse.SUPPRESS)  # gpu_bench_ranks.py: a cp rank's row folder
    ap.add_argument(
        "--ep", type=int, default=1, help="also run the MoE bfd row at ep 1 and ep N on N GPUs (default 1: no)"
    )
    ap.add_argument("--ep-worker", help=argparse.SUPPRESS)  # gpu_bench_ranks.py: an ep rank's row folder
    ap.add_argument("--rank-case", choices=("cp", "ep"), help=argparse.SUPPRESS)  # gpu_bench_ranks.py: the case
    ap.add_argument("--rank-case-out", type=Path, help=argparse.SUPPRESS)  # gpu_bench_ranks.py: its JSON
    ap.add_argument("--smoke", action="store_true", help="CPU dry run on a shrunken shape (checks the script only)")
    ap.add_argument("--out", type=Path, help=f"JSON path (default {RESULTS}; --smoke writes none unless given)")
    args = ap.parse_args()
    for key, value in (SMOKE_DEFAULTS if args.smoke else DEFAULTS).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    for flag in ("lora", "moe"):
        chosen = [m for m in getattr(args, flag).split(",") if m and m != "none"]
        unknown = [m for m in chosen if m not in args.modes.split(",")]
        if unknown:
            raise SystemExit(
                f"--{flag} {unknown} are not among --modes {args.modes}: add them there, or pass --{flag} none"
            )
        setattr(args, flag, chosen)
    if args.cp > 1 and args.pack_len % args.cp:
        raise SystemExit(
            f"--cp {args.cp} splits each {args.pack_len}-token pack over {args.cp} ranks: pass a --pack-len "
            "divisible by it"
        )
    return args


def row_plan(
    backends: list[str], modes: list[str], lora_modes: list[str], moe_modes: list[str]
) -> list[tuple[str, str, list[str]]]:
    """``(backend, variant, modes)`` per model to build, variant ``full``, ``lora`` or ``moe``: each backend fully
    fine-tuned, then (after the first) LoRA on ``lora_modes`` and the MoE model on ``moe_modes``, so both run beside
    full fine-tuning with the same kernels. peft missing: no LoRA, with a note."""
    if lora_modes and importlib.util.find_spec("peft") is None:
        print("note: peft is not installed: no LoRA rows (carry its wheel in .whl/, see bench/README.md)", flush=True)
        lora_modes = []
    first = [(backends[0], "full", modes), (backends[0], "lora", lora_modes), (backends[0], "moe", moe_modes)]
    return [group for group in first if group[2]] + [(b, "full", modes) for b in backends[1:]]


def model_configs(args: argparse.Namespace) -> dict[str, object]:
    """The dense 0.8B shape (``full`` and ``lora`` rows) and the few-layer 35B-A3B shape (``moe``), shrunk for
    ``--smoke``. Both have the same vocabulary and special-token ids, so the rows share their batches."""
    dense, moe = qwen3_5_0_8b_config(), qwen3_5_35b_a3b_config(args.moe_layers)
    if args.smoke:
        dense, moe = shrink(dense), shrink(moe)
    assert dense.text_config.pad_token_id == moe.text_config.pad_token_id, "the rows share their padded batches"
    return {"full": dense, "lora": dense, "moe": moe}


def main() -> None:
    args = parse_args()
    if args.ep > 1 and not args.smoke and torch.cuda.device_count() == 0:
        print(
            f"ep case skipped: --ep {args.ep} needs {args.ep} CUDA GPUs; none is visible (--smoke runs it on the CPU)"
        )
        return
    if args.smoke:
        device = torch.device("cpu")
    elif not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run on a GPU machine, or pass --smoke for a CPU dry run of the script")
    else:
        device = torch.device("cuda")
    configs = model_configs(args)
    peak = peak_flops(device, torch.bfloat16)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    source = SyntheticSource(args.samples, distribution="long_tail", seed=0)
    samples = [source(i) for i in range(args.samples)]
    pad_id = int(configs["full"].text_config.pad_token_id)
    batches = {
        m: make_batches(samples, m, pack_len=args.pack_len, stack_rows=args.stack_rows, pad_id=pad_id)
        for m in args.modes.split(",")
    }
    targets = [args.out] if args.out is not None else ([] if args.smoke else [RESULTS])
    if os.environ.get("OUT"):
        targets.append(Path(os.environ["OUT"]) / "gpu_bench.json")
    payload = {"device": name, "peak_flops": peak, "torch": torch.__version__, "pack_len": args.pack_len}
    payload |= {"smoke": args.smoke, "complete": False, "rows": []}
    for backend, variant, modes in row_plan(args.backends.split(","), list(batches), args.lora, args.moe):
        bench = Bench(configs[variant], device, backend, lora=variant == "lora")
        for mode in modes:
            row = run_row(bench, batches[mode], args, peak) | {"backend": backend, "mode": mode}
            payload["rows"].append(row)
            write_json(targets, payload, quiet=True)  # rows so far survive a time limit that stops the run
            tok_s = f"{row['real_tok_s']:.0f} real tok/s"
            print(f"  {backend} {row['model']} {bench.tuning} {mode}: {tok_s} ({row['wall_s']:.0f} s)", flush=True)
        del bench
        if device.type == "cuda":
            gc.collect()  # the next model's peak memory must not count this one
            torch.cuda.empty_cache()
    peak_text = f"peak {peak / 1e12:.0f} TFLOP/s bf16 dense" if peak else "no known peak rate (MFU n/a)"
    shape = "Qwen3.5-0.8B shape" + (f"; MoE rows: Qwen3.5-35B-A3B widths, {args.moe_layers} layers" if args.moe else "")
    shape = f"shrunken {shape} (--smoke)" if args.smoke else shape
    precision = "bf16 autocast" if device.type == "cuda" else "float32"
    print(f"\n{shape}, random init, {precision}, frozen vision, {args.pack_len}-token packs; {name}; {peak_text}")
    print(format_rows(payload["rows"]))
    for flag in ("cp", "ep"):
        if getattr(args, flag) > 1:
            payload[flag] = run_rank_case(flag, sys.argv[1:])
            write_json(targets, payload, quiet=True)
    payload["complete"] = True
    write_json(targets, payload)
    failed = [f for f in ("cp", "ep") if "error" in payload.get(f, {})]
    if failed:
        raise SystemExit(
            f"the {failed} case failed (the other rows are written): {payload[failed[0]]['error'][-2000:]}"
        )


def run_row(bench: Bench, batches: list[PackedBatch], args: argparse.Namespace, peak: float | None) -> dict:
    """One row: ``run_mode`` plus the model it ran (``0.8B``, or ``35B-A3B/4L`` for the MoE shape) and its kernels."""
    start = time.perf_counter()
    row = run_mode(bench, batches, args.warmup, args.steps, peak)
    text = bench.model.config.text_config
    chosen = bench.model.backends
    kernels = f"{chosen.attention}/{chosen.linear_attention}"
    if is_moe_text_config(text):
        row["model"] = f"35B-A3B/{text.num_hidden_layers}L"
        kernels += f"/{chosen.experts}"
    else:
        row["model"] = "0.8B"
    return row | {"kernels": kernels, "wall_s": time.perf_counter() - start}


def _time_mfu_memory(r: dict) -> tuple[str, str, str]:
    """A row's time split (vision / text forward / backward / optimizer ms), MFU and peak memory, as printed."""
    split = "/".join(f"{r[k]:.0f}" for k in ("vision_ms", "text_forward_ms", "backward_ms", "optimizer_ms"))
    m = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "n/a"
    mem = f"{r['peak_mem_gib']:.1f}" if r["peak_mem_gib"] is not None else "n/a"
    return split, m, mem


ROW_COLUMNS = [("backend", "backend"), ("kernels", "kernels"), ("model", "model"), ("tuning", "tune")]
ROW_COLUMNS += [("mode", "mode"), ("rows_x_len", "rows x len"), ("real_tok_s", "real tok/s", ".0f")]
ROW_COLUMNS += [("step_ms", "step ms", ".1f"), ("split", "vis/txt/bwd/opt ms"), ("useful_tflop_s", "TFLOP/s", ".1f")]
ROW_COLUMNS += [("mfu_text", "MFU"), ("padding_fraction", "pad", ".2f"), ("mem_text", "mem GiB")]


def format_rows(rows: list[dict]) -> str:
    """The results table (one line per backend x model x tuning x mode); ``bench/gpu_check.py`` prints it too."""
    return harness.format_table(None, ROW_COLUMNS, [_shown(r) | {"model": "0.8B", "tuning": "full"} | r for r in rows])


def _shown(r: dict) -> dict:
    split, m, mem = _time_mfu_memory(r)
    return {"split": split, "mfu_text": m, "mem_text": mem}


def write_json(targets: list[Path], payload: dict, *, quiet: bool = False) -> None:
    for target in targets:
        harness.write_results("gpu_bench", payload, path=target, quiet=quiet)


# ------------------------------------------------------------------------------------------------ several ranks


def run_rank_case(flag: str, argv: list[str]) -> dict:
    """The ``--cp`` / ``--ep`` case, run by ``gpu_bench_ranks.py`` in a process of its own (its table printed as it
    goes); its result, or the failure's error."""
    with tempfile.TemporaryDirectory(prefix=f"gpu_bench_{flag}_") as out:
        result = Path(out, "case.json")
        cmd = [sys.executable, str(RANKS_SCRIPT), *argv, "--rank-case", flag, "--rank-case-out", str(result)]
        done = subprocess.run(cmd, stderr=subprocess.PIPE, text=True)
        if done.returncode or not result.is_file():
            return {"error": f"{flag} case, exit {done.returncode}: {done.stderr[-6000:]}"}
        return json.loads(result.read_text())


if __name__ == "__main__":
    main()
