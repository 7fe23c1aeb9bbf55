"""``--dry-run`` and what a rank holds while a big bf16 checkpoint loads.

The dry run builds everything as training would and stops before the first optimizer step; its report is how these
tests read each rank's peak host memory. The bound is the sharded load's: every rank holds its final fp32 shard
(``2 S / W`` for a bf16 checkpoint of S bytes on W ranks) plus one tensor's read buffer, so at 2 ranks a rank's peak
above a tiny checkpoint's baseline stays within ``2 S``. The load that reads the whole checkpoint on every rank,
casts it to fp32 and only then shards, holds ``2 S`` of fp32 state before anything is freed and breaks the bound
(measured 2.4 x S dense and 3.9 x S MoE on 2 ranks at S ~ 100 MiB in 2 files).

The three 2-rank runs (dense, MoE, tiny baseline) run side by side: peaks are per process, so sharing the cores
changes their times, not their memory.
"""

from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest
from big_checkpoints import BigCheckpoint, cached_checkpoint, tiny_baseline
from train_helpers import Background, read_metrics, tiny_run_args

from vlm_sft.checks.memory_report import REPORT_FILE

RSS_BOUND = 2.0
"""Peak host memory above the baseline, in units of S, per rank at 2 ranks (module docstring)."""
RANKS = 2


@dataclass(frozen=True)
class DryRun:
    checkpoint: BigCheckpoint
    proc: subprocess.CompletedProcess
    out_dir: Path
    report: dict
    """``dry_run.json``."""

    def peaks(self) -> list[int]:
        return [r["peak_rss"] for r in self.report["ranks"]]


@pytest.fixture(scope="module")
def dry_runs(tmp_path_factory) -> dict[str, DryRun]:
    """``--dry-run`` on 2 ranks of the dense and the MoE checkpoint (S ~ 100 MiB) and of the tiny baseline."""
    from vlm_sft.data.shapes import materialize_shapes

    tmp = tmp_path_factory.mktemp("dry_run")
    materialize_shapes(tmp / "shapes", num_train=48, num_eval=0, progress=False)  # once, before the runs race to it
    writers = {
        "baseline": lambda: tiny_baseline(tmp_path_factory, "dense"),
        "dense": lambda: cached_checkpoint(tmp_path_factory, "dense"),
        "moe": lambda: cached_checkpoint(tmp_path_factory, "moe"),
    }
    checkpoints, started = {}, {}
    for name, write in writers.items():  # each run starts as soon as its checkpoint is written
        ck = checkpoints[name] = write()
        overrides = {"model.name_or_path": str(ck.path), "model.initializer_range": "none"}
        overrides |= {"train.output_dir": str(tmp / name / "run"), "data.shapes.root": str(tmp / "shapes")}
        started[name] = Background([*tiny_run_args(tmp / name, **overrides), "--dry-run"], nproc=RANKS)
    runs = {}
    for name, bg in started.items():
        proc = bg.wait(timeout=240)
        out = tmp / name / "run"
        runs[name] = DryRun(checkpoints[name], proc, out, json.loads((out / REPORT_FILE).read_text()))
    return runs


def test_dry_run_exits_0_with_every_rank_in_its_table_and_takes_no_step(dry_runs):
    run = dry_runs["dense"]
    assert run.proc.returncode == 0
    out = run.proc.stdout
    assert out.count("peak host memory (RSS high-water mark)") == 1, out  # printed once, by rank 0
    assert "rank 0" in out and "rank 1" in out
    assert "planned (estimates" in out and "measured so far" in out
    assert "no optimizer step taken" in out
    assert [r["rank"] for r in run.report["ranks"]] == [0, 1]
    assert run.report["checkpoint_bytes"] >= run.checkpoint.size  # every tensor of the files (mtp.* included)
    assert not (run.out_dir / "final").exists() and not (run.out_dir / "checkpoints").exists()
    metrics = run.out_dir / "metrics.jsonl"
    assert not metrics.exists() or not [r for r in read_metrics(run.out_dir) if "loss" in r]


