"""Every model config preset, tiny and real-size, in one place.

``tiny_qwen3_5_config`` is the offline model of the tests and the default run; ``tiny_qwen3_5_moe_config`` is its
Qwen3.5-MoE twin (routed experts plus a shared expert in every layer); ``tiny_preset`` picks one by the name a config
uses. The real sizes (``qwen3_5_0_8b_config`` ... ``qwen3_5_35b_a3b_config``) are the released checkpoints' shapes,
written out so that the FLOP counts, the memory plan and the benchmarks need no download."""

from __future__ import annotations

from transformers import Qwen3_5Config, Qwen3_5MoeConfig

from processors.special_tokens import (
    EOS_TOKEN,
    IMAGE_TOKEN,
    PAD_TOKEN,
    TINY_VOCAB_SIZE,
    VIDEO_TOKEN,
    VISION_END_TOKEN,
    VISION_START_TOKEN,
    tiny_token_id,
)


def tiny_qwen3_5_config(
    *,
    hidden_size: int = 64,
    num_hidden_layers: int = 4,
    vision_hidden_size: int = 64,
    vision_depth: int = 2,
    initializer_range: float = 0.02,
) -> Qwen3_5Config:
    """A Qwen3.5 config small enough for CPU tests, with every structural feature of the real model.

    Layers mix ``linear_attention`` (GatedDeltaNet) and ``full_attention`` 3:1 like the real model; rope is
    partial (factor 0.5 of head_dim 32 = 16 rotary dims) and interleaved MRoPE with ``mrope_section`` [3, 3, 2]
    (sums to half the rotary dim, as transformers requires); the vision tower has patch 16, temporal patch 2 and
    spatial merge 2 like the real one. Vocabulary and special-token ids are those of the tiny offline tokenizer.
    """
    if num_hidden_layers % 4:
        raise ValueError(f"num_hidden_layers={num_hidden_layers}: use a multiple of 4 (3 linear : 1 full attention)")
    text_config = {
        "vocab_size": TINY_VOCAB_SIZE,
        "hidden_size": hidden_size,
        "intermediate_size": 2 * hidden_size,
        "num_hidden_layers": num_hidden_layers,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 32,
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "max_position_embeddings": 8192,
        "initializer_range": initializer_range,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.5,
            "mrope_section": [3, 3, 2],
            "mrope_interleaved": True,
        },
        "pad_token_id": tiny_token_id(PAD_TOKEN),
        "eos_token_id": tiny_token_id(EOS_TOKEN),
    }
    vision_config = {
        "depth": vision_depth,
        "hidden_size": vision_hidden_size,
        "intermediate_size": 2 * vision_hidden_size,
        "num_heads": 2,
        "in_channels": 3,
        "patch_size": 16,
        "temporal_patch_size": 2,
        "spatial_merge_size": 2,
        "out_hidden_size": hidden_size,
        "num_position_embeddings": 576,
        "initializer_range": initializer_range,
    }
    return Qwen3_5Config(
        text_config=text_config,
        vision_config=vision_config,
        image_token_id=tiny_token_id(IMAGE_TOKEN),
        video_token_id=tiny_token_id(VIDEO_TOKEN),
        vision_start_token_id=tiny_token_id(VISION_START_TOKEN),
        vision_end_token_id=tiny_token_id(VISION_END_TOKEN),
        tie_word_embeddings=False,
    )


def tiny_qwen3_5_moe_config(
    *,
    num_experts: int = 4,
    num_experts_per_tok: int = 2,
    moe_intermediate_size: int = 32,
    shared_expert_intermediate_size: int = 64,
    router_aux_loss_coef: float = 0.0,
    **dense_kwargs,
) -> Qwen3_5MoeConfig:
    """The tiny Qwen3.5-MoE config: ``tiny_qwen3_5_config``'s widths, layers and vision tower (``dense_kwargs`` are
    its arguments), with every MLP a sparse MoE block of ``num_experts`` experts, top-``num_experts_per_tok`` routing
    and a sigmoid-gated shared expert, as in the 35B-A3B family.

    ``router_aux_loss_coef`` defaults to 0 here: the load-balancing loss is batch-global, and the exactness tests
    (packed == alone) run without it.
    """
    dense = tiny_qwen3_5_config(**dense_kwargs)
    text = dense.text_config.to_dict()
    for key in ("intermediate_size", "model_type", "transformers_version", "architectures", "dtype"):
        text.pop(key, None)
    text.update(
        num_experts=num_experts,
        num_experts_per_tok=num_experts_per_tok,
        moe_intermediate_size=moe_intermediate_size,
        shared_expert_intermediate_size=shared_expert_intermediate_size,
        router_aux_loss_coef=router_aux_loss_coef,
    )
    vision = dense.vision_config.to_dict()
    for key in ("model_type", "transformers_version", "architectures", "dtype"):
        vision.pop(key, None)
    return Qwen3_5MoeConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=dense.image_token_id,
        video_token_id=dense.video_token_id,
        vision_start_token_id=dense.vision_start_token_id,
        vision_end_token_id=dense.vision_end_token_id,
        tie_word_embeddings=False,
    )


