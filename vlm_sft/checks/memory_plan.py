"""Planned memory per rank: what each rank holds at load, in training and at save (estimates, in bytes).

Used two ways: by ``--dry-run`` (``dry_run.py``) on the live, sharded model, where the parameter shard is the rank's
real one, and without any model (``python -m vlm_sft.checks.memory_plan``), from a Hugging Face config built on the
meta device, to size a job before it is launched. Every figure here is an **estimate**: a model of what the code
allocates, not a measurement (``--dry-run`` prints the measured peaks beside it).

The terms, per rank, for ``W`` ranks (``sharded``: FSDP2, i.e. several ranks or any CUDA run), ``N_t`` trainable
and ``N_f`` frozen parameter elements, master weights fp32 (4 bytes) for what trains, ``f`` bytes per frozen element
(2 for a bf16 LoRA base, else 4), ``c`` bytes of the compute dtype (2 in bf16, 4 in fp32), ``k`` bytes per element of
the checkpoint on disk (2 for the released bf16 checkpoints), ``S`` the checkpoint's size:

- **load** (the sharded load: meta init, wrap, ``fully_shard``, then each rank reads only its rows)
  = shard ``(4 N_t + f N_f) / W`` + read buffer ``n_max / W * (k + 4)`` (the rows of the largest tensor, read in
  the checkpoint dtype and cast to fp32).
- **training** = parameters ``(4 N_t + f N_f) / W`` + gradients ``4 N_t / W`` + AdamW state ``8 N_t / W`` (exp_avg
  and exp_avg_sq, fp32) + the optimizer step's temporaries ``t 4 N_t / W`` (``STEP_TEMPORARY_COPIES``: ``t = 0``
  for ``train.optimizer_impl = "fused"``, ``t = 1`` for ``"foreach"``) + accumulated gradients ``4 N_t`` (only with
  ``micro_batches > 1`` and ``grad_sync = "step"`` on a sharded model: FSDP2 keeps every unit's *unsharded* fp32
  gradient until the step's last micro-batch) + gathered weights ``c (n_root + 2 n_unit) + 4 n_unit_t`` (FSDP2 keeps
  the root unit, embeddings + LM head + final norm, gathered through forward and backward, gathers one decoder
  layer or the vision tower at a time with one prefetched, and holds that unit's unsharded fp32 gradient before its
  reduce-scatter) + activations (``checks.activations.activation_bytes``, one micro-batch's graph, for the
  kernels of ``planned_backends``). The gradients and the activations are added, an upper bound: a backward frees
  the activations as it makes the gradients, and with one micro-batch a step the gradients are freed after each
  optimizer step, so the two never coexist in full (measured on the CPU: ``bench/bench_memory_plan.py``). With
  ``train.optimizer_offload`` the AdamW state is on the host between steps: training is then the larger of the
  forward / backward peak (everything above but the AdamW state and the step's temporaries) and the step's
  (parameters, gradients, accumulated gradients, AdamW state, temporaries). Under expert parallelism
  (``train.ep_size = ep``) each rank still holds ``1 / W`` of the routed experts (``1 / ep`` of them split over
  ``edp``), but FSDP2 gathers a layer's experts over ``edp`` alone, as a unit of their own after the layer's router:
  the gathered term counts the layer without its experts as above plus ``1 / ep`` of its experts once (no prefetched
  copy), the accumulated gradients ``1 / ep`` of the experts; the dispatch adds its buffers
  (``expert_parallel_bytes``, with a planned routing imbalance ``EP_IMBALANCE``).
- **save** (the streamed export, on the writing rank) = parameters + AdamW state (gradients are freed after the
  step) + one gathered tensor ``n_max * (4 + k)`` (fp32, and its cast to the checkpoint dtype) + one output shard
  ``min(5 GB, S)`` (``save_pretrained``'s default bound of a safetensors file).

On CUDA the shard, the training state and the activations are GPU memory; the load's read buffer and the save's
output shard are host memory. On the CPU everything is host memory.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from transformers import Qwen3_5Config, Qwen3_5MoeConfig

from vlm_sft.checks.activations import (
    EP_IMBALANCE,
    FP32,
    GPU_BACKENDS,
    StepShape,
    activation_bytes,
    expert_parallel_bytes,
)
from vlm_sft.checks.model_counts import ModelCounts
from vlm_sft.config import TINY_MODELS, ConfigError, LoraSettings, RunConfig, cli_parser, parse_cli
from vlm_sft.model.backends import Backends
from vlm_sft.model.presets import qwen3_5_0_8b_config, qwen3_5_9b_config, qwen3_5_27b_config, qwen3_5_35b_a3b_config

GB = 1e9
"""Figures are printed in GB (10^9 bytes), the unit GPU memory is sold in (an H100 has 80 GB, an H200 141 GB)."""
MAX_SHARD_BYTES = 5 * 10**9
"""The export's bound on one safetensors file (``save_pretrained``'s default ``max_shard_size = "5GB"``)."""
STEP_TEMPORARY_COPIES = {"fused": 0, "foreach": 1}
"""fp32 copies of the trainable shard that one AdamW step allocates beyond its state, per ``train.optimizer_impl``.
Measured on the CPU (torch 2.13, ``bench/bench_optimizer.py``, plain and FSDP2 DTensor parameters): ``fused``
updates in place and raises the peak by a few KiB for a 385 MiB shard; ``foreach`` by 1.00 x the shard:
``torch._foreach_sqrt(exp_avg_sqs)`` copies one parameter group's shard (groups run one after the other, and the
decay group holds nearly every element; ``tests/test_optim.py`` pins both counts to the ops torch dispatches). Not
measured on CUDA: foreach runs the same ops there, and the fused CUDA kernel also updates in place."""

KNOWN_SHAPES: dict[str, Callable[[], Qwen3_5Config | Qwen3_5MoeConfig]] = {
    "Qwen/Qwen3.5-0.8B": qwen3_5_0_8b_config,
    "Qwen/Qwen3.5-9B": qwen3_5_9b_config,
    "Qwen/Qwen3.5-27B": qwen3_5_27b_config,
    "Qwen/Qwen3.5-35B-A3B": qwen3_5_35b_a3b_config,
}
"""Hub ids whose config is written out in ``vlm_sft/flops.py``, so a plan needs no download."""


@dataclass(frozen=True)
class MemoryPlan:
    """Planned bytes on one rank (estimates; the module docstring gives each formula)."""

    world_size: int
    """Ranks of the job."""
    checkpoint_bytes: int
    """S: the checkpoint's size on disk (planned: every parameter in the checkpoint dtype)."""
    load_shard: int
    """This rank's final parameter shard, written in place by the sharded load."""
    load_read_buffer: int
    """Rows of the largest tensor, read in the checkpoint dtype and cast (host memory)."""
    params: int
    """This rank's parameters as trained (the load's shard)."""
    grads: int
    """fp32 gradients of the rank's trainable shard."""
    optimizer_state: int
    """AdamW exp_avg + exp_avg_sq, fp32, of the trainable shard."""
    optimizer_temporaries: int
    """The AdamW step's own buffers: none when fused, one fp32 copy of the trainable shard with foreach."""
    host_optimizer_state: int
    """``train.optimizer_offload``: the AdamW state held in host memory between steps (0 without it); on the device
    only during the step, so ``training`` is the larger of the forward / backward peak and the step's."""
    accumulated_grads: int
    """Unsharded fp32 gradients kept across micro-batches (``grad_sync = "step"``, ``micro_batches > 1``)."""
    gathered_weights: int
    """FSDP2's gathered units in the compute dtype, and one unit's unsharded gradient."""
    activations: int
    """One micro-batch's saved activations and the chunked loss's buffers (``activation_bytes``)."""
    expert_dispatch: int
    """Expert parallelism: the slots a rank receives beyond its balanced share, and their copies on both sides of
    the all-to-alls (``expert_parallel_bytes``); 0 without it."""
    save_gathered: int
    """The streamed export's one gathered tensor (fp32 and its cast)."""
    save_output_shard: int
    """One output safetensors file, assembled on the writing rank (host memory)."""

    @property
    def load(self) -> int:
        return self.load_shard + self.load_read_buffer

    @property
    def training(self) -> int:
        held = self.params + self.grads + self.accumulated_grads
        forward_backward = held + self.gathered_weights + self.activations + self.expert_dispatch
        step = self.optimizer_state + self.optimizer_temporaries
        if self.host_optimizer_state:  # the state comes to the device for the step, when the activations are freed
            return max(forward_backward, held + step)
        return forward_backward + step

    @property
    def save(self) -> int:
        return self.params + self.optimizer_state + self.save_gathered + self.save_output_shard

    def to_dict(self) -> dict[str, int]:
        return asdict(self) | {"load": self.load, "training": self.training, "save": self.save}