def test_dry_run_plans_from_each_ranks_actual_shard(dry_runs):
    """Two ranks split the fp32 parameters (twice the bf16 checkpoint's bytes) about evenly."""
    run = dry_runs["dense"]
    shards = [r["plan"]["params"] for r in run.report["ranks"]]
    assert sum(shards) == pytest.approx(2 * run.checkpoint.size, rel=0.05)
    assert max(shards) <= 0.6 * sum(shards)


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_loading_a_bf16_checkpoint_holds_at_most_twice_its_size_per_rank(dry_runs, kind):
    run, base = dry_runs[kind], dry_runs["baseline"]
    size = run.checkpoint.size
    above = [(p - b) / size for p, b in zip(run.peaks(), base.peaks(), strict=True)]
    print(f"{kind}: S = {size / 2**20:.1f} MiB, peak RSS above the baseline per rank: {[f'{a:.2f}' for a in above]} S")
    assert max(above) <= RSS_BOUND, (
        f"{kind} checkpoint of S = {size / 2**20:.1f} MiB: peak host memory above the tiny baseline is "
        f"{[f'{a:.2f}' for a in above]} x S per rank at {RANKS} ranks (bound {RSS_BOUND} x S: the rank's fp32 shard "
        "plus one tensor's read buffer)"
    )


# ------------------------------------------------------------------------------------------------ the plan itself


def test_plan_of_an_unsharded_model_is_its_parameters_grads_and_adamw():
    """One CPU process: the shard is the whole model; gradients and AdamW state only for what trains."""
    from vlm_sft.checks.memory_plan import StepShape, plan
    from vlm_sft.checks.memory_report import local_shard
    from vlm_sft.checks.model_counts import ModelCounts
    from vlm_sft.model import build_model
    from vlm_sft.model.presets import tiny_qwen3_5_config

    model = build_model(tiny_qwen3_5_config(), freeze_vision=True)
    counts = ModelCounts.of_model(model)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert 0 < trainable < counts.total
    assert local_shard(model) == (4 * counts.total, trainable)
    step = StepShape(tokens=256, activation_checkpointing=False, compute_bytes=4)
    p = plan(counts, model.config, step, world_size=1, sharded=False, micro_batches=4)
    assert (p.params, p.grads, p.optimizer_state) == (4 * counts.total, 4 * trainable, 8 * trainable)
    assert p.gathered_weights == p.accumulated_grads == 0  # nothing is gathered or kept unsharded without FSDP2


def test_plan_shards_the_9b_over_8_ranks_and_counts_the_accumulated_gradient():
    """The unsharded fp32 gradient FSDP2 keeps across micro-batches (``grad_sync = "step"``) is the whole model's on
    every rank: 36 GB for the 9B, more than its sharded training state."""
    from vlm_sft.checks.memory_plan import plan_for_run
    from vlm_sft.config import RunConfig

    model = {"name_or_path": "Qwen/Qwen3.5-9B", "dtype": "bfloat16", "activation_checkpointing": True}
    model |= {"vlm": {"freeze_vision": True}}
    cfg = RunConfig(model=model, data={"pack_len": 4096}, train={"device": "cuda", "micro_batches": 4})
    p = plan_for_run(cfg, 8)
    params = 9.41e9
    assert p.params == pytest.approx(4 * params / 8, rel=0.01)
    assert p.accumulated_grads == pytest.approx(4 * 8.95e9, rel=0.01)  # the text model trains, the tower is frozen
    per_step = plan_for_run(
        cfg.model_copy(update={"train": cfg.train.model_copy(update={"grad_sync": "micro_batch"})}), 8
    )
    assert per_step.accumulated_grads == 0


def test_activation_checkpointing_keeps_less_and_activations_grow_with_the_row():
    from vlm_sft.checks.memory_plan import StepShape, activation_bytes, meta_counts
    from vlm_sft.model.presets import qwen3_5_0_8b_config

    config = qwen3_5_0_8b_config()
    counts = meta_counts(config, lora=None, bf16=True)
    short, long = (StepShape(tokens=t, activation_checkpointing=False, compute_bytes=2) for t in (4096, 16384))
    recompute = StepShape(tokens=16384, activation_checkpointing=True, compute_bytes=2)
    assert activation_bytes(config, recompute, counts) < activation_bytes(config, long, counts) / 3
    assert activation_bytes(config, long, counts) > 3 * activation_bytes(config, short, counts)


