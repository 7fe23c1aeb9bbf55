"""Collation to ``PackedBatch``: padding, segments, image tensors in pack order, positions, and ``check()``."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5Model

from renderers.errors import SkipSample
from renderers.types import IMAGE_TOKEN_TYPE
from vlm_sft.data.batch import PackedBatch
from vlm_sft.data.collate import TINY_PAD_ID, collate
from vlm_sft.data.pack import make_packer, pack_stream
from vlm_sft.data.shift import ShiftedSample, shift_sample
from vlm_sft.data.synthetic import ImageSpan, TextSpan, compose_sample, random_spans
from vlm_sft.data.truncate import truncate_sample
from vlm_sft.model.presets import tiny_qwen3_5_config

L = 48


def prepared(rng, index: int) -> ShiftedSample | None:
    """Random sample of 1..2L tokens, truncated to L inputs and shifted (None when a stage skips it)."""
    s = compose_sample(random_spans(rng, max_tokens=2 * L), sample_index=index)
    try:
        return shift_sample(truncate_sample(s, L, policy="truncate"))
    except SkipSample:
        return None


def assert_rows_hold_their_samples(batch: PackedBatch, rows: list[tuple[ShiftedSample, ...]]) -> None:
    """Each segment is exactly one sample's (input, target, mask, type) values; the rest of the row is padding."""
    for b, row in enumerate(rows):
        start = 0
        for s in row:
            seg = slice(start, start + len(s))
            assert torch.equal(batch.input_ids[b, seg], s.input_ids)
            assert torch.equal(batch.target_ids[b, seg], s.target_ids), "a target crossed a sample boundary"
            assert torch.equal(batch.loss_mask[b, seg], s.loss_mask)
            assert torch.equal(batch.mm_token_type_ids[b, seg], s.mm_token_type_ids)
            start += len(s)
        pad = slice(start, None)
        assert bool((batch.input_ids[b, pad] == TINY_PAD_ID).all()) and not bool(batch.loss_mask[b, pad].any())
        assert not bool(batch.mm_token_type_ids[b, pad].any())


def test_two_samples_in_one_row_with_padding():
    a = shift_sample(compose_sample([TextSpan(3), ImageSpan(4, 4), TextSpan(5, True)], sample_index=10))
    b = shift_sample(compose_sample([ImageSpan(2, 2), ImageSpan(4, 2), TextSpan(4, True)], sample_index=11))
    pack = next(pack_stream([a, b], make_packer("cat", 40)))
    batch = collate([pack])
    batch.check()
    assert batch.shape == (1, 40) and batch.seq_lens.tolist() == [len(a), len(b), 40 - len(a) - len(b)]
    assert batch.model_kwargs()["seq_lens"] == (13, 10, 17)  # host ints: FSDP would move a tensor to the GPU
    assert batch.sample_indices == ((10, 11),)
    assert batch.image_grid_thw.tolist() == [[1, 4, 4], [1, 2, 2], [1, 4, 2]]
    assert torch.equal(batch.pixel_values, torch.cat([a.pixel_values, b.pixel_values]))
    assert batch.num_real_tokens == 23 and batch.num_trainable_tokens == a.num_trainable_tokens + b.num_trainable_tokens
    assert_rows_hold_their_samples(batch, [(a, b)])


def test_text_only_batch_has_no_image_tensors_and_full_rows_have_no_pad_segment():
    a = shift_sample(compose_sample([TextSpan(4), TextSpan(5, True)], sample_index=0))
    b = shift_sample(compose_sample([TextSpan(8, True)], sample_index=1))
    batch = collate(list(pack_stream([a, b], make_packer("cat", 8))))  # rows [a] (exactly 8) and [b, pad]
    batch.check()
    assert batch.pixel_values is None and batch.image_grid_thw is None
    assert batch.seq_lens.tolist() == [8, 7, 1]


def test_stack_batch_has_an_attention_mask_and_no_seq_lens():
    samples = [shift_sample(compose_sample([TextSpan(n), TextSpan(3, True)], sample_index=n)) for n in (2, 9, 5)]
    samples.append(shift_sample(compose_sample([TextSpan(2), ImageSpan(2, 4), TextSpan(2, True)], sample_index=99)))
    packs = list(pack_stream(samples, make_packer("stack", 32, batch_size=4, pad_multiple=8)))
    assert len(packs) == 1
    batch = collate(packs)
    batch.check()
    assert batch.seq_lens is None and batch.shape == (4, 16)
    assert batch.attention_mask.sum(-1).tolist() == [len(r[0]) for r in packs[0].rows]
    assert "attention_mask" not in batch.model_kwargs() and batch.model_kwargs()["seq_lens"] is None
    assert_rows_hold_their_samples(batch, list(packs[0].rows))


