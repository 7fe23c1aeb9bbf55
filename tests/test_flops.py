"""The FLOP model: hand-computed counts on the tiny config, the real modules' weights, packed vs padded accounting,
per-segment attention, per-image vision attention, the MoE MLP's active experts (by hand, against the modules'
weights and against FLOPs measured by ``torch.utils.flop_counter`` on the tiny MoE model), and the MFU peak table."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from vlm_sft.data.collate import collate
from vlm_sft.data.pack import make_packer, pack_stream
from vlm_sft.data.shift import shift_sample
from vlm_sft.data.synthetic import ImageSpan, TextSpan, compose_sample
from vlm_sft.flops import (
    FlopCount,
    attention_flops,
    batch_flops,
    conv_flops_per_token,
    dense_flops_per_token,
    executed_segment_lengths,
    gdn_segment_flops,
    linear_attention_flops,
    lm_head_flops_per_token,
    mfu,
    mlp_flops_per_token,
    peak_flops,
    peak_for_name,
    real_segment_lengths,
    vision_flops,
)
from vlm_sft.model import build_model
from vlm_sft.model.backends import resolve_backends
from vlm_sft.model.moe import Experts, TopKRouter
from vlm_sft.model.presets import (
    qwen3_5_0_8b_config,
    qwen3_5_35b_a3b_config,
    tiny_qwen3_5_config,
    tiny_qwen3_5_moe_config,
)
from vlm_sft.model.vlm import Qwen3_5VLM

TINY = tiny_qwen3_5_config()
TINY_MOE = tiny_qwen3_5_moe_config()  # TINY's layers and widths; 4 experts of 32, top 2, shared expert of 64


def _meta_model(config) -> Qwen3_5VLM:
    with torch.device("meta"):
        return Qwen3_5VLM(config, resolve_backends("cpu"))


# ------------------------------------------------------------------------------------------------ per token


def test_tiny_per_token_counts_by_hand():
    # hidden 64, MLP 128, 3 GatedDeltaNet layers (key dim 2 x 16 = 32, value dim 4 x 16 = 64) + 1 attention layer
    # (2 heads x 32 with the output gate, 1 kv head), vocabulary 2048 regular + 33 special = 2081, conv width 4.
    gdn_layer = 64 * (2 * 32 + 64) + 64 * 64 + 2 * 64 * 4 + 64 * 64  # in_proj_qkv, z, b + a, out_proj = 16896
    attn_layer = 64 * (2 * 2 * 32) + 2 * 64 * 32 + 2 * 32 * 64  # q + gate, k + v, o = 16384
    mlp_layer = 3 * 64 * 128  # 24576
    assert dense_flops_per_token(TINY.text_config) == 2 * (3 * gdn_layer + attn_layer + 4 * mlp_layer) == 330_752
    assert lm_head_flops_per_token(TINY.text_config) == 2 * 64 * 2081
    assert conv_flops_per_token(TINY.text_config) == 2 * 3 * (2 * 32 + 64) * 4


@pytest.mark.parametrize("config", [TINY, qwen3_5_0_8b_config()], ids=["tiny", "0.8B"])
def test_per_token_counts_are_twice_the_weights_of_the_real_modules(config):
    """Every weight of a projection is one multiply-add per token: 2 FLOPs (catches a missed or doubled matrix)."""
    model = _meta_model(config)
    text = model.model.language_model
    linear = sum(m.weight.numel() for m in text.modules() if isinstance(m, nn.Linear))
    assert dense_flops_per_token(config.text_config) == 2 * linear
    assert lm_head_flops_per_token(config.text_config) == 2 * model.lm_head.weight.numel()
    conv = sum(layer.linear_attn.conv1d.weight.numel() for layer in text.layers if hasattr(layer, "linear_attn"))
    assert conv_flops_per_token(config.text_config) == 2 * conv


def test_0_8b_shape_has_0_8b_parameters():
    params = sum(p.numel() for p in _meta_model(qwen3_5_0_8b_config()).parameters())  # tied embeddings count once
    assert 0.80e9 < params < 0.90e9


# ------------------------------------------------------------------------------------------------ MoE MLP


def test_tiny_moe_per_token_counts_by_hand():
    # TINY's attention and GatedDeltaNet layers (as above); each MLP a router over 4 experts, the top 2 experts of
    # width 32, a shared expert of width 64 and its one-output gate.
    gdn_layer, attn_layer = 16896, 16384
    router, routed, shared, gate = 64 * 4, 2 * 3 * 64 * 32, 3 * 64 * 64, 64
    moe_layer = router + routed + shared + gate  # 24896, where all 4 experts would be 37184
    assert mlp_flops_per_token(TINY_MOE.text_config) == 2 * moe_layer
    assert dense_flops_per_token(TINY_MOE.text_config) == 2 * (3 * gdn_layer + attn_layer + 4 * moe_layer) == 333_312
    assert lm_head_flops_per_token(TINY_MOE.text_config) == lm_head_flops_per_token(TINY.text_config)
    assert mlp_flops_per_token(TINY.text_config) == 2 * 3 * 64 * 128  # dense configs unchanged


def test_more_experts_at_the_same_top_k_only_add_router_work():
    """Doubling E at fixed k adds the router's ``2 D E`` and nothing else; counting all experts would add E more."""
    layers, d = 4, 64
    four = dense_flops_per_token(tiny_qwen3_5_moe_config(num_experts=4).text_config)
    eight = dense_flops_per_token(tiny_qwen3_5_moe_config(num_experts=8).text_config)
    assert eight - four == layers * 2 * d * 4
    top3 = dense_flops_per_token(tiny_qwen3_5_moe_config(num_experts=4, num_experts_per_tok=3).text_config)
    assert top3 - four == layers * 2 * 3 * d * 32  # one more routed expert per token: its SwiGLU, per layer