def _saved_by_one_forward(model, tokens: int, *, router_probs_grad: bool) -> int:
    """Bytes of the distinct storages autograd saves in one forward of ``model`` with targets (its parameters left
    out), on a pack of ``tokens`` tokens of 30-50-token samples (the shapes data's lengths)."""
    import random

    import torch

    rng = random.Random(0)
    lengths: list[int] = []
    while sum(lengths) < tokens:
        lengths.append(min(rng.randint(30, 50), tokens - sum(lengths)))
    vocab = model.config.text_config.vocab_size
    ids = torch.randint(0, vocab - 50, (1, tokens), generator=torch.Generator().manual_seed(0))
    positions = torch.cat([torch.arange(n) for n in lengths]).view(1, 1, tokens).expand(3, 1, tokens).contiguous()
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            saved.setdefault(storage.data_ptr(), storage.nbytes())
        return t

    kwargs = {"router_probs_grad": True} if router_probs_grad else {}
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(input_ids=ids, position_ids=positions, seq_lens=tuple(lengths), target_ids=ids, **kwargs)
    return sum(saved.values())


def _pre_calibration_estimate(text, tokens: int, c: int) -> int:
    """The layers' term as the plan counted it before it was calibrated: ``4 D`` + the mixer (GatedDeltaNet
    ``6 K + 5 V + 2 H_v``, attention ``5 Q + 3 KV``) + the MLP (``4 I``) elements a token and layer, all ``c`` bytes."""
    d, per_layer = text.hidden_size, []
    for kind in text.layer_types:
        if kind == "linear_attention":
            key = text.linear_num_key_heads * text.linear_key_head_dim
            value = text.linear_num_value_heads * text.linear_value_head_dim
            mixer = 6 * key + 5 * value + 2 * text.linear_num_value_heads
        else:
            mixer = (5 * text.num_attention_heads + 3 * text.num_key_value_heads) * text.head_dim
        per_layer.append(4 * d + mixer + 4 * text.intermediate_size)
    return tokens * c * sum(per_layer)


@pytest.mark.parametrize(
    ("moe", "dtype_name"), [(False, "float32"), (False, "bfloat16"), (True, "float32"), (True, "bfloat16")]
)
def test_activation_model_counts_what_one_forward_saves(moe, dtype_name):
    """``saved_bytes`` (the forward's share of the plan's activation term, the CPU kernels) against the storages
    ``saved_tensors_hooks`` see in one forward of the tiny model on a 512-token pack: within 10%, dense and MoE (its
    load-balancing loss training), fp32 and bf16: measured 0.97-0.99 x of the plan. The count this replaced (elements in
    the compute dtype, no fp32 norm buffers, the fla rule's inputs only) planned 0.36 x (fp32) and 0.22 x (bf16) of
    what the dense model saves, which the last assertion shows."""
    import torch

    from vlm_sft.checks.activations import StepShape, saved_bytes
    from vlm_sft.model import build_model
    from vlm_sft.model.presets import tiny_qwen3_5_config, tiny_qwen3_5_moe_config

    dtype = getattr(torch, dtype_name)
    config = tiny_qwen3_5_moe_config() if moe else tiny_qwen3_5_config()
    model = build_model(config, freeze_vision=True).to(dtype)
    tokens = 512
    measured = _saved_by_one_forward(model, tokens, router_probs_grad=moe)
    step = StepShape(tokens, False, dtype.itemsize, backends=model.backends, router_probs_grad=moe)
    planned = saved_bytes(config, step)
    print(f"{'moe' if moe else 'dense'} {dtype_name}: saved {measured} B, planned {planned} B")
    assert measured == pytest.approx(planned, rel=0.10), f"saved {measured} B vs planned {planned} B"
    if not moe:  # the guard can fail: the earlier count misses by far more than the tolerance
        old = _pre_calibration_estimate(config.text_config, tokens, dtype.itemsize)
        assert measured > 1.25 * old, f"saved {measured} B vs the old count {old} B"
