"""Image-safe truncation and the causal shift: the per-sample stages before packing."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from renderers.errors import SkipSample
from renderers.types import IMAGE_TOKEN_TYPE, RenderedSample
from vlm_sft.data import shift as shift_mod
from vlm_sft.data import truncate as trunc_mod
from vlm_sft.data.shift import shift_sample
from vlm_sft.data.synthetic import (
    IMAGE_PAD_ID,
    VISION_END_ID,
    VISION_START_ID,
    ImageSpan,
    TextSpan,
    compose_sample,
    random_spans,
)
from vlm_sft.data.truncate import truncate_sample

SKIP_REASONS = {trunc_mod.REASON_NO_TRAINABLE, trunc_mod.REASON_FINAL_TURN}


def assert_image_safe(sample: RenderedSample) -> None:
    """Every ``<|vision_start|>`` opens a complete run closed by ``<|vision_end|>``, matching the image tensors."""
    sample.check()
    ids = sample.token_ids.tolist()
    starts = [i for i, t in enumerate(ids) if t == VISION_START_ID]
    ends = [i for i, t in enumerate(ids) if t == VISION_END_ID]
    mm = sample.multi_modal_data
    places = [] if mm is None else list(mm.placeholders)
    assert len(starts) == len(ends) == len(places), f"markers {len(starts)}/{len(ends)} for {len(places)} images"
    for s, e, r in zip(starts, ends, places, strict=True):
        assert s == r.offset - 1 and e == r.end, "marker not around its run"
        assert all(t == IMAGE_PAD_ID for t in ids[r.offset : r.end])
    assert ids.count(IMAGE_PAD_ID) == int((sample.mm_token_type_ids == IMAGE_TOKEN_TYPE).sum())


def _two_image_sample() -> RenderedSample:
    # [0,2) text, [2,4) trained, block A [4,10) (4 slots), [10,13) trained, block B [13,15+16) (16 slots), [31,36) trained
    spans = [TextSpan(2), TextSpan(2, True), ImageSpan(4, 4), TextSpan(3, True), ImageSpan(8, 8), TextSpan(5, True)]
    return compose_sample(spans, sample_index=3)


def test_fitting_sample_is_returned_unchanged():
    s = _two_image_sample()
    assert truncate_sample(s, len(s) - 1) is s  # seq_len counts inputs after the shift: T - 1 == seq_len fits


@pytest.mark.parametrize("keep", range(5, 10))
def test_cut_inside_first_block_moves_before_its_vision_start(keep):
    s = _two_image_sample()
    out = truncate_sample(s, keep - 1, policy="truncate")
    assert len(out) == 4 and out.multi_modal_data is None
    assert torch.equal(out.token_ids, s.token_ids[:4])
    assert_image_safe(out)
    # the bug this guards against: a plain slice leaves a dangling <|vision_start|> (and a partial run)
    naive = dataclasses.replace(
        s,
        token_ids=s.token_ids[:keep],
        loss_mask=s.loss_mask[:keep],
        mm_token_type_ids=s.mm_token_type_ids[:keep],
    )
    with pytest.raises(AssertionError):
        assert_image_safe(naive)


def test_cut_inside_second_block_keeps_first_image_rows_only():
    s = _two_image_sample()
    out = truncate_sample(s, 20, policy="truncate")  # keep 21 tokens: inside block B [13, 31)
    assert len(out) == 13
    mm = out.multi_modal_data
    assert mm.num_images == 1 and mm.image_grid_thw.tolist() == [[1, 4, 4]]
    assert torch.equal(mm.pixel_values, s.multi_modal_data.pixel_values[:16])
    assert mm.image_hashes == s.multi_modal_data.image_hashes[:1]
    assert_image_safe(out)


def test_cut_right_after_vision_end_keeps_the_image():
    s = _two_image_sample()
    out = truncate_sample(s, 30, policy="truncate")  # keep 31 = block B's end
    assert len(out) == 31 and out.num_images == 2
    assert_image_safe(out)
    assert shift_sample(out).num_patches == 16 + 64  # the run lies whole in the inputs


def test_drop_policy_skips_a_reply_cut_before_its_closing_token():
    s = _two_image_sample()
    with pytest.raises(SkipSample) as err:
        truncate_sample(s, 32)  # keeps 33 of 36: inside the final trained span [31, 36)
    assert err.value.reason == trunc_mod.REASON_FINAL_TURN and err.value.sample_index == 3
    kept = truncate_sample(s, 32, policy="truncate")
    assert len(kept) == 33 and kept.loss_mask[-1]


def test_drop_policy_keeps_a_cut_after_a_closed_turn():
    s = _two_image_sample()
    assert len(truncate_sample(s, 12)) == 13  # keeps [0, 13): the trained span [10, 13) is whole
    with pytest.raises(SkipSample, match=trunc_mod.REASON_FINAL_TURN):
        truncate_sample(s, 11)  # keeps [0, 12): cuts that span one token before its end


def test_text_only_follows_the_same_rules():
    s = compose_sample([TextSpan(5), TextSpan(6, True), TextSpan(2), TextSpan(6, True)], sample_index=1)
    assert len(truncate_sample(s, 12)) == 13  # cut after the first reply [5, 11) and inside the prompt [11, 13)
    with pytest.raises(SkipSample, match=trunc_mod.REASON_FINAL_TURN):
        truncate_sample(s, 15)
    with pytest.raises(SkipSample, match=trunc_mod.REASON_NO_TRAINABLE):
        truncate_sample(s, 4)


def test_image_at_the_very_start_cut_inside_it_leaves_nothing():
    s = compose_sample([ImageSpan(4, 4), TextSpan(8, True)], sample_index=9)
    with pytest.raises(SkipSample) as err:
        truncate_sample(s, 3)
    assert err.value.reason == trunc_mod.REASON_NO_TRAINABLE and "sample 9" in str(err.value)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rng=st.randoms(use_true_random=False), seq_len=st.integers(1, 48), policy=st.sampled_from(["drop", "truncate"]))
def test_truncation_is_image_safe_and_maximal(rng, seq_len, policy):
    s = compose_sample(random_spans(rng, max_tokens=2 * seq_len + 2), sample_index=0)
    try:
        out = truncate_sample(s, seq_len, policy=policy)
    except SkipSample as err:
        assert err.reason in SKIP_REASONS
        return
    cut = len(out)
    assert cut <= seq_len + 1
    assert_image_safe(out)
    for name in ("token_ids", "loss_mask", "mm_token_type_ids"):
        assert torch.equal(getattr(out, name), getattr(s, name)[:cut]), f"{name} misaligned"
    if out.multi_modal_data is not None:
        rows = out.multi_modal_data.num_patches
        assert torch.equal(out.multi_modal_data.pixel_values, s.multi_modal_data.pixel_values[:rows])
    if cut < len(s):
        assert bool(out.loss_mask[1:].any())
        if policy == "drop":
            assert not (bool(s.loss_mask[cut - 1]) and bool(s.loss_mask[cut])), "final turn lost its closing token"
        if cut < seq_len + 1:  # moved back: only to the start of the block the plain cut would split
            blocks = trunc_mod.image_blocks(s.multi_modal_data)
            assert any(a == cut and a < seq_len + 1 < b for a, b in blocks)


# -- causal shift -------------------------------------------------------------------------------------------------


def test_shift_aligns_inputs_targets_mask_and_types():
    s = _two_image_sample()
    sh = shift_sample(s)
    assert len(sh) == len(s) - 1
    assert torch.equal(sh.input_ids, s.token_ids[:-1]) and torch.equal(sh.target_ids, s.token_ids[1:])
    assert torch.equal(sh.loss_mask, s.loss_mask[1:])  # the target's mask
    assert torch.equal(sh.mm_token_type_ids, s.mm_token_type_ids[:-1])  # the input's type
    assert sh.num_patches == s.multi_modal_data.num_patches and sh.sample_index == 3


def test_shift_skips_samples_without_a_trainable_target():
    with pytest.raises(SkipSample, match=shift_mod.REASON_TOO_SHORT):
        shift_sample(compose_sample([TextSpan(1, True)]))
    # the only trained token is the first one, which is never a target
    with pytest.raises(SkipSample, match=shift_mod.REASON_NO_TRAINABLE):
        shift_sample(compose_sample([TextSpan(1, True), TextSpan(4)]))


def test_shift_rejects_a_run_that_reaches_the_last_token():
    s = compose_sample([TextSpan(3, True), ImageSpan(2, 2)])
    cut = dataclasses.replace(  # drop the <|vision_end|>: the run now ends the sample
        s, token_ids=s.token_ids[:-1], loss_mask=s.loss_mask[:-1], mm_token_type_ids=s.mm_token_type_ids[:-1]
    )
    with pytest.raises(SkipSample, match=shift_mod.REASON_IMAGE_AT_END):
        shift_sample(cut)
