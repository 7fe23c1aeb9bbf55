"""What one micro-batch keeps alive on one rank (estimates, in bytes): the activation terms of the memory plan.

``checks.memory_plan`` adds them to the parameters, gradients and optimizer state; the formulas are in each
function's docstring (``activation_bytes``; ``expert_parallel_bytes`` under expert parallelism).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from transformers import Qwen3_5Config, Qwen3_5MoeConfig

from vlm_sft.model.loss import DEFAULT_CHUNK
from vlm_sft.model.moe import is_moe_text_config

if TYPE_CHECKING:
    from vlm_sft.checks.memory_plan import ModelCounts

FP32 = 4


@dataclass(frozen=True)
class StepShape:
    """What one micro-batch holds on one rank, for the activation estimate."""

    tokens: int
    """Tokens of one micro-batch on this rank: rows x row length / ``cp_size``."""
    activation_checkpointing: bool
    """Each decoder layer recomputed in backward (``model.activation_checkpointing``)."""
    compute_bytes: int
    """Bytes per activation element: 2 in bf16, 4 in fp32."""
    vision_patches: int = 0
    """Patches of one micro-batch (counted only when the vision tower trains)."""
    loss_chunk: int = DEFAULT_CHUNK
    """Tokens per chunk of the chunked cross-entropy."""


def layer_activation_elements(text, layer_type: str) -> int:
    """Elements one decoder layer keeps for backward per token (an estimate: the tensors autograd saves).

    ``4 D`` (the two norms' inputs and outputs) + the token mixer + the MLP, where GatedDeltaNet keeps
    ``6 K + 5 V + 2 H_v`` (qkv projection before and after the conv, normalised q and k, the rule's output, z, the gated
    norm's output, b and a; ``K`` = key heads x key dim, ``V`` = value heads x value dim), full attention ``5 Q + 3 KV``
    (q with its gate, k, v, normalised and rotated q and k, the output, the gated output; ``Q`` = query heads x
    head dim, ``KV`` = kv heads x head dim), a dense MLP ``4 I`` (gate, up, the activation, the product) and an MoE
    block ``k (2 D + 4 I_e) + 4 I_s + E`` (each of the token's ``k`` expert slots: its input copy, gate-up, the
    activation, the product and its output; the shared expert; the router logits).
    """
    d = text.hidden_size
    if layer_type == "linear_attention":
        key = text.linear_num_key_heads * text.linear_key_head_dim
        value = text.linear_num_value_heads * text.linear_value_head_dim
        mixer = 6 * key + 5 * value + 2 * text.linear_num_value_heads
    else:
        head_dim = getattr(text, "head_dim", None) or d // text.num_attention_heads
        mixer = 5 * text.num_attention_heads * head_dim + 3 * text.num_key_value_heads * head_dim
    if is_moe_text_config(text):
        mlp = text.num_experts_per_tok * (2 * d + 4 * text.moe_intermediate_size)
        mlp += 4 * text.shared_expert_intermediate_size + text.num_experts
    else:
        mlp = 4 * text.intermediate_size
    return 4 * d + mixer + mlp


def activation_bytes(config: Qwen3_5Config | Qwen3_5MoeConfig, step: StepShape, counts: ModelCounts) -> int:
    """Bytes one micro-batch keeps alive at its peak on one rank (an **estimate**), with ``T`` tokens, ``c`` bytes:

    - decoder layers, without activation checkpointing: ``T c sum_l a_l`` (``a_l``: ``layer_activation_elements``);
      with it: ``T c (L D + 2 max_l a_l)`` (every layer's input, plus one layer recomputed and its backward buffers);
    - chunked loss: ``T D c`` (the hidden-state gradient it computes in forward) + ``N V (4 + c)`` (one chunk of
      ``N = min(T, 1024)`` fp32 logits and its gradient in the compute dtype) + ``4 V D`` when the LM head trains
      (its fp32 gradient, built in forward);
    - vision tower, only when it trains: ``P c depth (8 D_v + 2 I_v)`` for ``P`` patches (a frozen tower runs without
      autograd and keeps nothing).

    Not counted: the batch itself, the merged image features, the allocator's fragmentation.
    """
    text, vision = config.text_config, config.vision_config
    t, c, d = step.tokens, step.compute_bytes, text.hidden_size
    per_layer = [layer_activation_elements(text, kind) for kind in text.layer_types]
    if step.activation_checkpointing:
        layers = t * c * (len(per_layer) * d + 2 * max(per_layer))
    else:
        layers = t * c * sum(per_layer)
    chunk = min(t, step.loss_chunk)
    loss = t * d * c + chunk * text.vocab_size * (FP32 + c)
    if counts.lm_head_trains:
        loss += FP32 * text.vocab_size * d
    vis = 0
    if counts.vision_trains:
        vis = step.vision_patches * c * vision.depth * (8 * vision.hidden_size + 2 * vision.intermediate_size)
    return layers + loss + vis


EP_IMBALANCE = 2.0
"""The planned routing imbalance under expert parallelism: a rank's experts receive this many times their balanced
share of the slots (routers trained with a load-balancing loss stay well below it; ``--dry-run`` and the step
metrics' tokens per expert show the real one)."""


def expert_parallel_bytes(
    config: Qwen3_5Config | Qwen3_5MoeConfig, step: StepShape, ep_size: int, imbalance: float = EP_IMBALANCE
) -> int:
    """Bytes expert parallelism adds to one rank's step (an **estimate**), for ``T`` tokens, ``k`` experts per token,
    ``c`` bytes: every MoE layer kept for backward (one with activation checkpointing, the recomputed one; else all)
    holds the received copy of its ``N = T k`` slots (``N D c``) and, when its experts get ``imbalance`` times their
    share, the extra slots' expert activations ``(imbalance - 1) N (2 D + 4 I_e) c``; plus the dispatch's transient
    send and receive buffers of one layer, ``2 imbalance N D c``. 0 without expert parallelism or experts."""
    text = config.text_config
    if ep_size <= 1 or not is_moe_text_config(text):
        return 0
    d, c = text.hidden_size, step.compute_bytes
    slots = step.tokens * text.num_experts_per_tok
    moe_layers = len(text.layer_types)  # every Qwen3.5-MoE layer has routed experts
    kept = 1 if step.activation_checkpointing else moe_layers
    per_layer = slots * d * c + (imbalance - 1) * slots * (2 * d + 4 * text.moe_intermediate_size) * c
    return int(kept * per_layer + 2 * imbalance * slots * d * c)
