"""Expert parallelism (``train.ep_size``): what one rank moves per MoE layer under EP and under FSDP2 alone, and the
trainer's step time at ep 2 vs ep 1 on the CPU.

    python bench/bench_ep.py [--reps 3] [--steps 10] [--cases h64,h256,h256-ac] [--quick]

About 4 minutes on 2 quiet cores (18 trainer runs of 10-16 s, most of it their start; 9 minutes with another job
on the cores); ``--quick`` (1 repetition of the ``h64`` case, 6 steps; nothing written) about 1 minute. Three parts:

**1. Bytes per decoder layer per step, analytic** (no run): Qwen3.5-35B-A3B (``presets.qwen3_5_35b_a3b_config``:
hidden D = 2048, E = 256 experts of width I = 512, top K = 8, a shared expert of 512) on W = 8 ranks, ep 8, bf16
compute (c = 2 bytes), fp32 gradient reduction (g = 4), activation checkpointing (``AC`` = 1), one micro-batch of T
tokens per rank (8k and 16k), N = T K routed slots. P_e: the layer's routed experts (E x 3 D I = 805 M parameters);
P_n: the rest of it (token mixer, norms, router, shared expert and its gate: 37.4 M in a GatedDeltaNet layer, 31.0 M
in a full-attention one), counted on a meta-device model. f = (ep - 1) / ep: the share of its slots a rank sends to
other ranks under balanced routing. A ring all-gather or reduce-scatter moves (W - 1) / W of the full tensor in and
out of each rank; an all-to-all sends a rank's off-rank rows. Per rank, per decoder layer, per step:

    FSDP2 alone (ep 1)   gather  2 (W - 1)/W (P_e + P_n) c      forward, and backward's re-gather
                         reduce    (W - 1)/W (P_e + P_n) g      reduce-scatter of the layer's fp32 gradient
    expert parallel      a2a     (1 + AC) [f (2 N D c + 8 N) + 8 (ep - 1)]  +  f 2 N D c
                         gather  2 (W - 1)/W P_n c + 2 (R - 1)/R (P_e / ep) c     (the rest of the layer over all
                         reduce    (W - 1)/W P_n g +   (R - 1)/R (P_e / ep) g      ranks, the experts over edp)
                         R = W / ep: the edp ranks that FSDP2-shard the same experts (0 expert bytes at ep = W)

The all-to-all term, per forward: dispatch and combine of N rows of D in the compute dtype, each slot's int64 local
expert id, and the all-to-all of ep int64 counts before them; backward sends the two row all-to-alls back (ids and
counts are not differentiated); activation checkpointing's recompute repeats the forward's exchanges. The gathers
stay 2 with activation checkpointing: the recompute runs inside the backward's gather (FSDP2 skips its pre-forward
unshard in pre-backward), which part 2 counts; under EP the layer's experts, a unit of their own over ``edp``,
reduce once more and gather twice more (FSDP2 skips the gathers, and the reduction moves no bytes, when ``edp`` is
one rank). The table gives GB (1e9 bytes) per layer, the ratio, and the break-even T where EP's bytes reach
FSDP2's (EP grows with T, FSDP2's do not), also without activation checkpointing (AC = 0). Bytes only: link
bandwidth, overlap with compute and routing imbalance are not modelled; expected on GPUs, not measured.

**2. The formulas' terms counted** on the trainer's own model and parallel code: the tiny Qwen3.5-MoE
(``configs/debug_moe.toml``'s: hidden 64, 4 experts, top 2, 4 layers) on 2 processes over gloo, ``parallelize`` with
activation checkpointing at ep 1 and ep 2, one forward + backward of a 1024-token row (2 images) per rank, float32
(c = g = 4). FSDP2's all-gathers and reduce-scatters are counted per decoder layer by wrapping torch's private
``foreach_all_gather`` / ``foreach_reduce`` (the bench breaks, not lies, if torch renames them); the all-to-alls by a
``TorchDispatchMode``. Calls and bytes per layer (mean over the layers and the 2 ranks) against the formulas on that
config and T, with f the measured off-rank share of the slots (the routing's, not the balanced (ep - 1)/ep).

**3. Measured on the CPU**: the trainer itself (``vlm_sft/train.py``, ``torch.distributed.run --nproc_per_node 2``,
gloo, ``train.cpu_threads`` 1) on ``configs/debug_moe.toml``, ``--steps`` steps (eval and generation off, a private
shapes folder of ``--samples`` samples) at ep 2 and ep 1 (FSDP2 alone over the same 2 ranks): the same global batch
and rows per rank (checked: the first two steps' losses agree to ``LOSS_RTOL``; later steps drift, up to ~1e-3 at
hidden 256: float32 sums in other orders at a high learning rate; the JSON records it). Cases: ``h64`` (the config),
``h256`` (``--model.hidden_size 256``: the experts a larger share of the compute), ``h256-ac`` (with activation
checkpointing). From rank 0's ``metrics.jsonl``: the median ``step_time_s`` and its forward / backward parts after
the first step; ep2 / ep1 within a repetition (the run order rotating), then the median and range. **This measures
EP's overhead on 2 CPU cores over gloo** (host reads, sorting, copies; the tiny experts are a small part of a step),
**not the GPU gain** (part 1's bytes, expected, not measured).

Prints the tables and writes ``bench/results/bench_ep.json`` (not with ``--quick``).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import harness  # first: the CPU environment, before any torch import

RESULTS = harness.results_path("bench_ep")
BF16, FP32, INT64 = 2, 4, 8
GB = 1e9
WORLD, EP = 8, 8
"""Part 1's job: 8 ranks, experts split over all 8."""
TOKENS = (8192, 16384)
"""Part 1's micro-batch tokens per rank."""
COUNT_ROW = {"tokens": 1024, "images": 2}
"""Part 2's row per rank."""
CASES = {
    "h64": [],
    "h256": ["--model.hidden_size", "256"],
    "h256-ac": ["--model.hidden_size", "256", "--model.activation_checkpointing", "true"],
}
"""Part 3's trainer runs: overrides of ``configs/debug_moe.toml`` besides the common ones (``trainer_cmd``)."""
LOSS_RTOL = 1e-5
"""ep 2 vs ep 1: the first two steps' losses (float32, the experts' sums in other orders)."""


