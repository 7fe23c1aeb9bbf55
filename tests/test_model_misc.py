"""Vision symmetry, freezing, image-slot scatter, input validation, backends at build, activation checkpointing."""

from __future__ import annotations

import pytest
import torch

from vlm_sft.data.mrope import batch_position_ids
from vlm_sft.model import build_model, tiny_qwen3_5_config
from vlm_sft.model.backends import BackendUnavailableError
from vlm_sft.model.loss import chunked_cross_entropy
from vlm_sft.model.varlen import Segments

PATCH_ROW = 3 * 2 * 16 * 16


@pytest.fixture(scope="module")
def cfg():
    return tiny_qwen3_5_config()


def image_batch(cfg, gen: torch.Generator) -> dict:
    """Two rows of 24 tokens: row 0 holds an image (grid 1x4x4: 4 slots), row 1 is text."""
    vs, ve, img = cfg.vision_start_token_id, cfg.vision_end_token_id, cfg.image_token_id
    ids = torch.randint(0, 2048, (2, 24), generator=gen)
    ids[0, 5], ids[0, 6:10], ids[0, 10] = vs, img, ve
    mm = torch.zeros_like(ids)
    mm[0, 6:10] = 1
    return {
        "input_ids": ids,
        "position_ids": batch_position_ids(mm, torch.tensor([[1, 4, 4]])),
        "mm_token_type_ids": mm,
        "pixel_values": torch.randn(16, PATCH_ROW, generator=gen),
        "image_grid_thw": torch.tensor([[1, 4, 4]]),
    }


def _text_positions(ids: torch.Tensor, seq_lens=None) -> torch.Tensor:
    return batch_position_ids(torch.zeros_like(ids), None, seq_lens)


def _targets(ids: torch.Tensor) -> torch.Tensor:
    return torch.cat([ids[:, 1:], torch.full((ids.shape[0], 1), -100)], dim=1)


def test_vision_frozen_by_default_text_trainable(cfg):
    model = build_model(cfg)
    assert not any(p.requires_grad for p in model.model.visual.parameters())
    assert all(p.requires_grad for n, p in model.named_parameters() if not n.startswith("model.visual."))
    assert build_model(cfg, freeze_vision=False).vision_trainable


def test_text_only_batch_gives_trainable_tower_zero_grads_and_same_loss(cfg):
    torch.manual_seed(0)
    model = build_model(cfg, freeze_vision=False)
    ids = torch.randint(0, 2048, (2, 20))
    loss_sum, count = model(ids, position_ids=_text_positions(ids), target_ids=_targets(ids))
    loss_sum.backward()
    vision = list(model.model.visual.named_parameters())
    assert vision and all(p.grad is not None for _, p in vision), [n for n, p in vision if p.grad is None]
    assert all(bool((p.grad == 0).all()) for _, p in vision)
    assert float(model.lm_head.weight.grad.abs().sum()) > 0

    # The same loss without the dummy vision path: the text decoder and the loss op called directly.
    with torch.no_grad():
        lm = model.model.language_model
        pos = torch.arange(20).repeat(2).expand(3, -1)
        hidden, _ = lm(lm.embed_tokens(ids.reshape(-1)), pos, Segments.from_lengths([20, 20]), model.backends)
        targets = _targets(ids).reshape(-1)
        expected, _ = chunked_cross_entropy(hidden, model.lm_head.weight, targets, targets >= 0)
    assert float(loss_sum.detach()) == float(expected)
    assert int(count) == 38


def test_vision_tower_runs_exactly_once_per_forward(cfg):
    model = build_model(cfg)
    calls = []
    handle = model.model.visual.register_forward_hook(lambda *_: calls.append(1))
    b = image_batch(cfg, torch.Generator().manual_seed(0))
    with torch.no_grad():
        model(b["input_ids"], position_ids=_text_positions(b["input_ids"]))
        model(**b)
    handle.remove()
    assert len(calls) == 2


