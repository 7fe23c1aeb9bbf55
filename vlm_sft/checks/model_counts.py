"""What the memory plan counts of a model: its parameters, FSDP2's units and the routed experts (global counts, not
per rank), on any device, the meta device included."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn


@dataclass(frozen=True)
class ModelCounts:
    """Parameter counts of a whole model (global, not per rank), as the plan needs them."""

    total: int
    """Elements of the base model's parameters, tied ones once (LoRA adapters and ``modules_to_save`` copies left
    out): what the checkpoint holds."""
    trainable: int
    """Elements that get gradients and AdamW state (fp32)."""
    param_bytes: int
    """Bytes of every parameter as stored in training (fp32 master weights; a bf16 LoRA run's frozen base in bf16)."""
    largest: int
    """Elements of the largest parameter (the load's read buffer, the save's gathered tensor)."""
    root: int
    """Elements FSDP2's root unit holds: whatever is outside the decoder layers and the vision tower (embeddings, LM
    head, final norm)."""
    largest_unit: int
    """Elements of the largest other FSDP2 unit (a decoder layer or the vision tower)."""
    largest_unit_trainable: int
    """Trainable elements of that unit (its unsharded fp32 gradient before the reduce-scatter)."""
    lm_head_trains: bool
    """Whether the LM head gets a gradient (the chunked loss then builds its fp32 gradient in forward)."""
    vision_trains: bool
    """Whether the vision tower trains (its activations are kept for backward)."""
    experts: int = 0
    """Elements of the routed experts of every MoE layer (0 for a dense model)."""
    experts_trainable: int = 0
    """Trainable elements among them."""
    largest_unit_without_experts: int = 0
    """Elements of the largest FSDP2 unit without its routed experts (under expert parallelism those are a unit of
    their own, of which FSDP2 gathers ``1 / ep``)."""
    largest_unit_without_experts_trainable: int = 0
    """Trainable elements of that unit."""

    @classmethod
    def of_model(cls, model: nn.Module) -> ModelCounts:
        """Counts of a ``Qwen3_5VLM`` on any device, meta included; a sharded DTensor counts its global size."""
        params = list(model.parameters())  # tied parameters once
        from vlm_sft.parallel.parallelize import fsdp_units, routed_experts

        units = fsdp_units(model)  # the decoder layers, then the vision tower
        unit_sizes = [(sum(p.numel() for p in u.parameters()), u) for u in units]
        n_unit, unit = max(unit_sizes, key=lambda x: x[0])
        in_units = sum(n for n, _ in unit_sizes)
        experts = [p for m in routed_experts(model) for p in m.parameters()]
        expert_ids = {id(p) for p in experts}
        dense = [[p for p in u.parameters() if id(p) not in expert_ids] for u in units]
        dense_unit = max(dense, key=lambda ps: sum(p.numel() for p in ps))
        added = {id(p) for n, p in model.named_parameters() if ".lora_" in n or ".modules_to_save." in n}
        return cls(
            total=sum(p.numel() for p in params if id(p) not in added),
            trainable=sum(p.numel() for p in params if p.requires_grad),
            param_bytes=sum(p.numel() * p.element_size() for p in params),
            largest=max(p.numel() for p in params),
            root=sum(p.numel() for p in params) - in_units,
            largest_unit=n_unit,
            largest_unit_trainable=sum(p.numel() for p in unit.parameters() if p.requires_grad),
            lm_head_trains=any(p.requires_grad for p in model.lm_head.parameters()),
            vision_trains=any(p.requires_grad for p in units[-1].parameters()),
            experts=sum(p.numel() for p in experts),
            experts_trainable=sum(p.numel() for p in experts if p.requires_grad),
            largest_unit_without_experts=sum(p.numel() for p in dense_unit),
            largest_unit_without_experts_trainable=sum(p.numel() for p in dense_unit if p.requires_grad),
        )