# ------------------------------------------------------------------------------------------------ 1. the formulas


@dataclass(frozen=True)
class LayerParams:
    """One decoder layer's parameters, split as expert parallelism splits them."""

    kind: str
    """``linear_attention`` (GatedDeltaNet) or ``full_attention``."""
    experts: int
    """P_e: the routed experts (under EP split over ``ep``, gathered over ``edp`` only)."""
    rest: int
    """P_n: everything else in the layer (FSDP2 gathers and reduces it with or without EP)."""


def layer_params(config) -> list[LayerParams]:
    """Each decoder layer's P_e and P_n, counted on a meta-device model of ``config`` (nothing allocated)."""
    import torch

    from vlm_sft.model.backends import resolve_backends
    from vlm_sft.model.vlm import Qwen3_5VLM
    from vlm_sft.parallel.parallelize import decoder_layers

    with torch.device("meta"):
        model = Qwen3_5VLM(config, resolve_backends("cpu"), freeze_vision=True)
    out = []
    for layer, kind in zip(decoder_layers(model), config.text_config.layer_types, strict=True):
        experts = sum(p.numel() for p in layer.mlp.experts.parameters()) if layer.moe_mlp else 0
        out.append(LayerParams(kind, experts, sum(p.numel() for p in layer.parameters()) - experts))
    return out