@pytest.mark.parametrize("config", [TINY_MOE, qwen3_5_35b_a3b_config()], ids=["tiny", "35B-A3B"])
def test_moe_per_token_counts_are_twice_the_active_weights_of_the_real_modules(config):
    """2 FLOPs per weight of every projection, the router and the shared expert, but only k / E of the experts."""
    text_cfg = config.text_config
    text = _meta_model(config).model.language_model
    linear = sum(m.weight.numel() for m in text.modules() if isinstance(m, nn.Linear))  # shared experts, gates
    router = sum(m.weight.numel() for m in text.modules() if isinstance(m, TopKRouter))
    experts = sum(p.numel() for m in text.modules() if isinstance(m, Experts) for p in m.parameters())
    active = experts * text_cfg.num_experts_per_tok // text_cfg.num_experts
    assert dense_flops_per_token(text_cfg) == 2 * (linear + router + active)


def _grouped_mm_flops(a_shape, b_shape, *args, out_shape, **kwargs) -> int:
    """torch's FLOP counter has no ``_grouped_mm`` formula. The experts' ``[N, K] x [E, K, F] -> [N, F]`` (row groups
    by offsets) is 2 N K F for any grouping: it counts the routed slots the kernel was given, never ``E`` experts."""
    assert len(a_shape) == 2 and len(b_shape) == 3, (a_shape, b_shape)
    return 2 * a_shape[0] * a_shape[1] * out_shape[-1]


