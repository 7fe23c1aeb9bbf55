"""What one micro-batch keeps alive on one rank (estimates, in bytes): the activation terms of the memory plan.

``checks.memory_plan`` adds them to the parameters, gradients and optimizer state. The model is a list of the tensors
autograd saves for backward, per token, named buffer by buffer in each function's docstring, each in the dtype the
code holds it in: ``c`` bytes for the compute dtype (2 in bf16, 4 in fp32) and 4 for what the code computes in
float32 whatever the compute dtype (the RMSNorms, the router's softmax, the linear attention's decay and, in the
pure-torch rule, everything). A few buffers depend on the kernel backend (``Backends``): the fla and flash kernels
save their own inputs, the pure-torch paths the intermediates of their padded layouts; ``GPU_BACKENDS`` are the
kernels a CUDA run picks with flash-attn and flash-linear-attention installed (``memory_plan.planned_backends``).

Calibrated on the CPU: ``tests/test_dry_run.py`` holds ``activation_bytes`` to the bytes ``saved_tensors_hooks`` see
in one forward of the tiny dense and MoE models, fp32 and bf16; ``bench/bench_memory_plan.py`` holds the whole plan
to the trainer's peak resident set (bench/README.md, "Memory plan vs measured (CPU)"). The fla and flash kernels'
buffers are read from their sources (flash-linear-attention 0.6, flash-attn 2), not measured.

Legend: T tokens, D hidden size, I MLP width, L decoder layers, c compute bytes; GatedDeltaNet: H_k / H_v key / value
heads of K_h / V_h, K = H_k K_h, V = H_v V_h, C = 2 K + V conv channels, W conv width; attention: H query heads,
H_kv kv heads, Q = H x head dim, KV = H_kv x head dim, R rotary dims; MoE: E experts, k per token, I_e / I_s routed /
shared expert width.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from transformers import Qwen3_5Config, Qwen3_5MoeConfig

from vlm_sft.checks.model_counts import ModelCounts
from vlm_sft.model.backends import Backends
from vlm_sft.model.loss import DEFAULT_CHUNK
from vlm_sft.model.moe import is_moe_text_config

FP32 = 4
INT64 = 8

GPU_BACKENDS = Backends(
    attention="flash_attn", linear_attention="fla", conv="fla", loss="fla_fused", experts="grouped_mm"
)
"""The kernels ``model.backends.resolve_backends`` picks on a CUDA GPU with flash-attn and flash-linear-attention
installed (the README's set-up): what a plan for ``cuda`` assumes unless the config names another backend."""

FLA_CHUNK = 64
"""flash-linear-attention's chunk size: ``chunk_gated_delta_rule`` saves the solved ``[T, H_v, 64]`` matrix ``A``."""
TORCH_GDN_WIDTH = 64
"""The pure-torch gated delta rule's widest chunk: segments up to 64 tokens are one chunk of their group's width,
longer ones chunks of at most 64 (``gdn.py``). Its ``[C, C]`` buffers cost this many elements per token and head at
most; the shapes data's 30-50-token samples measure about 40 (``bench/bench_memory_plan.py``)."""


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
    backends: Backends = field(default=GPU_BACKENDS)
    """The kernels the run uses (``memory_plan.planned_backends``, or a live model's ``backends``)."""
    router_probs_grad: bool = False
    """MoE: the load-balancing loss trains the routers (its coefficient > 0), so every MoE layer's fp32 router
    probabilities are kept for backward, outside the checkpointed layers."""


# ------------------------------------------------------------------------------------------------ per layer


def norm_bytes(width: int, c: int) -> int:
    """One RMSNorm over ``width`` channels: its input in float32 (in fp32 the input itself, in bf16 the upcast copy)
    and the normalised ``x * rsqrt`` (saved for the weight's gradient), 4 + 4 bytes; its output in the compute dtype,
    saved by the projection that reads it; the fp32 ``rsqrt``."""
    return (2 * FP32 + c) * width + FP32


def mlp_bytes(text, c: int) -> int:
    """The MLP after ``post_attention_layernorm`` (its input is the norm's output). Dense SwiGLU: ``4 I c`` (the gate
    and up projections' outputs, the activation, the product). MoE: each of the token's ``k`` slots ``2 D + 4 I_e``
    (its gathered input, gate-up output, activation, product, output), the shared expert ``4 I_s`` and its output
    ``D`` (saved by the sigmoid gate's multiply), all ``c``; the router's fp32 probabilities ``4 E``, the top-k
    weights ``4 k``, and ``8 k`` for each of the four int64 index tensors of the sort (ids, order, the order's
    inverse and token)."""
    if not is_moe_text_config(text):
        return 4 * text.intermediate_size * c
    d, k = text.hidden_size, text.num_experts_per_tok
    routed = k * (2 * d + 4 * text.moe_intermediate_size) + 4 * text.shared_expert_intermediate_size + d
    return routed * c + FP32 * (text.num_experts + k) + 4 * INT64 * k


def linear_attention_bytes(text, c: int, backends: Backends) -> int:
    """One GatedDeltaNet after its input norm, by backend:

    - the short conv: its input, the qkv projection, ``C c`` on fla / causal-conv1d; the torch conv also keeps each of
      the ``W - 1`` shifted, masked copies and the sum before the SiLU: ``(W + 1) C c``;
    - the decay and beta: softplus's fp32 input and output, the sigmoid's output: ``(8 + c) H_v``;
    - the rule on fla: the l2-normalised q and k (``2 K c``, key heads), a contiguous v (``V c``), the solved
      ``[H_v, 64]`` matrix ``A`` and beta (``65 H_v c``), the chunk-cumulated fp32 decay ``4 H_v`` and the fp32 norms of
      q and k ``8 H_k``; on torch, all fp32 (``_torch_chunked``): q and k repeated to the value heads and their norms
      ``H_v (2 K_h + 2)``, the int64 scatter index ``2 H_v`` (in fp32 units), and per padded slot and head the
      scattered rows ``2 K_h + V_h + 2``, ``k beta`` ``K_h``, ``u`` ``V_h`` and seven ``[C, C]`` buffers (masked log
      decay, decay, masked decay, ``k beta k^T``, ``A``, ``q k^T``, ``attn``), ``7 x TORCH_GDN_WIDTH``;
    - the gated RMSNorm and ``out_proj``: the rule's output in fp32 ``4 V``, the normalised fp32 ``x * rsqrt`` cast to
      ``c``, its weighted product ``c``, the gate ``z`` in fp32 and its SiLU ``8 V``, the gated output ``c`` (out_proj's
      input): ``(12 + 3 c) V``, and the fp32 ``rsqrt`` ``4 H_v``.
    """
    h_k, h_v = text.linear_num_key_heads, text.linear_num_value_heads
    k_h, v_h = text.linear_key_head_dim, text.linear_value_head_dim
    key, value = h_k * k_h, h_v * v_h
    channels = 2 * key + value
    conv_copies = text.linear_conv_kernel_dim + 1 if backends.conv == "torch" else 1
    conv = conv_copies * channels * c
    gates = (2 * FP32 + c) * h_v
    if backends.linear_attention == "fla":
        rule = (2 * key + value + (FLA_CHUNK + 1) * h_v) * c + FP32 * h_v + 2 * FP32 * h_k
    else:
        per_slot = (2 * k_h + v_h + 2) + k_h + v_h + 7 * TORCH_GDN_WIDTH
        rule = FP32 * h_v * (2 * k_h + 2 + 2 + per_slot)
    gated_norm = (3 * FP32 + 3 * c) * value + FP32 * h_v
    return conv + gates + rule + gated_norm


def attention_bytes(text, c: int, backends: Backends) -> int:
    """One gated full attention after its input norm (the same on SDPA and the flash kernels, whose saved inputs
    SDPA saves as its padded copies):

    - q's RMSNorm: its fp32 input ``4 Q`` (in fp32 the q half of ``q_proj``'s output, whose whole ``[Q | gate]``
      storage is then kept: ``8 Q``) and ``x * rsqrt`` ``4 Q``; k's: ``4 KV + 4 KV``; their fp32 ``rsqrt``
      ``4 (H + H_kv)`` (the rotary multiplies keep only the shared cos / sin, counted once per model);
    - the kernel: q, k, v and the output ``c (2 Q + 2 KV)``, the fp32 log-sum-exp ``4 H``;
    - the output gate and ``o_proj``: the attention output, the gate's sigmoid, their product, ``3 Q c``;
    - SDPA's two int64 gather indices, ``16`` bytes.
    """
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    heads, kv_heads = text.num_attention_heads, text.num_key_value_heads
    q, kv = heads * head_dim, kv_heads * head_dim
    norms = (2 * FP32 if c == FP32 else FP32) * q + FP32 * q + 2 * FP32 * kv + FP32 * (heads + kv_heads)
    kernel = (2 * q + 2 * kv) * c + FP32 * heads
    indices = 2 * INT64 if backends.attention == "sdpa" else 0
    return norms + kernel + 3 * q * c + indices


def layer_activation_bytes(text, layer_type: str, c: int, backends: Backends) -> int:
    """Bytes one decoder layer keeps for backward per token: its two RMSNorms (``norm_bytes``; in fp32 the first
    one's input is the layer's input, the second's the residual sum), the token mixer (``linear_attention_bytes`` or
    ``attention_bytes``) and the MLP (``mlp_bytes``)."""
    d = text.hidden_size
    if layer_type == "linear_attention":
        mixer = linear_attention_bytes(text, c, backends)
    else:
        mixer = attention_bytes(text, c, backends)
    return 2 * norm_bytes(d, c) + mixer + mlp_bytes(text, c)


def backward_working_bytes(text, c: int) -> int:
    """The backward of one decoder layer beyond what is saved: the gradients alive together at its widest point, the
    MLP's gate and up outputs' and its input and output's, ``c (2 I_t + 2 D)`` per token (``I_t = I``; MoE
    ``k I_e + I_s``). What one fp32 forward + backward of ``bench/bench_memory_plan.py``'s dense and MoE checkpoints
    allocated above its saved tensors (and, with checkpointing, the recomputed layer): about 0.6 x of this without
    checkpointing, 0.9 x with it."""
    if is_moe_text_config(text):
        width = text.num_experts_per_tok * text.moe_intermediate_size + text.shared_expert_intermediate_size
    else:
        width = text.intermediate_size
    return c * (2 * width + 2 * text.hidden_size)


def rotary_dims(text) -> int:
    """``R``: the rotated dims of a head (``head_dim x partial_rotary_factor``), the width of the cos / sin tables."""
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    rope = getattr(text, "rope_parameters", None) or {}
    return int(head_dim * rope.get("partial_rotary_factor", 1.0))


# ------------------------------------------------------------------------------------------------ per micro-batch


def saved_bytes(config: Qwen3_5Config | Qwen3_5MoeConfig, step: StepShape) -> int:
    """Bytes the text model's forward saves for backward on one rank (an **estimate**), ``T`` tokens, ``c`` bytes:

    - decoder layers, without activation checkpointing: ``T sum_l a_l`` (``a_l``: ``layer_activation_bytes``); with
      it: ``T (L D c + max_l a_l)`` (every layer's input, kept by its checkpoint, plus the one layer recomputed in
      backward) and ``8 k`` a token and MoE layer, the routing its recompute replays;
    - model-wide: the rotary cos / sin in fp32 ``8 R``, the final norm ``8 D`` (its output is not saved), the
      embedding's int64 ids ``8``; MoE with a training load-balancing loss: each MoE layer's fp32 router
      probabilities ``4 E`` (saved outside the checkpointed layers).
    """
    text = config.text_config
    t, c, d = step.tokens, step.compute_bytes, text.hidden_size
    per_layer = [layer_activation_bytes(text, kind, c, step.backends) for kind in text.layer_types]
    moe = is_moe_text_config(text)
    if step.activation_checkpointing:
        replay = INT64 * text.num_experts_per_tok if moe else 0
        layers = t * (len(per_layer) * (d * c + replay) + max(per_layer))
    else:
        layers = t * sum(per_layer)
    model_wide = t * (2 * FP32 * rotary_dims(text) + 2 * FP32 * d + INT64)
    if moe and step.router_probs_grad:
        model_wide += t * FP32 * text.num_experts * len(text.layer_types)
    return layers + model_wide


def activation_bytes(config: Qwen3_5Config | Qwen3_5MoeConfig, step: StepShape, counts: ModelCounts) -> int:
    """Bytes one micro-batch keeps alive at its peak on one rank (an **estimate**), with ``T`` tokens, ``c`` bytes:

    - the forward's saved tensors, ``saved_bytes``, and the backward's working set ``T backward_working_bytes``;
    - chunked loss: ``T D c`` (the hidden-state gradient it computes in forward) + ``N V (4 + c)`` (one chunk of
      ``N = min(T, 1024)`` fp32 logits and its gradient in the compute dtype) + ``4 V D`` when the LM head trains
      (its fp32 gradient, built in forward);
    - vision tower, only when it trains: ``P c depth (8 D_v + 2 I_v)`` for ``P`` patches (a frozen tower runs without
      autograd and keeps nothing).

    Not counted: the batch itself, the merged image features, the allocator's fragmentation.
    """
    text, vision = config.text_config, config.vision_config
    t, c, d = step.tokens, step.compute_bytes, text.hidden_size
    chunk = min(t, step.loss_chunk)
    loss = t * d * c + chunk * text.vocab_size * (FP32 + c)
    if counts.lm_head_trains:
        loss += FP32 * text.vocab_size * d
    vis = 0
    if counts.vision_trains:
        vis = step.vision_patches * c * vision.depth * (8 * vision.hidden_size + 2 * vision.intermediate_size)
    return saved_bytes(config, step) + t * backward_working_bytes(text, c) + loss + vis


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