@torch.no_grad()
def test_image_features_go_where_mm_token_type_ids_says(cfg):
    torch.manual_seed(0)
    model = build_model(cfg)
    b = image_batch(cfg, torch.Generator().manual_seed(1))
    ref = model(**b)
    # The token id under an image slot does not matter: the slot's embedding is replaced by the feature.
    other = dict(b, input_ids=b["input_ids"].clone())
    other["input_ids"][0, 6:10] = 7
    assert torch.equal(model(**other), ref)
    # An <|image_pad|> id on a text position (mm type 0) is just text, not a slot.
    stray = dict(b, input_ids=b["input_ids"].clone())
    stray["input_ids"][1, 3] = cfg.image_token_id
    assert torch.equal(model(**stray)[0], ref[0])
    # And the features do change the logits (the scatter is not a no-op).
    assert not torch.allclose(model(**dict(b, pixel_values=b["pixel_values"] + 1.0)), ref)


def test_image_slot_count_mismatch_raises(cfg):
    model = build_model(cfg)
    b = image_batch(cfg, torch.Generator().manual_seed(0))
    b["mm_token_type_ids"][0, 11] = 1
    with pytest.raises(ValueError, match=r"5 image slots.*4 features"):
        model(**b)
    b = image_batch(cfg, torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match=r"4 image slots but no pixel_values"):
        model(b["input_ids"], position_ids=b["position_ids"], mm_token_type_ids=b["mm_token_type_ids"])
    with pytest.raises(ValueError, match="without mm_token_type_ids"):
        model(
            b["input_ids"],
            position_ids=b["position_ids"],
            pixel_values=b["pixel_values"],
            image_grid_thw=b["image_grid_thw"],
        )
    with pytest.raises(ValueError, match="15 patch rows"):
        model(**dict(b, pixel_values=b["pixel_values"][:15]))


def test_seq_lens_must_cover_rows(cfg):
    model = build_model(cfg)
    ids = torch.randint(0, 2048, (2, 8))
    pos = _text_positions(ids)
    with torch.no_grad():
        model(ids, position_ids=pos, seq_lens=torch.tensor([3, 5, 8]))
        model(ids, position_ids=pos, seq_lens=(3, 5, 8))  # host ints, as PackedBatch.model_kwargs passes them
        with pytest.raises(ValueError, match="row by row"):
            model(ids, position_ids=pos, seq_lens=torch.tensor([4, 8, 4]))  # the middle segment spans both rows
        with pytest.raises(ValueError, match="row by row"):
            model(ids, position_ids=pos, seq_lens=torch.tensor([8, 7]))
        with pytest.raises(ValueError, match="positive"):
            model(ids, position_ids=pos, seq_lens=torch.tensor([8, 0, 8]))
        with pytest.raises(ValueError, match=r"\[3, B, L\]"):
            model(ids, position_ids=torch.zeros(3, 16, dtype=torch.long))
        with pytest.raises(ValueError, match="position_ids is required"):
            model(ids)
        with pytest.raises(ValueError, match="host ints"):
            model(ids, position_ids=pos, seq_lens=torch.tensor([8, 8], device="meta"))


def test_missing_requested_backend_raises_at_build(cfg):
    with pytest.raises(BackendUnavailableError, match="Fix"):
        build_model(cfg, linear_attn_impl="fla")
    with pytest.raises(BackendUnavailableError, match="Fix"):
        build_model(cfg, attn_impl="flash_attn")
    assert build_model(cfg).backends.linear_attention == "torch"


def test_activation_checkpointing_gives_same_loss_and_grads(cfg):
    torch.manual_seed(0)
    plain = build_model(cfg, freeze_vision=False)
    ckpt = build_model(cfg, freeze_vision=False, activation_checkpointing=True)
    ckpt.load_state_dict(plain.state_dict())
    b = image_batch(cfg, torch.Generator().manual_seed(2))
    targets = _targets(b["input_ids"])
    seq_lens = torch.tensor([10, 14, 24])
    losses = []
    for model in (plain, ckpt):
        loss_sum, _ = model(**b, seq_lens=seq_lens, target_ids=targets)
        loss_sum.backward()
        losses.append(float(loss_sum.detach()))
    assert losses[0] == losses[1]
    for (name, p), q in zip(plain.named_parameters(), ckpt.parameters(), strict=True):
        assert torch.allclose(p.grad, q.grad, rtol=1e-6, atol=1e-9), name
