"""Ours vs transformers, and packed vs alone, at the real head shapes of Qwen3.5-0.8B, -9B and -27B.

The tiny preset (``tiny_qwen3_5_config``) has 2 query heads of 32 and 2 GatedDeltaNet key heads of 16; the real
models have 8-24 query heads of 256 (GQA groups of 4 and 6), 16 GatedDeltaNet key heads of 128 repeated 1x, 2x and
3x to the value heads, 64 rotary dims in MRoPE sections [11, 11, 10]. Shape-dependent bugs (a wrong head split or
repeat, a rotary slice, a kernel tile that only fits small heads) would pass the tiny tests and fail here.

Each config keeps every head count, head dim, conv kernel, rope and MRoPE setting and the embedding tying of the
real model, with the real 3 linear : 1 full layer pattern (one group of 4 layers), a small hidden size (hidden does
not fix the head shapes: ``q_proj`` is hidden -> heads * head_dim * 2), a 2048-token vocabulary and a one-block
vision tower with the real patch 16, temporal patch 2 and merge 2. Weights are transformers' random init, copied
into ours. In float32 this proves, for each shape:

1. ours equals transformers' ``Qwen3_5ForConditionalGeneration`` on a text + image sample (logits within 1e-5,
   loss sum equal to transformers' cross-entropy);
2. in a packed row (text-only, one-image and two-image samples of 1, 3, 17, 64 and 65 tokens, a padding segment)
   every sample's logits equal its logits alone within 1e-5, and the gradient of the packed loss equals the sum of
   the per-sample gradients within 1e-5 relative; the same row without ``seq_lens`` differs by far more.
"""

from __future__ import annotations

import pytest
import torch
from packing_helpers import make_sample, max_delta_per_sample, packed_row, padding_segment
from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

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
from vlm_sft.data.mrope import mrope_position_ids
from vlm_sft.model import Qwen3_5VLM, build_model

TOL = 1e-5
"""Absolute bound on logits, relative bound on gradients (float32)."""
VOCAB = 2048
"""Regular tokens drawn for samples; the model's vocabulary also holds the tiny tokenizer's special ids above it."""
PATCH_ROW = 3 * 2 * 16 * 16
"""One pixel_values row: channels * temporal patch * patch * patch."""
MERGE = 2

# The real configs. Sources (public copies of the hub config.json files, cross-checked where two agree; none is
# Qwen's own file read directly, the hub being offline here):
# - 0.8B: Qwen/Qwen3.5-0.8B config.json as written out in vlm_sft/flops.py:qwen3_5_0_8b_config; the same values in
#   a table read from the official config (a Qwen3.5-0.8B inference design doc) and in a C++ test parsing the
#   0.8B config.json (vision depth 12, hidden 768, 12 heads, MLP 3072, out 1024).
# - 9B: Qwen/Qwen3.5-9B config.json as re-saved by unsloth ("unsloth_fixed": true, every field shown); the same
#   text and vision values in another project's test fixture "run against the real Qwen3.5-9B config".
# - 27B: a transformers Qwen3_5Config built field by field from Qwen/Qwen3.5-27B's config.json (a benchmark's
#   model wrapper); THUDM/slime scripts/models/qwen3.5-27B.sh agrees on the attention shapes (24 heads, 4 query
#   groups, kv-channels 256, rotary-percent 0.25, base 1e7, untied, hidden 5120, FFN 17408, 64 layers, output
#   gate) and several tools' fixtures agree on the GatedDeltaNet heads (16 key / 48 value heads of 128).
# Common to all three (every source above): layer_types 3 x linear_attention + 1 x full_attention repeated
# (full_attention_interval 4), attn_output_gate true (transformers always gates: q_proj emits heads * head_dim * 2),
# rope_theta 1e7, partial_rotary_factor 0.25 (64 of 256 dims), mrope_section [11, 11, 10], mrope_interleaved true,
# linear_conv_kernel_dim 4, vocab 248320; vision patch 16, temporal patch 2, merge 2, 16 heads of 72 except 0.8B.
# Only the head-shape fields are used below; the full sizes are recorded for reference.
REAL_SHAPES: dict[str, dict] = {
    "0.8B": {
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "head_dim": 256,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 16,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_conv_kernel_dim": 4,
        "tie_word_embeddings": True,
        # for reference: hidden 1024, MLP 3584, 24 layers; vision depth 12, hidden 768, 12 heads, MLP 3072, out 1024
    },
    "9B": {
        "num_attention_heads": 16,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 32,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_conv_kernel_dim": 4,
        "tie_word_embeddings": False,
        # for reference: hidden 4096, MLP 12288, 32 layers; vision depth 27, hidden 1152, 16 heads, MLP 4304, out 4096
    },
    "27B": {
        "num_attention_heads": 24,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 48,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_conv_kernel_dim": 4,
        "tie_word_embeddings": False,
        # for reference: hidden 5120, MLP 17408, 64 layers; vision depth 27, hidden 1152, 16 heads, MLP 4304, out 5120
    },
}
REAL_ROPE = {
    "rope_type": "default",
    "rope_theta": 10_000_000.0,
    "partial_rotary_factor": 0.25,
    "mrope_section": [11, 11, 10],
    "mrope_interleaved": True,
}
REAL_LAYER_PATTERN = ["linear_attention"] * 3 + ["full_attention"]


