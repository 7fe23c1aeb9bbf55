"""Ours vs transformers' Qwen3_5ForConditionalGeneration: same names, same init scheme, same logits, same files."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import Qwen3_5ForConditionalGeneration

from vlm_sft.checkpoint.export import save_pretrained
from vlm_sft.checkpoint.load import from_pretrained
from vlm_sft.data.mrope import batch_position_ids, mrope_position_ids
from vlm_sft.model import build_model, tiny_qwen3_5_config
from vlm_sft.model.layers import GatedDeltaNet, RMSNorm, RMSNormGated

PATCH_ROW = 3 * 2 * 16 * 16


@pytest.fixture(scope="module")
def cfg():
    return tiny_qwen3_5_config()


@pytest.fixture(scope="module")
def pair(cfg):
    """(transformers model, ours) holding the same weights."""
    torch.manual_seed(0)
    ref = Qwen3_5ForConditionalGeneration(cfg).eval()
    ours = build_model(cfg)
    ours.load_state_dict(ref.state_dict())
    return ref, ours


def text_positions(ids: torch.Tensor) -> torch.Tensor:
    return batch_position_ids(torch.zeros_like(ids))


def image_batch(cfg, gen: torch.Generator) -> dict:
    """One sample: text, an image (grid 1x4x6), text, two adjacent images (1x2x4, 1x4x2), text."""
    vs, ve, img = cfg.vision_start_token_id, cfg.vision_end_token_id, cfg.image_token_id
    grids = torch.tensor([[1, 4, 6], [1, 2, 4], [1, 4, 2]])
    text = torch.randint(0, 2048, (12,), generator=gen).tolist()
    ids = text[:3] + [vs] + [img] * 6 + [ve] + text[3:6] + [vs] + [img] * 2 + [ve, vs] + [img] * 2 + [ve] + text[6:]
    input_ids = torch.tensor([ids])
    return {
        "input_ids": input_ids,
        "mm_token_type_ids": (input_ids == img).long(),
        "pixel_values": torch.randn(int(grids.prod(-1).sum()), PATCH_ROW, generator=gen),
        "image_grid_thw": grids,
    }


def test_parameter_names_and_shapes_equal_transformers(cfg, pair):
    ref, _ = pair
    ours = build_model(cfg)
    theirs = {k: tuple(v.shape) for k, v in ref.state_dict().items()}
    assert {k: tuple(v.shape) for k, v in ours.state_dict().items()} == theirs
    assert "lm_head.weight" in theirs and any(k.startswith("model.visual.") for k in theirs)


@torch.no_grad()
def test_random_init_follows_transformers_scheme(cfg):
    torch.manual_seed(0)
    model = build_model(cfg)
    lm = model.model.language_model
    norms = [m for m in lm.modules() if isinstance(m, RMSNorm)]
    assert norms and all(bool((m.weight == 0).all()) for m in norms)  # (1 + w) norms start at identity
    assert all(bool((m.weight == 1).all()) for m in lm.modules() if isinstance(m, RMSNormGated))
    gdns = [m for m in lm.modules() if isinstance(m, GatedDeltaNet)]
    assert all(bool((m.dt_bias == 1).all()) for m in gdns)
    a = torch.cat([m.A_log.exp() for m in gdns])
    assert bool(((a >= 0.01 - 1e-6) & (a <= 16 + 1e-4)).all()) and float(a.std()) > 1.0
    assert bool((lm.embed_tokens.weight[cfg.text_config.pad_token_id] == 0).all())
    std = cfg.text_config.initializer_range
    for w in (
        model.lm_head.weight,
        lm.layers[0].linear_attn.in_proj_qkv.weight,
        lm.layers[0].linear_attn.conv1d.weight,
    ):
        assert abs(float(w.std()) - std) < 0.2 * std and abs(float(w.mean())) < 0.2 * std


def test_positions_equal_transformers_get_rope_index(cfg, pair):
    ref, _ = pair
    b = image_batch(cfg, torch.Generator().manual_seed(0))
    theirs, _ = ref.model.get_rope_index(b["input_ids"], b["mm_token_type_ids"], image_grid_thw=b["image_grid_thw"])
    n = b["input_ids"].shape[1]
    ours = mrope_position_ids(b["mm_token_type_ids"][0], b["image_grid_thw"], torch.tensor([n]), spatial_merge_size=2)
    assert torch.equal(ours, theirs[:, 0])
    # Two segments: the second is numbered from 0 and uses the images after the first's.
    both = mrope_position_ids(
        b["mm_token_type_ids"][0].repeat(2),
        b["image_grid_thw"].repeat(2, 1),
        torch.tensor([n, n]),
        spatial_merge_size=2,
    )
    assert torch.equal(both, torch.cat([ours, ours], dim=1))


@torch.no_grad()
def test_logits_equal_transformers_on_text_and_images(cfg, pair):
    ref, ours = pair
    b = image_batch(cfg, torch.Generator().manual_seed(0))
    pos, _ = ref.model.get_rope_index(b["input_ids"], b["mm_token_type_ids"], image_grid_thw=b["image_grid_thw"])
    theirs = ref(**b, position_ids=pos).logits
    mine = ours(b["input_ids"], position_ids=pos, **{k: v for k, v in b.items() if k != "input_ids"})
    assert float((mine - theirs).abs().max()) <= 1e-5
    # With the positions our data pipeline builds on the CPU (the model never builds them itself).
    ours_pos = batch_position_ids(b["mm_token_type_ids"], b["image_grid_thw"])
    mine = ours(b["input_ids"], position_ids=ours_pos, **{k: v for k, v in b.items() if k != "input_ids"})
    assert float((mine - theirs).abs().max()) <= 1e-5
    assert float(theirs.abs().max()) > 0.1  # logits carry signal, the bound is not vacuous


@torch.no_grad()
def test_logits_equal_transformers_on_text_rows(pair):
    ref, ours = pair
    ids = torch.randint(0, 2048, (2, 70))
    mine = ours(ids, position_ids=text_positions(ids))
    assert float((mine - ref(input_ids=ids).logits).abs().max()) <= 1e-5


def test_loss_equals_transformers_cross_entropy(cfg, pair):
    ref, ours = pair
    b = image_batch(cfg, torch.Generator().manual_seed(2))
    targets = torch.cat([b["input_ids"][:, 1:], torch.full((1, 1), -100)], dim=1)
    targets[b["mm_token_type_ids"].roll(-1, 1) == 1] = -100
    with torch.no_grad():
        pos = batch_position_ids(b["mm_token_type_ids"], b["image_grid_thw"])
        rest = {k: v for k, v in b.items() if k != "input_ids"}
        loss_sum, count = ours(b["input_ids"], position_ids=pos, target_ids=targets, **rest)
        logits = ref(**b).logits[0]
    expected = torch.nn.functional.cross_entropy(logits, targets[0], ignore_index=-100, reduction="sum")
    assert int(count) == int((targets >= 0).sum())
    assert abs(float(loss_sum) - float(expected)) <= 1e-4 * float(expected)


def test_checkpoint_round_trip_through_transformers(cfg, tmp_path):
    torch.manual_seed(1)
    ours = build_model(cfg)
    save_pretrained(ours, tmp_path / "ours", max_shard_size="200KB")
    index = json.loads((tmp_path / "ours" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1  # really sharded

    theirs, info = Qwen3_5ForConditionalGeneration.from_pretrained(tmp_path / "ours", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert theirs.config.architectures == ["Qwen3_5ForConditionalGeneration"]
    theirs.save_pretrained(tmp_path / "theirs")
    back = from_pretrained(tmp_path / "theirs")

    a, b = ours.state_dict(), back.state_dict()
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not back.vision_trainable  # frozen by default after loading too
    ids = torch.randint(0, 2048, (1, 16))
    with torch.no_grad():
        assert torch.equal(back(ids, position_ids=text_positions(ids)), ours(ids, position_ids=text_positions(ids)))


def test_bf16_checkpoint_loads(cfg, pair, tmp_path):
    ref, ours = pair
    bf16 = Qwen3_5ForConditionalGeneration(cfg)
    bf16.load_state_dict(ref.state_dict())
    bf16.to(torch.bfloat16).save_pretrained(tmp_path)
    assert next(iter(load_file(tmp_path / "model.safetensors").values())).dtype == torch.bfloat16

    fp32 = from_pretrained(tmp_path)  # dtype None: float32 master weights
    expected = {k: v.bfloat16().float() for k, v in ours.state_dict().items()}
    got = fp32.state_dict()
    assert all(got[k].dtype == torch.float32 and torch.equal(got[k], expected[k]) for k in expected)
    kept = from_pretrained(tmp_path, dtype=torch.bfloat16)
    assert {p.dtype for p in kept.parameters()} == {torch.bfloat16}


def test_checkpoint_keys_mtp_dropped_unknown_rejected(cfg, tmp_path):
    torch.manual_seed(2)
    save_pretrained(build_model(cfg), tmp_path)
    path = tmp_path / "model.safetensors"
    state = load_file(path)
    save_file({**state, "mtp.fc.weight": torch.zeros(2, 2)}, path, metadata={"format": "pt"})
    from_pretrained(tmp_path)  # the hub's multi-token-prediction head is ignored
    save_file({**state, "model.bogus.weight": torch.zeros(2)}, path, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"unexpected \['model.bogus.weight'\]"):
        from_pretrained(tmp_path)
    del state["model.language_model.norm.weight"]
    save_file(state, path, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing \['model.language_model.norm.weight'\]"):
        from_pretrained(tmp_path)


def test_tied_embeddings_save_and_load(tmp_path):
    cfg = tiny_qwen3_5_config()
    cfg.tie_word_embeddings = True
    torch.manual_seed(3)
    ours = build_model(cfg)
    assert ours.lm_head.weight is ours.model.language_model.embed_tokens.weight
    save_pretrained(ours, tmp_path / "ours")
    assert "lm_head.weight" not in load_file(tmp_path / "ours" / "model.safetensors")
    theirs = Qwen3_5ForConditionalGeneration.from_pretrained(tmp_path / "ours")
    assert torch.equal(theirs.lm_head.weight, ours.lm_head.weight)
    back = from_pretrained(tmp_path / "ours")
    assert back.lm_head.weight is back.model.language_model.embed_tokens.weight
    ids = torch.randint(0, 2048, (1, 12))
    with torch.no_grad():
        mine = back(ids, position_ids=text_positions(ids))
        assert float((mine - theirs(input_ids=ids).logits).abs().max()) <= 1e-5