# ------------------------------------------------------------------------------------------------ the plan


def plan(
    counts: ModelCounts,
    config: Qwen3_5Config | Qwen3_5MoeConfig,
    step: StepShape,
    *,
    world_size: int,
    sharded: bool,
    micro_batches: int = 1,
    grad_sync: str = "step",
    checkpoint_elem_bytes: int = 2,
    checkpoint_bytes: int | None = None,
    local_param_bytes: int | None = None,
    local_trainable: int | None = None,
    optimizer_impl: str = "fused",
    ep_size: int = 1,
    optimizer_offload: bool = False,
    ep_imbalance: float = EP_IMBALANCE,
) -> MemoryPlan:
    """The plan of one rank (module docstring). ``local_param_bytes`` / ``local_trainable``: this rank's real shard
    (a live model: the sum of its DTensors' local bytes / trainable elements); None: an even split, ``1 / W``
    (``ep_size``: ``train.ep_size``).
    ``optimizer_impl``, ``optimizer_offload``: the run's ``train.optimizer_impl`` and ``train.optimizer_offload``
    (their defaults here too); ``ep_imbalance``: the routing imbalance planned under expert parallelism."""
    w = world_size if sharded else 1
    ep = ep_size if counts.experts else 1
    if local_param_bytes is None:
        local_param_bytes = counts.param_bytes // w
    if local_trainable is None:
        local_trainable = counts.trainable // w
    shard, trainable = local_param_bytes, local_trainable
    size = checkpoint_bytes if checkpoint_bytes is not None else counts.total * checkpoint_elem_bytes
    c = step.compute_bytes
    accumulate = sharded and micro_batches > 1 and grad_sync == "step"
    unit, unit_t = counts.largest_unit, counts.largest_unit_trainable
    gathered = c * (counts.root + 2 * unit) + FP32 * unit_t if sharded else 0
    if sharded and ep > 1:  # the layer's dense part as above, 1 / ep of its experts once (their own unit, over edp)
        dense, dense_t = counts.largest_unit_without_experts, counts.largest_unit_without_experts_trainable
        gathered = c * (counts.root + 2 * dense + (unit - dense) // ep) + FP32 * (dense_t + (unit_t - dense_t) // ep)
    unsharded_t = counts.trainable - (counts.experts_trainable - counts.experts_trainable // ep)
    return MemoryPlan(
        world_size=world_size,
        checkpoint_bytes=size,
        load_shard=shard,
        load_read_buffer=-(-counts.largest // w) * (checkpoint_elem_bytes + FP32),
        params=shard,
        grads=FP32 * trainable,
        optimizer_state=2 * FP32 * trainable,
        optimizer_temporaries=STEP_TEMPORARY_COPIES[optimizer_impl] * FP32 * trainable,
        host_optimizer_state=2 * FP32 * trainable if optimizer_offload else 0,
        accumulated_grads=FP32 * unsharded_t if accumulate else 0,
        gathered_weights=gathered,
        activations=activation_bytes(config, step, counts),
        expert_dispatch=expert_parallel_bytes(config, step, ep, ep_imbalance),
        save_gathered=counts.largest * (FP32 + checkpoint_elem_bytes),
        save_output_shard=min(MAX_SHARD_BYTES, size),
    )


# ------------------------------------------------------------------------------------------------ from a config


def step_shape(
    cfg: RunConfig, config: Qwen3_5Config | Qwen3_5MoeConfig, compute_bytes: int, backends: Backends = GPU_BACKENDS
) -> StepShape:
    """One micro-batch of ``cfg`` computed in ``compute_bytes`` per element with ``backends``: one row of
    ``pack_len`` (packed modes; ``stack``: ``stack_batch_size`` rows of up to ``seq_len``), split over ``cp_size``;
    patches bounded by ``max_image_patches_per_pack`` or by every token being an image token (``merge^2`` patches
    each); the router probabilities kept when the load-balancing loss trains (``model.router_aux_loss_coef``, else
    the checkpoint's)."""
    d = cfg.data
    rows, length = (d.stack_batch_size, d.seq_len) if d.packing == "stack" else (1, d.pack_len)
    tokens = rows * length
    patches = tokens * config.vision_config.spatial_merge_size**2
    if d.max_image_patches_per_pack is not None:
        patches = min(patches, rows * d.max_image_patches_per_pack)
    coef = cfg.model.router_aux_loss_coef
    if coef is None:
        coef = getattr(config.text_config, "router_aux_loss_coef", 0.0) or 0.0
    return StepShape(
        tokens=tokens // cfg.train.cp_size,
        activation_checkpointing=cfg.model.activation_checkpointing,
        compute_bytes=compute_bytes,
        vision_patches=patches,
        backends=backends,
        router_probs_grad=coef > 0,
    )


def planned_backends(cfg: RunConfig, device_type: str) -> Backends:
    """The kernels a plan of ``cfg`` assumes: on the CPU what a CPU run resolves (``resolve_backends("cpu")``); on
    CUDA each backend the config names, and for ``auto`` those of ``GPU_BACKENDS`` (flash-attn and
    flash-linear-attention installed, the README's set-up), on any machine, so a plan made on a laptop and the
    table in docs/memory.md agree. ``--dry-run`` plans with the model's own, resolved kernels instead."""
    m = cfg.model
    if device_type == "cpu":
        from vlm_sft.model.backends import resolve_backends

        return resolve_backends("cpu", m.attn_impl, m.linear_attn_impl, m.loss_impl, m.experts_impl)
    gpu = GPU_BACKENDS
    linear = gpu.linear_attention if m.linear_attn_impl == "auto" else m.linear_attn_impl
    return Backends(
        attention=gpu.attention if m.attn_impl == "auto" else m.attn_impl,
        linear_attention=linear,
        conv="torch" if linear == "torch" else gpu.conv,
        loss=gpu.loss if m.loss_impl == "auto" else m.loss_impl,
        experts=gpu.experts if m.experts_impl == "auto" else m.experts_impl,
    )


def hf_config_for(cfg: RunConfig) -> Qwen3_5Config | Qwen3_5MoeConfig:
    """The model config ``cfg`` trains, without downloading: a tiny preset, a known hub id (``KNOWN_SHAPES``) or a
    local checkpoint directory's ``config.json``."""
    name = cfg.model.name_or_path
    if name in TINY_MODELS:
        from vlm_sft.model.presets import tiny_preset

        m = cfg.model
        return tiny_preset(name, hidden_size=m.hidden_size, initializer_range=m.initializer_range)
    if name in KNOWN_SHAPES:
        return KNOWN_SHAPES[name]()
    if (Path(name).expanduser() / "config.json").is_file():
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(Path(name).expanduser())
    raise ConfigError(
        f"model.name_or_path = {name!r}: no local config.json and not one of the shapes known offline "
        f"({', '.join(KNOWN_SHAPES)}); point it at a checkpoint directory"
    )


def meta_counts(
    config: Qwen3_5Config | Qwen3_5MoeConfig, *, lora: LoraSettings | None, bf16: bool, freeze_vision: bool = True
) -> ModelCounts:
    """``ModelCounts`` of the model a run would build (LoRA adapters and the frozen dtype included), on the meta
    device: nothing is allocated, so a 35B model counts in seconds."""
    from vlm_sft.model.backends import resolve_backends
    from vlm_sft.model.lora import attach_lora, store_frozen_in
    from vlm_sft.model.vlm import Qwen3_5VLM

    with torch.device("meta"):
        model = Qwen3_5VLM(config, resolve_backends("cpu"), freeze_vision=freeze_vision)
        if lora is not None:
            attach_lora(
                model, r=lora.r, alpha=lora.alpha, dropout=lora.dropout, targets=lora.target_modules,
                modules_to_save=lora.modules_to_save,
            )  # fmt: skip
            store_frozen_in(model, torch.bfloat16 if bf16 else torch.float32)
    return ModelCounts.of_model(model)


def plan_for_run(
    cfg: RunConfig, world_size: int, *, device_type: str = "cuda", ep_imbalance: float = EP_IMBALANCE
) -> MemoryPlan:
    """The plan of ``cfg`` on ``world_size`` ranks, without a model (meta counts of the model it would build);
    ``device_type`` picks the kernels it plans for (``planned_backends``)."""
    config = hf_config_for(cfg)
    bf16 = cfg.model.dtype == "bfloat16"
    freeze = cfg.model.vlm is None or cfg.model.vlm.freeze_vision
    counts = meta_counts(config, lora=cfg.model.lora, bf16=bf16, freeze_vision=freeze)
    step = step_shape(cfg, config, 2 if bf16 else FP32, planned_backends(cfg, device_type))
    sharded = world_size > 1 or device_type == "cuda"
    return plan(
        counts, config, step, world_size=world_size, sharded=sharded, micro_batches=cfg.train.micro_batches,
        grad_sync=cfg.train.grad_sync, optimizer_impl=cfg.train.optimizer_impl, ep_size=cfg.train.ep_size,
        optimizer_offload=cfg.train.optimizer_offload, ep_imbalance=ep_imbalance,
    )  # fmt: skip


# ------------------------------------------------------------------------------------------------ the table

TABLE_MODELS = ("Qwen/Qwen3.5-0.8B", "Qwen/Qwen3.5-9B", "Qwen/Qwen3.5-27B", "Qwen/Qwen3.5-35B-A3B")
TABLE_SETTINGS = {
    "model.dtype": "bfloat16",
    "model.activation_checkpointing": True,
    "data.pack_len": 16384,
    "data.seq_len": 8192,
    "data.max_image_patches_per_pack": 65536,
    "train.micro_batches": 1,
}
"""The settings of the table in docs/memory.md: the shipped GPU configs' (bf16, activation checkpointing, 16k-token rows,
frozen vision tower), one micro-batch per step; the default fused AdamW."""


def table_rows(world_size: int = 8) -> list[dict]:
    """The plan of each ``TABLE_MODELS`` entry, full fine-tuning and LoRA (r 16 on every text projection)."""
    rows = []
    for name in TABLE_MODELS:
        for mode in ("full", "lora"):
            model = {"name_or_path": name, "vlm": {"freeze_vision": True}}
            model |= {k.split(".", 1)[1]: v for k, v in TABLE_SETTINGS.items() if k.startswith("model.")}
            if mode == "lora":
                model["lora"] = {}
            data = {k.split(".", 1)[1]: v for k, v in TABLE_SETTINGS.items() if k.startswith("data.")}
            cfg = RunConfig(model=model, data=data, train={"device": "cuda", "micro_batches": 1})
            p = plan_for_run(cfg, world_size)
            rows.append({"model": name.split("/")[-1], "mode": mode, **p.to_dict()})
    return rows


COLUMNS = (
    ("load", "load"), ("params", "params"), ("grads", "grads"), ("optimizer_state", "AdamW"),
    ("optimizer_temporaries", "step tmp"), ("gathered_weights", "gathered"), ("activations", "activ."),
    ("training", "training"), ("save", "save"),
)  # fmt: skip
"""(plan key, header) of the printed table, in GB per rank."""


def format_table(rows: list[dict], world_size: int) -> str:
    """The table as the README shows it (GB per rank, estimates)."""
    head = f"{'model':<16} {'mode':<5} {'S (GB)':>7} " + " ".join(f"{h:>9}" for _, h in COLUMNS)
    lines = [
        f"Planned memory per rank at {world_size} GPUs, GB (estimates; vlm_sft/checks/memory_plan.py): bf16, "
        "activation checkpointing, 16384-token rows, 1 micro-batch, frozen vision, fused AdamW",
        head,
        "-" * len(head),
    ]
    for r in rows:
        cells = " ".join(f"{r[k] / GB:>9.1f}" for k, _ in COLUMNS)
        lines.append(f"{r['model']:<16} {r['mode']:<5} {r['checkpoint_bytes'] / GB:>7.1f} {cells}")
    return "\n".join(lines)


def format_plan(p: MemoryPlan, title: str) -> str:
    """One plan as labelled lines (GB per rank)."""
    rows = [(k, v) for k, v in p.to_dict().items() if k not in ("world_size", "checkpoint_bytes")]
    return "\n".join([title, *(f"  {k:<22} {v / GB:8.2f} GB" for k, v in rows)])


def main(argv: list[str] | None = None) -> int:
    parser = cli_parser(
        "python -m vlm_sft.checks.memory_plan",
        "Planned memory per rank (estimates). Without --config: the table of Qwen3.5-0.8B, 9B, 27B and 35B-A3B. "
        "With --config: that run's plan (hub ids of those four need no download).",
    )
    parser.add_argument("--world-size", type=int, default=8, help="ranks (GPUs) of the job (default 8)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="where it runs (default cuda)")
    args = sys.argv[1:] if argv is None else argv
    known, rest = parser.parse_known_args(args)
    if known.config is None and not rest:
        print(format_table(table_rows(known.world_size), known.world_size))
        return 0
    known, cfg = parse_cli(parser, args)
    if cfg is None:
        return 2
    p = plan_for_run(cfg, known.world_size, device_type=known.device)
    print(format_plan(p, f"planned memory per rank at {known.world_size} ranks (estimates)"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
