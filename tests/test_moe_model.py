"""Qwen3.5-MoE through our model code: transformers' names and logits, HF checkpoints both ways, exact packing.

transformers' reference runs with ``experts_implementation="eager"`` (its per-expert loop; the default
``grouped_mm`` is set explicitly aside so the comparison names what it compares against).
"""

from __future__ import annotations

import pytest
import torch
from packing_helpers import max_delta_per_sample, mixed_row, packed_row
from safetensors.torch import load_file, save_file
from test_model_parity import image_batch  # one sample with three images of different grids
from transformers import Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration
from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeVisionModel

from vlm_sft.checkpoint.export import save_pretrained
from vlm_sft.checkpoint.hf_dir import fuse_experts, split_experts
from vlm_sft.checkpoint.load import from_pretrained
from vlm_sft.data.mrope import batch_position_ids
from vlm_sft.model import build_model, tiny_qwen3_5_moe_config
from vlm_sft.model.moe import Experts, SparseMoeBlock, TopKRouter

TOL = 1e-5
PATCH_ROW = 3 * 2 * 16 * 16
EXPERTS = "model.language_model.layers.0.mlp.experts"


@pytest.fixture(scope="module")
def cfg():
    return tiny_qwen3_5_moe_config()


@pytest.fixture(scope="module")
def pair(cfg):
    """(transformers model with eager experts, ours) holding the same weights."""
    torch.manual_seed(0)
    ref = Qwen3_5MoeForConditionalGeneration(cfg).eval()
    ref.set_experts_implementation("eager")
    ours = build_model(cfg)
    ours.load_state_dict(ref.state_dict())
    return ref, ours


def test_structure_names_and_shapes_equal_transformers(cfg, pair):
    ref, ours = pair
    assert isinstance(ours.model.visual, Qwen3_5MoeVisionModel)
    layers = ours.model.language_model.layers
    assert all(isinstance(layer.mlp, SparseMoeBlock) for layer in layers)
    theirs = {k: tuple(v.shape) for k, v in ref.state_dict().items()}
    assert {k: tuple(v.shape) for k, v in build_model(cfg).state_dict().items()} == theirs
    assert theirs[f"{EXPERTS}.gate_up_proj"] == (4, 64, 64) and theirs[f"{EXPERTS}.down_proj"] == (4, 64, 32)


@torch.no_grad()
def test_random_init_of_moe_parts_follows_transformers(cfg):
    torch.manual_seed(0)
    lm = build_model(cfg).model.language_model
    for module in lm.modules():
        if isinstance(module, Experts):
            for p in (module.gate_up_proj, module.down_proj):
                assert abs(float(p.std()) - 0.02) < 0.002 and abs(float(p.mean())) < 0.002
        elif isinstance(module, TopKRouter):
            assert 0.01 < float(module.weight.std()) < 0.03
        elif isinstance(module, SparseMoeBlock):
            assert 0.01 < float(module.shared_expert_gate.weight.std()) < 0.03


@torch.no_grad()
def test_logits_equal_transformers_on_text_and_images(cfg, pair):
    ref, ours = pair
    b = image_batch(cfg, torch.Generator().manual_seed(0))
    theirs = ref(**b).logits
    pos = batch_position_ids(b["mm_token_type_ids"], b["image_grid_thw"])
    mine = ours(b["input_ids"], position_ids=pos, **{k: v for k, v in b.items() if k != "input_ids"})
    scale = float(theirs.abs().max())
    assert scale > 0.1  # logits carry signal, the bound is not vacuous
    assert float((mine - theirs).abs().max()) <= TOL * max(1.0, scale)


def test_checkpoint_round_trip_through_transformers(cfg, tmp_path):
    torch.manual_seed(1)
    ours = build_model(cfg)
    save_pretrained(ours, tmp_path / "ours")
    on_disk = load_file(tmp_path / "ours" / "model.safetensors")
    assert f"{EXPERTS}.3.gate_proj.weight" in on_disk and f"{EXPERTS}.gate_up_proj" not in on_disk

    theirs, info = Qwen3_5MoeForConditionalGeneration.from_pretrained(tmp_path / "ours", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert theirs.config.architectures == ["Qwen3_5MoeForConditionalGeneration"]
    theirs.save_pretrained(tmp_path / "theirs")
    assert load_file(tmp_path / "theirs" / "model.safetensors").keys() == on_disk.keys()
    back = from_pretrained(tmp_path / "theirs")
    assert isinstance(back.config, Qwen3_5MoeConfig)

    a, b = ours.state_dict(), back.state_dict()
    assert a.keys() == b.keys() == theirs.state_dict().keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert all(torch.equal(a[k], v) for k, v in theirs.state_dict().items())


def test_fused_checkpoint_loads_and_incomplete_experts_raise(cfg, tmp_path):
    torch.manual_seed(2)
    ours = build_model(cfg)
    save_pretrained(ours, tmp_path)
    path = tmp_path / "model.safetensors"
    per_expert = load_file(path)
    fused = fuse_experts(per_expert)
    assert fused.keys() == ours.state_dict().keys() and split_experts(fused).keys() == per_expert.keys()
    save_file(fused, path, metadata={"format": "pt"})  # the in-memory form, as a raw state dict dump holds it
    back = from_pretrained(tmp_path)
    assert all(torch.equal(v, back.state_dict()[k]) for k, v in ours.state_dict().items())
    del per_expert[f"{EXPERTS}.2.up_proj.weight"]
    save_file(per_expert, path, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"experts \[2\] lack one of"):
        from_pretrained(tmp_path)


@torch.no_grad()
def test_packed_logits_equal_each_sample_alone_and_differ_without_seq_lens(cfg, pair):
    _, model = pair
    samples = mixed_row(cfg)
    seq_lens = torch.tensor([len(s["input_ids"]) for s in samples])
    assert max_delta_per_sample(model(**packed_row(samples), seq_lens=seq_lens), samples, model) <= TOL
    assert max_delta_per_sample(model(**packed_row(samples)), samples, model) > 1e3 * TOL


def test_grouped_mm_widths_are_checked_at_build():
    """``torch._grouped_mm`` needs 16-byte row strides: an expert width that is no multiple of 8 (bf16) fails when
    the model is built, naming the fix, not at its first forward; ``sorted`` takes any width."""
    odd = tiny_qwen3_5_moe_config(moe_intermediate_size=36)
    with pytest.raises(ValueError, match="experts_impl='sorted'"):
        build_model(odd, experts_impl="grouped_mm")
    assert build_model(odd, experts_impl="sorted").backends.experts == "sorted"