@pytest.mark.parametrize("experts_impl", ["sorted", "grouped_mm"])
def test_moe_mlp_flops_equal_the_flops_measured_on_the_tiny_moe_model(experts_impl):
    """torch's FLOP counter on the real forward: the MoE blocks do exactly T tokens x the active count (the sorted
    path's per-expert ``mm`` by torch's own formulas; the grouped path's ``_grouped_mm`` by ``_grouped_mm_flops``)."""
    model = build_model(TINY_MOE, experts_impl=experts_impl).eval()
    batch = _batch("bfd")
    counter = FlopCounterMode(display=False, custom_mapping={torch.ops.aten._grouped_mm: _grouped_mm_flops})
    with torch.no_grad(), counter:
        model(**batch.model_kwargs())
    per_module = counter.get_flop_counts()
    blocks = [name for name in per_module if re.fullmatch(r".*\.layers\.\d+\.mlp", name)]
    assert len(blocks) == TINY_MOE.text_config.num_hidden_layers
    measured = sum(sum(per_module[name].values()) for name in blocks)
    tokens = batch.input_ids.numel()  # the model runs every slot of the row, padding included
    assert measured == tokens * TINY_MOE.text_config.num_hidden_layers * mlp_flops_per_token(TINY_MOE.text_config)


def test_35b_a3b_shape_has_35b_parameters_3b_active():
    config = qwen3_5_35b_a3b_config()
    model = _meta_model(config)
    total = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for m in model.modules() if isinstance(m, Experts) for p in m.parameters())
    text = config.text_config
    active_text = total - experts + experts * text.num_experts_per_tok // text.num_experts
    active_text -= sum(p.numel() for p in model.model.visual.parameters())
    active_text -= model.model.language_model.embed_tokens.weight.numel()  # a lookup, no FLOPs
    assert 34.5e9 < total < 36e9 and 2.8e9 < active_text < 3.2e9
    assert qwen3_5_35b_a3b_config(4).text_config.layer_types == ["linear_attention"] * 3 + ["full_attention"]


# ------------------------------------------------------------------------------------------------ token mixing


def test_attention_counts_causal_pairs_per_segment():
    per_pair = 4 * 1 * 2 * 32  # 4 x full-attention layers x heads x head_dim
    assert attention_flops(TINY.text_config, [3]) == per_pair * 6  # 3 * 4 / 2 query-key pairs
    packed = attention_flops(TINY.text_config, [100, 200, 50])
    assert packed == per_pair * (100 * 101 + 200 * 201 + 50 * 51) // 2
    assert packed < attention_flops(TINY.text_config, [350]) / 2  # the row as one segment: L^2, not sum of s^2


def test_gdn_chunk_costs_by_hand():
    k = v = 16
    intra = 2 * k + 2 * k + (v + k) + 2 * v + 2 * k  # qk^T, kk^T, solve, attn @ u, attn @ w per c^2: 160
    assert gdn_segment_flops(40, key_dim=k, value_dim=v) == 40 * 40 * intra  # one chunk: no state at all
    two_chunks = 64 * 64 * intra + 2 * 64 * k * v + (1 * intra + 4 * 1 * k * v)  # update after 1st, reads in 2nd
    assert gdn_segment_flops(65, key_dim=k, value_dim=v) == two_chunks
    # all layers and value heads: 3 GatedDeltaNet layers x 4 value heads
    assert linear_attention_flops(TINY.text_config, [40, 65]) == 12 * (40 * 40 * intra + two_chunks)
    # packing short samples never costs more than running them as one long segment
    assert linear_attention_flops(TINY.text_config, [40] * 8) < linear_attention_flops(TINY.text_config, [320])


def test_vision_by_hand_and_attention_per_image():
    vision = TINY.vision_config  # hidden 64, MLP 128, depth 2, patch rows of 3 x 2 x 16 x 16, merge 2, out 64
    embed = 2 * 16 * 1536 * 64
    blocks = 2 * (16 * 2 * (64 * 192 + 64 * 64 + 2 * 64 * 128) + 4 * 16 * 16 * 64)
    merger = 2 * 4 * (256 * 256 + 256 * 64)
    assert vision_flops(vision, [[1, 4, 4]]) == embed + blocks + merger
    two_small = vision_flops(vision, [[1, 4, 4], [1, 4, 4]])
    one_big = vision_flops(vision, [[1, 4, 8]])
    # same patches, so only the attention differs: 2 x 16^2 pairs per block against 32^2
    assert one_big - two_small == 2 * 4 * 64 * (32 * 32 - 2 * 16 * 16)


