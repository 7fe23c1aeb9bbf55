"""``parallelize``: the one place that spreads a ``Qwen3_5VLM`` over ranks, and the only code outside the model that
knows its module paths (the text decoder, its layers and embedding, the vision tower): others ask ``decoder_layers``,
``vision_tower`` and their siblings here.

It applies, in order (torchtitan's): LoRA wrapping (before FSDP, so FSDP shards the wrapped layers; also on a meta
model), activation checkpointing (each decoder layer recomputed in backward: the model's own switch), context
parallelism (all-to-alls around the token mixers, ``parallel.context_parallel``), expert parallelism (each rank's
experts, dispatch and combine around the routed experts, every layer's experts an FSDP2 unit over ``edp``,
``parallel.expert_parallel``) and FSDP2 (every decoder layer and the vision tower a unit of their own, then the
root). The vision tower is its own unit so its all-gather is one collective that every rank issues on every forward:
the model always runs it (a dummy image on text-only micro-batches), which keeps the ranks' collective sequences
identical.

``apply_context_parallel`` and ``context_parallel_off`` turn context parallelism on and off on a built model (the
trainer's eval and generation run on whole rows); ``shard_model`` is FSDP2 alone, for tools and tests.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch import nn

from vlm_sft.config import ConfigError
from vlm_sft.model.sequence_split import SequenceSplit, check_heads
from vlm_sft.parallel.context_parallel import NO_CP, wrap_token_mixers
from vlm_sft.parallel.env import DistEnv
from vlm_sft.parallel.expert_parallel import fully_shard_experts, shard_experts, wrap_experts
from vlm_sft.parallel.fsdp import fully_shard_units
from vlm_sft.parallel.mesh import ParallelMesh, build_mesh

TEXT_DECODER = "model.language_model"
"""The text decoder's module path in a ``Qwen3_5VLM`` (transformers' names, as every path here)."""
DECODER_LAYERS = f"{TEXT_DECODER}.layers"
"""The decoder layers' ``nn.ModuleList``: layer ``i``'s parameters are named ``{DECODER_LAYERS}.{i}.*``."""
INPUT_EMBEDDINGS = f"{TEXT_DECODER}.embed_tokens"
"""The token embedding (the LM head's tied weight when ``tie_word_embeddings``)."""
VISION_TOWER = "model.visual"
"""The vision tower."""


def text_decoder(model: nn.Module) -> nn.Module:
    """The text decoder (``TEXT_DECODER``): embeddings, decoder layers, final norm."""
    return model.get_submodule(TEXT_DECODER)


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The text decoder's layers (``DECODER_LAYERS``)."""
    return model.get_submodule(DECODER_LAYERS)


def input_embeddings(model: nn.Module) -> nn.Embedding:
    """The token embedding (``INPUT_EMBEDDINGS``)."""
    return model.get_submodule(INPUT_EMBEDDINGS)


def vision_tower(model: nn.Module) -> nn.Module:
    """The vision tower (``VISION_TOWER``)."""
    return model.get_submodule(VISION_TOWER)


def routed_experts(model: nn.Module) -> list[nn.Module]:
    """Every MoE layer's routed experts (``mlp.experts``), in layer order; empty for a dense model."""
    return [layer.mlp.experts for layer in decoder_layers(model) if getattr(layer, "moe_mlp", False)]


def fsdp_units(model: nn.Module) -> list[nn.Module]:
    """The modules FSDP2 shards as units of their own (the root takes the rest): every decoder layer, the tower."""
    return [*decoder_layers(model), vision_tower(model)]


def token_mixers(model: nn.Module) -> list[nn.Module]:
    """Every decoder layer's token mixer (``linear_attn`` or ``self_attn``), in layer order."""
    return [layer.linear_attn if hasattr(layer, "linear_attn") else layer.self_attn for layer in decoder_layers(model)]


def apply_context_parallel(model: nn.Module, cp: SequenceSplit) -> None:
    """Split every forward's row over ``cp``'s ranks: each computes the loss of its ``1 / cp`` of the tokens, the
    token mixers wrapped in the all-to-alls (``parallel.context_parallel``). An inactive ``cp`` (``NO_CP``, size 1)
    unwraps them: the whole row on each rank again. Refused, with the fix, when the head counts do not split over
    ``cp.size``; the model is left unchanged then."""
    check_heads(model.config.text_config, cp.size)
    wrap_token_mixers(token_mixers(model), cp)
    model.context_parallel = cp


@contextlib.contextmanager
def context_parallel_off(model: nn.Module) -> Iterator[None]:
    """The whole row on every rank inside the block (eval, generation), the model's CP back afterwards (also when
    the block raises)."""
    previous = model.context_parallel
    apply_context_parallel(model, NO_CP)
    try:
        yield
    finally:
        apply_context_parallel(model, previous)


def parallelize(
    model: nn.Module,
    mesh: ParallelMesh | None,
    *,
    attach_lora: Callable[[nn.Module], None] | None = None,
    activation_checkpointing: bool | None = None,
    param_dtype: torch.dtype | None = None,
) -> nn.Module:
    """``model`` wrapped for ``mesh`` (None: one process, nothing spread), in the module docstring's order; returns
    the model (sharded in place when the mesh shards). ``attach_lora`` adds the adapters (peft) before anything else.
    ``activation_checkpointing``: None leaves the model's setting. ``param_dtype`` (bf16 runs): FSDP's compute dtype
    over fp32 master weights."""
    if attach_lora is not None:
        attach_lora(model)
    if activation_checkpointing is not None:
        model.set_activation_checkpointing(activation_checkpointing)
    if mesh is None:
        return model
    if mesh.cp.active:
        apply_context_parallel(model, mesh.cp)
    if mesh.ep is not None:
        experts = routed_experts(model)
        if not experts:
            raise ConfigError(
                f"train.ep_size = {mesh.ep.size} needs a Qwen3.5-MoE model; this one has no routed experts: set "
                "train.ep_size = 1"
            )
        for module in experts:
            shard_experts(module, mesh.ep)
        wrap_experts(experts, mesh.ep)
        fully_shard_experts(experts, mesh.ep, param_dtype=param_dtype)
    if mesh.fsdp_mesh is not None:
        fully_shard_units(fsdp_units(model), model, mesh.fsdp_mesh, param_dtype=param_dtype)
    return model


def shard_model(model: nn.Module, env: DistEnv, *, param_dtype: torch.dtype | None = None) -> nn.Module:
    """FSDP2 alone over every rank of ``env`` (when ``env.sharded``): ``parallelize`` on a data-parallel mesh, for
    tools and tests that build a model and shard it outside a run."""
    if not env.sharded:
        return model
    return parallelize(model, build_mesh(env), param_dtype=param_dtype)