def real_shape_config(name: str, *, hidden_size: int = 64) -> Qwen3_5Config:
    """The real head shapes of ``name`` on a small body: 4 layers (3 linear : 1 full), vocab 2048 + specials."""
    shape = REAL_SHAPES[name]
    text_config = {
        **{k: v for k, v in shape.items() if k != "tie_word_embeddings"},
        "vocab_size": TINY_VOCAB_SIZE,  # 2048 regular tokens + the tiny tokenizer's special tokens
        "hidden_size": hidden_size,
        "intermediate_size": 2 * hidden_size,
        "num_hidden_layers": len(REAL_LAYER_PATTERN),
        "layer_types": list(REAL_LAYER_PATTERN),
        "max_position_embeddings": 262144,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": shape["tie_word_embeddings"],
        "rope_parameters": dict(REAL_ROPE),
        "pad_token_id": tiny_token_id(PAD_TOKEN),
        "eos_token_id": tiny_token_id(EOS_TOKEN),
    }
    vision_config = {
        "depth": 1,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_heads": 2,
        "in_channels": 3,
        "patch_size": 16,
        "temporal_patch_size": 2,
        "spatial_merge_size": MERGE,
        "out_hidden_size": hidden_size,
        "num_position_embeddings": 2304,
    }
    return Qwen3_5Config(
        text_config=text_config,
        vision_config=vision_config,
        image_token_id=tiny_token_id(IMAGE_TOKEN),
        video_token_id=tiny_token_id(VIDEO_TOKEN),
        vision_start_token_id=tiny_token_id(VISION_START_TOKEN),
        vision_end_token_id=tiny_token_id(VISION_END_TOKEN),
        tie_word_embeddings=shape["tie_word_embeddings"],
    )