# ------------------------------------------------------------------------------------------------ batches


def _samples():
    spans = [
        [TextSpan(30, trainable=True)],
        [ImageSpan(4, 4), TextSpan(20, trainable=True)],
        [TextSpan(11, trainable=True)],
        [ImageSpan(4, 8), TextSpan(40, trainable=True)],
    ]
    return [shift_sample(compose_sample(s, sample_index=i, pixel_dim=1536)) for i, s in enumerate(spans)]


def _batch(mode: str, pack_len: int = 256):
    packer = make_packer(mode, pack_len, batch_size=4, buffer_size=8)
    (pack,) = list(pack_stream(_samples(), packer))
    return collate([pack])


def test_packed_and_padded_batches_count_the_same_useful_flops():
    packed, padded = _batch("bfd"), _batch("stack")
    assert packed.shape == (1, 256) and padded.shape[0] == 4
    useful_packed = batch_flops(packed, TINY, vision_trainable=True)
    useful_padded = batch_flops(padded, TINY, vision_trainable=True)
    assert useful_packed == useful_padded
    assert useful_packed.tokens == packed.num_real_tokens == padded.num_real_tokens
    executed_padded = batch_flops(padded, TINY, vision_trainable=True, count_padding=True)
    assert executed_padded.tokens == padded.input_ids.numel() > useful_padded.tokens
    assert executed_padded.attention > useful_padded.attention  # whole rows of L, padding included
    assert executed_padded.vision == useful_padded.vision  # images are never padded
    executed_packed = batch_flops(packed, TINY, vision_trainable=True, count_padding=True)
    assert executed_packed.dense > useful_packed.dense  # the row's padding segment runs too


def test_segment_lengths_without_and_with_padding():
    packed, padded = _batch("bfd"), _batch("stack")
    lens = sorted(len(s) for s in _samples())
    assert sorted(real_segment_lengths(packed)) == lens
    assert sorted(real_segment_lengths(padded)) == lens
    assert sum(executed_segment_lengths(packed)) == 256 and len(executed_segment_lengths(packed)) == 5
    assert executed_segment_lengths(padded) == [padded.shape[1]] * 4


def test_frozen_vision_counts_its_forward_only():
    batch = _batch("bfd")
    trainable = batch_flops(batch, TINY, vision_trainable=True)
    frozen = batch_flops(batch, TINY, vision_trainable=False)
    assert frozen.vision == trainable.vision > 0
    assert trainable.train == 3 * trainable.forward
    assert frozen.train == 3 * frozen.text_forward + frozen.vision


def test_flop_counts_add_up_and_refuse_mixed_vision():
    a = batch_flops(_batch("bfd"), TINY, vision_trainable=True)
    assert (a + a).train == 2 * a.train and (a + a).tokens == 2 * a.tokens
    with pytest.raises(ValueError, match="frozen and a trainable"):
        _ = a + batch_flops(_batch("bfd"), TINY, vision_trainable=False)
    assert isinstance(a, FlopCount)


# ------------------------------------------------------------------------------------------------ MFU


@pytest.mark.parametrize(
    ("name", "peak"),
    [
        ("NVIDIA H200", 989e12),
        ("NVIDIA H100 80GB HBM3", 989e12),
        ("NVIDIA H100 PCIe", 756e12),
        ("NVIDIA A100-SXM4-80GB", 312e12),
        ("NVIDIA L40S", 362e12),
        ("NVIDIA L4", 121e12),
        ("NVIDIA GeForce RTX 4090", None),
    ],
)
def test_peak_table(name, peak):
    assert peak_for_name(name) == peak


def test_mfu_only_with_a_known_peak():
    assert peak_flops("cpu", torch.bfloat16) is None
    assert peak_flops("cpu", torch.float32) is None
    assert mfu(1e12, 1.0, None) is None
    assert mfu(989e12, 2.0, 989e12) == 0.5
    assert mfu(989e12, 1.0, 989e12, num_devices=4) == 0.25