def traffic(
    layer: LayerParams, text, *, tokens: int, world: int, ep: int, ac: bool, c: int = BF16, g: int = FP32,
    sent_fraction: float | None = None,
) -> dict[str, float]:  # fmt: skip
    """Bytes one rank moves for ``layer`` in one step, by collective (the module docstring's formulas).
    ``sent_fraction``: f, the off-rank share of the slots (default the balanced ``(ep - 1) / ep``)."""
    w = (world - 1) / world
    if ep == 1:
        whole = layer.experts + layer.rest
        return {"gather": 2 * w * whole * c, "reduce": w * whole * g, "a2a": 0.0}
    f = (ep - 1) / ep if sent_fraction is None else sent_fraction
    rows = tokens * text.num_experts_per_tok * text.hidden_size * c
    forward = f * (2 * rows + INT64 * tokens * text.num_experts_per_tok) + INT64 * (ep - 1)
    edp = (world // ep - 1) / (world // ep)
    return {
        "gather": 2 * w * layer.rest * c + 2 * edp * layer.experts / ep * c,
        "reduce": w * layer.rest * g + edp * layer.experts / ep * g,
        "a2a": (1 + ac) * forward + f * 2 * rows,
    }


def expected_calls(ep: int, ac: bool, world: int) -> dict[str, int]:
    """Collectives per decoder layer per step: 2 gathers (AC or not), 1 reduce-scatter, and under EP one more reduce
    for the layer's experts (their own unit, over ``edp``; FSDP2 skips their gathers on a one-rank ``edp``), and per
    forward 4 all-to-alls (counts, rows, ids, combine) and 2 in backward."""
    if ep == 1:
        return {"gather": 2, "reduce": 1, "a2a": 0}
    return {"gather": 2 if world == ep else 4, "reduce": 2, "a2a": (1 + ac) * 4 + 2}


def _ep_bytes(parts: list[tuple[LayerParams, int]], text, tokens: int, ep: int, ac: bool = True) -> dict[str, float]:
    """``traffic`` summed over ``parts`` ((layer, count) pairs) on part 1's job."""
    total: collections.Counter = collections.Counter()
    for layer, n in parts:
        for key, value in traffic(layer, text, tokens=tokens, world=WORLD, ep=ep, ac=ac).items():
            total[key] += n * value
    return dict(total)


def _versus(parts: list[tuple[LayerParams, int]], text, tokens: int, ac: bool) -> tuple[float, float]:
    """FSDP2's bytes over EP's, and the break-even T (EP's bytes are linear in T: the slope from T and 2 T)."""
    fsdp = sum(_ep_bytes(parts, text, tokens, 1, ac).values())
    ep = sum(_ep_bytes(parts, text, tokens, EP, ac).values())
    slope = (sum(_ep_bytes(parts, text, 2 * tokens, EP, ac).values()) - ep) / tokens
    return fsdp / ep, tokens + (fsdp - ep) / slope


def analytic_rows() -> list[dict]:
    """Part 1's table: per layer kind of 35B-A3B and per T, GB per layer per step at ep 1 and ep 8 with activation
    checkpointing, their ratio and the break-even T, and both without it; then the whole 40-layer decoder."""
    from vlm_sft.model.presets import qwen3_5_35b_a3b_config

    text = qwen3_5_35b_a3b_config().text_config
    kinds = {p.kind: p for p in layer_params(qwen3_5_35b_a3b_config(4))}  # 3 GatedDeltaNet + 1 full attention
    groups = [(kind, [(layer, 1)]) for kind, layer in kinds.items()]
    every = [(kinds[k], n) for k, n in collections.Counter(text.layer_types).items()]
    groups.append((f"all {len(text.layer_types)} layers", every))
    rows = []
    for tokens in TOKENS:
        for name, parts in groups:
            fsdp = sum(_ep_bytes(parts, text, tokens, 1).values())
            ep_parts = _ep_bytes(parts, text, tokens, EP)
            (ratio, even), (ratio_no_ac, even_no_ac) = (_versus(parts, text, tokens, ac) for ac in (True, False))
            one = parts[0][0] if len(parts) == 1 else None
            rows.append({
                "layer": name, "tokens": tokens, "p_experts": one and one.experts, "p_rest": one and one.rest,
                "fsdp_gb": fsdp / GB, "ep_gb": sum(ep_parts.values()) / GB, "ep_a2a_gb": ep_parts["a2a"] / GB,
                "ep_fsdp_gb": (ep_parts["gather"] + ep_parts["reduce"]) / GB, "fsdp_over_ep": ratio,
                "break_even_tokens": even, "fsdp_over_ep_no_ac": ratio_no_ac, "break_even_tokens_no_ac": even_no_ac,
            })  # fmt: skip
    return rows


# ------------------------------------------------------------------------------------------------ 2. counted (child)


class Tally:
    """Calls and bytes per (decoder layer or None, collective), filled by the hooks of ``count_collectives``."""

    def __init__(self) -> None:
        self.calls: collections.Counter = collections.Counter()
        self.bytes: collections.Counter = collections.Counter()
        self.slots = self.off_rank_slots = 0

    def add(self, layer: int | None, kind: str, nbytes: float) -> None:
        self.calls[(layer, kind)] += 1
        self.bytes[(layer, kind)] += nbytes


def _layer_of(fsdp_params) -> int | None:
    """The decoder layer an FSDP2 parameter group belongs to (by its first parameter's name), None elsewhere."""
    found = re.search(r"language_model\.layers\.(\d+)\.", fsdp_params[0]._param_fqn or "")
    return int(found.group(1)) if found else None


def count_collectives(tally: Tally, world: int, ep_rank: int):
    """Wrap FSDP2's gather and reduce (private torch names, module docstring) and return a dispatch mode that counts
    the all-to-alls; bytes as a rank moves them ((W - 1)/W of a ring collective, an all-to-all's off-rank rows)."""
    import torch.distributed.fsdp._fully_shard._fsdp_param_group as group_module
    from torch.utils._python_dispatch import TorchDispatchMode

    gather, reduce = group_module.foreach_all_gather, group_module.foreach_reduce

    def share(fsdp_params) -> float:  # (n - 1) / n of the group the unit is sharded over (the experts': edp)
        n = fsdp_params[0].mesh_info.shard_mesh_size
        return (n - 1) / n

    def counted_gather(fsdp_params, *args, **kwargs):
        result = gather(fsdp_params, *args, **kwargs)
        out = result.all_gather_output
        tally.add(_layer_of(fsdp_params), "gather", share(fsdp_params) * out.numel() * out.element_size())
        return result

    def counted_reduce(fsdp_params, grads, *args, **kwargs):
        nbytes = sum(t.numel() * t.element_size() for t in grads)
        tally.add(_layer_of(fsdp_params), "reduce", share(fsdp_params) * nbytes)
        return reduce(fsdp_params, grads, *args, **kwargs)

    group_module.foreach_all_gather, group_module.foreach_reduce = counted_gather, counted_reduce

    class AllToAlls(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if "all_to_all_single" in str(func):
                x, _, in_splits = args[0], args[1], args[2]
                own = in_splits[ep_rank] if in_splits else x.shape[0] // world
                row = x.element_size() * (x[0].numel() if x.dim() > 1 else 1)
                tally.add(None, "a2a", (x.shape[0] - own) * row)
                if x.dtype.itemsize == INT64 and x.dim() == 1 and in_splits:  # the slots' expert ids
                    tally.slots += x.shape[0]
                    tally.off_rank_slots += x.shape[0] - own
            return func(*args, **(kwargs or {}))

    return AllToAlls()


def count_child(args: argparse.Namespace) -> None:
    """One rank of part 2: the tiny MoE model parallelized with activation checkpointing at ``--count-child`` = ep,
    one forward + backward under the counters; writes ``rank<R>.json``."""
    import torch
    from bench_cp import make_row  # beside this file: one packed row of synthetic samples with images

    from vlm_sft.model import build_model
    from vlm_sft.model.presets import tiny_preset
    from vlm_sft.parallel.env import cleanup, end_process, init_distributed
    from vlm_sft.parallel.mesh import build_mesh
    from vlm_sft.parallel.parallelize import parallelize

    harness.set_threads(1)
    env = init_distributed("cpu")
    torch.manual_seed(0)
    model = build_model(tiny_preset("tiny-moe", hidden_size=64), dtype=torch.float32, freeze_vision=True)
    mesh = build_mesh(env, ep_size=args.count_child)
    parallelize(model, mesh, activation_checkpointing=True)
    model.train()
    row = make_row(COUNT_ROW["tokens"], COUNT_ROW["images"], int(model.config.text_config.pad_token_id), seed=env.rank)
    tally = Tally()
    with count_collectives(tally, env.world_size, mesh.ep.rank if mesh.ep else 0):
        model(**row.model_kwargs()).loss_sum.backward()
    per_layer = collections.defaultdict(dict)
    for (layer, kind), calls in tally.calls.items():
        per_layer[str(layer)][kind] = {"calls": calls, "bytes": tally.bytes[(layer, kind)]}
    result = {"rank": env.rank, "tokens": row.num_real_tokens, "per_layer": per_layer}
    result |= {"slots": tally.slots, "off_rank_slots": tally.off_rank_slots}
    Path(args.out_dir, f"rank{env.rank}.json").write_text(json.dumps(result))
    cleanup(env, finished=True)
    end_process(0)  # gloo's teardown may abort a finished process (vlm_sft.parallel.env.end_process)


def launch(child: list[str], ranks: int = 2) -> None:
    """``torch.distributed.run`` of this script with ``child`` arguments; raises with the tail of stderr on failure."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}", *child]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env |= {"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=harness.REPO)
    if done.returncode:
        raise RuntimeError(f"{' '.join(child[:4])} failed (exit {done.returncode}):\n{done.stderr[-4000:]}")


def _per_layer(ranks: list[dict], kind: str, field: str, layers: int) -> float:
    """A collective's ``calls`` or ``bytes`` per decoder layer, the mean over the layers and the ranks' records."""
    if kind == "a2a":  # recorded without a layer: every layer of the tiny MoE model has routed experts
        return statistics.mean(r["per_layer"]["None"][kind][field] for r in ranks) / layers
    return statistics.mean(r["per_layer"][str(i)].get(kind, {}).get(field, 0) for r in ranks for i in range(layers))


def counted_rows() -> list[dict]:
    """Part 2: both ep sizes counted, per collective: calls and bytes per decoder layer (mean over layers and ranks)
    against ``expected_calls`` and ``traffic`` on the tiny config (c = g = 4) with the measured off-rank share."""
    from vlm_sft.model.presets import tiny_preset

    config = tiny_preset("tiny-moe", hidden_size=64)
    layers = layer_params(config)
    rows = []
    for ep in (1, 2):
        with tempfile.TemporaryDirectory(prefix="bench_ep_count_") as out:
            launch([__file__, "--count-child", str(ep), "--out-dir", out])
            ranks = [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(2)]
        tokens = ranks[0]["tokens"]
        f = sum(r["off_rank_slots"] for r in ranks) / sum(r["slots"] for r in ranks) if ep > 1 else None
        kw = {"tokens": tokens, "world": 2, "ep": ep, "ac": True, "c": FP32, "g": FP32, "sent_fraction": f}
        formula = [traffic(p, config.text_config, **kw) for p in layers]
        for kind, calls in expected_calls(ep, True, 2).items():
            if calls:
                counted = {field: _per_layer(ranks, kind, field, len(layers)) for field in ("calls", "bytes")}
                want = statistics.mean(t[kind] for t in formula)
                rows.append({
                    "ep": ep, "collective": kind, "calls": counted["calls"], "expected_calls": calls,
                    "counted_kb": counted["bytes"] / 1e3, "formula_kb": want / 1e3,
                    "counted_over_formula": counted["bytes"] / want, "tokens": tokens, "off_rank_share": f,
                })  # fmt: skip
    return rows


# ------------------------------------------------------------------------------------------------ 3. the trainer


def trainer_cmd(case: str, ep: int, steps: int, samples: int, out: Path, shapes: Path) -> list[str]:
    """The trainer on 2 processes for ``case`` at ``ep`` (the module docstring's overrides)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "vlm_sft/train.py"]
    cmd += ["--config", "configs/debug_moe.toml", "--train.max_steps", str(steps), "--train.log_every", "1"]
    cmd += ["--train.eval_every", "1000", "--train.eval_generate", "0", "--train.check_packing", "false"]
    cmd += ["--data.shapes.num_train", str(samples), "--data.shapes.num_eval", "0", "--data.shapes.root", str(shapes)]
    cmd += ["--train.cpu_threads", "1", "--train.ep_size", str(ep), "--train.output_dir", str(out)]
    return cmd + CASES[case]


def run_trainer(case: str, ep: int, args: argparse.Namespace, work: Path) -> dict:
    """One trainer run; its steps' figures from rank 0's ``metrics.jsonl`` (medians over the steps after the first)."""
    out = work / f"{case}_ep{ep}"
    cmd = trainer_cmd(case, ep, args.steps, args.samples, out, work / "shapes")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    start = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, env=env | {"HF_HUB_OFFLINE": "1"}, cwd=harness.REPO)
    if done.returncode:
        raise RuntimeError(f"{case} ep {ep} failed (exit {done.returncode}): {' '.join(cmd)}\n{done.stderr[-4000:]}")
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = sorted((r for r in records if "step_time_s" in r), key=lambda r: r["step"])
    timed = steps[1:]  # the first step warms up (allocations, the data pipeline's start)
    figures = harness.medians(timed, ("step_time_s", "forward_s", "backward_s", "optimizer_s", "data_s"))
    figures |= {"tokens_per_s": statistics.median(r["tokens_per_s"] for r in timed), "timed_steps": len(timed)}
    figures |= {"losses": [r["loss"] for r in steps], "wall_s": time.perf_counter() - start}
    return figures


def measured(args: argparse.Namespace) -> tuple[list[dict], dict]:
    """Part 3: every (case, ep) once per repetition in a rotating order; per case the medians and ep2 / ep1."""
    from vlm_sft.data.shapes import materialize_shapes

    with tempfile.TemporaryDirectory(prefix="bench_ep_") as tmp:
        work = Path(tmp)
        materialize_shapes(work / "shapes", num_train=args.samples, num_eval=0, progress=False)  # not data/shapes
        contenders = {(case, ep): None for case in args.cases for ep in (1, 2)}
        runs: dict = {key: [] for key in contenders}
        for rep in range(args.reps):
            for case, ep in harness.rotation(list(contenders), rep):
                runs[(case, ep)].append(run_trainer(case, ep, args, work))
                r = runs[(case, ep)][-1]
                step_ms = 1e3 * r["step_time_s"]
                print(f"  rep {rep + 1}/{args.reps} {case} ep {ep}: step {step_ms:.0f} ms ({r['wall_s']:.0f} s)")
    rows, ratios = [], {}
    for case in args.cases:
        first, drift = _loss_diffs(runs[(case, 1)], runs[(case, 2)])
        if first > LOSS_RTOL:
            raise RuntimeError(f"{case}: ep 2's first losses differ from ep 1's by {first:.1e} relative: not one batch")
        for ep in (1, 2):
            keys = ("step_time_s", "forward_s", "backward_s", "optimizer_s", "data_s", "tokens_per_s")
            rows.append({"case": case, "ep": ep} | harness.medians(runs[(case, ep)], keys))
        ratios[case] = {
            key: harness.ratio_stats([r[key] for r in runs[(case, 2)]], [r[key] for r in runs[(case, 1)]])
            for key in ("step_time_s", "forward_s", "backward_s")
        }
        ratios[case] |= {"first_two_loss_rel_diff": first, "max_loss_rel_diff": drift}
    return rows, ratios


def _loss_diffs(ep1_runs: list[dict], ep2_runs: list[dict]) -> tuple[float, float]:
    """The largest relative loss difference between paired ep 1 and ep 2 runs over their first two steps, and over
    all steps."""
    pairs = zip(ep1_runs, ep2_runs, strict=True)
    diffs = [[abs(x - y) / abs(x) for x, y in zip(a["losses"], b["losses"], strict=True)] for a, b in pairs]
    return max(max(d[:2]) for d in diffs), max(max(d) for d in diffs)


# ------------------------------------------------------------------------------------------------ report


def print_analytic(rows: list[dict]) -> None:
    print(
        f"\nExpected, not measured: bytes one rank moves per decoder layer per step, Qwen3.5-35B-A3B, {WORLD} ranks, "
        f"bf16 compute, fp32 gradient reduction, activation checkpointing; ep {EP} vs FSDP2 alone (ep 1)"
    )
    columns = [("layer", "layer"), ("tokens", "T/rank"), ("fsdp_gb", "FSDP2 GB", ".2f"), ("ep_gb", "EP GB", ".2f")]
    columns += [("ep_a2a_gb", "EP a2a GB", ".2f"), ("ep_fsdp_gb", "EP FSDP GB", ".3f")]
    columns += [("fsdp_over_ep", "FSDP2 / EP", ".2f"), ("break_even_tokens", "break-even T", ",.0f")]
    columns += [("fsdp_over_ep_no_ac", "no AC: FSDP2 / EP", ".2f"), ("break_even_tokens_no_ac", "break-even T", ",.0f")]
    harness.print_table(None, columns, rows)
    print("FSDP2: all-gathers (bf16) + reduce-scatter (fp32) of the whole layer, 256 experts included; EP: the")
    print("all-to-alls plus FSDP2 on the layer without its experts (the experts over edp: one rank at ep = W).")
    print("break-even T: tokens per rank where EP moves as much as FSDP2. no AC: without activation checkpointing")


def print_counted(rows: list[dict]) -> None:
    print(
        "\nCounted: collectives per decoder layer in one step (forward + backward, activation checkpointing), tiny MoE "
        f"(hidden 64, 4 experts, top 2, 4 layers), 2 ranks over gloo, float32, {rows[0]['tokens']} tokens per rank; "
        "mean over layers and ranks, against the formulas"
    )
    columns = [("ep", "ep"), ("collective", "collective"), ("calls", "calls", ".1f"), ("expected_calls", "expected")]
    columns += [("counted_kb", "counted KB", ".1f"), ("formula_kb", "formula KB", ".1f")]
    columns += [("counted_over_formula", "counted / formula", ".4f")]
    harness.print_table(None, columns, rows)
    share = next(r["off_rank_share"] for r in rows if r["off_rank_share"] is not None)
    print(f"a2a formula with f = {share:.3f}, the measured off-rank share of the slots (balanced: 0.5)")


def print_measured(rows: list[dict], ratios: dict, meta: dict) -> None:
    print(
        f"\nMeasured on the CPU: the trainer (configs/debug_moe.toml), 2 processes over gloo, 1 thread each, "
        f"{meta['steps']} steps (the first left out), median of {meta['reps']}. EP's overhead on 2 CPU cores, not "
        "the GPU gain"
    )
    columns = [("case", "case"), ("ep", "ep"), ("step_ms", "step ms", ".0f"), ("forward_ms", "fwd ms", ".0f")]
    columns += [("backward_ms", "bwd ms", ".0f"), ("tokens_per_s", "tok/s", ".0f"), ("ep2_over_ep1", "ep2 / ep1 step")]
    shown = []
    for r in rows:
        ms = {f"{k}_ms": 1e3 * r[f"{k}_s"] for k in ("step_time", "forward", "backward")}
        ratio = harness.fmt_range(ratios[r["case"]]["step_time_s"]) if r["ep"] == 2 else "-"
        shown.append(r | ms | {"step_ms": ms["step_time_ms"], "ep2_over_ep1": ratio})
    harness.print_table(None, columns, shown)
    first, drift = (max(v[k] for v in ratios.values()) for k in ("first_two_loss_rel_diff", "max_loss_rel_diff"))
    print(f"same batches: the first two steps' losses at ep 2 within {first:.1e} (relative) of ep 1's; later steps")
    print(f"drift apart by up to {drift:.1e} (float32 sums in other orders, amplified by training)")


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=3, help="repetitions of every trainer run (default 3)")
    ap.add_argument("--steps", type=int, default=10, help="optimizer steps per run, the first not timed (default 10)")
    ap.add_argument("--samples", type=int, default=1000, help="shapes samples in the private data folder")
    ap.add_argument("--cases", default=",".join(CASES), help=f"comma list of {', '.join(CASES)}")
    ap.add_argument("--quick", action="store_true", help="a smoke run: 1 repetition of h64, 6 steps, nothing written")
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--count-child", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--out-dir", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.quick:
        args.reps, args.steps, args.cases = 1, 6, "h64"
    args.cases = [c for c in args.cases.split(",") if c]
    unknown = [c for c in args.cases if c not in CASES]
    if unknown or args.steps < 2:
        raise SystemExit(f"--cases {unknown} unknown (known: {', '.join(CASES)}) or --steps {args.steps} < 2")
    return args


def main() -> None:
    args = parse_args()
    if args.count_child:
        count_child(args)
        return
    with harness.wall_clock() as meta:
        print_analytic(analytic := analytic_rows())
        print_counted(counted := counted_rows())
        rows, ratios = measured(args)
    meta |= {"reps": args.reps, "steps": args.steps, "samples": args.samples, "cases": args.cases}
    meta |= {"case_overrides": {c: CASES[c] for c in args.cases}, "world": WORLD, "ep": EP, "quick": args.quick}
    print_measured(rows, ratios, meta)
    print(f"\nwall {meta['wall_s']:.0f} s")
    if not args.quick:
        payload = {"meta": meta, "analytic": analytic, "counted": counted, "measured": rows, "ratios": ratios}
        harness.write_results("bench_ep", payload, path=args.out)


if __name__ == "__main__":
    main()
