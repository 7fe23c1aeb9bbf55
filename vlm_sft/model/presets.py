"""Model config presets. ``tiny_qwen3_5_config`` is the offline model of the tests and the default run;
``tiny_qwen3_5_moe_config`` is its Qwen3.5-MoE twin (routed experts plus a shared expert in every layer)."""

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