@pytest.fixture(scope="module", params=list(REAL_SHAPES))
def shape_name(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def cfg(shape_name):
    return real_shape_config(shape_name)


@pytest.fixture(scope="module")
def pair(cfg):
    """(transformers model, ours) holding the same random weights; ours has a trainable vision tower."""
    torch.manual_seed(0)
    ref = Qwen3_5ForConditionalGeneration(cfg).eval()
    ours = build_model(cfg, freeze_vision=False)
    ours.load_state_dict(ref.state_dict())
    return ref, ours


# ------------------------------------------------------------------------------------------------------ samples


def packed_samples(cfg) -> list[dict]:
    """The samples of the packed row: lengths 1, 17, 3, 17, 64, 65 and 7 (padding)."""
    gen = torch.Generator().manual_seed(1)
    out = [
        make_sample(cfg, 1, [], 0, gen),
        make_sample(cfg, 5, [(1, 4, 4)], 6, gen),  # one image: 16 patches, 4 slots
        make_sample(cfg, 3, [], 0, gen),
        make_sample(cfg, 4, [(1, 2, 4), (1, 4, 2)], 5, gen),  # two adjacent images
        make_sample(cfg, 64, [], 0, gen),  # one GatedDeltaNet chunk
        make_sample(cfg, 52, [(1, 4, 6)], 5, gen),  # 65 tokens with an image: a chunk and one token
        padding_segment(cfg, 7),
    ]
    assert [len(s["input_ids"]) for s in out] == [1, 17, 3, 17, 64, 65, 7]
    return out


@pytest.fixture(scope="module")
def samples(cfg):
    return packed_samples(cfg)


def _model_inputs(s: dict) -> dict:
    """One sample as a one-row batch (no seq_lens: the caller adds it)."""
    return {
        "input_ids": s["input_ids"][None],
        "position_ids": s["position_ids"][:, None],
        "mm_token_type_ids": s["mm_token_type_ids"][None],
        "pixel_values": s["pixel_values"],
        "image_grid_thw": s["image_grid_thw"],
    }


def _seq_lens(samples: list[dict]) -> torch.Tensor:
    return torch.tensor([len(s["input_ids"]) for s in samples], dtype=torch.long)


def _alone_logits(model: Qwen3_5VLM, s: dict) -> torch.Tensor:
    return model(**_model_inputs(s), seq_lens=_seq_lens([s]))[0]


# -------------------------------------------------------------------------------------------------------- tests


def test_modules_carry_the_real_head_shapes(cfg, shape_name, pair):
    ref, ours = pair
    real, hidden = REAL_SHAPES[shape_name], cfg.text_config.hidden_size
    theirs = {k: tuple(v.shape) for k, v in ref.state_dict().items()}
    assert {k: tuple(v.shape) for k, v in ours.state_dict().items()} == theirs
    heads, kv, d = real["num_attention_heads"], real["num_key_value_heads"], real["head_dim"]
    hk, hv = real["linear_num_key_heads"], real["linear_num_value_heads"]
    dk, dv = real["linear_key_head_dim"], real["linear_value_head_dim"]
    attn, gdn = "model.language_model.layers.3.self_attn.", "model.language_model.layers.0.linear_attn."
    assert theirs[attn + "q_proj.weight"] == (heads * d * 2, hidden)  # query + output gate per head
    assert theirs[attn + "k_proj.weight"] == (kv * d, hidden)
    assert theirs[attn + "q_norm.weight"] == (d,)
    assert theirs[gdn + "in_proj_qkv.weight"] == (2 * hk * dk + hv * dv, hidden)
    assert theirs[gdn + "conv1d.weight"] == (2 * hk * dk + hv * dv, 1, real["linear_conv_kernel_dim"])
    assert theirs[gdn + "A_log"] == (hv,)
    assert ours.tied_embeddings == real["tie_word_embeddings"]
    assert ours.config.text_config.layer_types == REAL_LAYER_PATTERN


def image_sample(cfg, gen: torch.Generator) -> dict:
    """Text, an image (grid 1x4x6), text, two adjacent images (1x2x4, 1x4x2), text; 26 tokens."""
    vs, ve, img = cfg.vision_start_token_id, cfg.vision_end_token_id, cfg.image_token_id
    grids = torch.tensor([[1, 4, 6], [1, 2, 4], [1, 4, 2]])
    text = torch.randint(0, VOCAB, (12,), generator=gen).tolist()
    ids = text[:3] + [vs] + [img] * 6 + [ve] + text[3:6] + [vs] + [img] * 2 + [ve, vs] + [img] * 2 + [ve] + text[6:]
    input_ids = torch.tensor([ids])
    mm = (input_ids == img).long()
    return {
        "input_ids": input_ids,
        "mm_token_type_ids": mm,
        "pixel_values": torch.randn(int(grids.prod(-1).sum()), PATCH_ROW, generator=gen),
        "image_grid_thw": grids,
        "position_ids": mrope_position_ids(mm[0], grids, torch.tensor([len(ids)]), spatial_merge_size=MERGE)[:, None],
    }


@torch.no_grad()
def test_logits_and_loss_equal_transformers_on_text_and_images(pair):
    ref, ours = pair
    b = image_sample(ref.config, torch.Generator().manual_seed(0))
    theirs_pos, _ = ref.model.get_rope_index(b["input_ids"], b["mm_token_type_ids"], image_grid_thw=b["image_grid_thw"])
    assert torch.equal(b["position_ids"], theirs_pos)
    theirs = ref(**b).logits
    seq_lens = torch.tensor([b["input_ids"].shape[1]])
    mine = ours(**b, seq_lens=seq_lens)
    assert float(theirs.abs().max()) > 0.1  # logits carry signal, the bound is not vacuous
    assert float((mine - theirs).abs().max()) <= TOL
    # The positions matter at this tolerance: swapping the height and width axes moves the logits far more.
    swapped = ours(**{**b, "position_ids": b["position_ids"][[0, 2, 1]]}, seq_lens=seq_lens)
    assert float((swapped - theirs).abs().max()) > 1e3 * TOL

    targets = torch.cat([b["input_ids"][:, 1:], torch.full((1, 1), -100)], dim=1)
    targets[b["mm_token_type_ids"].roll(-1, 1) == 1] = -100
    loss_sum, count = ours(**b, seq_lens=seq_lens, target_ids=targets)
    expected = torch.nn.functional.cross_entropy(theirs[0], targets[0], ignore_index=-100, reduction="sum")
    assert int(count) == int((targets >= 0).sum())
    assert abs(float(loss_sum) - float(expected)) <= TOL * float(expected)


@torch.no_grad()
def test_packed_logits_equal_each_sample_alone(pair, samples):
    _, ours = pair
    logits = ours(**packed_row(samples), seq_lens=_seq_lens(samples))
    assert float(logits.abs().max()) > 0.1
    assert max_delta_per_sample(logits, samples, ours, _alone_logits) <= TOL


@torch.no_grad()
def test_same_row_without_seq_lens_leaks(pair, samples):
    _, ours = pair
    logits = ours(**packed_row(samples))  # seq_lens None: the whole row is one segment
    assert max_delta_per_sample(logits, samples, ours, _alone_logits) > 1e3 * TOL


def _loss_grads(model: Qwen3_5VLM, inputs: dict, seq_lens: torch.Tensor | None, s: dict) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    loss_sum, _ = model(**inputs, seq_lens=seq_lens, target_ids=s["target_ids"][None], loss_mask=s["loss_mask"][None])
    loss_sum.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_packed_gradients_equal_sum_of_per_sample_gradients(pair, samples):
    _, ours = pair
    packed_targets = {k: torch.cat([s[k] for s in samples]) for k in ("target_ids", "loss_mask")}
    packed = _loss_grads(ours, packed_row(samples), _seq_lens(samples), packed_targets)
    summed: dict[str, torch.Tensor] = {}  # the sum of the per-sample gradients
    for s in samples:
        if not bool(s["loss_mask"].any()):
            continue  # padding: no loss, no gradient
        for n, g in _loss_grads(ours, _model_inputs(s), _seq_lens([s]), s).items():
            summed[n] = summed[n] + g if n in summed else g
    assert packed.keys() == summed.keys()
    assert any(n.startswith("model.visual.") for n in packed)  # the tower's gradients are compared too
    assert _grad_rel_delta(packed, summed) <= TOL
    # Negative case: the same row as one segment (no seq_lens) gives gradients far from the per-sample sum.
    leaky = _loss_grads(ours, packed_row(samples), None, packed_targets)
    ours.zero_grad(set_to_none=True)
    assert _grad_rel_delta(leaky, summed) > 1e3 * TOL


def _grad_rel_delta(grads: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> float:
    """max |grads - expected| over every parameter, relative to max |expected|."""
    scale = max(float(g.abs().max()) for g in expected.values())
    assert scale > 0
    return max(float((grads[n] - expected[n]).abs().max()) for n in expected) / scale
