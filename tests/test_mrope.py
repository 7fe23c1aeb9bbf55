"""MRoPE positions: per segment, identical to transformers' Qwen3.5 ``get_rope_index`` on each sample alone."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5Model

from renderers.errors import SkipSample
from vlm_sft.data.mrope import mrope_position_ids, sample_position_ids
from vlm_sft.data.shift import ShiftedSample, shift_sample
from vlm_sft.data.synthetic import ImageSpan, TextSpan, compose_sample, random_spans
from vlm_sft.model.presets import tiny_qwen3_5_config


@pytest.fixture(scope="module")
def hf_model() -> Qwen3_5Model:
    return Qwen3_5Model(tiny_qwen3_5_config()).eval()


def hf_positions(model: Qwen3_5Model, s: ShiftedSample) -> torch.Tensor:
    """``[3, n]`` from transformers for one sample alone."""
    if s.image_grid_thw is None:
        # transformers only calls get_rope_index with images; without, every axis is arange (text-only MRoPE)
        return torch.arange(len(s)).expand(3, -1)
    pos, _ = model.get_rope_index(s.input_ids[None], s.mm_token_type_ids[None], s.image_grid_thw)
    return pos[:, 0]


def _shifted(spans, index=0) -> ShiftedSample:
    return shift_sample(compose_sample(spans, sample_index=index, pixel_dim=8))


EDGE_CASES = {
    "image_first": [ImageSpan(4, 6), TextSpan(5, True)],
    "adjacent_images": [TextSpan(3), ImageSpan(2, 4), ImageSpan(6, 2), ImageSpan(4, 4), TextSpan(4, True)],
    "image_last": [TextSpan(4, True), ImageSpan(8, 4)],
    "only_images": [ImageSpan(2, 2), ImageSpan(4, 2)],
    "temporal_2": [TextSpan(2, True), ImageSpan(4, 4, grid_t=2), TextSpan(3, True)],
    "wide_then_tall": [TextSpan(2, True), ImageSpan(2, 10), TextSpan(2), ImageSpan(10, 2), TextSpan(3, True)],
}


@pytest.mark.parametrize("case", sorted(EDGE_CASES))
def test_single_sample_matches_transformers(hf_model, case):
    spans = EDGE_CASES[case]
    if case == "only_images":  # nothing trained: build the shifted sample by hand
        sample = compose_sample(spans, pixel_dim=8)
        ids, types, grid = sample.token_ids[:-1], sample.mm_token_type_ids[:-1], sample.multi_modal_data.image_grid_thw
        ours = sample_position_ids(types, grid)
        theirs = hf_model.get_rope_index(ids[None], types[None], grid)[0][:, 0]
    else:
        s = _shifted(spans)
        ours, theirs = sample_position_ids(s.mm_token_type_ids, s.image_grid_thw), hf_positions(hf_model, s)
    assert torch.equal(ours, theirs)


def test_packed_segments_restart_and_padding_counts_from_zero(hf_model):
    a = _shifted(EDGE_CASES["adjacent_images"], 0)
    b = _shifted(EDGE_CASES["image_first"], 1)
    types = torch.cat([a.mm_token_type_ids, b.mm_token_type_ids, torch.zeros(5, dtype=torch.long)])
    grid = torch.cat([a.image_grid_thw, b.image_grid_thw])
    pos = mrope_position_ids(types, grid, [len(a), len(b), 5])
    assert torch.equal(pos[:, : len(a)], hf_positions(hf_model, a))
    assert torch.equal(pos[:, len(a) : len(a) + len(b)], hf_positions(hf_model, b))
    assert torch.equal(pos[:, -5:], torch.arange(5).expand(3, -1))
    # what it guards against: one segment over the whole row (no restart) gives the second sample other positions
    whole = mrope_position_ids(types, grid, None)
    assert not torch.equal(whole[:, len(a) : len(a) + len(b)], hf_positions(hf_model, b))


def test_rejects_counts_that_do_not_match_the_grids():
    types = torch.tensor([0, 1, 1, 1, 0])
    with pytest.raises(ValueError, match="image tokens"):
        mrope_position_ids(types, torch.tensor([[1, 4, 4]]))  # 4 slots expected, 3 present
    with pytest.raises(ValueError, match="other than 0"):
        mrope_position_ids(torch.tensor([0, 3, 0]), None)  # 3: no such slot type
    with pytest.raises(ValueError, match="no image_grid_thw"):
        mrope_position_ids(torch.tensor([0, 2, 0]), None)  # a video slot without its grid


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rngs=st.lists(st.randoms(use_true_random=False), min_size=1, max_size=4), pad=st.integers(0, 7))
def test_random_packed_rows_match_transformers_per_segment(hf_model, rngs, pad):
    samples = []
    for k, rng in enumerate(rngs):
        try:
            samples.append(_shifted(random_spans(rng, max_tokens=64), k))
        except SkipSample:
            continue
    if not samples:
        return
    lens = [len(s) for s in samples] + ([pad] if pad else [])
    types = torch.cat([s.mm_token_type_ids for s in samples] + [torch.zeros(pad, dtype=torch.long)])
    grids = [s.image_grid_thw for s in samples if s.image_grid_thw is not None]
    pos = mrope_position_ids(types, torch.cat(grids) if grids else None, lens)
    start = 0
    for s in samples:
        assert torch.equal(pos[:, start : start + len(s)], hf_positions(hf_model, s)), f"sample {s.sample_index}"
        start += len(s)
    assert torch.equal(pos[:, start:], torch.arange(pad).expand(3, -1))