def tiny_preset(name: str, *, hidden_size: int, initializer_range: float | None = None) -> Qwen3_5Config:
    """The random-init preset ``name`` (``tiny`` or ``tiny-moe``, the config's ``model.name_or_path``) at
    ``hidden_size`` (the text and the vision width)."""
    kwargs = {"hidden_size": hidden_size, "vision_hidden_size": hidden_size}
    if initializer_range is not None:
        kwargs["initializer_range"] = initializer_range
    if name == "tiny-moe":
        return tiny_qwen3_5_moe_config(**kwargs)
    if name != "tiny":
        raise ValueError(f"{name!r} is not a tiny preset (tiny, tiny-moe)")
    return tiny_qwen3_5_config(**kwargs)


# ------------------------------------------------------------------------------------------------ real sizes


QWEN3_5_VISION_TOKEN_IDS = {
    "image_token_id": 248056,
    "video_token_id": 248057,
    "vision_start_token_id": 248053,
    "vision_end_token_id": 248054,
}
"""The vision special tokens of every released Qwen3.5 tokenizer."""


def _qwen3_5_text_common() -> dict:
    """Text settings every released Qwen3.5 checkpoint shares (interleaved MRoPE over a quarter of each head, theta
    1e7; the tokenizer's pad / end id); a fresh dict per call, since configs may rewrite their rope parameters."""
    rope = {"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25}
    rope |= {"mrope_section": [11, 11, 10], "mrope_interleaved": True}
    return {"rope_parameters": rope, "pad_token_id": 248044, "eos_token_id": 248044}


def qwen3_5_0_8b_config() -> Qwen3_5Config:
    """The shape of ``Qwen/Qwen3.5-0.8B`` (its public ``config.json``, written out here: nothing is downloaded).

    Text: hidden 1024, MLP 3584, 24 layers (3 GatedDeltaNet : 1 full attention), 8 query / 2 kv heads of 256 with
    an output gate, partial rotary 0.25 with interleaved MRoPE [11, 11, 10], GatedDeltaNet 16 key and 16 value heads
    of 128, conv 4, vocabulary 248320, tied embeddings. Vision: 12 blocks of hidden 768 (12 heads, MLP 3072), patch
    16, temporal patch 2, merge 2, output 1024. For random-init throughput runs (``bench/gpu_bench.py``).
    """
    text_config = {
        "vocab_size": 248320,
        "hidden_size": 1024,
        "intermediate_size": 3584,
        "num_hidden_layers": 24,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "head_dim": 256,
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 16,
        "max_position_embeddings": 262144,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True,
        **_qwen3_5_text_common(),
    }
    vision_config = {
        "depth": 12,
        "hidden_size": 768,
        "intermediate_size": 3072,
        "num_heads": 12,
        "in_channels": 3,
        "patch_size": 16,
        "temporal_patch_size": 2,
        "spatial_merge_size": 2,
        "out_hidden_size": 1024,
        "num_position_embeddings": 2304,
    }
    return Qwen3_5Config(
        text_config=text_config,
        vision_config=vision_config,
        **QWEN3_5_VISION_TOKEN_IDS,
        tie_word_embeddings=True,
    )


def _dense_big_config(text_shape: dict, vision_out: int) -> Qwen3_5Config:
    """A dense Qwen3.5 config past the 0.8B: the 0.8B's other text fields (GatedDeltaNet 16 key heads of 128, head_dim
    256, rope, vocabulary 248320) with ``text_shape`` on top, untied embeddings, and the 27-block vision tower
    (hidden 1152, 16 heads, MLP 4304) projecting to ``vision_out``."""
    base = qwen3_5_0_8b_config()
    text = base.text_config.to_dict() | text_shape | {"tie_word_embeddings": False}
    text["layer_types"] = (["linear_attention"] * 3 + ["full_attention"]) * (text["num_hidden_layers"] // 4)
    for key in ("model_type", "transformers_version", "architectures", "dtype"):
        text.pop(key, None)
    vision = base.vision_config.to_dict() | {"depth": 27, "hidden_size": 1152, "num_heads": 16}
    vision |= {"intermediate_size": 4304, "out_hidden_size": vision_out}
    for key in ("model_type", "transformers_version", "architectures", "dtype"):
        vision.pop(key, None)
    return Qwen3_5Config(text_config=text, vision_config=vision, **QWEN3_5_VISION_TOKEN_IDS, tie_word_embeddings=False)


def qwen3_5_9b_config() -> Qwen3_5Config:
    """The shape of ``Qwen/Qwen3.5-9B`` (sources: ``tests/test_model_real_shapes.py``, ``REAL_SHAPES``).

    Text: hidden 4096, MLP 12288, 32 layers (3 GatedDeltaNet : 1 full attention), 16 query / 4 kv heads of 256 with
    an output gate, GatedDeltaNet 16 key and 32 value heads of 128, vocabulary 248320, untied embeddings. Vision: 27
    blocks of hidden 1152 (16 heads, MLP 4304), output 4096. About 9.4B parameters.
    """
    text = {"hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 32, "num_attention_heads": 16}
    text |= {"num_key_value_heads": 4, "linear_num_value_heads": 32}
    return _dense_big_config(text, vision_out=4096)


def qwen3_5_27b_config() -> Qwen3_5Config:
    """The shape of ``Qwen/Qwen3.5-27B`` (sources: ``tests/test_model_real_shapes.py``, ``REAL_SHAPES``).

    Text: hidden 5120, MLP 17408, 64 layers (3 GatedDeltaNet : 1 full attention), 24 query / 4 kv heads of 256 with
    an output gate, GatedDeltaNet 16 key and 48 value heads of 128, vocabulary 248320, untied embeddings. Vision: 27
    blocks of hidden 1152 (16 heads, MLP 4304), output 5120. About 27.4B parameters.
    """
    text = {"hidden_size": 5120, "intermediate_size": 17408, "num_hidden_layers": 64, "num_attention_heads": 24}
    text |= {"num_key_value_heads": 4, "linear_num_value_heads": 48}
    return _dense_big_config(text, vision_out=5120)


def qwen3_5_35b_a3b_config(num_hidden_layers: int = 40) -> Qwen3_5MoeConfig:
    """The shape of ``Qwen/Qwen3.5-35B-A3B`` (its public ``config.json``, written out here: nothing is downloaded).

    Text: hidden 2048, 40 layers (3 GatedDeltaNet : 1 full attention), 16 query / 2 kv heads of 256 with an output
    gate, partial rotary 0.25 with interleaved MRoPE [11, 11, 10] (theta 1e7), GatedDeltaNet 16 key and 32 value heads
    of 128, conv 4, vocabulary 248320, untied embeddings; every MLP a sparse MoE block of 256 experts of width 512,
    top-8 routing, plus one shared expert of width 512 with its sigmoid gate. Vision: 27 blocks of hidden 1152 (16
    heads, MLP 4304), patch 16, temporal patch 2, merge 2, output 2048. About 35B parameters, 3B active per token.

    ``num_hidden_layers`` keeps the first layers of the 3:1 pattern at the real widths (``bench/gpu_bench.py``'s MoE
    row: 4 layers fit one GPU with AdamW). transformers' ``Qwen3_5MoeConfig()`` defaults have the same text widths
    but not the checkpoint's rotary theta, context length, MRoPE sections or vision output width, hence written out.
    """
    text_config = {
        "vocab_size": 248320,
        "hidden_size": 2048,
        "num_hidden_layers": num_hidden_layers,
        "num_attention_heads": 16,
        "num_key_value_heads": 2,
        "head_dim": 256,
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 32,
        "num_experts": 256,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 512,
        "shared_expert_intermediate_size": 512,
        "router_aux_loss_coef": 0.001,
        "max_position_embeddings": 262144,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        **_qwen3_5_text_common(),
    }
    vision_config = {
        "depth": 27,
        "hidden_size": 1152,
        "intermediate_size": 4304,
        "num_heads": 16,
        "in_channels": 3,
        "patch_size": 16,
        "temporal_patch_size": 2,
        "spatial_merge_size": 2,
        "out_hidden_size": 2048,
        "num_position_embeddings": 2304,
    }
    return Qwen3_5MoeConfig(
        text_config=text_config,
        vision_config=vision_config,
        **QWEN3_5_VISION_TOKEN_IDS,
        tie_word_embeddings=False,
    )
