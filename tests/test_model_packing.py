"""Packing exactness: every sample of a packed row gets exactly the logits and gradients it gets alone.

The row mixes text-only, one-image and two-adjacent-image samples with segment lengths 1, 2, 3 (shorter than the
conv kernel), 64 (one GatedDeltaNet chunk), 65 (a chunk and one token) and a padding segment. The same row without
``seq_lens`` must differ by far more than the tolerance, which proves the comparison can fail.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from processors.special_tokens import PAD_TOKEN, tiny_token_id
from vlm_sft.data.mrope import mrope_position_ids
from vlm_sft.model import Qwen3_5VLM, build_model, tiny_qwen3_5_config
from vlm_sft.model.packing_check import check_packing
from vlm_sft.model.varlen import Segments

TOL = 1e-5
PATCH_ROW = 3 * 2 * 16 * 16


def make_sample(cfg, n_before: int, grids: list[tuple[int, int, int]], n_after: int, gen: torch.Generator) -> dict:
    """Text, then the images back to back (``<vision_start> slots <vision_end>`` each), then text; shifted targets."""
    merge = cfg.vision_config.spatial_merge_size
    ids = torch.randint(0, 2048, (n_before,), generator=gen).tolist()
    types = [0] * n_before
    for t, h, w in grids:
        n = t * h * w // merge**2
        ids += [cfg.vision_start_token_id] + [cfg.image_token_id] * n + [cfg.vision_end_token_id]
        types += [0] + [1] * n + [0]
    ids += torch.randint(0, 2048, (n_after,), generator=gen).tolist()
    types += [0] * n_after
    input_ids = torch.tensor(ids)
    mm = torch.tensor(types)
    target_ids = torch.cat([input_ids[1:], torch.tensor([-100])])
    loss_mask = (target_ids >= 0) & (torch.cat([mm[1:], torch.tensor([0])]) == 0)
    grid = torch.tensor(grids, dtype=torch.long) if grids else None
    n_patches = sum(t * h * w for t, h, w in grids)
    return {
        "input_ids": input_ids,
        "position_ids": mrope_position_ids(mm, grid, torch.tensor([len(ids)]), spatial_merge_size=merge),
        "mm_token_type_ids": mm,
        "target_ids": target_ids,
        "loss_mask": loss_mask,
        "pixel_values": torch.randn(n_patches, PATCH_ROW, generator=gen) if grids else None,
        "image_grid_thw": grid,
    }


def padding_segment(n: int) -> dict:
    pad = tiny_token_id(PAD_TOKEN)
    return {
        "input_ids": torch.full((n,), pad),
        "position_ids": torch.arange(n).expand(3, -1),
        "mm_token_type_ids": torch.zeros(n, dtype=torch.long),
        "target_ids": torch.full((n,), -100),
        "loss_mask": torch.zeros(n, dtype=torch.bool),
        "pixel_values": None,
        "image_grid_thw": None,
    }


@pytest.fixture(scope="module")
def cfg():
    return tiny_qwen3_5_config()


@pytest.fixture(scope="module")
def samples(cfg):
    gen = torch.Generator().manual_seed(1)
    out = [
        make_sample(cfg, 1, [], 0, gen),
        make_sample(cfg, 2, [], 0, gen),
        make_sample(cfg, 5, [(1, 4, 4)], 6, gen),  # one image: 16 patches, 4 slots
        make_sample(cfg, 3, [], 0, gen),
        make_sample(cfg, 4, [(1, 2, 4), (1, 4, 2)], 5, gen),  # two adjacent images
        make_sample(cfg, 64, [], 0, gen),
        make_sample(cfg, 65, [], 0, gen),
        padding_segment(7),
    ]
    assert [len(s["input_ids"]) for s in out][:2] == [1, 2] and len(out[3]["input_ids"]) == 3
    assert [len(s["input_ids"]) for s in out][5:7] == [64, 65]
    return out


@pytest.fixture(scope="module")
def model(cfg):
    torch.manual_seed(0)
    return build_model(cfg, freeze_vision=False)


def _packed_row(samples: list[dict]) -> dict:
    images = [s for s in samples if s["pixel_values"] is not None]
    return {
        "input_ids": torch.cat([s["input_ids"] for s in samples])[None],
        "position_ids": torch.cat([s["position_ids"] for s in samples], dim=1)[:, None],
        "mm_token_type_ids": torch.cat([s["mm_token_type_ids"] for s in samples])[None],
        "pixel_values": torch.cat([s["pixel_values"] for s in images]),
        "image_grid_thw": torch.cat([s["image_grid_thw"] for s in images]),
    }


def _alone(model: Qwen3_5VLM, s: dict) -> torch.Tensor:
    return model(
        s["input_ids"][None],
        position_ids=s["position_ids"][:, None],
        mm_token_type_ids=s["mm_token_type_ids"][None],
        pixel_values=s["pixel_values"],
        image_grid_thw=s["image_grid_thw"],
    )[0]


def _max_delta_per_sample(packed_logits: torch.Tensor, samples: list[dict], model: Qwen3_5VLM) -> float:
    worst, start = 0.0, 0
    for s in samples:
        n = len(s["input_ids"])
        worst = max(worst, float((packed_logits[0, start : start + n] - _alone(model, s)).abs().max()))
        start += n
    return worst


@torch.no_grad()
def test_packed_logits_equal_each_sample_alone(model, samples):
    seq_lens = torch.tensor([len(s["input_ids"]) for s in samples])
    logits = model(**_packed_row(samples), seq_lens=seq_lens)
    assert _max_delta_per_sample(logits, samples, model) <= TOL


@torch.no_grad()
def test_same_row_without_seq_lens_leaks(model, samples):
    logits = model(**_packed_row(samples))
    assert _max_delta_per_sample(logits, samples, model) > 1e3 * TOL


def test_check_packing_ok_on_logits_gradients_and_every_op(model, samples):
    report = check_packing(model, samples, tol=TOL)
    assert report.ok, report.format()
    assert report.logits_delta <= TOL and report.grad_rel_delta <= TOL
    assert set(report.op_deltas) == {"vision", "conv", "linear_attention", "attention", "mlp"}
    assert max(report.op_deltas.values()) <= TOL, report.format()
    # The vision tower is trainable here, so its gradients are part of the comparison.
    assert any(n.startswith("model.visual.") for n, p in model.named_parameters() if p.requires_grad)


class _IgnoresSeqLens(nn.Module):
    """A deliberately broken model: drops ``seq_lens`` so packed samples see each other."""

    def __init__(self, inner: Qwen3_5VLM) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, input_ids, *, seq_lens=None, **kwargs):
        return self.inner(input_ids, **kwargs)


def test_check_packing_flags_a_model_that_ignores_seq_lens(model, samples):
    report = check_packing(_IgnoresSeqLens(model), samples, tol=TOL)
    assert not report.ok
    assert report.logits_delta > 1e3 * TOL and report.grad_rel_delta > 1e3 * TOL
    # The leak starts in the token mixers; the vision tower (per image) stays exact.
    for op in ("conv", "linear_attention", "attention"):
        assert report.op_deltas[op] > 100 * TOL, report.format()
    assert report.op_deltas["vision"] <= TOL
    assert "FAILED" in report.format()


def test_check_packing_names_the_leaking_op(model, samples, monkeypatch):
    """Only the short conv ignores segment starts: the conv class shows the leak."""
    import vlm_sft.model.layers as layers

    real_conv = layers.causal_conv1d

    def leaky_conv(x_TC, weight, bias, segments, **kwargs):
        whole = Segments.from_lengths([x_TC.shape[0]], x_TC.device)
        return real_conv(x_TC, weight, bias, whole, **kwargs)

    monkeypatch.setattr(layers, "causal_conv1d", leaky_conv)
    report = check_packing(model, samples, tol=TOL)
    assert not report.ok
    assert report.op_deltas["conv"] > 100 * TOL
    assert report.op_deltas["vision"] <= TOL