def test_a_shift_done_after_packing_is_caught():
    a = shift_sample(compose_sample([TextSpan(6, True)], sample_index=0))
    b = shift_sample(compose_sample([TextSpan(6, True)], sample_index=1))
    packs = list(pack_stream([a, b], make_packer("cat", 16)))
    good = collate(packs)
    good.check()
    assert_rows_hold_their_samples(good, [(a, b)])
    # shifting the concatenated row instead of each sample: a's last target becomes b's first input
    flat = good.input_ids.reshape(-1)
    crossing = dataclasses.replace(good, target_ids=torch.cat([flat[1:], flat[:1]]).view_as(good.input_ids))
    with pytest.raises(AssertionError, match="crossed"):
        assert_rows_hold_their_samples(crossing, [(a, b)])
    # a target misaligned inside a segment is caught by check() itself
    late = dataclasses.replace(good, target_ids=torch.roll(good.target_ids, 1, dims=1))
    with pytest.raises(AssertionError, match="next input"):
        late.check()


def test_check_catches_a_segment_across_rows():
    a = shift_sample(compose_sample([TextSpan(6, True)], sample_index=0))
    good = collate(list(pack_stream([a, a], make_packer("cat", 8))))
    good.check()
    straddling = dataclasses.replace(good, seq_lens=torch.tensor([5, 6, 5]))
    with pytest.raises(AssertionError, match="straddles"):
        straddling.check()


def test_collate_refuses_mixed_packs():
    a = shift_sample(compose_sample([TextSpan(6, True)], sample_index=0))
    with pytest.raises(ValueError, match="row length"):
        collate([next(pack_stream([a], make_packer("cat", 8))), next(pack_stream([a], make_packer("cat", 16)))])


def test_to_and_pin_memory_keep_values():
    a = shift_sample(compose_sample([TextSpan(2), ImageSpan(2, 2), TextSpan(3, True)], sample_index=0))
    batch = collate(list(pack_stream([a], make_packer("bfd", 16))))
    for moved in (batch.to("cpu"), batch.pin_memory()):
        moved.check()
        assert torch.equal(moved.input_ids, batch.input_ids) and torch.equal(moved.pixel_values, batch.pixel_values)


@pytest.fixture(scope="module")
def hf_model() -> Qwen3_5Model:
    return Qwen3_5Model(tiny_qwen3_5_config()).eval()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    rngs=st.lists(st.randoms(use_true_random=False), min_size=1, max_size=10),
    mode=st.sampled_from(["cat", "bfd"]),
    rows_per_batch=st.integers(1, 3),
)
def test_random_packed_batches_keep_every_invariant(rngs, mode, rows_per_batch):
    samples = [s for k, rng in enumerate(rngs) if (s := prepared(rng, k)) is not None]
    packs = list(pack_stream(samples, make_packer(mode, L, buffer_size=4)))
    assert sorted(s.sample_index for p in packs for s in p.samples) == [s.sample_index for s in samples]
    for i in range(0, len(packs), rows_per_batch):
        group = packs[i : i + rows_per_batch]
        batch = collate(group)
        batch.check()  # includes per-segment MRoPE positions
        b = len(group)
        assert int(batch.seq_lens.sum()) == b * L
        grids = [s.image_grid_thw for p in group for s in p.samples if s.image_grid_thw is not None]
        prods = int(torch.cat(grids).prod(-1).sum()) if grids else 0
        assert int((batch.mm_token_type_ids == IMAGE_TOKEN_TYPE).sum()) == prods // 4
        assert batch.num_patches == prods
        assert_rows_hold_their_samples(batch, [row for p in group for row in p.rows])


def test_image_slots_equal_the_features_the_vision_tower_returns(hf_model):
    samples = [
        shift_sample(
            compose_sample([TextSpan(2), ImageSpan(4, 6), ImageSpan(2, 2), TextSpan(3, True)], sample_index=0)
        ),
        shift_sample(compose_sample([ImageSpan(6, 4), TextSpan(5, True)], sample_index=1)),
    ]
    batch = collate(list(pack_stream(samples, make_packer("cat", 64))))
    batch.check()
    with torch.no_grad():
        feats = hf_model.get_image_features(batch.pixel_values, batch.image_grid_thw).pooler_output
    assert sum(f.shape[0] for f in feats) == int((batch.mm_token_type_ids == IMAGE_TOKEN_TYPE).sum())
